"""Draw one step of --profile traces: for each rank, what its training thread did (forward,
backward, the optimizer step, the wait for data) above the collectives it ran, on one time
axis (needs matplotlib).

    python tools/draw_trace.py ddp/profile/rank*.trace.json fsdp/profile/rank*.trace.json -o step.png

Each trace gets two lanes, labelled by its run's folder and rank; the times are from each
trace's own step start (ranks' clocks agree on one machine, not across machines). The
README's picture is drawn this way: docs/profiling.md gives the commands.
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from tools.plot_metrics import output_path, pyplot  # noqa: E402
from tools.trace_summary import summarize  # noqa: E402
from training import errors, stopping  # noqa: E402
from training.errors import UsageError, first_line, path_argument  # noqa: E402

COLORS = {"forward": "#4c78a8", "backward": "#f58518", "optimizer step": "#54a24b", "data wait": "#bab0ac",
          "all-reduce": "#e45756", "all-gather": "#b279a2", "reduce-scatter": "#9d755d", "broadcast": "#72b7b2"}


def lanes(summary: dict) -> tuple[list, list]:
    """(the training thread's bars, the collectives' bars): (start ms, length ms, what)."""
    work = []
    micro = summary["micro_steps"]
    for i, m in enumerate(micro):
        back = m["backward"]
        forward_end = back[0] if back else (micro[i + 1]["forward"] if i + 1 < len(micro) else summary["ms"])
        work.append((m["forward"], forward_end - m["forward"], "forward"))
        if back:
            work.append((back[0], back[1] - back[0], "backward"))
    if summary["optimizer"] is not None:  # the step's end: the optimizer, then logging, saving, the stop flag
        work.append((summary["optimizer"], summary["ms"] - summary["optimizer"], "optimizer step"))
    comm = [(c["start"], c["end"] - c["start"], c["kind"]) for c in summary["collectives"]]
    return work, comm


def label(path: Path) -> str:
    rank = re.match(r"rank(\d+)", path.name)
    run = path.parent.parent.name if path.parent.name == "profile" else path.parent.name
    return f"{run}, rank {rank.group(1) if rank else '?'}"


def main(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=path_argument)
    parser.add_argument("-o", "--output", type=path_argument, default="step.png")
    parser.add_argument("--step", type=int, help="which traced step (default: each trace's last)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    plt = pyplot("draw_trace.py")
    from matplotlib.patches import Patch
    output = output_path(args.output, plt)  # checked before the traces are read
    rows = []
    for path in map(Path, args.traces):
        summaries = summarize(path)
        chosen = [s for s in summaries if args.step is None or s["step"] == args.step]
        if not chosen:
            raise UsageError(f"{path} traces steps {[s['step'] for s in summaries]}, not step {args.step}")
        rows.append((label(path), chosen[-1]))
    fig, ax = plt.subplots(figsize=(11, 0.7 * 2 * len(rows) + 1.2))
    ticks, names = [], []
    for r, (name, summary) in enumerate(rows):
        work, comm = lanes(summary)
        for lane, bars, y in (("training", work, 2 * r), ("collectives", comm, 2 * r + 1)):
            ax.broken_barh([(start, max(width, 0.2)) for start, width, _ in bars], (-y - 0.4, 0.8),
                           facecolors=[COLORS.get(what, "#888888") for _, _, what in bars], edgecolor="white",
                           linewidth=0.3)
            ticks.append(-y)
            names.append(f"{name}: {lane}" if lane == "training" else lane)
    ax.set_yticks(ticks, names)
    ax.set_xlabel("ms from the step's start")
    used = sorted({what for _, s in rows for bars in lanes(s) for _, _, what in bars}, key=list(COLORS).index)
    ax.legend(handles=[Patch(color=COLORS[w], label=w) for w in used], loc="upper center", ncols=len(used),
              bbox_to_anchor=(0.5, -0.18 if len(rows) > 1 else -0.4), frameon=False, fontsize="small")
    ax.set_title(args.title or f"one step of {len(rows)} traces")
    fig.tight_layout()
    try:
        fig.savefig(output, dpi=110)
    except OSError as e:  # a read-only folder, a full disk
        raise UsageError(f"--output {output}: cannot write it: {first_line(e)}") from None
    finally:
        plt.close(fig)
    print(f"wrote {output}")


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)
