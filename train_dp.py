"""Train the Llama model in ONE process, with nn.DataParallel when several GPUs are visible.

    python train_dp.py                 # the tiny demo: embedded corpus, a few minutes on a CPU
    python train_dp.py --model article --dataset HuggingFaceFW/fineweb --dataset-config sample-10BT

nn.DataParallel runs everything from one Python process: every forward it copies the model
from GPU 0 to each GPU, splits the batch, runs the replicas in threads, and gathers their
outputs and gradients back on GPU 0. With one device there is nothing to split.
Each rung is its diff with the one before: `diff train_dp.py train_ddp.py`, then train_fsdp.py.
"""

import math
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from tqdm import tqdm

import data
from model import IGNORE_INDEX
from training import build, config, evaluation, launch, memory, metrics, profiling, read_ahead, resume, run_data
from training import checkpoint, pt_checkpoint, run_folder, stopping  # saving and stopping


def main():
    cfg = config.parse_args(description=__doc__)
    rank, world_size = 0, 1  # one process, however many GPUs it drives
    is_main = True  # the one process that prints, logs and writes files
    device = torch.device("cuda" if launch.use_cuda(cfg) else "cpu")  # a GPU torch cannot see is an error
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    micro_batch = config.micro_batch_size(cfg, world_size)  # per process and micro-step
    dtype = launch.compute_dtype(cfg.dtype, device)  # matmuls in dtype; weights and loss stay fp32

    # ---- data: load, split, tokenizer, tokenize once (cached by `datasets`) ----
    # real jobs: a model too big for this device's memory is refused once the vocabulary is known
    model_fits = memory.Check(cfg, micro_batch, dtype, device)
    ckpt, tokenizer, train_ds, val_ds = run_data.prepare(cfg, model_fits=model_fits)
    steps_per_epoch = len(train_ds) // cfg.batch_size  # full global batches only
    total_steps = config.total_steps(cfg, steps_per_epoch)

    # ---- model and optimizer ----
    raw_model = build.model(cfg, tokenizer.get_vocab_size(), dtype).to(device)
    if cfg.compile:
        raw_model.compile()  # in place: the state_dict keeps its keys (no `_orig_mod.` prefix)
    optimizer, scheduler = build.optimizer(raw_model, cfg, total_steps)
    divergence = stopping.Divergence(cfg, tokenizer.get_vocab_size(), ckpt)  # real jobs: stops a run gone bad
    step = resume.from_checkpoint(ckpt, cfg, raw_model, optimizer, scheduler, steps_per_epoch)  # 0 for a new run
    profiler = profiling.Profiler(cfg, rank, device, step, total_steps, raw_model)  # --profile: docs/profiling.md
    log = metrics.MetricsLog(cfg, enabled=is_main, resume_step=step, facts=train_ds.facts)  # and the trackers
    if is_main:
        run_folder.write_run_files(cfg.out_dir, tokenizer, raw_model)  # every check has passed
    # DataParallel: one process drives every visible GPU (uncompiled: config.py refuses --compile there)
    model = nn.DataParallel(raw_model) if gpus > 1 else raw_model

    if not cfg.stream:  # --stream: train_ds reads its own sub-streams, read_ahead() below (docs/streaming.md)
        # each epoch a permutation of seed + epoch alone: train_ddp.py deals the same one to its ranks
        sampler = data.ResumableRandomSampler(train_ds, seed=cfg.seed)
        loader = DataLoader(train_ds, batch_size=micro_batch, sampler=sampler, drop_last=True,
                            pin_memory=device.type == "cuda")
    val_loader = evaluation.val_loader(val_ds, rank, world_size, micro_batch)
    writer = pt_checkpoint.PtCheckpointWriter(cfg.out_dir, cfg.keep_checkpoints)
    stop = stopping.StopSignal()  # real jobs: SIGTERM/SIGUSR1/Ctrl-C: finish the step, save, exit 0
    if is_main:
        print(metrics.describe(raw_model, train_ds, steps_per_epoch, total_steps, micro_batch, cfg, device, dtype))

    # ---- training loop ----
    last_step = min(total_steps, cfg.stop_at_step or total_steps)
    train_totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets] since last log
    pbar = tqdm(total=total_steps, initial=step, dynamic_ncols=True, disable=not is_main)
    peak = metrics.peak_tflops(device, dtype, n_devices=metrics.devices_in_use(model))  # for MFU
    speedometer = metrics.Speedometer(cfg, raw_model.flops_per_token(cfg.seq_len), peak, device,
                                      tokens_seen=train_ds.targets_before(step, cfg.batch_size, cfg.seed))
    batches, preempted, started = None, False, time.perf_counter()
    first_step = step  # for the summary at the end
    while step < last_step:
        profiler.begin(step + 1)  # --profile: traces a few steps; without it, nothing
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        if batches is None or step_in_epoch == 0:
            if cfg.stream:  # one feed for the whole run: each rank's sub-streams, read ahead from where they stand
                batches = train_ds.read_ahead(device, None)
            else:
                # a new epoch reshuffles; a resumed run skips the samples it has already seen
                sampler.set_epoch(epoch, start=step_in_epoch * micro_batch * cfg.grad_accum)
                # a thread reads each step's micro-batches onto the device while the step before runs
                batches = read_ahead.ReadAhead(loader, cfg.grad_accum, device,
                                               steps=min(steps_per_epoch - step_in_epoch, last_step - step))
        with speedometer.waiting():  # for data_wait_fraction
            micro_batches = next(batches)
        # Real (non-pad) targets in this whole optimizer step. Dividing each micro-batch's
        # summed loss by this count weighs every token the same, however many pads there are.
        n_tokens = sum((y != IGNORE_INDEX).sum() for _, y, *_ in micro_batches)
        for x, y, *packing in profiler.micro_steps(micro_batches):  # packing: --pack's, else none (model.py)
            loss_sum = model(x, y, *packing)[0].sum()  # DataParallel: inputs split by row, a sum per GPU
            (loss_sum / n_tokens).backward()  # gradients accumulate over the micro-batches
            train_totals[0] += loss_sum.detach()
        train_totals[1] += n_tokens

        # ---- the optimizer step: clip, step, next LR, clear gradients ----
        # the gradient norm before clipping, logged as grad_norm (max_norm inf: no clipping)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        speedometer.step()
        pbar.update()
        preempted = stop.requested

        if step % cfg.log_every == 0 or step == last_step:
            loss = (train_totals[0] / train_totals[1]).item()  # token-weighted mean since last log
            norm = grad_norm.item()  # this step's
            divergence.check(step, loss, norm)  # real jobs: a loss or norm gone bad stops the run
            row = speedometer.row(step, epoch, loss, lr, norm, nonpad_tokens=train_totals[1].item())
            log.write(row)  # to metrics.jsonl, and TensorBoard and W&B if asked for
            pbar.set_postfix(metrics.progress(row))
            train_totals.zero_()
        saving = step % cfg.save_every == 0 or step == last_step or preempted
        evaluating = (step % cfg.eval_every == 0 or step == last_step) and not preempted
        # saving, evaluating and writing a trace (--profile) do not count as training time
        with speedometer.paused(saving or evaluating or profiler.writes_after(step)):
            if saving:
                divergence.check_weights(step, raw_model)  # real jobs: on every rank, before saving
                if cfg.stream:  # every rank's sub-stream positions, to rank 0 (a collective)
                    train_ds.gather(batches)
            if saving and is_main:
                writer.save(raw_model, optimizer,
                            checkpoint.run_state(raw_model, scheduler, cfg, step, train_ds, divergence))
            if evaluating:
                totals = evaluation.evaluate(raw_model, val_loader, device)  # the plain module: no wrapper
                val_loss = (totals[0] / totals[1]).item()
                val_bpb = evaluation.bits_per_byte(totals[0], val_ds)  # per byte of text: comparable across tokenizers
                log.write({"step": step, "val_loss": val_loss, "val_bpb": val_bpb})
                if is_main:  # tqdm.write prints even where the bar is disabled
                    tqdm.write(f"step {step}: val loss {val_loss:.4f} | {val_bpb:.4f} bits per byte")
            profiler.end(step, writer)  # after the last traced step: the trace, once the checkpoint is on disk
        if preempted:
            break
    pbar.close()
    writer.wait()  # the last checkpoint is on disk before we go on
    profiler.finish()  # a run stopped within the traced steps: what it traced, in the room every rank's checkpoint left

    if step == total_steps:  # the whole model's weights, for generate.py and export_hf.py
        full_state = raw_model.state_dict()  # raw_model, not model: no `module.` prefix in the keys
    if is_main:
        if step == total_steps:
            run_folder.save_model(cfg.out_dir, full_state)
        trained = speedometer.trained + round(train_totals[1].item())  # and the steps since the last log
        seconds = time.perf_counter() - started - profiler.writing_seconds  # writing a trace is not training
        print(metrics.summary(cfg, step, total_steps, first_step, trained, seconds, log.latest, preempted,
                              writer.checkpoint_at(step)))
    log.close()  # the trackers' last writes (a W&B upload), once no rank waits for this one


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)  # real jobs: bad input is one line on stderr and exit status 2
