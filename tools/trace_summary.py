"""What a --profile trace shows, step by step: compute, communication, how much of the
communication overlapped compute, and the wait for data, all from the trace's own events.

    python tools/trace_summary.py out/profile/rank0.steps4-5.pt.trace.json [more traces]

A step is the span the trainer marks (ProfilerStep#N). Within it:
  micro-steps  each begins with its forward: DistributedDataParallel.forward, FSDP's
               root_pre_forward, or else the embedding lookup (the model's first op); its
               backward runs from its first autograd function to its last
  compute      the time the device computes: on a GPU the union of its kernels (NCCL's left
               out), on a CPU the ATen operators' own time on the training thread (each
               without the operators it calls; the autograd engine's functions, FSDP's and
               DDP's hooks and c10d's calls only hold them, or wait)
  collectives  gloo's work on its threads, or NCCL's kernels, each named by the c10d call
               that launched it (all-reduce, all-gather, reduce-scatter) and placed in the
               phase it started in
  overlapped   the part of the communication time during which compute also ran
  data wait    the DataLoader's __next__: the loop waiting for its batch
docs/profiling.md shows how to read them.
"""

import argparse
import bisect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from training import corpus, errors, stopping  # noqa: E402
from training.errors import UsageError, first_line, path_argument  # noqa: E402

STEP_MARK = "ProfilerStep#"
FORWARD_MARKS = ("DistributedDataParallel.forward", "FSDP::root_pre_forward", "aten::embedding")  # first found wins
C10D_KINDS = {"allreduce": "all-reduce", "allgather": "all-gather", "reduce_scatter": "reduce-scatter",
              "broadcast": "broadcast"}
NCCL_KINDS = {"AllReduce": "all-reduce", "AllGather": "all-gather", "ReduceScatter": "reduce-scatter",
              "Broadcast": "broadcast"}


def union(intervals) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a, b) -> list[tuple[float, float]]:
    """Of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals, start, end):
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def self_time(events, left_out=lambda event: False) -> list[tuple[float, float]]:
    """The intervals in which each event of one thread ran itself, not one of the events it
    holds: an operator's own work, without the operators it called (and none of left_out's)."""
    own, stack = [], []  # stack: [event, its children's intervals]

    def close(event, children):
        if left_out(event):
            return
        at = event["ts"]
        for start, end in union(children):
            if start > at:
                own.append((at, start))
            at = max(at, end)
        if at < event["ts"] + event["dur"]:
            own.append((at, event["ts"] + event["dur"]))

    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
            close(*stack.pop())
        if stack:
            stack[-1][1].append((e["ts"], e["ts"] + e["dur"]))
        stack.append((e, []))
    while stack:
        close(*stack.pop())
    return own


TRACE_LIMIT = 2**32  # a trace of a few steps of the 1b model on 8 GPUs is a few hundred MB


def read_trace(path) -> list[dict]:
    text = corpus.read_text(path, "trace", TRACE_LIMIT)  # a regular file: a FIFO or /dev/zero is one line
    try:
        trace = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"cannot read the trace {path}: {first_line(e)}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise UsageError(f"{path} is not a trace of torch.profiler (no traceEvents)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float))]


def collective_kind(name: str) -> str | None:
    for key, kind in C10D_KINDS.items():
        if key in name.replace("_base", "").replace("allgather_into_tensor", "allgather"):
            return kind
    return None


def summarize(path) -> list[dict]:
    """One dict a step: step, ms, compute_ms, data_wait_ms, communication_ms, overlapped_ms,
    micro_steps (each {"forward": start, "backward": (start, end)}, in ms from the step's
    start) and collectives (each {"kind", "phase", "start", "end", "elements"})."""
    events = read_trace(path)
    steps = sorted((e for e in events if e["name"].startswith(STEP_MARK)), key=lambda e: e["ts"])
    if not steps:
        raise UsageError(f"{path} marks no step ({STEP_MARK}N): not a trace of this trainer's --profile")
    main = steps[0]["tid"]
    on_gpu = any(e.get("cat") == "kernel" for e in events)
    c10d = sorted((e for e in events if e["tid"] == main and e["name"].startswith("c10d::")), key=lambda e: e["ts"])
    c10d_starts = [c["ts"] for c in c10d]
    collectives = []
    for e in events:
        if e["name"].startswith("gloo:"):  # gloo's work: named by the c10d call that handed it over, the last before
            launched = bisect.bisect_right(c10d_starts, e["ts"])  # (a reduce-scatter runs as gloo's all_reduce)
            kind = collective_kind(c10d[launched - 1]["name"]) if launched else None
            dims = e.get("args", {}).get("Input Dims") or [[]]
            elements = 1
            for n in dims[0] if dims and isinstance(dims[0], list) else []:
                elements *= n
            collectives.append({"kind": kind or e["name"][5:].replace("_", "-"), "ts": e["ts"],
                                "end": e["ts"] + e["dur"], "elements": elements})
        elif on_gpu and e.get("cat") == "kernel" and "nccl" in e["name"].lower():
            kind = next((k for key, k in NCCL_KINDS.items() if key in e["name"]), "collective")
            collectives.append({"kind": kind, "ts": e["ts"], "end": e["ts"] + e["dur"], "elements": None})
    if on_gpu:
        busy = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"
                and "nccl" not in e["name"].lower()]
    else:
        ops = [e for e in events if e["tid"] == main and e.get("cat") == "cpu_op"]
        # ATen's operators are the work; the autograd engine's functions, FSDP's and DDP's hooks
        # and c10d's calls hold them, and their own time is bookkeeping or a wait
        busy = self_time(ops, left_out=lambda e: not e["name"].startswith("aten::"))
    busy = union(busy)
    waits = union((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("enumerate(DataLoader)"))
    marks = next(([e for e in events if e["tid"] == main and e["name"] == mark] for mark in FORWARD_MARKS
                  if any(e["tid"] == main and e["name"] == mark for e in events)), [])
    autograd = [e for e in events if e["tid"] == main and e["name"].startswith("autograd::engine::evaluate_function")]
    optimizer = [e for e in events if e["tid"] == main and e["name"].startswith("Optimizer.step#")]
    summaries = []
    for s in steps:
        start, end = s["ts"], s["ts"] + s["dur"]
        ms = lambda t: (t - start) / 1000  # noqa: E731
        forwards = sorted(e["ts"] for e in marks if start <= e["ts"] < end)
        opt = min((e["ts"] for e in optimizer if start <= e["ts"] < end), default=end)
        micro = []
        for i, f in enumerate(forwards):
            until = forwards[i + 1] if i + 1 < len(forwards) else opt
            back = [e for e in autograd if f <= e["ts"] < until]
            span = (min(e["ts"] for e in back), max(e["ts"] + e["dur"] for e in back)) if back else None
            micro.append({"forward": f, "backward": span})
        comm = union((c["ts"], c["end"]) for c in collectives if start <= c["ts"] < end)
        compute = clip(busy, start, end)
        placed = []
        for c in sorted((c for c in collectives if start <= c["ts"] < end), key=lambda c: c["ts"]):
            placed.append({"kind": c["kind"], "phase": phase(c["ts"], micro, opt), "start": ms(c["ts"]),
                           "end": ms(c["end"]), "elements": c["elements"]})
        summaries.append({
            "step": int(s["name"][len(STEP_MARK):]), "ms": s["dur"] / 1000,
            "compute_ms": length(compute) / 1000, "data_wait_ms": length(clip(waits, start, end)) / 1000,
            "communication_ms": length(comm) / 1000, "overlapped_ms": length(intersection(comm, compute)) / 1000,
            "micro_steps": [{"forward": ms(m["forward"]), "backward": m["backward"] and tuple(map(ms, m["backward"]))}
                            for m in micro],
            "optimizer": ms(opt) if opt < end else None, "collectives": placed})
    return summaries


def phase(t: float, micro: list[dict], optimizer: float) -> str:
    """Where in the step a collective began: before the first forward, in micro-step i's
    forward or backward (from 1), between that backward and what follows, or at the optimizer."""
    if t >= optimizer:
        return "optimizer step and after"
    current = None
    for i, m in enumerate(micro, 1):
        if t >= m["forward"]:
            current = (i, m)
    if current is None:
        return "before the first forward"
    i, m = current
    if m["backward"] is None or t < m["backward"][0]:
        return f"forward {i}"
    return f"backward {i}" if t <= m["backward"][1] else f"after backward {i}"


def describe(summary: dict) -> list[str]:
    comm, overlapped = summary["communication_ms"], summary["overlapped_ms"]
    share = f" ({overlapped / comm:.0%})" if comm else ""
    lines = [f"step {summary['step']}: {summary['ms']:.1f} ms | compute {summary['compute_ms']:.1f} | data wait "
             f"{summary['data_wait_ms']:.1f} | communication {comm:.1f}, {overlapped:.1f} of it overlapped with "
             f"compute{share} | {len(summary['micro_steps'])} micro-step(s)"]
    groups = {}
    for c in summary["collectives"]:
        groups.setdefault((c["kind"], c["phase"]), []).append(c)
    for (kind, where), found in groups.items():
        ms = sum(c["end"] - c["start"] for c in found)
        lines.append(f"    {len(found)} x {kind}, {where}: {ms:.1f} ms")
    return lines


def main(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=path_argument, help="rank<R>.steps<A>-<B>.pt.trace.json files")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(Path(path).name)
        for summary in summarize(path):
            print("\n".join("  " + line for line in describe(summary)))


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)
