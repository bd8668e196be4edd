"""benchmarks/gpu_report.py, the one command a lent GPU runs, run here on a CPU: every row a GPU run writes."""

import contextlib
import json
import math
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import FAST, metrics, run_in_process, run_script
from test_failures import running

from benchmarks import gpu_report, step_rows
from benchmarks.bench import free_port
from training import config, read_ahead


def test_the_report_runs_on_a_cpu_and_writes_every_row_a_gpu_run_writes(tmp_path):
    out, temp = tmp_path / "report", tmp_path / "temp"
    temp.mkdir()
    peak = 0.5  # TFLOP/s: a CPU has none in the table; given, the report's MFU formula runs
    run_script("benchmarks/gpu_report.py", ["--out", str(out), "--device", "cpu", "--model", "debug",
                                            "--peak-tflops", str(peak), "--ranks", "2"], env={"TMPDIR": str(temp)})
    # its `datasets` caches (bench_data.fresh_cache's) went with it, though it leaves with os._exit
    assert list(temp.glob("bench_data_cache_*")) == []
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()

    # the rows do not depend on the device: the CPU's are the GPU's, each measured (no row failed)
    names = [row["name"] for row in step_rows.rows()]
    assert list(report["rows"]) == names and len(names) == len(set(names))
    assert {"packed, FSDP", "padded, DDP"} <= set(names)
    assert all(any(name.startswith(f"packed, DDP + {c}:") for name in names) for c in step_rows.CANDIDATES)
    assert all(any(name.startswith(f"packed, FSDP + {c}:") for name in names) for c in step_rows.FSDP_CANDIDATES)
    for name, row in report["rows"].items():
        assert "error" not in row, (name, row)
        assert row["tokens_per_s"] > 0 and row["positions_per_s"] >= row["tokens_per_s"] and row["peak_gib"] > 0
        assert row["steps"] == report["args"]["warmup"] + report["args"]["steps"]
        line = next(line for line in markdown.splitlines() if line.startswith(f"| {name} |"))
        assert f"{row['loss']:.4f}" in line and f"{row['tokens_per_s']:,.0f}" in line
        # MFU on real tokens (those with a target), not on positions: pads are no useful work
        assert row["mfu"] == row["tokens_per_s"] * report["flops_per_token"] / 1e12 / peak, (name, row)
        assert f"| {row['mfu']:.1%} |" in line
    padded = report["rows"]["padded, DDP"]  # where the two differ most: one window a row, the rest pads
    assert padded["mfu"] < 0.9 * padded["positions_per_s"] * report["flops_per_token"] / 1e12 / peak
    assert report["peak_tflops"] == peak
    assert f"MFU counts real tokens (those with a target) at {peak} TFLOP/s" in markdown
    assert f"- MFU of the baseline, on real tokens: {report['rows'][step_rows.BASELINE]['mfu']:.1%}" in markdown

    # every row starts from the same initial weights and trains the same batches: the baseline, built and
    # trained again at the end, lands on its first loss bit for bit
    baseline = report["rows"][step_rows.BASELINE]
    assert report["rows"][f"{step_rows.BASELINE}, again (the machine's drift)"]["loss"] == baseline["loss"]
    assert "- FSDP / DDP at world size 1 (the target: 0.95x): " in markdown

    # a profiled step of the baseline and of FSDP, their time by kind side by side, and the CUDA tests' line
    profile = markdown.split("## One profiled step each")[1].split("## The CUDA tests")[0]
    assert f"| ms a step | {step_rows.BASELINE} | {step_rows.FSDP} |" in profile
    for name in (step_rows.BASELINE, step_rows.FSDP):
        traced = report["profiles"][name]
        assert traced["kinds"]["matmul"] > 0 and traced["kinds"]["optimizer"] > 0
        assert (out / traced["trace"]).is_file()
    assert " skipped" in report["cuda_tests"] and "exit status 0" in report["cuda_tests"]

    # past one GPU (--ranks 2: two CPU processes here): FSDP and TP over them, launched by torchrun, train
    # the same batches from the same weights: the same loss to rounding, each its line in the table
    fsdp, tp = report["past_one_gpu"]["FSDP over 2"], report["past_one_gpu"]["TP 2 + FSDP"]
    assert fsdp["steps"] == tp["steps"] == report["args"]["warmup"] + report["args"]["steps"]
    assert fsdp["tokens_per_s"] > 0 and tp["tokens_per_s"] > 0 and abs(tp["loss"] - fsdp["loss"]) < 1e-5 * fsdp["loss"]
    assert f"| TP 2 + FSDP | {tp['tokens_per_s']:,.0f} | n/a |" in markdown



def test_each_row_builds_the_model_with_its_candidates_on_and_no_other():
    """A row named after a candidate times the candidate: a switch that did nothing would time the
    baseline under its name (a GPU run wasted, and a wrong winner). Each row's model, as build_row
    makes it (in one process: the switches are the same under every wrapper), and how each switch shows."""
    turned_on = {"fused-projections": lambda m: all(layer.self_attn.fused and layer.mlp.fused
                                                    for layer in m.base_model.layers),
                 "chunked-loss": lambda m: m.lm_head.compiled_loss == "chunked"}
    assert turned_on.keys() == step_rows.CANDIDATES.keys()  # a new candidate: say here how its switch shows
    cfg = config.parse_args(["--model", "debug"])
    for spec in step_rows.rows():
        if spec["wrap"] != "FSDP":  # (FSDP's candidates are train_fsdp.shard's options: tests/test_fsdp.py)
            model = step_rows.build_row({**spec, "wrap": "one process"}, cfg, 300, torch.device("cpu"),
                                        torch.float32, None)[0]
            assert {name for name, is_on in turned_on.items() if is_on(model)} == set(spec["candidates"]), spec


@pytest.mark.parametrize("clip", ["0.05", "0"])  # clipping at every step, and none (0: off)
@pytest.mark.parametrize("script, wrap", [("train_dp.py", "one process"), ("train_ddp.py", "DDP"),
                                          ("train_fsdp.py", "FSDP")])
def test_a_rows_step_is_its_trainers_step(corpus, tmp_path, monkeypatch, script, wrap, clip):
    """The report times the step its trainer takes, not a cheaper one: a row of each trainer (as build_row
    builds it, stepped by train_step), trained on the batches its trainer trained on, from the same initial
    weights, ends with the trainer's weights bit for bit. Clipping binds at every step (--grad-clip 0.05,
    below every logged norm): a row that skipped it, or clipped otherwise, ends elsewhere; so would a row
    with another loss, optimizer or schedule; and --grad-clip 0 clips nothing in either (a row that clipped
    to 0 zeroed every gradient). (The trainers in a world of one; packed, as the baseline.)"""
    fed = []
    real_next = read_ahead.ReadAhead.__next__

    def recorded(self):  # every step's micro-batches, as the trainer's loop gets them
        micro_batches = real_next(self)
        fed.append([tuple(t.clone() for t in batch) for batch in micro_batches])
        return micro_batches
    monkeypatch.setattr(read_ahead.ReadAhead, "__next__", recorded)
    out = tmp_path / "run"
    args = ["--dataset", str(corpus), *FAST, "--max-steps", "4", "--pack", "--grad-clip", clip, "--out-dir", str(out)]
    run_in_process(script, args)
    monkeypatch.undo()
    assert len(fed) == 4 and all(len(micro_batches) == 1 for micro_batches in fed)  # a step, a batch
    norms = [row["grad_norm"] for row in metrics(out) if "grad_norm" in row]
    assert norms and min(norms) > 0.05  # clipping (0.05) changed every logged step
    trained = torch.load(out / "model.pt", map_location="cpu", weights_only=True)

    cfg = config.parse_args(args)
    vocab_size = next(t for k, t in trained.items() if k.endswith("embed_tokens.weight")).shape[0]
    with contextlib.ExitStack() as world:
        mesh = None
        if wrap != "one process":  # DDP and FSDP in a world of one, as the report builds them
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            world.callback(dist.destroy_process_group)
            if wrap == "FSDP":
                from torch.distributed.device_mesh import init_device_mesh
                mesh = init_device_mesh("cpu", (1,))
        spec = next(row for row in step_rows.rows() if row["wrap"] == wrap and row["layout"] == "packed"
                    and not row["candidates"] and not row["fsdp"])
        model, optimizer, scheduler, clip = step_rows.build_row(spec, cfg, vocab_size, torch.device("cpu"),
                                                                torch.float32, mesh, total_steps=4)
        step = step_rows.train_step(model, optimizer, scheduler, clip, [])
        for (batch,) in fed:
            step(*batch)
        raw = model.module if wrap == "DDP" else model
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in raw.state_dict().items()}
    assert weights.keys() == trained.keys()
    assert [k for k in trained if not torch.equal(weights[k], trained[k])] == []


LAUNCHES = """import subprocess, sys, time
role = sys.argv[1] if len(sys.argv) > 1 else "pytest"
if role == "pytest":  # starts a worker, as pytest-xdist does
    subprocess.Popen([sys.executable, __file__, "agent"])
elif role == "agent":  # starts its own in a session of its own, as torchrun starts a training process
    subprocess.Popen([sys.executable, __file__, "worker"], start_new_session=True)
time.sleep(120)
"""


def test_the_cuda_tests_stopped_at_their_time_limit_leave_no_process_of_theirs_running(tmp_path):
    """gpu_report.end_process_tree, which stops tests/test_cuda.py at its time limit, ends every process the
    tests started, those in sessions of their own too: none computes on the GPU while the rows are timed."""
    script = tmp_path / "launches.py"
    script.write_text(LAUNCHES)
    tests = subprocess.Popen([sys.executable, str(script)])
    try:
        for _ in range(300):
            started = gpu_report.descendants(tests.pid)
            if len(started) == 2:
                break
            time.sleep(0.1)
        assert len(started) == 2  # the agent and its worker
        gpu_report.end_process_tree(tests.pid)
        tests.wait(timeout=30)
        for _ in range(100):  # the orphaned worker is ended by a signal, and reaped by whoever adopted it
            if not any(running(pid) for pid in started):
                break
            time.sleep(0.1)
        assert [pid for pid in started if running(pid)] == []
    finally:
        if tests.poll() is None:  # (not yet reaped: its pid is still its own)
            gpu_report.end_process_tree(tests.pid)
