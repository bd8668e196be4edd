"""Plot training and validation loss, and tokens/s, against step for one or more runs.

    python plot_metrics.py out                          # writes metrics.png
    python plot_metrics.py run-a run-b -o compare.png   # runs overlaid, one colour each

Reads metrics.jsonl from each output folder. Needs matplotlib (pip install matplotlib),
which training does not.
"""

import argparse
import json
from pathlib import Path

import launcher
import training
from checkpointing import METRICS
from errors import UsageError


def read_metrics(out_dir: str) -> list[dict]:
    path = Path(out_dir) / METRICS
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    if not rows:
        raise UsageError(f"{path} holds no logged step yet")
    return rows


def series(rows: list[dict], key: str):
    """(steps, values) of the rows that logged `key`."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    return [s for s, _ in points], [v for _, v in points]


def plot(runs: dict[str, list[dict]], output: str):
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plot_metrics.py needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    for i, (name, rows) in enumerate(runs.items()):
        color = f"C{i}"
        ax_loss.plot(*series(rows, "loss"), color=color, label=f"{name} train")
        ax_loss.plot(*series(rows, "val_loss"), color=color, linestyle="--", marker="o", markersize=3,
                     label=f"{name} val")
        ax_speed.plot(*series(rows, "tokens_per_s"), color=color, label=name)
    ax_loss.set_ylabel("loss (cross-entropy, nats)")
    ax_loss.legend()
    ax_speed.set_ylabel("tokens/s")
    ax_speed.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = training.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dirs", nargs="+", help="output folders of training runs")
    parser.add_argument("-o", "--output", default="metrics.png", help="PNG file to write")
    args = parser.parse_args(argv)
    if not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"--output {args.output}: its folder does not exist")
    runs = {}
    for out_dir in args.out_dirs:
        name = Path(out_dir).resolve().name
        runs[name if name not in runs else out_dir] = read_metrics(out_dir)
    plot(runs, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    launcher.exit_on_usage_error(main)
