"""One deliberate change to a training run, for the tolerance tests: `perturbed(name)` applies
it in this process (the tests' in-process runs); as a script, it runs a training script
(argv[1:]) with the change PERTURB names (runs under torchrun, tests/calibrate_tolerances.py).

    reverse-batches   every micro-batch with its sequences in reverse order: the same tokens,
                      the same weights, summed in another order. Its distance from the plain
                      run is the rounding floor every approximate comparison is bounded by.
    full-logits       the LM head's loss in the plain formulation that chunked_loss.py replaces:
                      every logit at once, then F.cross_entropy. The reference the chunks
                      must train the same model as.
    small-chunks      the chunked loss in chunks of 7 tokens: many a micro-batch, the last short
    bf16-weights      the initial weights rounded to bf16 (and kept in fp32): one rounding to
                      bf16, of the kind autocast makes of every matmul's inputs, in fp32
                      arithmetic. Its distance from the plain run is the bf16 floor, nearly the
                      same on every CPU (no bf16 kernel computes it).
The others are mutants: bugs that a bound taken from that floor must catch.
    lr-off-by-one     the schedule one step ahead: step s trains with the LR of step s+1
    drop-micro-batch  the second micro-batch of step 3 never trains (use with --grad-accum 2)
    per-rank-mean     each rank divides by its own target count instead of the global one
                      (the global count's all-reduce is skipped; use under torchrun)
"""

import contextlib
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the trainer's modules
from model import IGNORE_INDEX, LlamaLMHead  # noqa: E402
from ops import chunked_loss  # noqa: E402
from training import build  # noqa: E402
from training.read_ahead import ReadAhead  # noqa: E402


def full_logits_loss(lm_head, h, targets):
    """The formulation chunked_loss.py replaces: the logits of every token at once, then
    F.cross_entropy (summed over the targets that are not IGNORE_INDEX)."""
    logits = torch.nn.Linear.forward(lm_head, h)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def full_logits_head(self, h, targets=None):
    return torch.nn.Linear.forward(self, h) if targets is None else full_logits_loss(self, h, targets)


@contextlib.contextmanager
def perturbed(perturbation: str):
    real_next_micro_batches, real_make_optimizer, real_all_reduce = (
        ReadAhead.__next__, build.optimizer, dist.all_reduce)
    real_head, real_chunk_tokens = LlamaLMHead.forward, chunked_loss.chunk_tokens
    real_init_weights = build.init_weights
    calls = []

    def reversed_micro_batches(*args, **kwargs):
        return [tuple(t.flip(0) for t in micro_batch)  # position_ids and cu_seqlens too, with --pack
                for micro_batch in real_next_micro_batches(*args, **kwargs)]

    def one_dropped(*args, **kwargs):
        calls.append(1)
        micro_batches = real_next_micro_batches(*args, **kwargs)
        return micro_batches[:1] if len(calls) == 3 else micro_batches

    def schedule_one_ahead(*args, **kwargs):
        optimizer, scheduler = real_make_optimizer(*args, **kwargs)
        scheduler.step()
        return optimizer, scheduler

    def local_count_only(tensor, *args, **kwargs):
        if tensor.dtype == torch.int64 and tensor.dim() == 0:  # n_tokens: the step's target count
            return None
        return real_all_reduce(tensor, *args, **kwargs)

    @torch.no_grad()
    def rounded_to_bf16(model, cfg):
        real_init_weights(model, cfg)
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))

    if perturbation == "reverse-batches":
        ReadAhead.__next__ = reversed_micro_batches
    elif perturbation == "drop-micro-batch":
        ReadAhead.__next__ = one_dropped
    elif perturbation == "lr-off-by-one":
        build.optimizer = schedule_one_ahead
    elif perturbation == "per-rank-mean":
        dist.all_reduce = local_count_only
    elif perturbation == "full-logits":
        LlamaLMHead.forward = full_logits_head
    elif perturbation == "small-chunks":
        chunked_loss.chunk_tokens = lambda vocab_size, device: 7
    elif perturbation == "bf16-weights":
        build.init_weights = rounded_to_bf16
    else:
        raise ValueError(f"unknown perturbation {perturbation!r}")
    try:
        yield
    finally:
        ReadAhead.__next__, build.optimizer, dist.all_reduce = (
            real_next_micro_batches, real_make_optimizer, real_all_reduce)
        LlamaLMHead.forward, chunked_loss.chunk_tokens = real_head, real_chunk_tokens
        build.init_weights = real_init_weights


if __name__ == "__main__":
    with perturbed(os.environ["PERTURB"]):
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
