"""--profile: a trace of a few chosen steps on every rank, in the output folder, which
Perfetto, chrome://tracing and TensorBoard open and tools/trace_summary.py reads from the
trace's own events. What the traces show is what the lessons say: DDP all-reduces gradients
bucket by bucket while the last micro-step's backward runs, and not at all in the others
(no_sync); FSDP gathers every layer before it runs, in forward and again in backward, and
reduce-scatters each layer's gradients. A run without the flag traces nothing; a run with it
checks everything it will need before it writes anything, and keeps its trace however it ends.
A GPU's step (tests/fixtures/, an H100's) is read from the GPU's own timeline."""

import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import (FAST, MODEL, REPO, ddp_two_ranks, launch_env, metrics, run_script, script_in_process,
                      stopped_at_step_4, without_speed)
from model import PRESETS
from test_bad_inputs import check_refused, refused_in_process, snapshot
from test_failures import checkpoint_step, fault_env
from tools import draw_trace, trace_summary
from training import profiling

PROFILE = ["--profile", "--profile-warmup", "2", "--profile-steps", "2", "--grad-accum", "2"]
# DDP's first bucket holds 1 MB of gradients (the last layers'), sent as soon as backward has
# filled it: `tiny` has 16 MB. The debug model's 0.6 MB would fill one bucket, sent only when
# backward is done, and there would be no overlap for the test to find.
DDP_PROFILE = [*PROFILE, "--model", "tiny"]
GROUPS = PRESETS[MODEL]["num_hidden_layers"] + 2  # FSDP's: each layer, the embedding, the norm with the LM head


def traces(out):
    return sorted((out / "profile").iterdir())


def micro_step_marks(trace: Path) -> dict[int, list[dict]]:
    """The trainer's micro-step marks in each traced step (by number), in order. Each script
    marks them itself (profiler.micro_steps): without them trace_summary would find the
    micro-steps all the same, from each forward's first call, as in a trace of an earlier version."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    return {s["step"]: sorted((e for e in events if e["name"].startswith(profiling.MICRO_STEP_MARK)
                               and s["ts_us"] <= e["ts"] < s["ts_us"] + s["ms"] * 1000), key=lambda e: e["ts"])
            for s in trace_summary.summarize(trace)}


def test_ddp_traces_every_rank_and_all_reduces_gradients_during_the_last_backward_only(runs):
    out = runs("ddp2_profiled", "train_ddp.py", DDP_PROFILE, nproc=2)
    assert [p.name for p in traces(out)] == ["rank0.steps3-4.pt.trace.json", "rank1.steps3-4.pt.trace.json"]
    for trace in traces(out):
        assert "traceEvents" in json.loads(trace.read_text())  # Chrome's trace format
        steps = trace_summary.summarize(trace)
        assert [s["step"] for s in steps] == [3, 4]  # steps 1 and 2 warmed up, untraced
        marks = micro_step_marks(trace)
        for s in steps:
            assert len(s["micro_steps"]) == 2 and all(m["backward"] for m in s["micro_steps"])
            assert [e["name"] for e in marks[s["step"]]] == ["micro-step 1", "micro-step 2"]  # train_ddp.py's
            gradients = [c for c in s["collectives"] if c["kind"] == "all-reduce" and c["elements"] > 1
                         and not c["phase"].startswith("optimizer")]  # not the evaluation's [loss, count]
            # none in micro-step 1 (no_sync); the last bucket goes once backward has filled it
            assert gradients and {c["phase"] for c in gradients} <= {"backward 2", "after backward 2"}
            assert gradients[0]["phase"] == "backward 2"  # launched while backward still runs: what DDP decides
            # (how much of it overlaps is the scheduler's on 2 busy cores, not the code's: not asserted)
            assert 0 <= s["overlapped_ms"] <= s["communication_ms"] and 0 < s["compute_ms"] < s["ms"]
            assert len(s["data_waits"]) == 1  # the trainer's mark: one wait for the step's batches
    assert not (ddp_two_ranks(runs) / "profile").exists()  # without --profile: nothing


def test_fsdp_gathers_each_layer_before_it_runs_and_reduce_scatters_it_in_backward(runs):
    out = runs("fsdp2_profiled", "train_fsdp.py", PROFILE, nproc=2)
    for trace in traces(out):
        marks = micro_step_marks(trace)
        for s in trace_summary.summarize(trace):
            assert [e["name"] for e in marks[s["step"]]] == ["micro-step 1", "micro-step 2"]  # train_fsdp.py's
            # step 4 evaluates (FAST: every 4 steps): its gathers are evaluation's, not the optimizer step's
            phases = {c["phase"] for c in s["collectives"] if c["kind"] == "all-gather"}
            assert ("evaluation" in phases) == (s["step"] == 4) and "optimizer step and after" not in phases
            assert len(s["micro_steps"]) == 2
            for i in (1, 2):
                def count(kind, *phases):
                    return sum(c["kind"] == kind and c["phase"] in phases for c in s["collectives"])
                assert count("all-gather", f"forward {i}") == GROUPS and count("reduce-scatter", f"forward {i}") == 0
                # gathered again for backward, but the norm with the LM head, kept from forward
                assert count("all-gather", f"backward {i}") == GROUPS - 1
                assert count("reduce-scatter", f"backward {i}", f"after backward {i}") == GROUPS  # the last: once done
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        for name in [f"base_model.layers.{i}" for i in range(PRESETS[MODEL]["num_hidden_layers"])]:
            gathers = sorted(e["ts"] + e["dur"] for e in events if e["name"] == f"FSDP::all_gather ({name})")
            forwards = sorted(e["ts"] for e in events if e["name"] == f"FSDP::post_forward ({name})")
            # every forward of the layer (2 micro-steps a step, and evaluation's) gathers it anew first
            assert len(forwards) >= 4 and all(any(before < g <= f for g in gathers)
                                              for before, f in zip([0, *forwards], forwards))


def test_one_process_traces_its_steps_with_no_collective(runs, tmp_path, capsys):
    out = runs("dp_profiled", "train_dp.py", PROFILE)
    (trace,) = traces(out)
    steps = trace_summary.summarize(trace)
    assert [s["step"] for s in steps] == [3, 4] and all(not s["collectives"] for s in steps)
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    # the micro-steps are the trainer's marks, forward and backward inside each, none of evaluation's
    marked = micro_step_marks(trace)
    for s in steps:
        marks = marked[s["step"]]
        assert [e["name"] for e in marks] == ["micro-step 1", "micro-step 2"]
        assert [m["forward"][0] for m in s["micro_steps"]] == [(e["ts"] - s["ts_us"]) / 1000 for e in marks]
        assert all(m["backward"] and m["forward"][1] == m["backward"][0] < m["backward"][1]
                   for m in s["micro_steps"])
    first = min(e["ts"] for e in events if e["name"].startswith("ProfilerStep#"))
    assert all(e["ts"] >= first for e in events if e.get("cat") == "cpu_op")  # nothing before the traced steps
    # nor after them, nor between: the profiler stops after the last; every event of the training
    # thread lies within a step's mark (1 µs: the trace's rounding)
    step_marks = [e for e in events if e["name"].startswith("ProfilerStep#")]
    outside = [e["name"] for e in events if e["tid"] == step_marks[0]["tid"] and not any(
        m["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= m["ts"] + m["dur"] + 1 for m in step_marks)]
    assert not outside, f"{len(outside)} events outside the traced steps: {outside[:5]}"
    assert [row["step"] for row in metrics(out) if "loss" in row] == [2, 4, 6, 8]  # and trained on as always
    picture = tmp_path / "step.png"
    assert script_in_process("tools/draw_trace.py", [*map(str, traces(runs("ddp2_profiled", "train_ddp.py",
                                                                             DDP_PROFILE, nproc=2))), str(trace),
                                                     "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_trace.label(trace) == "dp_profiled, rank 0"


def test_a_file_that_is_no_trace_or_a_picture_that_cannot_be_written_is_one_line(tmp_path, capsys):
    bad, fifo, zeros, folder = (tmp_path / name for name in ("x.json", "fifo.pt.trace.json", "zeros.pt.trace.json",
                                                              "folder.pt.trace.json"))
    bad.write_text('{"a": 1}')
    os.mkfifo(fifo)  # read, it would block forever (and /dev/zero never end)
    zeros.symlink_to("/dev/zero")
    folder.mkdir()
    refusals = [("tools/trace_summary.py", [str(bad)], f"{bad} is not a trace of torch.profiler (no traceEvents)"),
                *(("tools/trace_summary.py", [str(path)], f"trace {path} is not a regular file")
                  for path in (fifo, zeros, folder)),
                ("tools/draw_trace.py", [str(bad), "-o", str(tmp_path / "step.json")],
                 f"--output {tmp_path / 'step.json'}: matplotlib cannot write .json files"),
                ("tools/draw_trace.py", [str(bad), "-o", str(fifo.with_suffix(".png"))], "exists and is not a file")]
    os.mkfifo(fifo.with_suffix(".png"))
    for tool, args, message in refusals:
        assert script_in_process(tool, args) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


# ---- reading a trace: what each figure counts, on a trace made by hand ----------------------

def event(name, ts, dur, tid=1, **more):
    return {"ph": "X", "cat": more.pop("cat", "cpu_op"), "name": name, "pid": 10, "tid": tid, "ts": ts, "dur": dur,
            **more}


def a_cpu_step() -> list[dict]:
    """One step of 1,000 µs on a CPU: a data wait, one micro-step (forward 100-400, backward
    400-600), a gloo all-reduce of 10 x 4 elements launched in backward, the optimizer step,
    evaluation. The ATen operators' own time is 310 µs; 100 of it while gloo ran."""
    return [event("ProfilerStep#7", 0, 1000, cat="user_annotation"),
            event("data wait", 0, 100, cat="user_annotation"),
            event("micro-step 1", 100, 600, cat="user_annotation"),
            event("aten::embedding", 110, 50),
            event("aten::linear", 200, 100), event("aten::mm", 220, 60),  # the linear's own time: 40
            event("autograd::engine::evaluate_function: MmBackward0", 400, 200),  # holds the mm: not counted
            event("c10d::allreduce_", 410, 10),  # (DDP's hook: a bucket ready) hands gloo its work
            event("gloo:all_reduce", 430, 200, tid=2, args={"Input Dims": [[10, 4]]}),
            event("aten::mm", 450, 100),
            event("Optimizer.step#AdamW.step", 800, 100, cat="user_annotation"),
            event("aten::_foreach_add_", 810, 50),
            event("evaluation", 920, 50, cat="user_annotation"), event("aten::embedding", 925, 10)]


def write_trace(path: Path, events: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_cpu_steps_figures_are_the_operators_own_time_and_the_marks(tmp_path):
    (s,) = trace_summary.summarize(write_trace(tmp_path / "rank0.steps7-7.pt.trace.json", a_cpu_step()))
    assert s["step"] == 7 and s["ms"] == 1.0
    assert s["compute_ms"] == pytest.approx(0.31)  # 50 + 40 + 60 + 100 + 50 + 10: ATen's own, no holder's
    assert s["communication_ms"] == pytest.approx(0.2) and s["overlapped_ms"] == pytest.approx(0.1)
    assert s["data_wait_ms"] == pytest.approx(0.1) and s["evaluation"] == [(0.92, 0.97)]
    assert s["micro_steps"] == [{"forward": (0.1, 0.4), "backward": (0.4, 0.6)}]  # evaluation's forward is none
    assert s["collectives"] == [{"kind": "all-reduce", "phase": "backward 1", "start": 0.43, "end": 0.63,
                                 "elements": 40}]
    assert s["optimizer"] == 0.8


def test_a_cpu_steps_compute_is_the_training_threads_alone(tmp_path):
    """Compute on a CPU is the training thread's: gloo's threads run ATen operators too (copies
    of the tensors they move), and they are communication, counted there."""
    gloo_copy = event("aten::copy_", 560, 60, tid=2)  # inside gloo's all-reduce, 430-630
    (s,) = trace_summary.summarize(write_trace(tmp_path / "rank0.steps7-7.pt.trace.json", [*a_cpu_step(), gloo_copy]))
    assert s["compute_ms"] == pytest.approx(0.31) and s["communication_ms"] == pytest.approx(0.2)


def a_gpu_step() -> list[dict]:
    """One step of 1,000 µs on the host, made by hand, whose GPU runs it later: its mark on
    the GPU's stream spans 200-1,100. Kernels: 150-250 (the step before's, half of it in the
    span), 300-500 and 450-600 (one on another stream: 300 µs of union), NCCL's all-reduce
    550-750, launched at 400 in backward (autograd's device thread, 300-500), and 1,150-1,200
    (the next step's)."""
    def kernel(name, ts, dur, stream=7, **more):
        return event(name, ts, dur, cat="kernel", pid=0, tid=stream, **more)
    return [event("ProfilerStep#7", 0, 1000, cat="user_annotation"),
            event("ProfilerStep#7", 200, 900, cat="gpu_user_annotation", pid=0, tid=7),
            event("micro-step 1", 50, 500, cat="user_annotation"),
            event("autograd::engine::evaluate_function: MmBackward0", 300, 200, tid=3),
            event("nccl:all_reduce", 400, 5, cat="user_annotation", args={"External id": 9}),
            kernel("void elementwise_kernel", 150, 100), kernel("sm90_gemm", 300, 200),
            kernel("sm90_gemm", 450, 150, stream=8),
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 550, 200, stream=9, args={"External id": 9}),
            kernel("void elementwise_kernel", 1150, 50)]


def test_a_gpu_steps_figures_are_its_kernels_within_the_gpus_own_span(tmp_path):
    """On a GPU, compute is the union of the kernels within the span the GPU marks (not the
    host's, which runs ahead), NCCL's left out: they are communication, the kernels its
    launch ran; overlapped is where both ran. A world of one (tests/fixtures' trace) has no
    NCCL kernel to tell them apart: this one has."""
    (s,) = trace_summary.summarize(write_trace(tmp_path / "rank0.steps7-7.pt.trace.json", a_gpu_step()))
    assert s["ms"] == 1.0 and (s["gpu"]["start"], s["gpu"]["end"]) == (0.2, 1.1)
    assert s["compute_ms"] == pytest.approx(0.35)  # 200-250 and 300-600
    assert s["communication_ms"] == pytest.approx(0.2) and s["overlapped_ms"] == pytest.approx(0.05)  # 550-600
    assert s["gpu"]["kernels"] == [(0.2, 0.25, "compute"), (0.3, 0.6, "compute"), (0.55, 0.75, "all-reduce")]
    assert s["micro_steps"] == [{"forward": (0.05, 0.3), "backward": (0.3, 0.5)}]
    assert s["collectives"] == [{"kind": "all-reduce", "phase": "backward 1", "start": 0.4, "end": 0.75,
                                 "elements": None}]


# ---- a GPU's step: an H100's trace (tests/fixtures/README.md) -----------------------------

def test_a_gpu_trace_lists_each_step_once_with_its_backward_on_autograds_thread(h100_trace, capsys):
    """Each step is marked on the CPU and again on the GPU's stream: listed once. Backward runs
    on autograd's device thread, in compiled regions: found there. Compute is the GPU's own
    timeline, within the GPU's span of the step; in a world of one NCCL moves nothing."""
    steps = trace_summary.summarize(h100_trace)
    assert [s["step"] for s in steps] == [25, 26]
    for s in steps:
        (m,) = s["micro_steps"]
        assert m["backward"] and m["forward"][0] < m["forward"][1] == m["backward"][0] < m["backward"][1]
        assert m["backward"][1] - m["backward"][0] > 40  # ms: backward is most of the step, not absent
        gpu = s["gpu"]["end"] - s["gpu"]["start"]
        assert 0 < s["compute_ms"] < gpu < s["ms"] and s["communication_ms"] == 0 == s["overlapped_ms"]
        assert {c["phase"] for c in s["collectives"] if c["kind"] == "all-reduce"} == {
            "before the first forward", "backward 1", "optimizer step and after"}
        assert sum(c["phase"] == "backward 1" for c in s["collectives"]) == 14  # DDP's buckets, in backward
        assert {what for _, _, what in s["gpu"]["kernels"]} == {"compute"}
    assert script_in_process("tools/trace_summary.py", [str(h100_trace)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("run/profile/rank0.steps25-26.pt.trace.json\n")
    assert printed.count("step 25:") == printed.count("step 26:") == 1 and "no communication" in printed
    assert printed.count("micro-step 1: forward") == 2 and "no backward" not in printed


def test_a_gpu_steps_picture_has_forward_backward_the_optimizer_and_a_gpu_lane(h100_trace, tmp_path):
    (lanes := dict(draw_trace.lanes(trace_summary.summarize(h100_trace)[-1])))
    assert {what for *_, what in lanes["training"]} == {"data wait", "forward", "backward", "optimizer step"}
    assert lanes["GPU"] and {what for *_, what in lanes["GPU"]} == {"compute"}
    picture = tmp_path / "gpu.png"
    assert script_in_process("tools/draw_trace.py", [str(h100_trace), "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_trace.label(h100_trace) == "run, rank 0"


# ---- hostile traces ---------------------------------------------------------------------------

def damaged(events: list, i: int, change: dict) -> list:
    events = [dict(e) for e in events]
    events[i] = {k: v for k, v in {**events[i], **change}.items() if v is not ...}
    return events


@pytest.mark.parametrize("change, message", [
    ({"name": ...}, "event 3 has no name"),
    ({"name": 7}, "event 3 has no name"),
    ({"tid": ...}, "event 3 has no thread"),
    ({"ts": math.nan}, "event 3 has a start that is not a time (a number of µs within ±2**53)"),
    ({"ts": 10**400}, "event 3 has a start that is not a time (a number of µs within ±2**53)"),  # no float holds it
    ({"dur": -5}, "event 3 has a duration that is not a time of at least 0 (ending within 2**53 µs)"),
    ({"dur": 1e300}, "event 3 has a duration that is not a time of at least 0 (ending within 2**53 µs)"),
    ({"ts": 2**53 - 5}, "event 3 has a duration that is not a time of at least 0 (ending within 2**53 µs)"),
    ({"args": "Input Dims"}, "event 3 has arguments that are not an object"),
], ids=["no-name", "numeric-name", "no-tid", "nan-ts", "huge-int-ts", "negative-dur", "huge-dur", "ends-too-late",
        "args-a-string"])
@pytest.mark.parametrize("tool", ["tools/trace_summary.py", "tools/draw_trace.py"])
def test_a_trace_with_a_malformed_event_is_one_line(tmp_path, capsys, tool, change, message):
    trace = write_trace(tmp_path / "rank0.steps7-7.pt.trace.json", damaged(a_cpu_step(), 3, change))
    assert script_in_process(tool, [str(trace), *(["-o", str(tmp_path / "p.png")] if "draw" in tool else [])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {trace}: {message}"), err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("number, shown", [("abc", "abc"), ("\u00b2", "\u00b2"), ("1" * 5000, "1" * 47 + "...")],
                         ids=["letters", "a-unicode-digit", "5000-digits"])  # '²': a digit to str, not to int
def test_a_step_mark_that_is_no_step_number_is_one_line(tmp_path, capsys, number, shown):
    trace = write_trace(tmp_path / "t.pt.trace.json", damaged(a_cpu_step(), 0, {"name": f"ProfilerStep#{number}"}))
    assert script_in_process("tools/trace_summary.py", [str(trace)]) == 2
    assert capsys.readouterr().err == f"error: {trace} marks a step 'ProfilerStep#{shown}': not a step this " \
                                      "trainer's --profile marks\n"


@pytest.mark.parametrize("marks, message", [
    ([("ProfilerStep#8", 100, 500, "user_annotation")],
     "step 8's mark on the training thread begins at 100 µs, inside step 7's (0 to 1000 µs)"),
    ([("ProfilerStep#8", 0, 1000, "user_annotation")],
     "step 8's mark on the training thread begins at 0 µs, inside step 7's (0 to 1000 µs)"),
    ([("ProfilerStep#7", 1000, 1000, "user_annotation")],
     "marks step 7 twice on the training thread (at 0 and 1000 µs)"),
    ([("ProfilerStep#7", 50, 900, "gpu_user_annotation"), ("ProfilerStep#8", 700, 900, "gpu_user_annotation")],
     "step 8's mark on GPU 0 stream 7 begins at 700 µs, inside step 7's (50 to 950 µs)"),
], ids=["a-step-inside-another", "a-step-marked-again-as-another", "a-step-marked-twice", "overlapping-on-the-gpu"])
@pytest.mark.parametrize("tool", ["tools/trace_summary.py", "tools/draw_trace.py"])
def test_step_marks_that_overlap_on_one_lane_are_one_line_not_counted_twice(tmp_path, capsys, tool, marks, message):
    """A step is marked on the training thread and again on the GPU's stream (tests/fixtures/'s
    trace: two lanes, each step listed once); on one lane the marks follow each other."""
    trace = write_trace(tmp_path / "rank0.steps7-8.pt.trace.json", a_cpu_step() + [
        event(name, ts, dur, cat=cat, **({"pid": 0, "tid": 7} if cat.startswith("gpu") else {}))
        for name, ts, dur, cat in marks])
    assert script_in_process(tool, [str(trace), *(["-o", str(tmp_path / "p.png")] if "draw" in tool else [])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0] and err[0].endswith("not a trace this trainer's --profile wrote"), err
    assert not (tmp_path / "p.png").exists()


def test_step_marks_that_touch_to_a_rounding_are_one_after_another(tmp_path):
    """Step 8's mark begins where step 7's ends, as ts + dur rounds it: a float sum of times
    printed to the ns, at the epoch's 1.7e15 µs one float step (0.25 µs) apart."""
    base = 1.7e15
    events = [{**e, "ts": base + e["ts"]} for e in a_cpu_step()]
    events.append(event("ProfilerStep#8", base + 1000 - 0.25, 500, cat="user_annotation"))
    trace = write_trace(tmp_path / "rank0.steps7-8.pt.trace.json", events)
    assert [s["step"] for s in trace_summary.summarize(trace)] == [7, 8]


@pytest.mark.parametrize("tool, unbuffered", [("tools/trace_summary.py", False), ("tools/trace_summary.py", True),
                                              ("tools/draw_trace.py", False)])
def test_a_reader_that_stops_reading_ends_the_tool_quietly(tmp_path, tool, unbuffered):
    """`trace_summary.py TRACE | head -1`: the pipe is closed before the tool writes (here at
    once), and the tool ends as a Unix tool SIGPIPE ends, 141 and nothing on stderr. Written at
    once (python -u, PYTHONUNBUFFERED) or on the way out, from the buffer."""
    trace = write_trace(tmp_path / "rank0.steps7-7.pt.trace.json", a_cpu_step())
    read, write = os.pipe()
    os.close(read)
    args = [str(trace), *(["-o", str(tmp_path / "p.png")] if "draw" in tool else [])]
    env = {k: v for k, v in launch_env().items() if k != "PYTHONUNBUFFERED"}
    try:
        proc = subprocess.run([sys.executable, str(REPO / tool), *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=300, env={**env, "PYTHONUNBUFFERED": "1"} if unbuffered else env)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_other_than_stdouts_reader_leaving_stays_an_error():
    """Every script's main runs inside reader_may_leave: a BrokenPipeError from a socket or a
    child's pipe, while stdout's reader is still there, is the script's error, never a quiet 141."""
    from training import stopping
    with pytest.raises(BrokenPipeError, match="a peer closed"):
        with stopping.reader_may_leave():
            raise BrokenPipeError("a peer closed its socket")


def test_two_runs_traces_of_one_name_are_told_apart_by_their_run(tmp_path, capsys):
    a = write_trace(tmp_path / "run-a" / "profile" / "rank0.steps7-7.pt.trace.json", a_cpu_step())
    b = write_trace(tmp_path / "run-b" / "profile" / "rank0.steps7-7.pt.trace.json", a_cpu_step())
    assert script_in_process("tools/trace_summary.py", [str(a), str(b)]) == 0
    printed = capsys.readouterr().out
    assert "run-a/profile/rank0.steps7-7.pt.trace.json\n" in printed
    assert "run-b/profile/rank0.steps7-7.pt.trace.json\n" in printed


@pytest.mark.parametrize("tool", ["draw_trace", "plot_metrics"])
def test_text_from_the_user_is_drawn_as_text_never_parsed_as_tex(runs, tmp_path, tool):
    """A title, or a run's folder named with dollars, is matplotlib's mathtext if parsed:
    `$\\foo{x}$` was a ParseFatalException."""
    folder = tmp_path / "run$\\bad$"
    if tool == "draw_trace":
        trace = write_trace(folder / "profile" / "rank0.steps7-7.pt.trace.json", a_cpu_step())
        args = [str(trace), "--title", "$\\foo{x}$", "-o", str(tmp_path / "p.png")]
    else:
        shutil.copytree(runs("dp", "train_dp.py"), folder)
        args = [str(folder), "-o", str(tmp_path / "p.png")]
    assert script_in_process(f"tools/{tool}.py", args) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the profiler in a run: checked first, kept on every way out ------------------------------

def profile_args(runs, out, *extra):
    return ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), *extra]


def test_an_error_while_the_profiler_records_is_one_line_and_keeps_the_trace(runs, tmp_path):
    """A diverging run stops within the traced steps: its one line, exit 2, and the trace of
    the steps it took. (The profiler left running made the process end in a segfault, 139.)"""
    out = tmp_path / "run"
    proc = run_script("train_dp.py", profile_args(runs, out, "--lr", "1e30", "--warmup-steps", "1", "--log-every",
                                                  "1", "--profile", "--profile-warmup", "0", "--profile-steps", "6"),
                      check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line
             and "s/it]" not in line and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: training diverged: "), lines
    assert [p.name for p in (out / "profile").iterdir()] == ["rank0.steps1-2.pt.trace.json"]
    assert [s["step"] for s in trace_summary.summarize(out / "profile" / "rank0.steps1-2.pt.trace.json")] == [1, 2]


def test_a_trace_that_cannot_be_written_is_a_warning_and_the_run_trains_on(runs, tmp_path, monkeypatch, capsys):
    """A full disk when the trace is written, an exporter that says so (ENOSPC): a warning that
    the disk is full, nothing half-written left, and the run's own files written as ever."""
    def full_disk(self, path):
        Path(path).write_bytes(b"{\"traceEv")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full_disk)
    out = tmp_path / "run"
    assert script_in_process("train_dp.py", profile_args(runs, out, "--profile")) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("warning", "error"))]
    assert len(err) == 1 and err[0].startswith(f"warning: --profile: rank 0's trace of steps 4-5 was not written to "
                                               f"{out / 'profile'}: the disk mounted at /") and " is full (" in err[0]
    assert list((out / "profile").iterdir()) == [] and (out / "model.pt").is_file()


def test_a_trace_its_exporter_left_torn_without_a_word_is_a_warning_and_no_file(runs, tmp_path, monkeypatch, capsys):
    """An exporter that writes the name it is given itself (not kineto's NAME.tmp, renamed when
    done) and stops half-way without an error: the file is not taken for a trace."""
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace",
                        lambda self, path: Path(path).write_bytes(b'{"traceEvents": [{"name": "aten::mm", '))
    out = tmp_path / "run"
    assert script_in_process("train_dp.py", profile_args(runs, out, "--profile")) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("warning", "error"))]
    assert len(err) == 1 and err[0].endswith("torch.profiler's exporter left .rank0.steps4-5.pt.trace.json.partial "
                                             "unfinished"), err
    assert list((out / "profile").iterdir()) == [] and (out / "model.pt").is_file()


def small_disks_here(tmp_path) -> bool:
    """Whether this machine lets a test mount a disk of its own (a tmpfs, in a user and mount
    namespace of its own: no root needed, and gone with the process)."""
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "-o",
                               "size=1m", "tmpfs", str(tmp_path)], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def test_a_disk_that_fills_while_the_trace_is_written_is_a_warning_and_the_checkpoint_still_fits(runs, tmp_path):
    """A real disk, which holds the run's files with 0.5 MB to spare, not a trace of 4 steps
    (5 MB). kineto raises nothing when its write fails, leaves its NAME.tmp as far as it got,
    and keeps it open while the profiler's results live: the warning says that the disk is
    full, no partial file of any name is left, nor held open, and the checkpoint of step 8 and
    model.pt still fit. (Before: an ENOENT warning; `rank0.steps4-7.tmp.tmp` took the space,
    and the run ended with exit 2 and no checkpoint of step 8.)"""
    if not small_disks_here(tmp_path):
        pytest.skip("this machine does not let a test mount a small disk (unshare --user --mount)")
    reference = runs("dp", "train_dp.py")  # a run's files, each counted once (checkpoint.pt: a second name)
    run_bytes = sum({p.stat().st_ino: p.stat().st_size for p in reference.iterdir() if p.is_file()}.values())
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    mounted = f'mount -t tmpfs -o size={run_bytes + 2**19} tmpfs "$0" && "$@"; status=$?; cp -a "$0/run" {kept}; ' \
              "exit $status"  # the disk is gone with the process: what the run left there is kept
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mounted, str(disk),
                           sys.executable, str(REPO / "train_dp.py"), *profile_args(runs, disk / "run", "--profile",
                                                                                    "--profile-steps", "4")],
                          cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    said = [line for line in proc.stderr.replace("\r", "\n").splitlines()
            if line.startswith(("warning", "error", "Traceback"))]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert said == [f"warning: --profile: rank 0's trace of steps 4-7 was not written to {disk / 'run' / 'profile'}: "
                    f"the disk mounted at {disk} is full (0.0 MB free)"]
    assert list((kept / "profile").iterdir()) == []  # hidden names too
    assert checkpoint_step(kept) == 8 and (kept / "model.pt").is_file()


def test_a_trace_that_fits_but_leaves_no_room_for_the_next_checkpoint_is_deleted_and_the_run_saves(runs, tmp_path):
    """A real disk with room for the trace of steps 4-7 (about 5 MB), written whole, but then
    for half the final checkpoint only: the trace is deleted with a warning that says why, and
    the checkpoint of step 8 and model.pt are written. (Before: the trace kept, the final save
    refused for want of space, exit 2, no checkpoint of the whole run: issue 65.)"""
    if not small_disks_here(tmp_path):
        pytest.skip("this machine does not let a test mount a small disk (unshare --user --mount)")
    args = ["--profile", "--profile-steps", "4"]
    reference = runs("dp_profiled_4_steps", "train_dp.py", args)  # the same run on a roomy disk: its sizes
    trace = reference / "profile" / "rank0.steps4-7.pt.trace.json"
    final, model_pt = reference / "checkpoint-00000008.pt", reference / "model.pt"
    sizes = {p.stat().st_ino: p.stat().st_size for p in reference.iterdir() if p.is_file()}  # checkpoint.pt: once
    before_the_trace = sum(sizes.values()) - final.stat().st_size - model_pt.stat().st_size  # checkpoint 4's, ...
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    size = before_the_trace + trace.stat().st_size + final.stat().st_size // 2  # then half the final checkpoint
    mounted = f'mount -t tmpfs -o size={size} tmpfs "$0" && "$@"; status=$?; cp -a "$0/run" {kept}; exit $status'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mounted, str(disk),
                           sys.executable, str(REPO / "train_dp.py"), *profile_args(runs, disk / "run", *args)],
                          cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    said = [line for line in proc.stderr.replace("\r", "\n").splitlines()
            if line.startswith(("warning", "error", "Traceback"))]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(said) == 1 and said[0].startswith(
        f"warning: --profile: rank 0's trace of steps 4-7 was not written to {disk / 'run' / 'profile'}: it left ")
    assert f" MB free on the disk mounted at {disk}, and the run's next checkpoint and model.pt need about " in said[0]
    assert list((kept / "profile").iterdir()) == []  # hidden names too
    assert checkpoint_step(kept) == 8 and (kept / "model.pt").is_file()


def test_the_trace_is_written_once_the_checkpoint_in_flight_is_on_disk(runs, tmp_path, monkeypatch):
    """The last traced step (4) saves a checkpoint, which a thread writes while training goes
    on: the trace waits for it, so that it takes only the room the checkpoint left, never the
    room the checkpoint is being written into. That write is held here until the trainer
    waits for it or starts exporting the trace, whichever comes first: the export must find
    it on disk."""
    from training import checkpoint, pt_checkpoint
    released, seen = threading.Event(), []
    real_save, real_wait = pt_checkpoint.save_checkpoint, checkpoint.CheckpointWriter.wait
    real_export = torch.profiler.profile.export_chrome_trace

    def held_save(state, out_dir, keep):
        assert released.wait(timeout=600)
        real_save(state, out_dir, keep)
        seen.append(f"checkpoint {state['step']} on disk")

    def wait(self):
        if self.thread is not None:  # a save in flight (save() waits for the one before too)
            released.set()
        real_wait(self)

    def export(self, path):
        released.set()
        seen.append("trace exported")
        return real_export(self, path)
    monkeypatch.setattr(pt_checkpoint, "save_checkpoint", held_save)
    monkeypatch.setattr(checkpoint.CheckpointWriter, "wait", wait)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    out = tmp_path / "run"
    assert script_in_process("train_dp.py", profile_args(runs, out, "--profile", "--profile-warmup", "2")) == 0
    assert seen == ["checkpoint 4 on disk", "trace exported", "checkpoint 8 on disk"]
    assert [p.name for p in traces(out)] == ["rank0.steps3-4.pt.trace.json"]


def test_under_ddp_no_rank_exports_its_trace_before_rank_0s_checkpoint_is_on_disk(runs, tmp_path):
    """The same under DDP, where rank 0 alone writes the checkpoint and the ranks may share the
    disk: rank 1, which has no checkpoint of its own to wait for, waits for rank 0's. Rank 0's
    write of step 4's checkpoint is held until a rank begins to export or rank 0 waits for it
    (tests/inject_fault.py's hold-checkpoint): every rank's export must find it on disk."""
    out = tmp_path / "run"
    proc = run_script("train_ddp.py", profile_args(runs, out, "--profile", "--profile-warmup", "2"), nproc=2,
                      wrapper="tests/inject_fault.py", env=fault_env(tmp_path, "hold-checkpoint", step=0),
                      check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = tmp_path / "fault-logs"
    assert {rank: (logs / f"exported-rank{rank}.txt").read_text() for rank in (0, 1)} == {0: "[4]\n", 1: "[4]\n"}
    assert [p.name for p in traces(out)] == ["rank0.steps3-4.pt.trace.json", "rank1.steps3-4.pt.trace.json"]


def test_a_ddp_run_stopped_within_its_traced_steps_exports_no_trace_before_rank_0s_checkpoint(runs, tmp_path):
    """The same where the run stops inside the traced steps (SIGUSR1 to rank 0 at step 2: every
    rank stops after one step, which saves): each rank writes what it traced once rank 0's
    checkpoint of that step is on disk, not at once."""
    out = tmp_path / "run"
    proc = run_script("train_ddp.py", profile_args(runs, out, "--profile", "--profile-warmup", "1", "--profile-steps",
                                                   "6"), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "hold-checkpoint,sigusr1", step=2), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stopped = checkpoint_step(out)
    assert 2 <= stopped < 7  # within steps 2-7
    logs = tmp_path / "fault-logs"
    assert {rank: (logs / f"exported-rank{rank}.txt").read_text() for rank in (0, 1)} == \
        {0: f"[{stopped}]\n", 1: f"[{stopped}]\n"}
    assert [p.name for p in traces(out)] == [f"rank{r}.steps2-{stopped}.pt.trace.json" for r in (0, 1)]


def test_a_trace_killed_while_written_leaves_partial_files_that_the_resume_deletes_and_no_other(runs, tmp_path):
    """kill -9 while kineto writes the trace: its half-written file has a name of the
    project's own, which the resumed run deletes; a file or folder of the user's in
    OUT/profile, whatever its name, stays. (Before: `rank0.steps4-5.tmp.tmp`, left for good.)"""
    out, profile = tmp_path / "run", tmp_path / "run" / "profile"
    env = {**fault_env(tmp_path, "kill-exporting", step=0), "FAULT_AFTER_FILE": str(out / "checkpoint.pt")}
    proc = run_script("train_dp.py", profile_args(runs, out, "--profile"), wrapper="tests/inject_fault.py", env=env,
                      check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    killed = profile / ".rank0.steps4-5.pt.trace.json.partial.tmp"  # kineto's own .tmp of the project's name
    assert list(profile.iterdir()) == [killed]
    (profile / "notes.tmp").write_text("the user's")
    (profile / "rank0.steps4-5.tmp").write_text("the user's, where the trace was once written")
    (profile / ".rank0.steps9-9.pt.trace.json.partial").mkdir()  # a name of the project's, but no file
    (profile / ".rank0.steps9-9.pt.trace.json.partial" / "x").write_text("the user's")
    (profile / ".rank0.steps9-9.pt.trace.json.partial.tmp").symlink_to(profile / "notes.tmp")
    users = {name: seen for name, seen in snapshot(profile).items() if name != killed.name}
    assert script_in_process("train_dp.py", profile_args(runs, out, "--resume")) == 0
    assert snapshot(profile) == users and sorted(users) == [
        ".rank0.steps9-9.pt.trace.json.partial", ".rank0.steps9-9.pt.trace.json.partial.tmp",
        ".rank0.steps9-9.pt.trace.json.partial/x", "notes.tmp", "rank0.steps4-5.tmp"]


def test_a_users_folder_where_the_trace_was_once_written_is_left_alone(runs, tmp_path):
    """`rank0.steps7-8.tmp`, the name a trace was once written under, is a name the user may
    use: the run traces beside it. (Before: the user's folder renamed to the trace's name, the
    trace left as `.tmp.tmp`, exit 0.)"""
    half = stopped_at_step_4(runs, tmp_path)  # resumed at 4, 2 warm-up steps: steps 7 and 8 traced
    users = half / "profile" / "rank0.steps7-8.tmp"
    users.mkdir(parents=True)
    (users / "x").write_text("the user's")
    assert script_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half),
                                             "--resume", "--profile", "--profile-warmup", "2"]) == 0
    assert sorted(p.name for p in (half / "profile").iterdir()) == ["rank0.steps7-8.pt.trace.json",
                                                                    "rank0.steps7-8.tmp"]
    assert [p.name for p in users.iterdir()] == ["x"] and (users / "x").read_text() == "the user's"
    assert [s["step"] for s in trace_summary.summarize(half / "profile" / "rank0.steps7-8.pt.trace.json")] == [7, 8]


@pytest.mark.parametrize("script", ["train_dp.py", "train_ddp.py", "train_fsdp.py"])  # each keeps its own time
def test_writing_the_trace_is_not_training_time(runs, tmp_path, monkeypatch, capsys, script):
    """The trace is written after its last step; an hour spent writing it (a clock moved on by
    the writing) shows in no logged speed and not in the summary's time. (The torchrun scripts
    in a world of one: their loops pause the clock as train_dp.py's does.)"""
    import time
    clock = {"ahead": 0.0}
    real_clock, real_export = time.perf_counter, torch.profiler.profile.export_chrome_trace
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + clock["ahead"])

    def slow_export(self, path):
        clock["ahead"] += 3600.0
        return real_export(self, path)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow_export)
    out = tmp_path / "run"
    printed = run_in_process_printing(script, profile_args(runs, out, "--profile", "--log-every", "1"))
    reference = [row for row in metrics(runs("dp", "train_dp.py")) if "tokens_per_s" in row]
    slowest = min(row["tokens_per_s"] for row in reference)
    assert all(row["tokens_per_s"] > slowest / 100 for row in metrics(out) if "tokens_per_s" in row)
    assert " in 0:00:" in printed and clock["ahead"] == 3600.0  # the summary's time: seconds, not an hour


def run_in_process_printing(script, args) -> str:
    from conftest import run_in_process
    return run_in_process(script, args)


def with_profile_folder(kind: str, out: Path):
    profile = out / "profile"
    if kind == "a-file":
        out.mkdir(parents=True, exist_ok=True)
        profile.write_text("not a folder")
    elif kind == "a-dangling-link":
        profile.symlink_to(out / "elsewhere")
    elif kind == "trace-name-a-folder":
        (profile / "rank0.steps7-8.pt.trace.json").mkdir(parents=True)
    elif kind == "stopped-trace-name-a-file":  # the name of a trace of step 7 alone: a run stopped after it
        profile.mkdir()
        (profile / "rank0.steps7-7.pt.trace.json").write_text("a trace of an earlier session")
    elif kind == "partial-name-a-folder":
        (profile / ".rank0.steps7-8.pt.trace.json.partial").mkdir(parents=True)
    elif kind == "partial-name-a-link":  # the write would go where it points
        profile.mkdir()
        (profile / ".rank0.steps7-7.pt.trace.json.partial").symlink_to(out / "config.json")


@pytest.mark.parametrize("args, message", [
    (["--profile-steps", "3"], "--profile-steps sets what --profile traces: add --profile, or leave it out"),
    (["--profile-warmup", "0"], "--profile-warmup sets what --profile traces: add --profile, or leave it out"),
    (["--profile", "--profile-steps", "150"], "--profile-steps must be at most 10, got 150"),
    (["--profile", "--profile-warmup", "7"], "--profile would trace steps 8-9, and this run ends at step 8: lower"),
    (["--profile", "--profile-warmup", str(10**12)], "--profile would trace steps 1000000000001-1000000000002, and"),
    (["--profile", "--stop-at-step", "4"], "--profile would trace steps 4-5, and this run ends at step 4: lower"),
], ids=["steps-without-profile", "warmup-without-profile", "too-many-steps", "past-the-end", "warmup-huge",
        "past-the-stop"])
def test_profile_flags_that_cannot_be_kept_are_one_line_before_anything_is_written(runs, tmp_path, capsys, args,
                                                                                  message):
    out = tmp_path / "run"
    out.mkdir()
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, *args], out, message, capsys)


@pytest.mark.parametrize("kind, message", [
    ("a-file", "profile is not a folder, and --profile writes its traces there: move it away"),
    ("a-dangling-link", "/profile is a link to {half}/elsewhere, which does not exist, and --profile writes its "
                        "traces there: create that folder or remove the link"),
    ("trace-name-a-folder", "profile/rank0.steps7-8.pt.trace.json exists (a trace of an earlier session"),
    ("stopped-trace-name-a-file", "profile/rank0.steps7-7.pt.trace.json exists (a trace of an earlier session"),
    ("partial-name-a-folder", "profile/.rank0.steps7-8.pt.trace.json.partial is in the way of --profile, which "
                              "writes its trace there first: move it away"),
    ("partial-name-a-link", "profile/.rank0.steps7-7.pt.trace.json.partial is in the way of --profile"),
])
def test_a_resumed_runs_profile_folder_that_cannot_take_the_trace_is_one_line_first(runs, tmp_path, capsys, kind,
                                                                                   message):
    """Whatever of the user's sits where the trace of steps 7-8 would be written, under any name
    it takes while written or once stopped short, or a link to nowhere in place of the folder."""
    half = stopped_at_step_4(runs, tmp_path)  # resumed at 4, traced: 4 + 1 + 2 warm-up steps = steps 7 and 8
    with_profile_folder(kind, half)
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--resume", "--profile",
                                       "--profile-warmup", "2"], half, message.format(half=half), capsys)


def test_a_fifo_where_kineto_writes_is_one_line_first(runs, tmp_path):
    """kineto's open of a FIFO would wait for a reader forever, holding the GIL, where no
    timeout of pytest's ends it: run in a process of its own, with a timeout of its own."""
    half = stopped_at_step_4(runs, tmp_path)
    (half / "profile").mkdir()
    os.mkfifo(half / "profile" / ".rank0.steps7-8.pt.trace.json.partial.tmp")
    check_refused("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--resume", "--profile", "--profile-warmup",
                                  "2"], half, "profile/.rank0.steps7-8.pt.trace.json.partial.tmp is in the way of "
                  "--profile", timeout=120)


def test_a_resume_traces_its_own_steps_and_the_default_warmup_past_the_end_is_refused(runs, tmp_path, capsys):
    half = stopped_at_step_4(runs, tmp_path)
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--resume", "--profile"], half,
                       "--profile would trace steps 8-9, and this run ends at step 8 (resumed after step 4)", capsys)
    assert script_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--resume", "--profile",
                                             "--profile-warmup", "1", "--out-dir", str(half)]) == 0
    assert [p.name for p in (half / "profile").iterdir()] == ["rank0.steps6-7.pt.trace.json"]


def test_an_unwritable_profile_folder_is_one_line_first(runs, tmp_path, capsys, monkeypatch):
    """(As root, which writes anywhere, the folder's own answer is faked.)"""
    half = stopped_at_step_4(runs, tmp_path)
    (half / "profile").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != half / "profile"
                        and real_access(path, mode, **kw))
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--resume", "--profile",
                                       "--profile-steps", "1"], half,
                       f"--profile: no permission to write in {half / 'profile'}", capsys)


def test_a_new_run_into_a_folder_holding_an_earlier_runs_traces_is_refused(runs, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "profile").mkdir(parents=True)
    (out / "profile" / "rank0.steps4-5.pt.trace.json").write_text("an earlier run's trace")
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--profile"], out,
                       "holds files of a run that never saved a checkpoint (profile)", capsys)


def test_one_ranks_trace_that_cannot_be_written_stops_every_rank_with_one_line(runs, tmp_path):
    """Under torchrun, rank 1's trace name taken by a folder: every rank ends before the first
    step, with one line, rather than rank 1 alone after the traced steps (and rank 0 in gloo)."""
    half = stopped_at_step_4(runs, tmp_path)  # train_dp.py's checkpoint: train_ddp.py resumes it
    (half / "profile" / "rank1.steps6-7.pt.trace.json").mkdir(parents=True)
    before = snapshot(half)
    proc = run_script("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume",
                                       "--profile", "--profile-warmup", "1"], nproc=2, check=False)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1  # torchrun's, when a worker failed (its report follows ours: docs/failures.md)
    assert ours == [f"error: {half / 'profile' / 'rank1.steps6-7.pt.trace.json'} exists (a trace of an earlier "
                    "session of this run): move it away to trace these steps"]
    assert snapshot(half) == before
