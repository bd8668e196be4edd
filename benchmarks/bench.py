"""Measure training speed on this machine, side by side in one run.

    python benchmarks/bench.py            # CPU: the tiny preset (16 x 128); GPU: the article preset (64 x 512)
    python benchmarks/bench.py --compile  # also torch.compile our path in Table 2 (slow to compile on a CPU)

Table 1 is the tutorial's comparison: one process, nn.DataParallel (when there is more than
one GPU), DDP and FSDP at world size 1..N (N = the GPUs, or 2 processes on a CPU; at most
--max-world-size), and HSDP as 2 replicas at even N (train_fsdp.py --replicas 2; on one
machine, and on a CPU above all, it shows that HSDP runs and what it holds, not what it
saves on a network: benchmarks/bench_network.py counts that). Every row trains the same
global batch, eager and in --dtype auto's dtype (DataParallel cannot run a compiled model);
tokens/s counts all positions of every rank. Its memory columns give each rank's bytes of
weights, gradients and AdamW state, counted from the tensors it holds (its shards under
FSDP), and its peak (CUDA max allocated, or peak RSS on a CPU). Table 3 counts those bytes
per rank for the article and 1b presets at 1 to 8 ranks on the meta device, without
allocating them. Table 2 starts from the tutorial's formulation (an explicit float
causal+padding mask, fp32, logits returned and the loss taken outside the model) and turns
our changes on one at a time. Both go to stdout and to --json. Synthetic right-padded
batches are used, so no dataset is needed; timing starts after warm-up steps, on the same
batches for every row.
"""

import argparse
import dataclasses
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
import train_fsdp  # noqa: E402
from model import IGNORE_INDEX, PRESETS, LlamaConfig, LlamaForPretraining  # noqa: E402
from training import config, files, launch, memory, metrics, stopping  # noqa: E402
from training.errors import ArgumentParser, UsageError, at_least, path_argument  # noqa: E402

def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="article" if cuda else "tiny")
    p.add_argument("--seq-len", type=at_least(1), help="tokens per sequence (default: the --model preset's)")
    p.add_argument("--batch-size", type=at_least(1), help="global sequences per step (default: the --model preset's)")
    p.add_argument("--steps", type=at_least(1), default=20 if cuda else 8, help="timed steps per row")
    p.add_argument("--warmup", type=at_least(0), default=5 if cuda else 2, help="untimed steps per row")
    p.add_argument("--compile", action="store_true", help="torch.compile our path (on by default on a GPU)")
    p.add_argument("--max-world-size", type=at_least(1), default=max(1, torch.cuda.device_count()) if cuda else 2,
                   help="largest DDP/FSDP world in Table 1 (default: every GPU, or 2 CPU processes)")
    p.add_argument("--json", type=path_argument, default="bench.json")
    args = p.parse_args(argv)
    if cuda and args.max_world_size > torch.cuda.device_count():  # one process per GPU
        p.error(f"--max-world-size {args.max_world_size}: this machine has {torch.cuda.device_count()} GPU(s)")
    args.compile = args.compile or cuda
    preset = config.TRAINING_PRESETS[args.model]  # the sizes the three scripts use
    args.vocab_size = preset["vocab_size"]
    args.seq_len = args.seq_len or preset["seq_len"]
    args.batch_size = args.batch_size or preset["batch_size"]
    check_shape(args.model, args.seq_len, args.batch_size, args.max_world_size)
    check_memory(args, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    files.check_output(args.json, "--json")  # before the minutes of measurements whose tables it holds
    return args


def check_shape(model: str, seq_len: int, batch_size: int, world_size: int):
    """A step no row could run: one line before anything is built or spawned."""
    positions = PRESETS[model]["max_position_embeddings"]
    if seq_len > positions:
        raise UsageError(f"--seq-len {seq_len} exceeds the {model} model's {positions} positions")
    if batch_size < world_size:
        raise UsageError(f"--batch-size {batch_size} leaves some of {world_size} ranks without a sequence: give "
                         "at least one a rank")


def check_memory(args, device: torch.device):
    """A batch whose memory estimate (training/memory.py's, the trainers' check) exceeds what is
    available is refused before anything is allocated. The estimate is our formulation in fp32,
    with nothing saved: below what the largest rows hold, the tutorial's, in fp32 with the whole
    logits (the article model at 64 x 512: 40.6 GB estimated, 56.1 GiB = 60.2 GB measured on one
    H200, docs/benchmarks.md). On a CPU the ranks of Table 1's largest world share the memory."""
    config = model_config(args)

    def need(rows: int) -> int:  # one process's, for a batch of `rows` sequences
        held = memory.estimate(config, rows, args.seq_len, torch.float32, on_gpu=device.type == "cuda")
        return dataclasses.replace(held, snapshot=0).total  # the copy a trainer's saves write from
    ranks = args.max_world_size
    held = need(args.batch_size) if device.type == "cuda" else max(need(args.batch_size),
                                                                   ranks * need(-(-args.batch_size // ranks)))
    available = memory.device_memory(device)[1]
    if held > available:
        raise UsageError(f"--batch-size {args.batch_size} x --seq-len {args.seq_len} cannot fit: the {args.model} "
                         f"model's rows need at least {memory.size(held)} (training/memory.py's estimate), and "
                         f"{memory.size(available)} of {'GPU' if device.type == 'cuda' else 'CPU'} memory are "
                         "available; lower --batch-size or --seq-len")


def synthetic_batches(args, n=4):
    """n global batches of right-padded sequences: lengths from a quarter to all of seq_len."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        tokens = torch.randint(3, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        lengths = torch.randint(args.seq_len // 4, args.seq_len + 2, (args.batch_size, 1), generator=g)
        real = torch.arange(args.seq_len + 1)[None, :] < lengths
        x = tokens[:, :-1].masked_fill(~real[:, :-1], 0)  # [PAD] = 0
        y = tokens[:, 1:].masked_fill(~real[:, 1:], IGNORE_INDEX)
        batches.append((x, y))
    return batches


# ---- the tutorial's formulation, for the ablation ------------------------------------------

_sdpa = F.scaled_dot_product_attention
_mask = {}


def _sdpa_with_float_mask(q, k, v, is_causal=False, enable_gqa=False):
    return _sdpa(q, k, v, attn_mask=_mask["mask"], enable_gqa=enable_gqa)


def float_mask(x):
    """What the tutorial builds every step: (B, 1, T, T), 0 where allowed, -inf elsewhere."""
    T = x.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None] & (x != 0)[:, None, None, :]
    return torch.zeros(allowed.shape, device=x.device).masked_fill(~allowed, float("-inf"))


# ---- one timed run --------------------------------------------------------------------------

def model_config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab_size, **PRESETS[args.model])


def build(args, device, dtype, compile_model=False):
    torch.manual_seed(0)
    model = LlamaForPretraining(model_config(args)).to(device)
    model.compute_dtype = dtype  # as build.model sets it: the model applies autocast itself
    if compile_model:
        model.compile()
    return model


def time_steps(args, model, batches, device, mask=False, loss_inside=True):
    """Run warm-up plus timed optimizer steps; return steps/s and peak memory."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    F.scaled_dot_product_attention = _sdpa_with_float_mask if mask else _sdpa

    def step(x, y):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if mask:
            _mask["mask"] = float_mask(x)
        if loss_inside:
            loss_sum, n = model(x, y)
            loss = loss_sum.sum() / n.sum()
        else:  # logits out of the model, then the loss
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for i in range(args.warmup):
            step(*batches[i % len(batches)])
        sync(device)
        if device.type == "cuda":  # on every GPU that DataParallel computes on, not only the first
            for index in getattr(model, "device_ids", None) or [device.index]:
                torch.cuda.reset_peak_memory_stats(index)
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(*batches[i % len(batches)])
        sync(device)
        seconds = time.perf_counter() - t0
        held = state_gb(model, optimizer, *batches[0], device)
    finally:
        F.scaled_dot_product_attention = _sdpa
    return {"steps_per_s": args.steps / seconds, "peak_mem_gb": peak_memory_gb(device), "state_gb": held}


def state_gb(model, optimizer, x, y, device) -> float:
    """GB of weights, gradients and AdamW state this process holds: its local shards under
    FSDP (DTensor.to_local), the whole tensors otherwise. Gradients from one more backward."""
    loss_sum, n = model(x.to(device), y.to(device))
    (loss_sum.sum() / n.sum()).backward()
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for state in optimizer.state.values() for v in state.values() if v.dim() > 0)]
    optimizer.zero_grad(set_to_none=True)
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors) / 2**30


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif dist.is_initialized():
        dist.barrier()


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gb()


def peak_rss_gb() -> float:
    """This process's own peak resident memory: Linux's VmHWM. Not ru_maxrss, which a process
    inherits from its parent across fork and exec: every spawned worker would report at least
    the peak its parent had reached (the fallback where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20  # KiB
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS, KiB elsewhere


# ---- table 1: one process, DataParallel, DDP ----------------------------------------------

def join_world(rank, world_size, port) -> torch.device:
    """Start a spawned worker's process group (NCCL on GPUs, gloo on a CPU); return its device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, os.cpu_count() // world_size))  # the cores are shared
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    return device


def distributed_worker(rank, world_size, port, args, dtype, kinds, results):
    """One world measures each kind in turn (FSDP before DDP: on a CPU the memory column is the
    peak RSS so far, and DDP's own peak is the larger)."""
    device = join_world(rank, world_size, port)
    cuda = device.type == "cuda"
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in synthetic_batches(args)]
    for kind in kinds:
        if kind != "DDP":  # as train_fsdp.py shards it: fp32 weights, `dtype` through the mixed-precision policy
            shape, names = config.mesh_shape(2 if kind == HSDP else 1, world_size)  # HSDP: train_fsdp.py --replicas 2
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
            model = train_fsdp.shard(build(args, device, torch.float32), mesh, dtype)
        else:  # as train_ddp.py builds it
            model = nn.parallel.DistributedDataParallel(build(args, device, dtype), device_ids=[rank] if cuda else None,
                                                        **launch.DDP_OPTIONS)
        row = time_steps(args, model, shard, device)
        if kind != "DDP":  # freed before DDP's is built (DDP's reducer never is: see the end)
            del model
            if cuda:
                torch.cuda.empty_cache()
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, (row["peak_mem_gb"], row["state_gb"]))
        if rank == 0:
            results.put((kind, {**row, "peak_mem_gb": [m for m, _ in per_rank], "state_gb": [s for _, s in per_rank]}))
    # Leave without tearing the model and gloo down: freeing them right after the last
    # collective can deadlock in gloo's destructor (its worker thread waits for the GIL that
    # the joining main thread holds; seen in CI with torch 2.13). Nothing is left to do here.
    os._exit(0)


HSDP = "HSDP, 2 replicas"  # a row of Table 1 on an even number of ranks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaling_table(args, device, dtype, batches):
    """Every row eager and in the same dtype: DataParallel cannot run a compiled model, so
    the comparison leaves compile out for all (Table 2 measures what compile adds)."""
    rows = [("one process", time_steps(args, build(args, device, dtype), batches, device))]
    if torch.cuda.device_count() > 1:  # DataParallel has nothing to split on a CPU or one GPU
        dp = nn.DataParallel(build(args, device, dtype))
        row = time_steps(args, dp, batches, device)
        row["peak_mem_gb"] = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(torch.cuda.device_count())]
        rows.append(("DataParallel", row))
        del dp
    if device.type == "cuda":  # hand this process's cached blocks back: the workers share its GPUs
        torch.cuda.empty_cache()
    kinds = ("DDP", "FSDP")
    measured = {}
    for world_size in range(1, args.max_world_size + 1):  # one world of processes per size, for every kind
        here = (*kinds, *([HSDP] if world_size % 2 == 0 else []))
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(distributed_worker, args=(world_size, free_port(), args, dtype, here[::-1], results),
                 nprocs=world_size)
        for _ in here:
            kind, row = results.get()
            measured[kind, world_size] = row
    return rows + [(f"{kind}, world size {n}", measured[kind, n]) for kind in (*kinds, HSDP)
                   for n in range(1, args.max_world_size + 1) if (kind, n) in measured]


def memory_table(world_sizes=(1, 2, 4, 8)):
    """GB of fp32 weights, gradients and AdamW's two moments (16 bytes per parameter) that each
    rank holds, for models too big to allocate here: counted on the meta device. FSDP splits
    every tensor along its first dimension into world_size equal (padded) pieces."""
    rows = []
    for preset in ("article", "1b"):
        with torch.device("meta"):
            vocab_size = config.TRAINING_PRESETS[preset]["vocab_size"]
            params = list(LlamaForPretraining(LlamaConfig(vocab_size=vocab_size, **PRESETS[preset])).parameters())
        full = sum(p.numel() for p in params)
        for n in world_sizes:
            local = sum(-(-p.shape[0] // n) * p[0].numel() for p in params)  # ceil(rows / n) rows each
            rows.append((preset, full, n, 16 * full / 2**30, 16 * local / 2**30))
    return rows


# ---- table 2: the ablation ----------------------------------------------------------------

def ablation_table(args, device, dtype, batches):
    """The tutorial's step, then each change alone, then ours. The tutorial's fp32 matmuls are
    full fp32 (torch's default); ours on a GPU run fp32 matmuls on TF32 (launch.compute_dtype
    set that before this table), which is one of the changes, measured alone."""
    fp32, bf16 = torch.float32, torch.bfloat16
    ours = torch.get_float32_matmul_precision()  # "high" (TF32) on a GPU, as the trainers set it
    variants = [  # (name, float mask, loss inside forward, dtype, compile, fp32 matmul precision)
        ("tutorial: float mask, fp32, loss outside", True, False, fp32, False, "highest"),
        ("+ is_causal instead of the mask", False, False, fp32, False, "highest"),
        ("+ loss inside forward", True, True, fp32, False, "highest"),
        ("+ bf16 autocast", True, False, bf16, False, "highest"),
    ]
    if ours != "highest":
        variants.append(("+ TF32 for fp32 matmuls", True, False, fp32, False, ours))
    if args.compile:
        variants.append(("+ torch.compile", True, False, fp32, True, "highest"))
    variants.append((f"ours, train_dp.py's default (--dtype auto = {str(dtype)[6:]})", False, True, dtype, False, ours))
    if dtype != bf16:
        variants.append(("ours, --dtype bf16", False, True, bf16, False, ours))
    if args.compile:
        variants.append(("ours, --dtype bf16 --compile", False, True, bf16, True, ours))
    rows = []
    try:
        for name, mask, loss_inside, variant_dtype, compile_model, precision in variants:
            torch.set_float32_matmul_precision(precision)
            model = build(args, device, variant_dtype, compile_model)
            rows.append((name, time_steps(args, model, batches, device, mask, loss_inside)))
    finally:
        torch.set_float32_matmul_precision(ours)
    return rows


def print_table(title, rows, args):
    tokens = args.batch_size * args.seq_len
    # A process's peak RSS never goes down: on a CPU, rows measured in one process show the
    # largest so far. GPU rows (and each DDP process) report their own peak.
    peak_column = "peak GPU memory (GiB)" if torch.cuda.is_available() else "peak RSS so far (GiB)"
    print(f"\n{title}\n{'':2}{'run':<55}{'steps/s':>9}{'tokens/s':>11}  {'weights+grads+AdamW (GiB)':<26} "
          f"{peak_column}")
    for name, row in rows:
        held, peak = (" / ".join(f"{m:.3f}" for m in (v if isinstance(v, list) else [v]))
                      for v in (row["state_gb"], row["peak_mem_gb"]))
        print(f"  {name:<55}{row['steps_per_s']:>9.2f}{row['steps_per_s'] * tokens:>11,.0f}  {held:<26} {peak}")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = launch.compute_dtype("auto", device)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"{name} | torch {torch.__version__} | {args.model} model | {args.batch_size} x {args.seq_len} tokens "
          f"per step | --dtype auto = {dtype} | {args.warmup} warm-up + {args.steps} timed steps per row")
    batches = synthetic_batches(args)
    scaling = scaling_table(args, device, dtype, batches)
    print_table(f"Table 1: one process, DataParallel, DDP, FSDP (same global batch; every row eager, "
                f"{str(dtype)[6:]}; memory per rank)", scaling, args)
    ablation = ablation_table(args, device, dtype, batches)
    print_table("Table 2: the tutorial's formulation, then our changes one at a time", ablation, args)

    speed = {name: row["steps_per_s"] for name, row in scaling + ablation}
    tutorial = ablation[0][1]["steps_per_s"]
    ratios = {"ddp_world_1_vs_one_process": speed["DDP, world size 1"] / speed["one process"]}
    for n in range(1, args.max_world_size + 1):  # the worlds this run measured (one GPU: only 1)
        ratios[f"fsdp_vs_ddp_at_world_size_{n}"] = speed[f"FSDP, world size {n}"] / speed[f"DDP, world size {n}"]
    ratios.update({f"{name} vs tutorial": row["steps_per_s"] / tutorial for name, row in ablation[1:]})
    print("\nRatios (tokens/s, side by side in this run):")
    for key, value in ratios.items():
        print(f"  {key:<70}{value:6.2f}x")
    with torch.device("meta"):  # the parameter shapes, without allocating the weights
        shapes_only = LlamaForPretraining(model_config(args))
    flops = shapes_only.flops_per_token(args.seq_len)
    peak = metrics.peak_tflops(device, dtype)
    best = max(row["steps_per_s"] for _, row in ablation)
    if peak:
        mfu = flops * best * args.batch_size * args.seq_len / 1e12 / peak
        print(f"  MFU of the fastest one-device row: {mfu:.1%} of {peak} TFLOP/s")
    memory_rows = memory_table()
    print(f"\nTable 3: GiB of weights, gradients and AdamW state per rank (fp32, 16 bytes per parameter; "
          f"each preset's vocabulary)\n  {'model':<10}{'parameters':>14}{'ranks':>7}{'DDP':>10}{'FSDP':>10}")
    for preset, n_params, n, ddp_gb, fsdp_gb in memory_rows:
        print(f"  {preset:<10}{n_params:>14,}{n:>7}{ddp_gb:>10.2f}{fsdp_gb:>10.2f}")
    files.atomic_save(json.dumps({"device": name, "torch": torch.__version__, "args": vars(args),
                                  "dtype_auto": str(dtype), "flops_per_token": flops, "scaling": dict(scaling),
                                  "ablation": dict(ablation), "ratios": ratios, "memory_per_rank": memory_rows},
                                 indent=2), Path(args.json))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
