"""Evaluation on the held-out documents: each rank's share of them, the summed loss and
target count (which the distributed scripts all-reduce), and the loss in bits per byte.
"""

import math

import torch

import data
from training.profiling import EVALUATION_MARK
from training.read_ahead import on_device


def val_loader(val_ds, rank: int, world_size: int, batch_size: int, same_length: bool = False):
    """Every rank takes every world_size-th held-out sequence, without DistributedSampler's
    padding (which repeats samples and would bias the loss); the sums are then all-reduced.
    same_length: ranks with one sequence fewer get a sequence of padding, whose targets are
    all ignored, so that every rank runs the same number of forwards (FSDP needs that)."""
    indices = list(range(rank, len(val_ds), world_size))
    if same_length and len(indices) < -(-len(val_ds) // world_size):
        indices.append(-1)  # -1: the padding sequence
    shard = [val_ds[i] if i >= 0 else val_ds.padding_row() for i in indices] if same_length else \
        torch.utils.data.Subset(val_ds, indices)
    return torch.utils.data.DataLoader(shard, batch_size=batch_size)


@torch.no_grad()
def evaluate(model, loader, device) -> torch.Tensor:
    """Return this process's [sum of token losses, number of targets] over `loader`."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.profiler.record_function(EVALUATION_MARK):  # --profile: its forwards are no training step's
        for batch in loader:
            inputs = on_device(batch, device)
            for t in inputs:
                if t.dim() == 2:  # rows x positions
                    # Compiled (--compile), the number of rows is left dynamic: the first batch's
                    # graph serves the last, smaller one too, instead of a second compile. No
                    # effect uncompiled.
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            loss_sum, n_tokens = model(*inputs)
            totals += torch.stack([loss_sum.sum(), n_tokens.sum()])
    model.train()
    return totals


def bits_per_byte(loss_sum: torch.Tensor, val_ds: data.PaddedSequenceDataset) -> float:
    """The held-out loss in bits per UTF-8 byte of its documents' text: the summed loss over
    every token (in nats: / ln 2 for bits), over the bytes they encode. Unlike the loss per
    token, it does not depend on the tokenizer."""
    return loss_sum.item() / math.log(2) / val_ds.text_bytes
