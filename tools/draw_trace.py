"""Draw one step of --profile traces: for each rank, what its training thread did (forward,
backward, the optimizer step, the wait for data, evaluation) above the collectives it ran
and, in a GPU trace, the GPU's own lane (its kernels, NCCL's among them), on one time axis
(needs matplotlib).

    python tools/draw_trace.py ddp/profile/rank*.trace.json fsdp/profile/rank*.trace.json -o step.png

Each trace gets its lanes, labelled by its run's folder and rank; the times are from each
trace's own step start (ranks' clocks agree on one machine, not across machines; a GPU's
events are on its host's clock). The README's picture is drawn this way: docs/profiling.md
gives the commands.
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
          "evaluation": "#eeca3b", "compute": "#79706e", "all-reduce": "#e45756", "all-gather": "#b279a2",
          "reduce-scatter": "#9d755d", "broadcast": "#72b7b2", "collective": "#ff9da6"}


def lanes(summary: dict) -> list[tuple[str, list]]:
    """(lane, its bars: (start ms, length ms, what)): the training thread's, the collectives',
    and on a GPU the GPU's."""
    work = [(a, b - a, "data wait") for a, b in summary.get("data_waits", [])]
    for m in summary["micro_steps"]:
        work.append((m["forward"][0], m["forward"][1] - m["forward"][0], "forward"))
        if m["backward"]:
            work.append((m["backward"][0], m["backward"][1] - m["backward"][0], "backward"))
    if summary["optimizer"] is not None:  # the step's end: the optimizer, then logging, saving, the stop flag
        work.append((summary["optimizer"], summary["ms"] - summary["optimizer"], "optimizer step"))
    work += [(a, b - a, "evaluation") for a, b in summary["evaluation"]]
    found = [("training", work), ("collectives", [(c["start"], c["end"] - c["start"], c["kind"])
                                                   for c in summary["collectives"]])]
    if "gpu" in summary:
        found.append(("GPU", [(a, b - a, what) for a, b, what in summary["gpu"]["kernels"]]))
    return found


def label(path: Path) -> str:
    rank = re.search(r"(?:^|\.)rank(\d+)\.", path.name)
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
    height = sum(len(lanes(summary)) for _, summary in rows)
    fig, ax = plt.subplots(figsize=(11, 0.7 * height + 1.2))
    ticks, names, y = [], [], 0
    for name, summary in rows:
        for lane, bars in lanes(summary):
            ax.broken_barh([(start, max(width, 0.2)) for start, width, _ in bars], (-y - 0.4, 0.8),
                           facecolors=[COLORS.get(what, "#888888") for _, _, what in bars],
                           edgecolor="none" if lane == "GPU" else "white", linewidth=0.3)  # kernels: many, thin
            ticks.append(-y)
            names.append(f"{name}: {lane}" if lane == "training" else lane)
            y += 1
    ax.set_yticks(ticks, names)
    ax.set_xlabel("ms from the step's start")
    order = list(COLORS)
    used = sorted({what for _, s in rows for _, bars in lanes(s) for _, _, what in bars},
                  key=lambda w: order.index(w) if w in COLORS else len(order))
    ax.legend(handles=[Patch(color=COLORS.get(w, "#888888"), label=w) for w in used], loc="upper center",
              ncols=len(used),
              bbox_to_anchor=(0.5, -0.18 if height > 3 else -0.4), frameon=False, fontsize="small")
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
