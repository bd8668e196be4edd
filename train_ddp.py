"""Train the Llama model with DistributedDataParallel: one process per GPU, launched by torchrun.

    torchrun --standalone --nproc_per_node=4 train_ddp.py      # 4 GPUs (or 4 CPU processes)
    python train_ddp.py                                         # a world of one process

DDP starts one process per device. Each builds the same model (DDP broadcasts rank 0's
weights at construction), reads its own 1/world_size of every global batch through a
DistributedSampler, and during backward all-reduces gradients bucket by bucket while the
rest of backward still runs. Every rank then takes the same optimizer step, so the
replicas never drift and nothing is copied between steps: no GPU 0 bottleneck, no GIL.
This file is train_dp.py plus exactly those changes: read `diff train_dp.py train_ddp.py`.
"""

import contextlib
import datetime
import inspect
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from tokenizers import Tokenizer
from tqdm import tqdm

import checkpointing
import training
from data import ResumableDistributedSampler, UsageError, first_line
from model import IGNORE_INDEX

# How DDP is built, for speed:
# - gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, so no copy in
#   and out of the buckets and no second set of gradient-sized tensors;
# - no buffer sync before each forward: our only buffers are RoPE's cos/sin tables, which
#   every rank computes identically, so broadcasting them every step is wasted traffic.
#   (torch 2.13 renamed broadcast_buffers to forward_sync_buffers; torch 2.5 knows only the old name.)
DDP_OPTIONS = dict(gradient_as_bucket_view=True,
                   **({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False}))


def on_all_ranks(fn, group, first: bool = True):
    """Run fn on the ranks where `first` is true, then on the rest. With first=local_rank == 0,
    each node's local rank 0 downloads and tokenizes while the others wait, then they
    read what `datasets` cached instead of racing to write the same files. A UsageError
    on any rank, in either turn, is raised on every rank: all exit with its message, none hangs."""
    result = None
    for my_turn in (first, not first):
        error = None
        if my_turn:
            try:
                result = fn()
            except UsageError as e:
                error = str(e)
        errors = [None] * dist.get_world_size()
        waiting_for_data(dist.all_gather_object, errors, error, group=group)  # also the barrier after each turn
        if any(errors):
            raise UsageError(next(e for e in errors if e))
    return result


def waiting_for_data(collective, *args, group):
    """A collective of data preparation. Waiting longer than --data-timeout-minutes, or for a
    rank that died, ends this rank with one line instead of gloo's traceback."""
    try:
        collective(*args, group=group)
    except RuntimeError as e:
        raise training.RankError(f"rank {dist.get_rank()} stopped waiting for data preparation "
                                 f"(--data-timeout-minutes): {first_line(e)}") from None


def from_rank0(fn, group):
    """Run fn on rank 0 only and give every rank its (picklable) result, or its UsageError."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [(fn(), None)]
        except UsageError as e:
            box = [(None, str(e))]
    waiting_for_data(dist.broadcast_object_list, box, group=group)
    result, error = box[0]
    if error:
        raise UsageError(error)
    return result


def side_groups(cfg, backend: str, timeout: datetime.timedelta):
    """Two small gloo groups beside the main one. `prep` carries the turns of data preparation:
    on a cold cache local rank 0 may download and tokenize for hours while the others wait,
    far longer than a training collective should ever take. `control` (NCCL only) carries the
    per-step stop flag, which under NCCL would need a GPU tensor whose read-back stalls the
    host; it waits as long as the training collectives do."""
    prep = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=cfg.data_timeout_minutes))
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return prep, control


def main():
    cfg = training.parse_args(ddp=True, description=__doc__)
    # DDP: torchrun tells each process who it is. RANK: its place in the whole job;
    # LOCAL_RANK: its place on this machine, which picks the GPU (RANK would pick GPU 5
    # on a 4-GPU node 2). Under plain `python` it is a world of one.
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    micro_batch = training.check_batch(cfg, world_size)  # per process, per micro-step
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init, else every rank opens a context on GPU 0
    else:
        device = torch.device("cpu")
    dtype = training.compute_dtype(cfg.dtype, device)  # matmuls in dtype; weights and loss stay fp32
    backend = cfg.backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)  # how long a collective may wait
    if "RANK" in os.environ:  # MASTER_ADDR/PORT, RANK and WORLD_SIZE come from torchrun
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        # torchrun shares its rendezvous store with the workers and keeps it when it restarts
        # them (--max-restarts): keys of each attempt get their own prefix, or a restarted
        # rank can read a dead peer's address and fail to connect (pytorch/pytorch#135712).
        store = dist.PrefixStore(f"attempt{checkpointing.restart_count()}/", store)
    else:
        store = dist.HashStore()  # a world of one
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        prep, control = side_groups(cfg, backend, timeout)
        train(cfg, rank, local_rank, world_size, micro_batch, device, dtype, prep, control)
    finally:
        dist.destroy_process_group()  # on every exit path, errors included


def train(cfg, rank, local_rank, world_size, micro_batch, device, dtype, prep, control):
    # ---- data: load, split, tokenizer, tokenize once (cached by `datasets`) ----
    ckpt = on_all_ranks(lambda: checkpointing.check_out_dir(cfg.out_dir, cfg.resume), prep)  # refuses to overwrite a run; loads it on --resume
    train_text, val_text = on_all_ranks(lambda: training.load_text(cfg), prep, first=local_rank == 0)
    # one tokenizer for the whole job: rank 0 trains (or loads) it and sends it to all
    tokenizer = Tokenizer.from_str(from_rank0(
        lambda: training.get_tokenizer(cfg, train_text, resuming=ckpt is not None).to_str(), prep))
    train_ds, val_ds = on_all_ranks(lambda: training.make_datasets(cfg, tokenizer, train_text, val_text),
                                    prep, first=local_rank == 0)
    steps_per_epoch = len(train_ds) // cfg.batch_size  # full global batches only
    total_steps = training.total_steps(cfg, steps_per_epoch)

    # ---- model and optimizer ----
    raw_model = training.build_model(cfg, tokenizer.get_vocab_size(), dtype).to(device)
    if cfg.compile:
        raw_model.compile()  # in place: the state_dict keeps its keys (no `_orig_mod.` prefix)
    optimizer, scheduler = training.make_optimizer(raw_model, cfg, total_steps)
    step = 0
    if ckpt:
        training.check_resume(ckpt, cfg, raw_model, steps_per_epoch)
        step = checkpointing.restore(ckpt, raw_model, optimizer, scheduler)
        if rank == 0:
            print(f"resumed from {ckpt['path']} at step {step} (restart {checkpointing.restart_count()})")
    if rank == 0:  # every file is written by rank 0 only
        checkpointing.write_run_files(cfg.out_dir, tokenizer, raw_model)  # every check has passed
    # DDP: one replica per process; gradients are all-reduced during backward
    model = DDP(raw_model, device_ids=[local_rank] if device.type == "cuda" else None, **DDP_OPTIONS)

    # Each rank reads every world_size-th sample of one shared permutation, so the ranks'
    # batches together are exactly the global batch that train_dp.py sees at this step.
    sampler = ResumableDistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                          seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=micro_batch, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    val_loader = training.val_loader(val_ds, rank=rank, world_size=world_size, batch_size=micro_batch)
    metrics = training.MetricsLog(cfg.out_dir, enabled=rank == 0, resume_step=step)
    writer = checkpointing.CheckpointWriter(cfg.out_dir, cfg.keep_checkpoints)
    stop = training.StopSignal()  # SIGTERM/SIGUSR1: finish the step, save, exit 0
    if rank == 0:
        print(f"{raw_model.num_parameters() / 1e6:.1f}M parameters | {len(train_ds)} training sequences | "
              f"{steps_per_epoch} steps per epoch | {total_steps} steps | {micro_batch} sequences x "
              f"{cfg.grad_accum} micro-steps per step x {world_size} ranks | device {device} ({dist.get_backend()}) "
              f"| {dtype}{' | compiled' if cfg.compile else ''}")

    # ---- training loop ----
    out = Path(cfg.out_dir)
    last_step = min(total_steps, cfg.stop_at_step or total_steps)
    train_totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets] since last log
    pbar = tqdm(total=total_steps, initial=step, dynamic_ncols=True, disable=rank != 0)
    flops_per_token = raw_model.flops_per_token(cfg.seq_len)
    peak = training.peak_tflops(device, dtype, n_devices=world_size)  # for MFU
    loader_iter, t0, steps_timed, preempted = None, time.perf_counter(), 0, False
    first_step, started, loss, val_loss = step, t0, None, None  # for the summary at the end
    while step < last_step:
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        if loader_iter is None or step_in_epoch == 0:
            # a new epoch reshuffles; a resumed run skips the samples it has already seen
            sampler.set_epoch(epoch, start=step_in_epoch * micro_batch * cfg.grad_accum)
            loader_iter = iter(loader)
        batches = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                   for x, y in (next(loader_iter) for _ in range(cfg.grad_accum))]
        # Real (non-pad) targets in this whole optimizer step. Dividing each micro-batch's
        # summed loss by this count weighs every token the same, however many pads there are.
        n_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
        dist.all_reduce(n_tokens)  # DDP: count the targets of every rank's share of the step
        for i, (x, y) in enumerate(batches):
            # Only the last micro-step all-reduces gradients; the others accumulate locally.
            # no_sync must wrap forward too, not just backward, or DDP syncs anyway.
            with model.no_sync() if i < cfg.grad_accum - 1 else contextlib.nullcontext():
                loss_sum = model(x, y)[0].sum()
                # DDP averages gradients over ranks; times world_size makes that a sum, so
                # every token in the global step weighs the same, as in one process.
                (loss_sum * world_size / n_tokens).backward()
            train_totals[0] += loss_sum.detach()
        train_totals[1] += n_tokens
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        steps_timed += 1
        pbar.update()
        # The signal reaches the ranks at different moments; one tiny all-reduce per step
        # makes all of them stop after the same step instead of racing.
        flag = torch.tensor([stop.requested], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
        preempted = bool(flag.item())

        if step % cfg.log_every == 0 or step == last_step:
            dist.all_reduce(train_totals[:1])  # loss sums of every rank (the counts are global already)
            loss = (train_totals[0] / train_totals[1]).item()  # token-weighted mean since last log
            speed = training.throughput(time.perf_counter() - t0, steps_timed, cfg, train_totals[1].item(),
                                        flops_per_token, peak)
            metrics.write(step=step, epoch=epoch, loss=loss, lr=lr, **speed)
            pbar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed['tokens_per_s']:,.0f}",
                             tflops=f"{speed['tflops']:.3g}", **({"mfu": f"{speed['mfu']:.1%}"} if peak else {}))
            train_totals.zero_()
            t0, steps_timed = time.perf_counter(), 0
        pause = time.perf_counter()  # saving and evaluation do not count as training time
        if (step % cfg.save_every == 0 or step == last_step or preempted) and rank == 0:
            # One writer, and no collective or DDP call inside this branch. The write runs in
            # a background thread, so the other ranks never wait in a collective for the disk.
            writer.save(checkpointing.checkpoint_state(raw_model, optimizer, scheduler, cfg, step, steps_per_epoch))
        if preempted:
            break
        if step % cfg.eval_every == 0 or step == last_step:
            totals = training.evaluate(raw_model, val_loader, device)  # the plain module: no DDP hooks
            dist.all_reduce(totals)  # [loss sum, targets] over every rank's shard
            val_loss = (totals[0] / totals[1]).item()
            metrics.write(step=step, epoch=epoch, val_loss=val_loss)
            if rank == 0:  # tqdm.write prints even where the bar is disabled
                tqdm.write(f"step {step}: val loss {val_loss:.4f}")
        t0 += time.perf_counter() - pause
    pbar.close()
    writer.wait()  # the last checkpoint is on disk before we go on

    if rank == 0 and step == total_steps:
        checkpointing.atomic_save(raw_model.state_dict(), out / checkpointing.MODEL)  # not model.state_dict(): no `module.`
    if rank == 0:
        print(training.summary(cfg, step, total_steps, first_step, time.perf_counter() - started, loss, val_loss,
                               preempted))


if __name__ == "__main__":
    training.run(main)
