"""--profile: a trace of a few chosen steps on every rank, in the output folder, which
Perfetto, chrome://tracing and TensorBoard open and tools/trace_summary.py reads from the
trace's own events. What the traces show is what the lessons say: DDP all-reduces gradients
bucket by bucket while the last micro-step's backward runs, and not at all in the others
(no_sync); FSDP gathers every layer before it runs, in forward and again in backward, and
reduce-scatters each layer's gradients. A run without the flag traces nothing."""

import json
import os

from conftest import ddp_two_ranks, metrics, script_in_process
from model import PRESETS
from tools import draw_trace, trace_summary

PROFILE = ["--profile", "--profile-warmup", "2", "--profile-steps", "2", "--grad-accum", "2"]
GROUPS = PRESETS["tiny"]["num_hidden_layers"] + 2  # FSDP's: each layer, the embedding, the norm with the LM head


def traces(out):
    return sorted((out / "profile").iterdir())


def test_ddp_traces_every_rank_and_all_reduces_gradients_during_the_last_backward_only(runs):
    out = runs("ddp2_profiled", "train_ddp.py", PROFILE, nproc=2)
    assert [p.name for p in traces(out)] == ["rank0.steps3-4.pt.trace.json", "rank1.steps3-4.pt.trace.json"]
    for trace in traces(out):
        assert "traceEvents" in json.loads(trace.read_text())  # Chrome's trace format
        steps = trace_summary.summarize(trace)
        assert [s["step"] for s in steps] == [3, 4]  # steps 1 and 2 warmed up, untraced
        for s in steps:
            assert len(s["micro_steps"]) == 2 and all(m["backward"] for m in s["micro_steps"])
            gradients = [c for c in s["collectives"] if c["kind"] == "all-reduce" and c["elements"] > 1
                         and not c["phase"].startswith("optimizer")]  # not the evaluation's [loss, count]
            # none in micro-step 1 (no_sync); the last bucket goes once backward has filled it
            assert gradients and {c["phase"] for c in gradients} <= {"backward 2", "after backward 2"}
            assert gradients[0]["phase"] == "backward 2"  # the first while backward still runs
            assert 0 < s["overlapped_ms"] <= s["communication_ms"] and 0 < s["compute_ms"] < s["ms"]
            assert 0 < s["data_wait_ms"] < s["ms"]
    assert not (ddp_two_ranks(runs) / "profile").exists()  # without --profile: nothing


def test_fsdp_gathers_each_layer_before_it_runs_and_reduce_scatters_it_in_backward(runs):
    out = runs("fsdp2_profiled", "train_fsdp.py", PROFILE, nproc=2)
    for trace in traces(out):
        for s in trace_summary.summarize(trace):
            for i in (1, 2):
                def count(kind, *phases):
                    return sum(c["kind"] == kind and c["phase"] in phases for c in s["collectives"])
                assert count("all-gather", f"forward {i}") == GROUPS and count("reduce-scatter", f"forward {i}") == 0
                # gathered again for backward, but the norm with the LM head, kept from forward
                assert count("all-gather", f"backward {i}") == GROUPS - 1
                assert count("reduce-scatter", f"backward {i}", f"after backward {i}") == GROUPS  # the last: once done
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        for name in [f"base_model.layers.{i}" for i in range(PRESETS["tiny"]["num_hidden_layers"])]:
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
    first = min(e["ts"] for e in events if e["name"].startswith("ProfilerStep#"))
    assert all(e["ts"] >= first for e in events if e.get("cat") == "cpu_op")  # nothing before the traced steps
    assert [row["step"] for row in metrics(out) if "loss" in row] == [2, 4, 6, 8]  # and trained on as always
    picture = tmp_path / "step.png"
    assert script_in_process("tools/draw_trace.py", [*map(str, traces(runs("ddp2_profiled", "train_ddp.py",
                                                                             PROFILE, nproc=2))), str(trace),
                                                     "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_trace.label(trace) == "dp_profiled, rank 0"


def test_a_file_that_is_no_trace_or_a_picture_that_cannot_be_written_is_one_line(tmp_path, capsys):
    bad, fifo = tmp_path / "x.json", tmp_path / "fifo.pt.trace.json"
    bad.write_text('{"a": 1}')
    os.mkfifo(fifo)  # read, it would block forever (and /dev/zero never end)
    refusals = [("tools/trace_summary.py", [str(bad)], f"{bad} is not a trace of torch.profiler (no traceEvents)"),
                ("tools/trace_summary.py", [str(fifo)], f"trace {fifo} is not a regular file"),
                ("tools/draw_trace.py", [str(bad), "-o", str(tmp_path / "step.json")],
                 f"--output {tmp_path / 'step.json'}: matplotlib cannot write .json files"),
                ("tools/draw_trace.py", [str(bad), "-o", str(fifo.with_suffix(".png"))], "exists and is not a file")]
    os.mkfifo(fifo.with_suffix(".png"))
    for tool, args, message in refusals:
        assert script_in_process(tool, args) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
