"""The fast paths train the same model: bf16 autocast and torch.compile. The throughput
figures in metrics.jsonl are computed from a FLOP count that matches PyTorch's own."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import checkpointing
import training
from errors import UsageError
from conftest import (BF16, FAST, FP32_LIKE_BF16, REPO, assert_follows_in_bf16, assert_same_model, load_weights,
                      metrics, run_script)
from model import LlamaConfig, LlamaForPretraining


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


def test_compute_dtype_on_cpus():
    cpu = torch.device("cpu")
    assert training.compute_dtype("fp32", cpu) == torch.float32
    assert training.compute_dtype("bf16", cpu) == torch.bfloat16
    expected = torch.bfloat16 if torch.cpu._is_amx_tile_supported() else torch.float32  # this machine's answer
    assert training.compute_dtype("auto", cpu) == expected


@pytest.mark.parametrize("gpu, capability, auto", [
    ("Tesla V100-SXM2-32GB", (7, 0), torch.float32),  # bf16 only emulated: slow
    ("Tesla T4", (7, 5), torch.float32),
    ("NVIDIA A100-SXM4-80GB", (8, 0), torch.bfloat16),
    ("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16),
])
def test_auto_picks_bf16_only_on_gpus_that_compute_it_natively(monkeypatch, gpu, capability, auto):
    """The GPU's compute capability is the fact we fake here; what compute_dtype makes of it
    is what is checked (torch.cuda.is_bf16_supported() would count emulation as support)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    device = torch.device("cuda", 0)
    assert training.compute_dtype("auto", device) == auto
    assert training.compute_dtype("fp32", device) == torch.float32
    if auto == torch.bfloat16:
        assert training.compute_dtype("bf16", device) == torch.bfloat16
    else:
        with pytest.raises(UsageError, match=f"--dtype bf16: {gpu} has no native bf16"):
            training.compute_dtype("bf16", device)


@pytest.mark.parametrize("gpu, peak", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA L4", 121),
    ("Tesla V100-SXM2-32GB", None), ("NVIDIA RTX A1000 6GB Laptop GPU", None),  # not an A100
])
def test_mfu_uses_the_bf16_peak_of_the_gpu_by_its_whole_name(monkeypatch, gpu, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    assert training.peak_tflops(torch.device("cuda", 0), torch.bfloat16) == peak


def test_mfu_divides_by_the_peak_of_every_gpu_at_work(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    gpu = torch.device("cuda", 0)
    assert training.peak_tflops(gpu, torch.bfloat16, n_devices=4) == 4 * 756
    assert training.peak_tflops(gpu, torch.float32) is None  # no MFU against a peak we don't use
    assert training.peak_tflops(torch.device("cpu"), torch.bfloat16) is None
    cfg = training.parse_args(["--batch-size", "64", "--seq-len", "512"])
    speed = training.throughput(2.0, steps=10, cfg=cfg, nonpad_tokens=300_000, flops_per_token=10**9,
                                peak=4 * 756)
    assert speed["tokens_per_s"] == 10 * 64 * 512 / 2.0 and speed["tokens_per_s_nonpad"] == 150_000
    assert speed["tflops"] == pytest.approx(163.84) and speed["flops_per_token"] == 10**9
    assert speed["mfu"] == pytest.approx(163.84 / (4 * 756))
    # train_dp.py counts the GPUs DataParallel computes on (here as if 4 were visible)
    model = torch.nn.Linear(2, 2)
    assert training.devices_in_use(model) == 1
    dp = torch.nn.DataParallel(model)
    dp.device_ids = [0, 1, 2, 3]
    assert training.devices_in_use(dp) == 4


def test_bf16_trains_like_fp32(runs, bf16_floor):
    bf16 = runs("dp_bf16", "train_dp.py", BF16)
    assert_follows_in_bf16(bf16, runs("dp_short", "train_dp.py", FP32_LIKE_BF16), bf16_floor)  # it follows fp32
    assert all(w.dtype == torch.float32 for w in load_weights(bf16).values())  # fp32 master weights


@pytest.mark.compile
def test_compiled_run_trains_the_same_model_and_its_checkpoints_load_into_a_plain_one(runs, tmp_path, floor):
    """Compiled kernels fuse and reorder the arithmetic: the same model to rounding."""
    eager = runs("dp", "train_dp.py")
    compiled = runs("dp_compiled", "train_dp.py", ["--compile"])
    assert_same_model(compiled, eager, floor)
    rows = [row for row in metrics(compiled) if "loss" in row]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert {"tokens_per_s", "tokens_per_s_nonpad", "flops_per_token", "tflops"} <= rows[-1].keys()
    # model.pt has plain keys and loads strictly; the step-4 checkpoint resumes without --compile
    checkpointing.load_trained(compiled)
    out = tmp_path / "resumed"
    shutil.copytree(compiled, out)
    for later in ("checkpoint.pt", "checkpoint-00000008.pt", "model.pt"):
        (out / later).unlink()
    run_script("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), "--resume"])
    assert_same_model(out, eager, floor)


def test_bench_runs_every_row_and_writes_its_table(tmp_path):
    """bench.py at toy size: one process, DDP and FSDP at world sizes 1 and 2 (gloo), the
    ablation, and the memory each rank holds: FSDP's ranks hold half of what DDP's do."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench.py"), "--steps", "1", "--warmup", "1", "--seq-len", "32",
                           "--batch-size", "4", "--json", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    scaling = result["scaling"]
    assert list(scaling) == ["one process", "DDP, world size 1", "DDP, world size 2", "FSDP, world size 1",
                             "FSDP, world size 2"]
    assert len(scaling["DDP, world size 2"]["peak_mem_gb"]) == 2  # one figure per rank
    ddp, fsdp = scaling["DDP, world size 2"]["state_gb"], scaling["FSDP, world size 2"]["state_gb"]
    assert ddp[0] == ddp[1] == scaling["one process"]["state_gb"]  # every DDP rank holds it all
    assert all(abs(f / ddp[0] - 0.5) < 0.01 for f in fsdp)  # each FSDP rank half (the embedding rows pad)
    assert [row[:3] for row in result["memory_per_rank"]][-1] == ["1b", 1_177_946_112, 8]
    assert list(result["ablation"])[0] == "tutorial: float mask, fp32, loss outside"
    assert all(row["steps_per_s"] > 0 for table in ("scaling", "ablation") for row in result[table].values())
    assert {"ddp_world_1_vs_one_process", "fsdp_vs_ddp_at_world_size_1", "fsdp_vs_ddp_at_world_size_2"} <= \
        result["ratios"].keys() and "Table 2" in proc.stdout


# torch 2.5 (which the README promises for DP and DDP) has no torch.distributed.fsdp.fully_shard
HIDE_FSDP = ("import sys, torch.distributed.fsdp as fsdp; del fsdp.fully_shard, fsdp.MixedPrecisionPolicy; "
             f"sys.path.insert(0, {str(REPO)!r}); ")


def test_bench_on_one_gpu_and_without_fsdp_still_prints_every_table(tmp_path):
    """--max-world-size 1, as on a machine with one GPU, on a torch without FSDP2: Table 1
    holds the rows it could measure, the ratios only those, and Tables 2-3 and bench.json
    still come out."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-c", HIDE_FSDP + "import bench; bench.main(sys.argv[1:])",
                           "--steps", "1", "--warmup", "1", "--seq-len", "32", "--batch-size", "4",
                           "--max-world-size", "1", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert list(result["scaling"]) == ["one process", "DDP, world size 1"]
    assert "no FSDP rows: torch" in proc.stdout
    assert [key for key in result["ratios"] if "vs tutorial" not in key] == ["ddp_world_1_vs_one_process"]
    assert all(f"Table {n}" in proc.stdout for n in (1, 2, 3)) and result["memory_per_rank"]


def test_bench_grouping_without_fsdp_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-c", HIDE_FSDP + "import bench_grouping; bench_grouping.main()"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: bench_grouping.py measures FSDP2, which needs torch 2.6 or newer "
                                        f"(this is {torch.__version__})"]


def _ddp_options_worker(rank, port, results):
    import os
    import torch.distributed as dist
    from launcher import DDP_OPTIONS
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
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
    # Leave without tearing DDP and gloo down: freeing the reducer right after its last
    # all-reduce can deadlock in gloo's destructor (its worker thread waits for the GIL that
    # the joining main thread holds; seen once in CI, torch 2.13).
    os._exit(0)


def test_ddp_keeps_gradients_in_its_buckets_and_sends_no_buffers_each_step():
    """launcher.DDP_OPTIONS, as train_ddp.py builds DDP, on 2 gloo ranks: gradients are views into the all-reduce
    buckets (no copy in and out), and a forward broadcasts no buffers: rank 1's own RoPE table
    survives it (with DDP's default, rank 0's would overwrite it before every forward)."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_ddp_options_worker, args=(port, results), nprocs=2)
    got = dict((rank, (cos, views)) for rank, cos, views in (results.get(), results.get()))
    untouched = LlamaForPretraining(LlamaConfig(vocab_size=97, max_position_embeddings=64, hidden_size=64,
                                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                                num_key_value_heads=2)).base_model.rotary_emb.cos[1, 0].item()
    assert got[0] == (pytest.approx(untouched), True)
    assert got[1] == (pytest.approx(untouched + 1), True)  # not rank 0's value: no broadcast
