"""What each rank sends per optimizer step, for DDP, FSDP and HSDP, and how much of it crosses
the network between nodes: counted from the model's parameter shapes (on the meta device:
nothing is allocated, no GPU or network is needed).

    python benchmarks/bench_network.py                          # article and 1b, 2 nodes of 8 GPUs
    python benchmarks/bench_network.py --nodes 4 --grad-accum 8

Bytes a rank sends in a ring collective over a group of n ranks, for a buffer of B bytes:
all-reduce 2 (n - 1) / n B, all-gather and reduce-scatter (n - 1) / n B. As train_ddp.py and
train_fsdp.py run on GPUs (bf16):
  DDP    all-reduces the fp32 gradients once a step (no_sync on the other micro-steps), over
         every rank: the group spans the nodes.
  FSDP   each micro-step, all-gathers every layer's bf16 weights in forward and again in
         backward, and reduce-scatters the fp32 gradients, over every rank.
  HSDP   (--replicas = nodes) the same gathers and reduce-scatters within a node, on its own
         links, and once a step an all-reduce of each rank's fp32 gradient shard with the
         ranks holding the same shard on the other nodes: the only bytes on the network.
The [norm, lm_head] group stays gathered from forward into backward and is gathered once a
micro-step, not twice; that, and the per-step scalars (token counts, losses, the stop flag),
are left out: under 0.1% of these figures.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from model import PRESETS, LlamaConfig, LlamaForPretraining  # noqa: E402
from training import stopping  # noqa: E402
from training.config import TRAINING_PRESETS  # noqa: E402
from training.errors import ArgumentParser, at_least  # noqa: E402


def shard_elements(shapes: list[torch.Size], shards: int) -> int:
    """Elements of one rank's shard of every tensor: FSDP2 splits each along its first dimension
    into `shards` equal pieces, padded (the last ones may be short; their buffers are not)."""
    return sum(-(-shape[0] // shards) * (shape.numel() // shape[0]) for shape in shapes)


def bytes_per_step(shapes: list[torch.Size], nodes: int, gpus_per_node: int, grad_accum: int) -> dict:
    """{method: (bytes a rank sends over the network a step, bytes it sends within its node)}."""
    n = nodes * gpus_per_node
    whole = shard_elements(shapes, 1)
    spans_nodes = nodes > 1  # a group over every rank crosses the network; within a node it does not
    ddp = 2 * (n - 1) / n * 4 * whole
    fsdp = grad_accum * (n - 1) / n * (2 + 2 + 4) * shard_elements(shapes, n) * n  # gathers bf16 twice, fp32 grads
    hsdp_node = grad_accum * (gpus_per_node - 1) / gpus_per_node * (2 + 2 + 4) * shard_elements(
        shapes, gpus_per_node) * gpus_per_node
    hsdp_network = 2 * (nodes - 1) / nodes * 4 * shard_elements(shapes, gpus_per_node)
    return {"DDP": (ddp, 0) if spans_nodes else (0, ddp),
            "FSDP": (fsdp, 0) if spans_nodes else (0, fsdp),
            f"HSDP (--replicas {nodes})": (hsdp_network, hsdp_node)}


def model_shapes(preset: str) -> list[torch.Size]:
    with torch.device("meta"):
        config = LlamaConfig(vocab_size=TRAINING_PRESETS[preset]["vocab_size"], **PRESETS[preset])
        return [p.shape for p in LlamaForPretraining(config).parameters()]


def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=at_least(1), default=2)
    p.add_argument("--gpus-per-node", type=at_least(1), default=8)
    p.add_argument("--grad-accum", type=at_least(1), default=4, help="micro-steps a step, for the last column")
    args = p.parse_args(argv)
    accum = args.grad_accum
    print(f"GB each rank sends per optimizer step, {args.nodes} nodes of {args.gpus_per_node} GPUs, bf16 "
          "(counted from the shapes, not measured)")
    print(f"  {'model':<9}{'method':<22}{'network':>10}{'in a node':>11}{f'network, {accum} micro-steps':>26}")
    rows = []
    for preset in ("article", "1b"):
        shapes = model_shapes(preset)
        one = bytes_per_step(shapes, args.nodes, args.gpus_per_node, 1)
        many = bytes_per_step(shapes, args.nodes, args.gpus_per_node, accum)
        for method, (network, node) in one.items():
            rows.append((preset, method, network, node, many[method][0]))
            print(f"  {preset:<9}{method:<22}{network / 1e9:>10.2f}{node / 1e9:>11.2f}{many[method][0] / 1e9:>26.2f}")
    return rows


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
