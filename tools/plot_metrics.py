"""Plot training and validation loss, and real (non-pad) tokens/s, against step for one or
more runs.

    python tools/plot_metrics.py out                          # writes metrics.png
    python tools/plot_metrics.py run-a run-b -o compare.png   # runs overlaid, one colour each

Reads metrics.jsonl from each output folder. Needs matplotlib (pip install matplotlib),
which training does not.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from training import errors, files, metrics, stopping  # noqa: E402
from training.errors import UsageError, first_line, path_argument  # noqa: E402
from training.run_folder import METRICS  # noqa: E402


def read_metrics(out_dir: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (metrics.read_metrics: a torn last line is dropped
    with a warning, other damage is an error)."""
    path = Path(out_dir) / METRICS
    if not os.path.lexists(path):  # something else there (a FIFO) is refused by read_metrics, as what it is
        raise UsageError(f"{out_dir} holds no {METRICS}: not an output folder of a training run")
    try:
        rows = metrics.read_metrics(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    if not any("loss" in row or "val_loss" in row for row in rows):  # the first row holds the run's facts
        raise UsageError(f"{path} holds no logged step yet")
    return rows


def series(rows: list[dict], key: str):
    """(steps, values) of the rows that logged `key`."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    return [s for s, _ in points], [v for _, v in points]


def pyplot(tool: str = "plot_metrics.py"):
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"{tool} needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed
    # every text we draw is text: a title or a run's folder with a `$` is not TeX math to parse
    # (a `$\foo{x}$` was matplotlib's ParseFatalException)
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt
    return plt


def output_path(output: str, plt) -> str:
    """The file a picture goes to, checked before anything is drawn: PNG unless the name says
    another format matplotlib writes, in a folder that exists, and not a FIFO or a folder."""
    path = Path(output)
    if not path.suffix:
        path = Path(output + ".png")  # what matplotlib would write anyway: say so, not "wrote metrics"
    else:
        formats = plt.figure().canvas.get_supported_filetypes()
        plt.close("all")
        if path.suffix[1:].lower() not in formats:
            raise UsageError(f"--output {output}: matplotlib cannot write {path.suffix} files "
                             f"(it writes {', '.join('.' + f for f in sorted(formats))})")
    files.check_output(str(path), "--output")  # its folder, and not a FIFO
    return str(path)


def plot(runs: dict[str, list[dict]], output: str, plt):
    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    for i, (name, rows) in enumerate(runs.items()):
        color = f"C{i}"
        ax_loss.plot(*series(rows, "loss"), color=color, label=f"{name} train")
        ax_loss.plot(*series(rows, "val_loss"), color=color, linestyle="--", marker="o", markersize=3,
                     label=f"{name} val")
        ax_speed.plot(*series(rows, "tokens_per_s_nonpad"), color=color, label=name)  # the tokens trained on
    ax_loss.set_ylabel("loss (cross-entropy, nats)")
    ax_loss.legend()
    ax_speed.set_ylabel("tokens/s (padding not counted)")
    ax_speed.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(output, dpi=120)
    except OSError as e:  # a read-only folder, a full disk
        raise UsageError(f"--output {output}: cannot write it: {first_line(e)}") from None
    finally:
        plt.close(fig)


def main(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dirs", nargs="+", type=path_argument, help="output folders of training runs")
    parser.add_argument("-o", "--output", default="metrics.png", type=path_argument, help="image to write (PNG unless its suffix "
                        "names another format, such as .svg or .pdf)")
    args = parser.parse_args(argv)
    plt = pyplot()
    output = output_path(args.output, plt)
    runs = {}
    for out_dir in args.out_dirs:
        name = Path(out_dir).resolve().name
        runs[name if name not in runs else out_dir] = read_metrics(out_dir)
    plot(runs, output, plt)
    print(f"wrote {output}")


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)
