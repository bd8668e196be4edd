"""The training step's rows for benchmarks/gpu_report.py: the baseline, its variants and the step's candidates,
each built, compiled and wrapped as its trainer builds it, then timed (and some profiled) on the same batches.

A candidate is a switch on the model (CANDIDATES) or an option of train_fsdp.shard (FSDP_CANDIDATES), each a
small named piece with its own CPU test proving it trains the baseline's model. None is the trainers' default
until a GPU has measured it faster than the baseline in one run of the report; then the slower one goes.
"""

import dataclasses
import gc
import math
import time
from pathlib import Path

import torch

import train_fsdp
from benchmarks.bench import peak_rss_gb, sync
from model import IGNORE_INDEX
from training import build, launch, profiling

CANDIDATES = {  # name: (what it changes, how to turn it on: before compile and wrapping)
    "fused-projections": ("q/k/v and gate/up as single matmuls (ops/fused_projections.py)",
                          lambda model: model.fuse_projections()),
    "chunked-loss": ("the LM head's loss chunked under compile (ops/chunked_loss.py)",
                     lambda model: setattr(model.lm_head, "compiled_loss", "chunked")),
}
FSDP_CANDIDATES = {  # name: (what it changes, train_fsdp.shard's options)
    "last-layer-kept": ("the last layer kept gathered into backward", {"layers_kept_gathered": 1}),
    "every-layer-kept": ("every layer kept gathered into backward", {"layers_kept_gathered": 10**6}),
}
BASELINE = "packed, DDP: the baseline"  # train_ddp.py --pack --compile at world size 1
FSDP = "packed, FSDP"  # train_fsdp.py's, against it


def rows() -> list[dict]:
    """Every row, in the order the report measures them (the most wanted first). "profile": one more step of
    it traced (the baseline's, and FSDP's to show where its time goes beside it)."""
    row = lambda name, **kw: {"name": name, "layout": "packed", "wrap": "DDP", "candidates": [], "fsdp": {},
                              "profile": None, **kw}
    found = [row(BASELINE, profile="ddp"), row(FSDP, wrap="FSDP", profile="fsdp")]
    found += [row(f"{FSDP} + {name}: {what}", wrap="FSDP", fsdp=options)
              for name, (what, options) in FSDP_CANDIDATES.items()]
    found += [row(f"packed, DDP + {name}: {what}", candidates=[name]) for name, (what, _) in CANDIDATES.items()]
    if len(CANDIDATES) > 1:
        found.append(row("packed, DDP + every candidate", candidates=list(CANDIDATES)))
    return found + [row("packed, one process, the whole model compiled (train_dp.py's)", wrap="one process"),
                    row("padded, DDP", layout="padded"), row(f"{BASELINE}, again (the machine's drift)")]


def build_row(spec: dict, cfg, vocab_size: int, device: torch.device, dtype: torch.dtype, mesh,
              total_steps: int = 10**6):
    """The model as the trainer of spec["wrap"] builds, compiles and wraps it, with the row's candidates; its
    optimizer, its schedule (over total_steps: the report's rows take a few of a long run's), and its clipping
    of the gradients (the trainer's). tests/test_gpu_report.py trains a row as its trainer trains."""
    fsdp = spec["wrap"] == "FSDP"
    raw = build.model(cfg, vocab_size, torch.float32 if fsdp else dtype, "meta" if fsdp else device)
    for name in spec["candidates"]:
        CANDIDATES[name][1](raw)
    if cfg.compile and spec["wrap"] == "one process":
        raw.compile()  # train_dp.py's: the whole model
    elif cfg.compile:  # train_ddp.py's and train_fsdp.py's: each layer and the LM head apart
        for block in [*raw.base_model.layers, raw.lm_head]:
            block.compile()
    model = raw
    if fsdp:
        train_fsdp.shard(raw, mesh, dtype, **spec["fsdp"])
        raw.to_empty(device=device)
        build.init_weights(raw, cfg)
    elif spec["wrap"] == "DDP":
        model = torch.nn.parallel.DistributedDataParallel(raw, device_ids=[device.index] if device.type == "cuda"
                                                          else None, **launch.DDP_OPTIONS)
    optimizer, scheduler = build.optimizer(raw, cfg, total_steps)

    def clip():  # the gradient norm, clipped to --grad-clip (0: not clipped), as each script computes it
        if fsdp:
            train_fsdp.clip_grad_norm(raw, cfg.grad_clip or math.inf)
        else:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip or math.inf)
    return model, optimizer, scheduler, clip


def measure(spec: dict, cfg, batches: list, warmup: int, vocab_size: int, device, dtype, mesh) -> dict:
    """Warm-up steps (compiling), then the timed steps: one optimizer step a batch, as the trainers step (the
    loss over the batch's targets, clipping, AdamW, the schedule). The data are on the device already: the
    trainers' read-ahead keeps the feed off the step (benchmarks/bench_read_ahead.py)."""
    losses = []
    step = train_step(*build_row(spec, cfg, vocab_size, device, dtype, mesh), losses)
    for batch in batches[:warmup]:
        step(*batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for batch in batches[warmup:]:
        step(*batch)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y, *_ in batches[warmup:])
    result = {"tokens_per_s": tokens / seconds, "positions_per_s": sum(y.numel() for _, y, *_ in batches[warmup:])
              / seconds, "loss": losses[-1].item(), "steps": len(losses),
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else peak_rss_gb()}
    if spec["profile"]:  # each in a folder of its own: the traces' names are the trainer's (rank0.steps1-1)
        traced = dataclasses.replace(cfg, out_dir=str(Path(cfg.out_dir) / spec["profile"]))
        result["trace"] = profile_one_step(traced, device, step, batches[0])
    return result


def train_step(model, optimizer, scheduler, clip, losses: list):
    """The row's optimizer step on one batch (one micro-batch: --grad-accum 1), as its trainer steps: the loss
    over the batch's real targets, backward, clipping, AdamW, the schedule; each step's loss onto losses."""
    def step(x, y, *packing):
        n_tokens = (y != IGNORE_INDEX).sum()
        loss_sum = model(x, y, *packing)[0].sum()
        (loss_sum / n_tokens).backward()
        clip()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum.detach() / n_tokens)
    return step


def profile_one_step(cfg, device, step, batch) -> str:
    """One more step, traced as --profile traces one (the trainer's marks included): its trace's path."""
    profiler = profiling.Profiler(cfg, 0, device, first_step=0, total_steps=1, model=None)  # no checkpoint
    profiler.begin(1)
    for micro_batch in profiler.micro_steps([batch]):
        step(*micro_batch)
    profiler.end(1)
    return str(Path(cfg.out_dir) / profiling.PROFILE / f"{profiler.name()}{profiling.TRACE}")


def free(device):
    """Between rows: the last row's model and its compiled code go (each row compiles afresh, as a new process
    would: no row may run eager because the compiler's cache for a function is full)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
