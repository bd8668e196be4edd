"""benchmarks/gpu_report.py, the one command a lent GPU runs, run here on a CPU: every row a GPU run writes."""

import json
import subprocess
import sys
import time

import torch

from conftest import run_script
from test_failures import running

from benchmarks import gpu_report, step_rows
from training import config


def test_the_report_runs_on_a_cpu_and_writes_every_row_a_gpu_run_writes(tmp_path):
    out, temp = tmp_path / "report", tmp_path / "temp"
    temp.mkdir()
    run_script("benchmarks/gpu_report.py", ["--out", str(out), "--device", "cpu", "--model", "debug"],
               env={"TMPDIR": str(temp)})
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
