"""Train the Llama model in ONE process, with nn.DataParallel when several GPUs are visible.

    python train_dp.py                 # the tiny demo: embedded corpus, a few minutes on a CPU
    python train_dp.py --model article --dataset HuggingFaceFW/fineweb --dataset-config sample-10BT

nn.DataParallel runs everything from one Python process. Every forward it copies the
model from GPU 0 to each GPU, splits the batch along dim 0, runs the replicas in threads,
gathers their outputs on GPU 0, and backward sums the gradients back onto GPU 0. That
replication every step, the one busy GPU 0 and Python's GIL are why train_ddp.py is
faster. Read `diff train_dp.py train_ddp.py` for what DDP changes. On a CPU or a single
GPU there is nothing to split and the model runs unwrapped.
"""

import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from tqdm import tqdm

import checkpointing
import training
from data import ResumableDistributedSampler, UsageError
from model import IGNORE_INDEX


def main():
    cfg = training.parse_args(description=__doc__)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world_size = 1  # one process, however many GPUs it drives
    micro_batch = training.check_batch(cfg, world_size)
    if cfg.compile and torch.cuda.device_count() > 1:
        raise UsageError("--compile does not work under nn.DataParallel: use train_ddp.py")
    dtype = training.compute_dtype(cfg.dtype, device)  # matmuls in dtype; weights and loss stay fp32

    # ---- data: load, split, tokenizer, tokenize once (cached by `datasets`) ----
    ckpt = checkpointing.check_out_dir(cfg.out_dir, cfg.resume)  # refuses to overwrite a run; loads it on --resume
    train_text, val_text = training.load_text(cfg)
    tokenizer = training.get_tokenizer(cfg, train_text, resuming=ckpt is not None)
    train_ds, val_ds = training.make_datasets(cfg, tokenizer, train_text, val_text)
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
        print(f"resumed from {ckpt['path']} at step {step} (restart {checkpointing.restart_count()})")
    checkpointing.write_run_files(cfg.out_dir, tokenizer, raw_model)  # every check has passed
    # DataParallel: one process drives every visible GPU
    model = nn.DataParallel(raw_model) if torch.cuda.device_count() > 1 else raw_model

    # The same sampler as DDP with a world of one: the order of global batches depends only
    # on the seed and the epoch, so this script and train_ddp.py train on the same batches.
    sampler = ResumableDistributedSampler(train_ds, num_replicas=1, rank=0, shuffle=True,
                                          seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=micro_batch, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    val_loader = training.val_loader(val_ds, rank=0, world_size=1, batch_size=micro_batch)
    metrics = training.MetricsLog(cfg.out_dir, enabled=True, resume_step=step)
    writer = checkpointing.CheckpointWriter(cfg.out_dir, cfg.keep_checkpoints)
    stop = training.StopSignal()  # SIGTERM/SIGUSR1: finish the step, save, exit 0
    print(f"{raw_model.num_parameters() / 1e6:.1f}M parameters | {len(train_ds)} training sequences | "
          f"{steps_per_epoch} steps per epoch | {total_steps} steps | {micro_batch} sequences x "
          f"{cfg.grad_accum} micro-steps per step | device {device} | {dtype}{' | compiled' if cfg.compile else ''}")

    # ---- training loop ----
    out = Path(cfg.out_dir)
    last_step = min(total_steps, cfg.stop_at_step or total_steps)
    train_totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets] since last log
    pbar = tqdm(total=total_steps, initial=step, dynamic_ncols=True)
    flops_per_token = raw_model.flops_per_token(cfg.seq_len)
    peak = training.peak_tflops(device, dtype, n_devices=training.devices_in_use(model))  # for MFU
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
        for x, y in batches:
            loss_sum = model(x, y)[0].sum()  # DataParallel returns one partial sum per GPU
            (loss_sum / n_tokens).backward()  # gradients accumulate over the micro-batches
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
        preempted = stop.requested

        if step % cfg.log_every == 0 or step == last_step:
            loss = (train_totals[0] / train_totals[1]).item()  # token-weighted mean since last log
            speed = training.throughput(time.perf_counter() - t0, steps_timed, cfg, train_totals[1].item(),
                                        flops_per_token, peak)
            metrics.write(step=step, epoch=epoch, loss=loss, lr=lr, **speed)
            pbar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed['tokens_per_s']:,.0f}",
                             tflops=f"{speed['tflops']:.3g}", **({"mfu": f"{speed['mfu']:.1%}"} if peak else {}))
            train_totals.zero_()
            t0, steps_timed = time.perf_counter(), 0
        pause = time.perf_counter()  # saving and evaluation do not count as training time
        if step % cfg.save_every == 0 or step == last_step or preempted:
            writer.save(checkpointing.checkpoint_state(raw_model, optimizer, scheduler, cfg, step, steps_per_epoch))
        if preempted:
            break
        if step % cfg.eval_every == 0 or step == last_step:
            totals = training.evaluate(raw_model, val_loader, device)
            val_loss = (totals[0] / totals[1]).item()
            metrics.write(step=step, epoch=epoch, val_loss=val_loss)
            tqdm.write(f"step {step}: val loss {val_loss:.4f}")
        t0 += time.perf_counter() - pause
    pbar.close()
    writer.wait()  # the last checkpoint is on disk before we go on

    if step == total_steps:
        checkpointing.atomic_save(raw_model.state_dict(), out / checkpointing.MODEL)
    print(training.summary(cfg, step, total_steps, first_step, time.perf_counter() - started, loss, val_loss,
                           preempted))


if __name__ == "__main__":
    training.run(main)
