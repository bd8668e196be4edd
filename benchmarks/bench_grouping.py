"""Measure how train_fsdp.py groups the embedding and the LM head, against the simplest grouping.

    python bench_grouping.py                 # article model, 2 ranks (gloo on a CPU, NCCL on GPUs)

  layers only  fully_shard on each decoder layer, then the root: the embedding, final norm
               and LM head fall to the root's group, gathered when forward starts and kept
               until backward ends
  ours         train_fsdp.shard(): the embedding alone (freed after its forward), the norm
               with the LM head (gathered at the end of forward, kept into backward)

Each variant runs in fresh processes (the model built on the meta device, so no full copy
ever exists) for a few AdamW steps; it prints every rank's peak memory: CUDA max allocated
on GPUs, peak RSS on a CPU.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
import train_fsdp  # noqa: E402
from benchmarks import bench  # noqa: E402
from model import PRESETS, LlamaConfig, LlamaForPretraining  # noqa: E402
from training import config, launch, stopping  # noqa: E402
from training.errors import ArgumentParser, at_least  # noqa: E402


def worker(rank, world_size, port, args, variant, results):
    device = bench.join_world(rank, world_size, port)
    cuda = device.type == "cuda"
    mesh = init_device_mesh(device.type, (world_size,))
    dtype = launch.compute_dtype("auto", device)
    vocab_size = config.TRAINING_PRESETS[args.model]["vocab_size"]
    with torch.device("meta"):
        model = LlamaForPretraining(LlamaConfig(vocab_size=vocab_size, **PRESETS[args.model]))
    if variant == "ours":
        train_fsdp.shard(model, mesh, dtype)
    else:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.base_model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)  # values do not matter here, only sizes
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(0.01)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(3, vocab_size, (args.batch_size // world_size, args.seq_len), device=device)
    for _ in range(args.steps):
        loss_sum, n_tokens = model(x, x)
        (loss_sum.sum() / n_tokens.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else bench.peak_rss_gb() * 2**10
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        results.put(peaks)
    os._exit(0)  # as bench.py's workers: no teardown right after the last collective


def main():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="article")
    p.add_argument("--world-size", type=at_least(1), default=2)
    p.add_argument("--batch-size", type=at_least(1), default=4, help="global sequences per step")
    p.add_argument("--seq-len", type=at_least(1), default=64)
    p.add_argument("--steps", type=at_least(1), default=2)
    p.add_argument("--repeats", type=at_least(1), default=2, help="runs of each variant, alternating")
    args = p.parse_args()
    bench.check_shape(args.model, args.seq_len, args.batch_size, args.world_size)
    memory = "CUDA max allocated" if torch.cuda.is_available() else "peak RSS"
    print(f"{args.model} model, {args.world_size} ranks, {args.batch_size} x {args.seq_len} tokens per step: "
          f"{memory} per rank (MiB)")
    for _ in range(args.repeats):
        for variant in ("layers only", "ours"):
            results = mp.get_context("spawn").SimpleQueue()
            mp.spawn(worker, args=(args.world_size, bench.free_port(), args, variant, results),
                     nprocs=args.world_size)
            print(f"  {variant:<12}" + " / ".join(f"{m:,.0f}" for m in results.get()))


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
