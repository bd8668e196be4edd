"""The fast paths train the same model: bf16 autocast and torch.compile. The throughput
figures in metrics.jsonl are computed from a FLOP count that matches PyTorch's own."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import (BF16, BF16_MULTIPLE, FAST, FP32_LIKE_BF16, REPO, assert_follows_in_bf16, assert_learns,
                      assert_same_model, load_weights, loss_distance, metrics, run_in_process, script_in_process, spied,
                      train, write_corpus)
from model import LlamaConfig, LlamaForPretraining
from training import config, launch, weights
from training.errors import UsageError
from training.metrics import devices_in_use, peak_tflops, throughput


def test_flops_per_token_matches_pytorchs_flop_counter():
    config = LlamaConfig(vocab_size=97, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForPretraining(config)
    B, T = 2, 32
    x = torch.randint(0, 97, (B, T))
    # the math backend computes attention with plain matmuls, which the counter sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_sum, _ = model(x, x)
        loss_sum.backward()
    assert counter.get_total_flops() == model.flops_per_token(T) * B * T


@pytest.mark.parametrize("amx, auto", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_picks_bf16_only_on_cpus_with_amx(monkeypatch, amx, auto):
    """AMX (bf16 matrix units) is the hardware fact faked here, so both answers are checked on
    every machine."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = torch.device("cpu")
    assert launch.compute_dtype("auto", cpu) == auto
    assert launch.compute_dtype("fp32", cpu) == torch.float32
    assert launch.compute_dtype("bf16", cpu) == torch.bfloat16  # asked for: slow without AMX, but it works


@pytest.mark.parametrize("gpu, capability, auto", [
    ("Tesla V100-SXM2-32GB", (7, 0), torch.float32),  # bf16 only emulated: slow
    ("Tesla T4", (7, 5), torch.float32),
    ("NVIDIA A100-SXM4-80GB", (8, 0), torch.bfloat16),
    ("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16),
])
def test_auto_picks_bf16_only_on_gpus_that_compute_it_natively(monkeypatch, matmul_precision, gpu, capability,
                                                               auto):
    """The GPU's compute capability is the fact we fake here; what compute_dtype makes of it
    is what is checked (torch.cuda.is_bf16_supported() would count emulation as support)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    device = torch.device("cuda", 0)
    assert launch.compute_dtype("auto", device) == auto
    assert launch.compute_dtype("fp32", device) == torch.float32
    if auto == torch.bfloat16:
        assert launch.compute_dtype("bf16", device) == torch.bfloat16
    else:
        with pytest.raises(UsageError, match=f"--dtype bf16: {gpu} has no native bf16"):
            launch.compute_dtype("bf16", device)


# The names torch.cuda.get_device_name() reports, and each one's dense bf16 peak (TFLOP/s)
@pytest.mark.parametrize("gpu, peak", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA GH200 480GB", 989), ("NVIDIA GH200 144G HBM3e", 989),
    ("NVIDIA H800", 989), ("NVIDIA H800 PCIe", 756), ("NVIDIA B200", 2250), ("NVIDIA GB200", 2500),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-SXM4-40GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA A800-SXM4-80GB", 312), ("NVIDIA A800 80GB PCIe", 312),
    ("NVIDIA A40", 149.7), ("NVIDIA A30", 165), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA L4", 121),
    ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA GeForce RTX 3090", 71), ("NVIDIA GeForce RTX 5090", 209.5),
    # not known here: no MFU, never another GPU's peak
    ("NVIDIA A10G", None), ("Tesla V100-SXM2-32GB", None), ("NVIDIA RTX A1000 6GB Laptop GPU", None),
])
def test_mfu_uses_the_bf16_peak_of_the_gpu_by_its_whole_name(monkeypatch, capsys, gpu, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    assert peak_tflops(torch.device("cuda", 0), torch.bfloat16) == peak
    said = capsys.readouterr().err
    assert said == ("" if peak else f"warning: no MFU: the bf16 peak of {gpu} is not known here; add it to "
                                   "metrics.GPU_BF16_PEAK_TFLOPS from its data sheet (dense, without sparsity)\n")


def test_a_pause_for_a_save_or_an_evaluation_starts_once_the_gpu_has_run_the_steps_queued_before_it(monkeypatch):
    """The host queues steps ahead of a GPU. A save or an evaluation on a step that logs
    nothing must first wait for those steps, or their time is counted as the pause's and the
    logged throughput is overstated. A step that neither saves nor evaluates waits for nothing.
    A clock of our own: the GPU's queued steps take 5 s, the evaluation 100 s, later steps 1.5 s."""
    from training import metrics
    clock, syncs = [0.0], []
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])

    def synchronize(device=None):
        syncs.append(device)
        clock[0] += 5.0  # the queued steps run to their end
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(metrics, "cuda_memory", lambda device: {})
    cfg = config.parse_args(["--batch-size", "8", "--seq-len", "32"])
    gpu = torch.device("cuda", 0)
    speedometer = metrics.Speedometer(cfg, flops_per_token=10**6, peak=None, device=gpu)
    speedometer.step()  # queued, at no cost to the host
    with speedometer.paused(True):
        clock[0] += 100.0  # evaluating
    for _ in range(3):
        speedometer.step()
        with speedometer.paused(False):
            clock[0] += 0.5
    row = speedometer.row(step=4, epoch=0, loss=1.0, lr=1e-3, grad_norm=1.0, nonpad_tokens=1000)
    assert syncs == [gpu]  # once, for the pause
    assert row["tokens_per_s"] == 4 * 8 * 32 / (5.0 + 1.5)


def test_the_tutorials_fp32_rows_of_the_benchmark_run_in_full_fp32_and_ours_as_the_trainers_set_it(monkeypatch):
    """On a GPU, launch.compute_dtype sets fp32 matmuls to TF32 ("high") before bench.py's
    tables: the tutorial's rows must not inherit it (torch's default is full fp32), or "Nx the
    tutorial" compares against a faster tutorial than the one published. TF32 is then a row
    of its own."""
    from benchmarks import bench
    monkeypatch.setattr(bench, "build", lambda args, device, dtype, compile_model: None)
    monkeypatch.setattr(bench, "time_steps", lambda args, model, batches, device, mask, loss_inside:
                        {"precision": torch.get_float32_matmul_precision()})
    args = bench.parse_args(["--compile"])
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what compute_dtype("auto") does on a GPU
    try:
        rows = dict(bench.ablation_table(args, torch.device("cpu"), torch.bfloat16, batches=None))
        seen = {name: row["precision"] for name, row in rows.items()}
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    assert {name: p for name, p in seen.items() if not name.startswith("ours")} == {
        "tutorial: float mask, fp32, loss outside": "highest", "+ is_causal instead of the mask": "highest",
        "+ loss inside forward": "highest", "+ bf16 autocast": "highest", "+ TF32 for fp32 matmuls": "high",
        "+ torch.compile": "highest"}
    assert {p for name, p in seen.items() if name.startswith("ours")} == {"high"} and after == "high"


def test_mfu_divides_by_the_peak_of_every_gpu_at_work(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    gpu = torch.device("cuda", 0)
    assert peak_tflops(gpu, torch.bfloat16, n_devices=4) == 4 * 756
    assert peak_tflops(gpu, torch.float32) is None  # no MFU against a peak we don't use
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None
    cfg = config.parse_args(["--batch-size", "64", "--seq-len", "512"])
    speed = throughput(2.0, steps=10, cfg=cfg, nonpad_tokens=300_000, flops_per_token=10**9, peak=4 * 756)
    assert speed["tokens_per_s"] == 10 * 64 * 512 / 2.0 and speed["tokens_per_s_nonpad"] == 150_000
    assert speed["tflops"] == pytest.approx(163.84) and speed["flops_per_token"] == 10**9
    assert speed["mfu"] == pytest.approx(163.84 / (4 * 756))
    assert devices_in_use(torch.nn.Linear(2, 2)) == 1


def test_mfu_counts_every_gpu_dataparallel_picks(monkeypatch):
    """train_dp.py gives DataParallel no device_ids: it takes every visible GPU, and MFU must
    divide by all of them. Four visible GPUs are faked; DataParallel itself picks them."""
    dp_module = sys.modules["torch.nn.parallel.data_parallel"]  # the module; its name is also a function's
    monkeypatch.setattr(dp_module, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(dp_module, "_get_all_device_indices", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(dp_module, "_check_balance", lambda device_ids: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    model = torch.nn.DataParallel(torch.nn.Identity())
    assert devices_in_use(model) == 4
    assert peak_tflops(torch.device("cuda", 0), torch.bfloat16, devices_in_use(model)) == 4 * 312


def test_bf16_trains_like_fp32(runs, bf16_floor):
    bf16, spy = spied(runs, "dp_bf16", "train_dp.py", BF16)
    assert spy[0]["matmul_dtypes"] == ["bfloat16"]  # every Linear computed in bf16: the flag took effect
    assert_follows_in_bf16(bf16, runs("dp_short", "train_dp.py", FP32_LIKE_BF16), bf16_floor)  # it follows fp32
    assert all(w.dtype == torch.float32 for w in load_weights(bf16).values())  # fp32 master weights


def test_the_bf16_bound_catches_a_dropped_micro_batch(runs, bf16_floor):
    """The nearest bug the bf16 bound was calibrated against (conftest.BF16_MULTIPLE): in a
    bf16 run of 2 micro-batches a step, step 3's second micro-batch never trains. Its losses
    land beyond the bound, with room: the floor is a rounding to bf16, not a kernel's order."""
    dropped = runs("dp_bf16_accum2_one_dropped", "train_dp.py", [*BF16, "--grad-accum", "2"],
                   perturb="drop-micro-batch")
    distance = loss_distance(dropped, runs("dp_short", "train_dp.py", FP32_LIKE_BF16))
    assert distance > 3 * BF16_MULTIPLE * bf16_floor.loss, distance / bf16_floor.loss


@pytest.mark.compile
def test_compiled_run_trains_the_same_model_and_its_checkpoints_load_into_a_plain_one(runs, tmp_path, floor):
    """Compiled kernels fuse and reorder the arithmetic: the same model to rounding."""
    eager = runs("dp", "train_dp.py")
    compiled, spy = spied(runs, "dp_compiled", "train_dp.py", ["--compile"])
    assert spy[0]["compiled_graphs"] > 0  # the flag took effect: torch.compile built graphs
    assert_same_model(compiled, eager, floor)
    rows = [row for row in metrics(compiled) if "loss" in row]
    assert_learns(rows)
    assert {"tokens_per_s", "tokens_per_s_nonpad", "flops_per_token", "tflops"} <= rows[-1].keys()
    # model.pt has plain keys and loads strictly; the step-4 checkpoint resumes without --compile
    weights.load_trained(compiled)
    out = tmp_path / "resumed"
    shutil.copytree(compiled, out)
    for later in ("checkpoint.pt", "checkpoint-00000008.pt", "model.pt"):
        (out / later).unlink()
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), "--resume"])
    assert_same_model(out, eager, floor)


def test_a_compiled_model_evaluates_every_batch_with_the_graph_of_the_first():
    """The held-out rows end with a smaller batch: compiled, it runs in the graph the first batch
    built, whose number of rows is left dynamic, instead of compiling a second one (a third of a
    compiled test run's CPU here, minutes of a GPU's at the article's size). The same losses as
    uncompiled."""
    from torch._dynamo.testing import CompileCounter

    from model import PRESETS
    from training.evaluation import evaluate
    torch.manual_seed(0)
    model = LlamaForPretraining(LlamaConfig(vocab_size=97, **PRESETS["debug"]))
    rows = torch.randint(0, 97, (15, 16))
    batches = [(rows[:8], rows[:8]), (rows[8:], rows[8:])]  # 8 rows, then 7
    eager = evaluate(model, batches, torch.device("cpu"))
    graphs = CompileCounter()  # dynamo's graphs, run as they are traced: no compiler
    torch._dynamo.reset()
    try:
        model.compile(backend=graphs)
        compiled = evaluate(model, batches, torch.device("cpu"))
    finally:
        torch._dynamo.reset()
    assert graphs.frame_count == 1
    assert torch.allclose(compiled, eager, rtol=1e-6)


def test_bench_runs_every_row_and_writes_its_table(tmp_path, capsys):
    """bench.py at toy size, in this process (its workers are spawned): one process, DDP and
    FSDP at world sizes 1 and 2 (gloo), HSDP as 2 replicas of 1 rank, the ablation, and the
    memory each rank holds: FSDP's ranks hold half of what DDP's do, HSDP's 2 x 1 all of it."""
    from benchmarks import bench
    out = tmp_path / "bench.json"
    bench.main(["--steps", "1", "--warmup", "0", "--seq-len", "32", "--batch-size", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    scaling = result["scaling"]
    assert list(scaling) == ["one process", "DDP, world size 1", "DDP, world size 2", "FSDP, world size 1",
                             "FSDP, world size 2", "HSDP, 2 replicas, world size 2"]
    assert len(scaling["DDP, world size 2"]["peak_mem_gb"]) == 2  # one figure per rank
    ddp, fsdp = scaling["DDP, world size 2"]["state_gb"], scaling["FSDP, world size 2"]["state_gb"]
    assert ddp[0] == ddp[1] == scaling["one process"]["state_gb"]  # every DDP rank holds it all
    assert all(abs(f / ddp[0] - 0.5) < 0.01 for f in fsdp)  # each FSDP rank half (the embedding rows pad)
    assert scaling["HSDP, 2 replicas, world size 2"]["state_gb"] == ddp  # 2 replicas of 1 shard: all of it
    assert [row[:3] for row in result["memory_per_rank"]][-1] == ["1b", 1_177_946_112, 8]
    assert list(result["ablation"])[0] == "tutorial: float mask, fp32, loss outside"
    # every ratio printed and saved is the quotient of the two rows it names
    speed = {name: row["steps_per_s"] for table in ("scaling", "ablation") for name, row in result[table].items()}
    ratios = result["ratios"]
    assert ratios["ddp_world_1_vs_one_process"] == speed["DDP, world size 1"] / speed["one process"]
    for n in (1, 2):
        assert ratios[f"fsdp_vs_ddp_at_world_size_{n}"] == speed[f"FSDP, world size {n}"] / speed[f"DDP, world size {n}"]
    for name in list(result["ablation"])[1:]:
        assert ratios[f"{name} vs tutorial"] == speed[name] / speed["tutorial: float mask, fp32, loss outside"]
        assert f"  {name} vs tutorial" in printed
    assert "Table 2" in printed


def test_bench_network_counts_a_row_for_each_method_and_preset(capsys):
    """2 nodes of 8: DDP and FSDP send the same bytes in one micro-step (bf16 gathers and an fp32
    reduce-scatter against an fp32 all-reduce), FSDP that again every micro-step; HSDP sends
    only its fp32 shard's all-reduce (what tests/test_hsdp.py measures), once a step."""
    from benchmarks import bench_network
    rows = {(preset, method): (network, node, accumulated)
            for preset, method, network, node, accumulated in bench_network.main([])}
    for preset in ("article", "1b"):
        ddp, fsdp, hsdp = (rows[preset, method] for method in ("DDP", "FSDP", "HSDP (--replicas 2)"))
        assert ddp[0] == pytest.approx(fsdp[0], rel=0.01) and ddp[2] == ddp[0] and fsdp[2] == 4 * fsdp[0]
        assert hsdp[0] == hsdp[2] == pytest.approx(ddp[0] / 15, rel=0.01)  # 4 bytes x P/8, against 2 x 15/16 x 4 bytes x P
        assert ddp[1] == fsdp[1] == 0 and hsdp[1] == pytest.approx(fsdp[0] * 14 / 15, rel=0.01)
    assert "1b" in capsys.readouterr().out


TOY_BENCH = ["--steps", "1", "--warmup", "0", "--seq-len", "32", "--batch-size", "2"]  # bench.py in seconds
# (benchmark, flags, what its one line says): each before the benchmark's first expensive step
BAD_BENCH_FLAGS = [
    ("bench_network.py", ["--nodes", "0"], "argument --nodes: must be at least 1, got 0"),  # was a ZeroDivisionError
    ("bench_network.py", ["--gpus-per-node", "0"], "argument --gpus-per-node: must be at least 1, got 0"),
    ("bench_network.py", ["--nodes", "-3"], "argument --nodes: must be at least 1, got -3"),  # negative gigabytes
    ("bench_network.py", ["--grad-accum", "-2"], "argument --grad-accum: must be at least 1, got -2"),
    ("bench_packing.py", ["--seq-lens", "512", "0"], "argument --seq-lens: must be at least 1, got 0"),  # after a minute
    ("bench_packing.py", ["--seq-lens", "4096"], "--seq-len 4096 exceeds the tiny model's 1024 positions"),
    ("bench_packing.py", ["--data", "{tmp}/none.parquet"], "--data {tmp}/none.parquet: no such file"),
    ("bench_packing.py", ["--vocab-size", "100"], "argument --vocab-size: must be at least 259, got 100"),
    ("bench_stream.py", ["--open-rows", "8", "0"], "argument --open-rows: must be at least 1, got 0"),
    ("bench_stream.py", ["--data", "{tmp}/none.parquet"], "--data {tmp}/none.parquet: no such file"),
    ("bench_data.py", ["--mb", "0"], "argument --mb: must be at least 1, got 0"),
    ("bench_data.py", ["--batch-size", "x"], "argument --batch-size: must be a whole number, got 'x'"),
    ("bench.py", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("bench.py", ["--batch-size", "1", "--max-world-size", "2"], "--batch-size 1 leaves some of 2 ranks without"),
    ("bench.py", ["--seq-len", "4096"], "--seq-len 4096 exceeds the tiny model's 1024 positions"),
    ("bench_memory.py", ["--batch", "8", "0"], "argument --batch: must be at least 1, got 0"),
    ("bench_memory.py", ["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    ("bench_memory.py", ["--gpu-gb", "nan"], "argument --gpu-gb: must be at least 0.001, got nan"),
    ("bench_grouping.py", ["--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
    ("bench_logging.py", ["--log-every", "0"], "argument --log-every: must be at least 1, got 0"),
    ("bench_read_ahead.py", ["--read-ms", "-1"], "argument --read-ms: must be at least 0.0, got -1"),
    # a flag for the trainer: the trainer's own line (was exit 2 and nothing said)
    ("bench_read_ahead.py", ["--", "--bogus"], "train_dp.py --bogus: unrecognized arguments: --bogus"),
    ("bench_read_ahead.py", ["--max-steps", "3"], "--max-steps 3: too few steps for a median"),  # a StatisticsError
    # its runs' folders are its own: a user's --out-dir was silently replaced by a temporary one
    ("bench_read_ahead.py", ["--", "--out-dir", "{tmp}/mine"], "train_dp.py --out-dir {tmp}/mine: bench_read_ahead.py "
     "runs the trainer in temporary folders of its own"),
    # an output that cannot be written, said before the measurements (was a traceback after them, the tables lost)
    ("bench.py", [*TOY_BENCH, "--json", "{tmp}/missing/bench.json"], "--json {tmp}/missing/bench.json: its folder "
     "does not exist"),
    ("bench.py", [*TOY_BENCH, "--json", "{tmp}"], "--json {tmp} exists and is not a file"),
    ("bench_memory.py", ["--model", "tiny", "--batch", "1", "--seq-len", "32", "--steps", "1", "--json",
                         "{tmp}/missing/bench_memory.json"], "--json {tmp}/missing/bench_memory.json: its folder"),
    # the report's folder is its own: a user's files there would be mixed with (or replaced by) the report's
    ("gpu_report.py", ["--out", "benchmarks", "--device", "cpu"], "--out benchmarks: not an empty folder"),
    ("gpu_report.py", ["--out", "README.md/report", "--device", "cpu"], "--out README.md/report: "),  # was mkdir's
    ("gpu_report.py", ["--out", "/dev/zero", "--device", "cpu"], "--out /dev/zero exists and is not a folder"),
    ("gpu_report.py", ["--out", "{tmp}/r", "--device", "cuda"], "--device cuda: torch sees no CUDA GPU here"),
    ("gpu_report.py", ["--out", "{tmp}/r", "--device", "cpu", "--model", "debug", "--seq-len", "4096"],
     "--seq-len 4096 exceeds the debug model's 1024 positions"),
    ("gpu_report.py", ["--out", "{tmp}/r", "--device", "cpu", "--peak-tflops", "0"],
     "argument --peak-tflops: must be at least 0.001, got 0"),  # MFU divides by it
    ("gpu_report.py", ["--out", "{tmp}/r", "--device", "cpu", "--peak-tflops", "nan"],
     "argument --peak-tflops: must be at least 0.001, got nan"),
]


@pytest.mark.parametrize("bench, flags, message", BAD_BENCH_FLAGS,
                         ids=[f"{b}:{' '.join(f)}" for b, f, _ in BAD_BENCH_FLAGS])
def test_every_benchmark_refuses_bad_flags_in_one_line_before_its_first_step(tmp_path, capsys, bench, flags, message):
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    data_dir = tmp_path / "data"  # where the corpus benchmarks would write a corpus first
    extra = ["--data-dir", str(data_dir)] if bench in ("bench_data.py", "bench_packing.py", "bench_stream.py") else []
    assert script_in_process(f"benchmarks/{bench}", [*flags, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message.replace('{tmp}', str(tmp_path))}"), err
    assert not data_dir.exists()


def test_bench_memory_measures_every_row_in_a_process_of_its_own_and_estimates_what_fits(tmp_path, capsys):
    """bench_memory.py at toy size: every row and batch measured (each in a fresh process),
    the bytes a token beside the estimate, and the largest micro-batch for both presets. The
    figures themselves are the benchmark's to report, not a test's to bound."""
    from benchmarks import bench_memory
    out = tmp_path / "bench_memory.json"
    bench_memory.main(["--model", "tiny", "--batch", "1", "2", "--seq-len", "32", "--steps", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert sorted(result["rows"]) == sorted(f"{v} @ {b}" for v in bench_memory.VARIANTS for b in (1, 2))
    assert all(row["seconds"] > 0 and row["built"] > 0 for row in result["rows"].values())
    assert set(result["bytes_per_token"]) == set(bench_memory.VARIANTS)
    assert {(preset, how) for preset, how, _, _ in result["fits"]} == {
        (preset, how) for preset in ("article", "1b") for how in ("DDP", "FSDP, 2 ranks", "FSDP, 4 ranks", "FSDP, 8 ranks")}
    assert all(f"Table {n}" in printed for n in (1, 2, 3))


def test_bench_on_one_gpu_still_prints_every_table(tmp_path, monkeypatch, capsys):
    """--max-world-size 1, as on a machine with one GPU: one world of one process measures DDP
    and FSDP (no HSDP: it needs an even world), Table 1 holds those rows, the ratios only
    theirs, and Tables 2-3 and bench.json still come out. (Every row is made up: the test
    above measures them all for real.)"""
    from benchmarks import bench
    row = {"steps_per_s": 2.0, "peak_mem_gb": 0.5, "state_gb": 0.25}
    monkeypatch.setattr(bench, "time_steps", lambda *args, **kwargs: dict(row))
    spawned = []

    def a_world_in_name_only(worker, args, nprocs):
        spawned.append((worker.__name__, args[4], nprocs))  # (the function, the kinds it measures, world size)
        for kind in args[4]:
            args[-1].put((kind, {**row, "peak_mem_gb": [0.5], "state_gb": [0.25]}))

    monkeypatch.setattr(bench.mp, "spawn", a_world_in_name_only)
    out = tmp_path / "bench.json"
    bench.main(["--steps", "1", "--warmup", "1", "--seq-len", "32", "--batch-size", "4", "--max-world-size", "1",
                "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert list(result["scaling"]) == ["one process", "DDP, world size 1", "FSDP, world size 1"]
    assert spawned == [("distributed_worker", ("FSDP", "DDP"), 1)]  # no HSDP, no world of 2
    assert [key for key in result["ratios"] if "vs tutorial" not in key] == ["ddp_world_1_vs_one_process",
                                                                             "fsdp_vs_ddp_at_world_size_1"]
    assert all(f"Table {n}" in printed for n in (1, 2, 3)) and result["memory_per_rank"]


def test_a_spawned_bench_worker_reports_its_own_peak_memory_not_its_parents():
    """On a CPU each DDP/FSDP row gives every rank's peak RSS. ru_maxrss would give each
    worker at least the peak of the bench process that started it (Linux carries it across
    fork and exec); bench.peak_rss_gb gives the worker's own."""
    from benchmarks import bench
    held = bytearray(2**30)  # this process now holds 1 GiB more...
    held[::4096] = b"x" * len(held[::4096])  # ...resident: one byte in every page
    child = subprocess.run([sys.executable, "-c", "from benchmarks import bench; print(bench.peak_rss_gb())"], cwd=REPO,
                           capture_output=True, text=True, check=True)
    assert bench.peak_rss_gb() > 1.0 > float(child.stdout)  # the child imported torch, far below 1 GiB
    del held


def test_bench_refuses_a_batch_that_cannot_fit_before_allocating_it(monkeypatch):
    """--batch-size 3000000 was an allocation error or the OOM killer: memory.py's estimate
    refuses it first, as the trainers' check does, and nothing is allocated."""
    from benchmarks import bench

    def allocated(*args):
        raise AssertionError("the batches were allocated before the estimate was made")
    monkeypatch.setattr(bench, "synthetic_batches", allocated)
    with pytest.raises(UsageError, match=r"^--batch-size 3000000 x --seq-len 128 cannot fit: the tiny model's rows "
                                         r"need at least [\d,.]+ GB \(training/memory.py's estimate\)"):
        bench.main(["--model", "tiny", "--batch-size", "3000000", "--seq-len", "128"])


def test_bench_memory_says_when_the_search_for_what_fits_stopped_before_the_gpu_did(capsys):
    """A micro-batch as large as the search goes is "at least" it, not the answer (--gpu-gb
    1e308 printed 4096 for every row)."""
    from benchmarks import bench_memory
    bench_memory.main(["--estimate-only", "--gpu-gb", "1e308"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "activation checkpointing:" in line]
    assert len(rows) == 16 and all(row.endswith(f": at least {bench_memory.LARGEST_SEARCHED}") for row in rows)
    bench_memory.main(["--estimate-only", "--gpu-gb", "24"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "activation checkpointing:" in line]
    assert len(rows) == 16 and not any("at least" in row for row in rows)


def test_bench_memory_tables_what_each_rank_holds_under_tp(capsys):
    """Table 4: article and 1b at each tp, with dp 1 and with FSDP over the rest of 8 GPUs; what
    TP cannot split said as train_tp.py refuses it. The activations fall with tp, but less than
    tp-fold (the gathered inputs stay whole); on 8 GPUs every layout holds about the same state."""
    from benchmarks import bench_memory
    rows = bench_memory.tp_table(bench_memory.parse_args(["--estimate-only", "--dtype", "bf16"]))
    assert {(r["model"], r["tp"]) for r in rows if "refused" in r} == {("article", 2), ("article", 4), ("article", 8)}
    one_b = {(r["tp"], r["dp"]): r for r in rows if r["model"] == "1b"}
    assert set(one_b) == {(1, 1), (1, 8), (2, 1), (2, 4), (4, 1), (4, 2), (8, 1)}
    for tp in (2, 4, 8):
        whole, split = one_b[1, 1]["activations"], one_b[tp, 1]["activations"]
        assert whole / tp < split < whole
        assert one_b[tp, 1]["weights"] == one_b[tp, 8 // tp]["weights"] * (8 // tp)  # FSDP's share of TP's
    on_8 = [r["weights"] for (tp, dp), r in one_b.items() if tp * dp == 8]
    assert max(on_8) < 1.001 * min(on_8)  # (the norms' gains whole on each TP rank: a little more at a higher tp)
    bench_memory.main(["--estimate-only"])
    assert "Table 4" in capsys.readouterr().out


READ_AHEAD_TOY = ["--rounds", "1", "--read-ms", "0", "--max-steps", "6", "--", "--model", "debug", "--vocab-size",
                  "300", "--seq-len", "32", "--batch-size", "8", "--val-docs", "2", "--dtype", "fp32"]


def test_bench_read_ahead_passes_on_the_line_its_trainer_failed_with(tmp_path, capsys):
    """The trainer's flags pass its checks; its data fails later, inside the run: the trainer's
    own line, exit status 2 (its stderr was swallowed: exit 2 and nothing said)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert script_in_process("benchmarks/bench_read_ahead.py", [*READ_AHEAD_TOY, "--dataset", str(empty)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: train_dp.py --model debug") and err[0].endswith(
        f"--dataset {empty}: dataset {empty} has no non-empty documents"), err


def test_bench_read_ahead_passes_on_an_interrupted_trainers_line_and_status(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the trainer prepares its data: its line and its status (128 + SIGINT), not
    a usage error, and not silence."""
    from training import run_data

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(run_data, "prepare", interrupted)
    assert script_in_process("benchmarks/bench_read_ahead.py", [*READ_AHEAD_TOY, "--dataset", "stdlib"]) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]


def test_bench_read_ahead_says_when_a_run_was_too_short_for_its_median(tmp_path, capsys):
    """An epoch shorter than --max-steps: the run logs one interval, which the median leaves out
    (it waits for the first read). One line, not statistics' 'no median for empty data'."""
    small = write_corpus(tmp_path / "small.txt", n_docs=12)  # one step of 8 rows an epoch
    assert script_in_process("benchmarks/bench_read_ahead.py",
                             [*READ_AHEAD_TOY, "--dataset", str(small), "--epochs", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith(": too few steps for a median: the run logged one interval, which is "
                                             "left out (it waits for the first read); give it more data or epochs"), err


def torn_parquet(path: Path, cut: bool) -> Path:
    """A parquet file of 2,000 documents, cut short (cut) or with its pages overwritten (its
    footer whole: only reading its rows fails)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [f"document {i} " + "word " * 50 for i in range(2000)]}), path)
    whole = bytearray(path.read_bytes())
    path.write_bytes(whole[:len(whole) // 2] if cut else whole[:100] + b"\xff" * (len(whole) // 2 - 100)
                     + whole[len(whole) // 2:])
    return path


@pytest.mark.parametrize("bench", ["bench_data.py", "bench_packing.py", "bench_stream.py"])
@pytest.mark.parametrize("kind", ["text file", "cut short", "pages overwritten"])
def test_bench_data_and_packing_refuse_a_corpus_that_is_no_whole_parquet_in_one_line(tmp_path, capsys, bench, kind):
    """--data corpus.txt, or a parquet cut short, was an Arrow traceback: one line before the
    corpus is read (its footer is checked first); one whose pages are damaged, when they are read."""
    if kind == "text file":
        path = write_corpus(tmp_path / "corpus.txt")
    else:
        path = torn_parquet(tmp_path / "corpus.parquet", cut=kind == "cut short")
    assert script_in_process(f"benchmarks/{bench}", ["--data", str(path), "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err.splitlines()
    said = (f"cannot read the texts of {path}: " if kind == "pages overwritten"
            else f"--data {path} is not a parquet file, or not a whole one: ")
    assert len(err) == 1 and err[0].startswith(f"error: {said}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no BPE trained on it, nothing generated


def test_a_generated_corpus_left_torn_is_one_line_that_says_to_remove_it(tmp_path, capsys):
    """A corpus cut short in --data-dir (by an older version on a full disk) was read by every
    later run ('magic bytes not found'): one line, before anything is generated or trained."""
    path = torn_parquet(tmp_path / "fineweb_like_1mb.parquet", cut=True)
    assert script_in_process("benchmarks/bench_data.py", ["--mb", "1", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the corpus generated earlier {path} is not a parquet file")
    assert err[0].endswith(": remove it, and the next run generates it anew"), err


def test_a_full_disk_while_the_corpus_is_generated_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch,
                                                                                               capsys):
    """The generated parquet is written under a temp name, then renamed: a disk that fills up
    midway leaves no torn corpus for the next run to read, and says so in one line."""
    import errno
    import io
    from training import files

    class FullAfter100KB(io.FileIO):
        def write(self, b):
            if self.tell() + len(b) > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)
    monkeypatch.setattr(files, "open", lambda path, mode: FullAfter100KB(path, mode.replace("b", "")), raising=False)
    data_dir = tmp_path / "data"
    assert script_in_process("benchmarks/bench_data.py", ["--mb", "1", "--data-dir", str(data_dir)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no space left to write {data_dir}/fineweb_like_1mb.parquet "
                                               "(on the disk mounted at "), err
    assert list(data_dir.iterdir()) == []  # neither the corpus nor its temp file


def _ddp_options_worker(rank, store_path, results):
    import os
    import torch.distributed as dist
    from training.launch import DDP_OPTIONS
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    # a FileStore: no port to pick and lose before it is bound (gloo binds its own)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=97, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
        model = DDP(LlamaForPretraining(config), **DDP_OPTIONS)
        cos = model.module.base_model.rotary_emb.cos
        cos += rank  # a buffer that differs between the ranks after DDP was built
        x = torch.randint(0, 97, (2, 16))
        model(x, x)[0].sum().backward()
        results.put((rank, cos[1, 0].item(), all(p.grad._base is not None for p in model.parameters())))
    except BaseException as e:  # reported, so that the test fails instead of waiting for a result
        results.put((rank, repr(e), False))
    results.close()
    results.join_thread()  # the result is in the pipe before os._exit, which would drop it
    # Leave without tearing DDP and gloo down: freeing the reducer right after its last
    # all-reduce can deadlock in gloo's destructor (its worker thread waits for the GIL that
    # the joining main thread holds; seen once in CI, torch 2.13).
    os._exit(0)


def test_ddp_keeps_gradients_in_its_buckets_and_sends_no_buffers_each_step(tmp_path):
    """launch.DDP_OPTIONS, as train_ddp.py builds DDP, on 2 gloo ranks: gradients are views into the all-reduce
    buckets (no copy in and out), and a forward broadcasts no buffers: rank 1's own RoPE table
    survives it (with DDP's default, rank 0's would overwrite it before every forward)."""
    import torch.multiprocessing as mp
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    workers = mp.start_processes(_ddp_options_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=False,
                                 start_method="spawn")
    got = dict((rank, (cos, views)) for rank, cos, views in (results.get(timeout=120), results.get(timeout=120)))
    deadline = time.monotonic() + 60
    while not workers.join(timeout=1):  # True once both exited; raises if one failed
        assert time.monotonic() < deadline, "a worker did not exit"
    untouched = LlamaForPretraining(LlamaConfig(vocab_size=97, max_position_embeddings=64, hidden_size=64,
                                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                                num_key_value_heads=2)).base_model.rotary_emb.cos[1, 0].item()
    assert got[0] == (pytest.approx(untouched), True)
    assert got[1] == (pytest.approx(untouched + 1), True)  # not rank 0's value: no broadcast


def test_train_ddp_builds_its_ddp_with_those_options(corpus, tmp_path, monkeypatch):
    """train_ddp.py spells the two options out where a reader learns DDP; the test above proves
    what launch.DDP_OPTIONS does, this one that the script passes the same. Without them it
    trains the same model, only with a second copy of every gradient and a broadcast of the
    RoPE tables before every forward: no loss would show it."""
    from torch.nn.parallel import DistributedDataParallel
    from training.launch import DDP_OPTIONS
    built, real_init = [], DistributedDataParallel.__init__

    def record(self, module, *args, **kwargs):
        built.append(kwargs)
        real_init(self, module, *args, **kwargs)

    monkeypatch.setattr(DistributedDataParallel, "__init__", record)
    run_in_process("train_ddp.py", ["--dataset", str(corpus), *FAST, "--max-steps", "1", "--out-dir",
                                    str(tmp_path / "run")])
    assert [{name: kwargs.get(name) for name in DDP_OPTIONS} for kwargs in built] == [DDP_OPTIONS]


def test_a_benchmarks_datasets_cache_is_removed_when_its_process_ends(tmp_path):
    """bench_data.fresh_cache gives each row a `datasets` cache of its own in the temporary folder;
    the process that made it (a benchmark, a GPU report, a test's worker) removes it as it ends,
    whether or not the benchmark did: gpu_report.py reads the rows until then, and left two behind
    on every run."""
    program = "from benchmarks import bench_data; print(bench_data.fresh_cache())"
    made = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert made.returncode == 0, made.stderr
    folder = Path(made.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("bench_data_cache_")
    assert not folder.exists() and list(tmp_path.iterdir()) == []

