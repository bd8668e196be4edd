"""What a --profile trace shows, step by step: compute, communication, how much of the
communication overlapped compute, and the wait for data, all from the trace's own events.

    python tools/trace_summary.py out/profile/rank0.steps4-5.pt.trace.json [more traces]

A step is the span the trainer marks on its training thread (ProfilerStep#N; a GPU trace
marks it again on the GPU's stream, which gives the GPU's own span of the step). Within it:
  micro-steps  the trainer marks each (micro-step i) around its forward and backward; its
               backward runs from its first autograd function to its last, on whatever thread
               runs them (on CUDA, autograd's device thread), compiled regions' included.
               (A trace of an earlier version, without these marks: each micro-step begins
               with its forward, DistributedDataParallel.forward, FSDP's root_pre_forward, or
               else the embedding lookup.) Evaluation is marked apart, and is no micro-step
  compute      on a GPU, the union of its kernels in the GPU's span of the step (NCCL's left
               out); on a CPU, the ATen operators' own time on the training thread (each
               without the operators it calls; the autograd engine's functions, FSDP's and
               DDP's hooks and c10d's calls only hold them, or wait)
  collectives  each named by the call that launched it (all-reduce, all-gather, reduce-scatter)
               and placed in the phase it was launched in; its time is gloo's work on its
               threads, or NCCL's kernels on the GPU (none in a world of one)
  overlapped   the part of the communication time during which compute also ran
  data wait    the trainer's mark around its wait for the step's batches (read ahead)
  by kind      the step's kernels' time (on a CPU the operators' own time) in matmuls, attention,
               the loss, the optimizer, communication and the rest: each kernel the step launched,
               the optimizer's too, which run after the GPU's span (tools/kernel_kinds.py)
docs/profiling.md shows how to read them.
"""

import argparse
import bisect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from tools import kernel_kinds  # noqa: E402
from tools.kernel_kinds import OPTIMIZER_MARK, communicates, thread  # noqa: E402
from training import corpus, errors, stopping  # noqa: E402
from training.errors import UsageError, first_line, path_argument  # noqa: E402
from training.profiling import DATA_WAIT_MARK, EVALUATION_MARK, MICRO_STEP_MARK, STEP_MARK  # noqa: E402

# where a micro-step began in a trace of an earlier version (no micro-step marks): the first found wins
FORWARD_MARKS = ("DistributedDataParallel.forward", "FSDP::root_pre_forward", "aten::embedding")
BACKWARD = "autograd::engine::evaluate_function"  # every function the autograd engine runs, on any thread
OLD_DATA_WAIT = "enumerate(DataLoader)"  # what a trace of an earlier version waited in
COLLECTIVE_KINDS = {"allreduce": "all-reduce", "all_reduce": "all-reduce", "allgather": "all-gather",
                    "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "broadcast": "broadcast"}
NCCL_KERNEL_KINDS = {"AllReduce": "all-reduce", "AllGather": "all-gather", "ReduceScatter": "reduce-scatter",
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


def self_time(events, left_out=lambda event: False) -> list[tuple[float, float, dict]]:
    """The intervals (start, end, the event) in which each event of one thread ran itself, not one of
    the events it holds: an operator's own work, without the operators it called (and none of left_out's)."""
    own, stack = [], []  # stack: [event, its children's intervals]

    def close(event, children):
        if left_out(event):
            return
        at = event["ts"]
        for start, end in union(children):
            if start > at:
                own.append((at, start, event))
            at = max(at, end)
        if at < end_of(event):
            own.append((at, end_of(event), event))

    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and end_of(stack[-1][0]) <= e["ts"]:
            close(*stack.pop())
        if stack:
            stack[-1][1].append((e["ts"], end_of(e)))
        stack.append((e, []))
    while stack:
        close(*stack.pop())
    return own


def end_of(event) -> float:
    return event["ts"] + event["dur"]


TRACE_LIMIT = 2**32  # a trace of a few steps of the 1b model on 8 GPUs is a few hundred MB


def read_trace(path) -> list[dict]:
    """The trace's complete events ("X": a name, a start and a duration on a thread), each
    checked: a trace is a file anyone may have edited, and a NaN, a negative duration or a time
    no clock reads would make every figure after it wrong in silence."""
    text = corpus.read_text(path, "trace", TRACE_LIMIT)  # a regular file: a FIFO or /dev/zero is one line
    try:
        trace = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"cannot read the trace {path}: {first_line(e)}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise UsageError(f"{path} is not a trace of torch.profiler (no traceEvents)")
    complete = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue  # metadata, flows, instants: not read
        problem = next((what for what, bad in (
            ("no name", not isinstance(e.get("name"), str)),
            ("no thread", not isinstance(e.get("tid"), (int, str)) or not isinstance(e.get("pid"), (int, str))),
            ("a start that is not a time (a number of µs within ±2**53)", not _time(e.get("ts"))),
            ("a duration that is not a time of at least 0 (ending within 2**53 µs)",
             not (_time(e.get("ts")) and _time(e.get("dur")) and e["dur"] >= 0 and _time(e["ts"] + e["dur"]))),
            ("arguments that are not an object", not isinstance(e.get("args", {}), dict))) if bad), None)
        if problem:
            raise UsageError(f"{path}: event {i} has {problem}: not a trace torch.profiler wrote ({str(e)[:80]})")
        complete.append(e)
    return complete


# A trace's times are µs on the clock torch.profiler read: since the epoch (1.7e15), or since a base time the
# trace names apart (5e12 in tests/fixtures/'s). Within 2**53 µs (285 years) either way a float64 holds every
# µs exactly; a time beyond it is no clock's, and NaN, an infinity or a 400-digit integer would make every
# figure after it wrong.
TIME_LIMIT = 2**53


def _time(value) -> bool:
    """A number within ±TIME_LIMIT (NaN and the infinities compare false; a huge int compares exactly)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -TIME_LIMIT <= value <= TIME_LIMIT


def collective_kind(name: str) -> str | None:
    name = name.replace("_base", "").replace("allgather_into_tensor", "allgather")
    return next((kind for key, kind in COLLECTIVE_KINDS.items() if key in name), None)


STEP_DIGITS = 19  # as many as 2**63 has: beyond any step a run takes (--profile-warmup stops at 2**62)


def step_number(path, name: str) -> int:
    """A step mark's number: ASCII digits, at most STEP_DIGITS of them ('²' is a digit to str.isdigit, not to int;
    5,000 digits are too many for int)."""
    number = name[len(STEP_MARK):]
    if not (number.isascii() and number.isdigit() and len(number) <= STEP_DIGITS):
        shown = name if len(name) <= 60 else name[:60] + "..."
        raise UsageError(f"{path} marks a step {shown!r}: not a step this trainer's --profile marks")
    return int(number)


# Marks that touch may overlap by a rounding: ts and dur are printed to the ns, and ts + dur is a float sum
# (at the epoch's 1.7e15 µs, a float's step is 0.25 µs)
TOUCHING_US = 1.0


def one_after_another(path, marks: list[dict], lane: str) -> list[int]:
    """The numbers of one lane's step marks (sorted by start), refused unless each step is marked once and each
    mark ends before the next begins, as torch.profiler marks them: a step inside another, or marked twice, would
    count its events twice. (A step is marked on the training thread and again on the GPU's stream: two lanes.)"""
    numbers, seen = [step_number(path, m["name"]) for m in marks], {}
    for i, (mark, number) in enumerate(zip(marks, numbers)):
        if number in seen:
            raise UsageError(f"{path} marks step {number} twice on {lane} (at {seen[number]} and {mark['ts']} µs): "
                             "not a trace this trainer's --profile wrote")
        seen[number] = mark["ts"]
        if i and mark["ts"] < end_of(marks[i - 1]) - TOUCHING_US:
            before = marks[i - 1]
            raise UsageError(f"{path}: step {number}'s mark on {lane} begins at {mark['ts']} µs, inside step "
                             f"{numbers[i - 1]}'s ({before['ts']} to {end_of(before)} µs): not a trace this "
                             "trainer's --profile wrote")
    return numbers


def summarize(path) -> list[dict]:
    """One dict a step, each once: step, ts_us (its start in the trace's clock), ms, compute_ms, data_wait_ms
    (data_waits: when), communication_ms, overlapped_ms, kinds (kernel_kinds.by_kind), micro_steps (each
    {"forward": (start, end), "backward": (start, end) or None}), optimizer, evaluation (each (start, end)),
    collectives (each {"kind", "phase", "start", "end", "elements"}) and, on a GPU, gpu: the GPU's span of the
    step and its kernels (each (start, end, what): "compute" or a collective's kind). Times in ms from the
    step's start on the training thread; the GPU's events are on the same clock."""
    events = read_trace(path)
    gpu_marks = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    steps = sorted((e for e in events if e["name"].startswith(STEP_MARK) and e.get("cat") != "gpu_user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        raise UsageError(f"{path} marks no step ({STEP_MARK}N): not a trace of this trainer's --profile")
    if len({(s["pid"], s["tid"]) for s in steps}) != 1:
        raise UsageError(f"{path} marks steps on more than one thread: not a trace this trainer's --profile wrote")
    pid, main = steps[0]["pid"], steps[0]["tid"]
    numbers = one_after_another(path, steps, "the training thread")
    streams = {}  # the GPU's marks of each step, a lane for each (device, stream)
    for g in gpu_marks:
        if g["name"].startswith(STEP_MARK):
            streams.setdefault((g["pid"], g["tid"]), []).append(g)
    for (device, stream), marks in streams.items():
        one_after_another(path, sorted(marks, key=lambda g: g["ts"]), f"GPU {device} stream {stream}")
    ours = [e for e in events if e["pid"] == pid]  # the training process's threads (not the GPU's)
    on_main = [e for e in ours if e["tid"] == main]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    collectives = launched_collectives(ours, kernels)
    if kernels:
        busy = union((e["ts"], end_of(e)) for e in kernels if not communicates(e["name"]))
        moving = union((e["ts"], end_of(e)) for e in kernels if communicates(e["name"]))
        work = kernel_kinds.kernel_work(kernels, ours)
    else:
        ops = [e for e in on_main if e.get("cat") == "cpu_op"]
        # ATen's operators are the work; the autograd engine's functions, FSDP's and DDP's hooks
        # and c10d's calls hold them, and their own time is bookkeeping or a wait
        own = self_time(ops, left_out=lambda e: not e["name"].startswith("aten::"))
        busy, work = union((a, b) for a, b, _ in own), [(e["name"], a, b, (thread(e), e["ts"])) for a, b, e in own]
        moving = union((c["ts"], c["end"]) for c in collectives)
    named = lambda *names: [e for e in on_main if e["name"] in names or e["name"].startswith(names)]  # noqa: E731
    waits = union((e["ts"], end_of(e)) for e in named(DATA_WAIT_MARK) or named(OLD_DATA_WAIT))  # the mark, or as was
    evaluations = named(EVALUATION_MARK)
    optimizer, marks = named(OPTIMIZER_MARK), kernel_kinds.marked(ours)
    backward = sorted((e for e in ours if e["name"].startswith(BACKWARD)), key=lambda e: e["ts"])
    micro_marks = named(MICRO_STEP_MARK)
    forwards = next((found for mark in FORWARD_MARKS if (found := [e for e in on_main if e["name"] == mark])), [])
    summaries = []
    for s, number in zip(steps, numbers):
        start, end = s["ts"], end_of(s)
        ms = lambda t: (t - start) / 1000  # noqa: E731
        inside = lambda found: sorted((e for e in found if start <= e["ts"] < end), key=lambda e: e["ts"])  # noqa
        opt = next((e["ts"] for e in inside(optimizer)), end)
        evaluating = [(e["ts"], end_of(e)) for e in inside(evaluations)]
        micro = micro_steps(inside(micro_marks), inside(forwards), backward, opt, evaluating)
        gpu = next((g for g in gpu_marks if g["name"] == s["name"]), None)
        window = (gpu["ts"], end_of(gpu)) if gpu else (start, end)  # the device's own span of the step
        compute, comm = clip(busy, *window), clip(moving, *window)
        placed = [{"kind": c["kind"], "phase": phase(c["ts"], micro, opt, evaluating), "start": ms(c["ts"]),
                   "end": ms(c["end"]), "elements": c["elements"]} for c in collectives if start <= c["ts"] < end]
        summary = {
            "step": number, "ts_us": start, "ms": s["dur"] / 1000,
            "compute_ms": length(compute) / 1000, "data_wait_ms": length(clip(waits, start, end)) / 1000,
            "data_waits": [(ms(a), ms(b)) for a, b in clip(waits, start, end)],
            "communication_ms": length(comm) / 1000, "overlapped_ms": length(intersection(comm, compute)) / 1000,
            "micro_steps": [{"forward": tuple(map(ms, m["forward"])),
                             "backward": m["backward"] and tuple(map(ms, m["backward"]))} for m in micro],
            "optimizer": ms(opt) if opt < end else None,
            "evaluation": [tuple(map(ms, span)) for span in evaluating], "collectives": placed,
            "kinds": kernel_kinds.by_kind(work, (start, end), window, marks)}
        if kernels:
            summary["gpu"] = {"start": ms(window[0]), "end": ms(window[1]), "kernels": [
                (ms(a), ms(b), "compute") for a, b in compute] + [
                (ms(e["ts"]), ms(end_of(e)), nccl_kind(e["name"])) for e in kernels
                if communicates(e["name"]) and window[0] <= e["ts"] < window[1]]}
        summaries.append(summary)
    return summaries


def micro_steps(marks, forwards, backward, optimizer: float, evaluating) -> list[dict]:
    """Each micro-step's forward and backward spans ((start, end), in the trace's µs). By the
    trainer's marks; a trace without them (an earlier version's) by each forward's first call,
    evaluation's left out. Backward: the autograd functions from the forward's end on, on any
    thread, up to the next micro-step or the optimizer step."""
    if marks:
        spans = [(m["ts"], end_of(m)) for m in marks]
    else:
        starts = [f["ts"] for f in forwards if f["ts"] < optimizer
                  and not any(a <= f["ts"] < b for a, b in evaluating)]
        spans = list(zip(starts, starts[1:] + [optimizer]))
    found = []
    for start, until in spans:
        back = [e for e in backward if start <= e["ts"] < until]
        first, last = (back[0]["ts"], max(end_of(e) for e in back)) if back else (until, None)
        found.append({"forward": (start, first), "backward": (first, last) if back else None})
    return found


def launched_collectives(events, kernels) -> list[dict]:
    """Every collective the process launched: {"kind", "ts" (its launch), "end", "elements"}.
    gloo's work is on its own threads, each named by the c10d call that handed it over (the
    last before it: a reduce-scatter runs as gloo's all_reduce); NCCL's launches are marked
    on the launching thread (nccl:all_reduce), their time the kernels they launched."""
    c10d = sorted((e for e in events if e["name"].startswith("c10d::")), key=lambda e: e["ts"])
    c10d_starts = [c["ts"] for c in c10d]
    by_launch = {}
    for k in kernels:
        by_launch.setdefault(k.get("args", {}).get("External id"), []).append(k)
    found = []
    for e in events:
        if e["name"].startswith("gloo:"):
            launched = bisect.bisect_right(c10d_starts, e["ts"])
            kind = collective_kind(c10d[launched - 1]["name"]) if launched else None
            found.append({"kind": kind or e["name"][5:].replace("_", "-"), "ts": e["ts"], "end": end_of(e),
                          "elements": input_elements(e)})
        elif e["name"].startswith("nccl:") and e.get("cat") == "user_annotation":
            ran = [k for k in by_launch.get(e.get("args", {}).get("External id"), ()) if "nccl" in k["name"].lower()]
            found.append({"kind": collective_kind(e["name"]) or e["name"][5:], "ts": e["ts"],
                          "end": max((end_of(k) for k in ran), default=e["ts"]), "elements": None})
    return sorted(found, key=lambda c: c["ts"])


def input_elements(event) -> int:
    dims = event.get("args", {}).get("Input Dims") or [[]]
    elements = 1
    for n in dims[0] if isinstance(dims, list) and dims and isinstance(dims[0], list) else []:
        elements *= n if isinstance(n, int) else 1
    return elements


def nccl_kind(name: str) -> str:
    return next((kind for key, kind in NCCL_KERNEL_KINDS.items() if key in name), "collective")


def phase(t: float, micro: list[dict], optimizer: float, evaluating) -> str:
    """Where in the step a collective was launched: before the first forward, in micro-step
    i's forward or backward (from 1), between that backward and what follows, in evaluation,
    or at the optimizer step and after."""
    if any(a <= t < b for a, b in evaluating):
        return "evaluation"
    if t >= optimizer:
        return "optimizer step and after"
    current = None
    for i, m in enumerate(micro, 1):
        if t >= m["forward"][0]:
            current = (i, m)
    if current is None:
        return "before the first forward"
    i, m = current
    if m["backward"] is None or t < m["backward"][0]:
        return f"forward {i}"
    return f"backward {i}" if t <= m["backward"][1] else f"after backward {i}"


def describe(summary: dict) -> list[str]:
    comm, overlapped = summary["communication_ms"], summary["overlapped_ms"]
    moved = f"communication {comm:.1f}, {overlapped:.1f} of it overlapped with compute ({overlapped / comm:.0%})" \
        if comm else "no communication"
    where = f" | on the GPU {summary['gpu']['end'] - summary['gpu']['start']:.1f} ms" if "gpu" in summary else ""
    lines = [f"step {summary['step']}: {summary['ms']:.1f} ms{where} | compute {summary['compute_ms']:.1f} | data "
             f"wait {summary['data_wait_ms']:.1f} | {moved} | {len(summary['micro_steps'])} micro-step(s)"]
    for i, m in enumerate(summary["micro_steps"], 1):
        back = m["backward"]
        lines.append(f"    micro-step {i}: forward {m['forward'][1] - m['forward'][0]:.1f} ms, "
                     + (f"backward {back[1] - back[0]:.1f} ms" if back else "no backward"))
    groups = {}
    for c in summary["collectives"]:
        groups.setdefault((c["kind"], c["phase"]), []).append(c)
    for (kind, where), found in groups.items():
        ms = sum(c["end"] - c["start"] for c in found)
        lines.append(f"    {len(found)} x {kind}, {where}: {ms:.1f} ms")
    what = "kernels" if "gpu" in summary else "ATen operators' own time"
    return lines + ["    " + line for line in kernel_kinds.describe(summary["kinds"], what)]


def kernel_time_by_kind(path) -> dict[int, dict]:
    """Each traced step's kernel time by kind (kernel_kinds.step_by_kind), by step number."""
    return {s["step"]: kernel_kinds.step_by_kind(s) for s in summarize(path)}


def trace_name(path) -> str:
    """A trace by its run's folder: two runs' rank0.steps4-5.pt.trace.json are not one."""
    path = Path(path)
    return str(Path(path.parent.parent.name, path.parent.name, path.name)) if path.parent.name == "profile" \
        else str(Path(path.parent.name, path.name))


def main(argv=None):
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=path_argument, help="rank<R>.steps<A>-<B>.pt.trace.json files")
    args = parser.parse_args(argv)
    for path in args.traces:
        summaries = summarize(path)  # a damaged trace is one line before anything is printed of it
        print(trace_name(path))
        for summary in summaries:
            print("\n".join("  " + line for line in describe(summary)))


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)
