"""Train the Llama model with FSDP2 (fully_shard): one process per GPU, launched by torchrun.

    torchrun --standalone --nproc_per_node=4 train_fsdp.py     # 4 GPUs (or 4 CPU processes)
    torchrun --nnodes=2 --nproc_per_node=8 ... train_fsdp.py --replicas 2  # HSDP: shard in a node, replicate across

DDP keeps the whole weights, gradients and AdamW state (16 bytes a parameter) on every GPU;
FSDP keeps 1/N of each on each of N ranks, all-gathers a layer's weights only while it runs
(forward, then again in backward), and reduce-scatters its gradients. Checkpoints are sharded.
Each rung is its diff with the one before: `diff train_dp.py train_ddp.py`, then train_fsdp.py.
"""

import datetime
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader
from tqdm import tqdm

import data
from model import IGNORE_INDEX
from training import build, config, evaluation, launch, memory, metrics, profiling, read_ahead, resume, run_data
from training import checkpoint, run_folder, sharded_checkpoint, stopping, turns  # saving, stopping, data in turns


def shard(model, mesh, dtype: torch.dtype, layers_kept_gathered: int = 0):
    """FSDP: shard the model in place, in groups gathered whole only while they run: each layer
    (gathered again for backward), the embedding, the final norm with the LM head (kept into
    backward, which starts with them: bench_grouping.py). MixedPrecisionPolicy replaces
    autocast: gathered in `dtype` to compute, gradients reduced in fp32 into fp32 shards.
    layers_kept_gathered (a candidate, 0 until a GPU measured it): the last N layers stay gathered
    from forward into backward, 1 as torchtitan keeps the last (backward runs it next), all of
    them ZeRO-2's trade (no gather in backward); the price, their gathered weights held meanwhile."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = model.base_model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - layers_kept_gathered)
    if not model.config.tie_word_embeddings:  # tied, the one matrix is gathered by the root, for both
        fully_shard(model.base_model.embed_tokens, mesh=mesh, mp_policy=policy)
        fully_shard([model.base_model.norm, model.lm_head], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: starts each forward's gathers


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for FSDP's sharded gradients: the norm of the whole
    model's gradient (each rank's shards' squares summed over a replica's ranks: one
    all-reduce), returned, and every shard scaled by the same factor. benchmarks/step_rows.py's
    FSDP rows clip with it too."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads).full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def main():
    cfg = config.parse_args(distributed=True, sharded=True, description=__doc__)
    # torchrun tells each process who it is. RANK: its place in the whole job;
    # LOCAL_RANK: its place on this machine, which picks the GPU (RANK would pick GPU 5
    # on a 4-GPU node 2). Under plain `python` it is a world of one.
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    is_main = rank == 0  # the one process that prints, logs and writes files
    device = torch.device("cuda", local_rank) if launch.use_cuda(cfg) else torch.device("cpu")  # as in train_dp.py
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init, else every rank opens a context on GPU 0
    micro_batch = config.micro_batch_size(cfg, world_size)  # per process and micro-step
    dtype = launch.compute_dtype(cfg.dtype, device)  # matmuls in dtype; weights and loss stay fp32
    backend = cfg.backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, store=launch.job_store(cfg.timeout_minutes), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=cfg.timeout_minutes))  # join the job's processes
    prep, control = launch.side_groups(backend, cfg.timeout_minutes, cfg.data_timeout_minutes)  # real jobs: see there
    # FSDP: the ranks that share each tensor. With --replicas R (HSDP), a 2-D mesh: R replicas (one a
    # node) of world_size / R ranks each (a node's): each tensor is sharded within a replica, over the
    # node's fast links, and only the gradient shards' all-reduce between replicas crosses the network
    shape, names = config.mesh_shape(cfg.replicas, world_size)  # (world_size,), or (R, world_size / R)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)

    # ---- data: load, split, tokenizer, tokenize once (cached by `datasets`) ----
    # real jobs: local rank 0 of each node prepares the data first; the others then read its cache
    # real jobs: a model too big for this device's memory is refused once the vocabulary is known
    model_fits = memory.Check(cfg, micro_batch, dtype, device, shards=mesh.shape[-1])  # FSDP: 1/shards each
    ckpt, tokenizer, train_ds, val_ds = run_data.prepare(cfg, turns.InTurns(prep, local_rank),
                                                         model_fits=model_fits, sharded=True)
    steps_per_epoch = len(train_ds) // cfg.batch_size  # full global batches only
    total_steps = config.total_steps(cfg, steps_per_epoch)

    # ---- model and optimizer ----
    # FSDP: built on the meta device (no memory), sharded, then memory for this rank's shards
    # alone; each whole weight is drawn as one process draws it, and each rank keeps its shard.
    # float32, not dtype: under FSDP, MixedPrecisionPolicy (in shard) sets the compute dtype, not autocast
    raw_model = build.model(cfg, tokenizer.get_vocab_size(), torch.float32, device="meta")
    if cfg.compile:  # DDP: each layer and the LM head (with its loss) apart: see docs/ddp.md (FSDP: before sharding)
        for block in [*raw_model.base_model.layers, raw_model.lm_head]:
            block.compile()  # in place: the state_dict keeps its keys (no `_orig_mod.` prefix)
    shard(raw_model, mesh, dtype)  # in place
    raw_model.to_empty(device=device)
    build.init_weights(raw_model, cfg)  # FSDP: each rank now holds its shard of every weight
    optimizer, scheduler = build.optimizer(raw_model, cfg, total_steps)
    divergence = stopping.Divergence(cfg, tokenizer.get_vocab_size(), ckpt)  # real jobs: stops a run gone bad
    step = resume.from_checkpoint(ckpt, cfg, raw_model, optimizer, scheduler, steps_per_epoch)  # 0 for a new run
    profiler = profiling.Profiler(cfg, rank, device, step, total_steps, raw_model)  # --profile: docs/profiling.md
    log = metrics.MetricsLog(cfg, enabled=is_main, resume_step=step, facts=train_ds.facts)  # and the trackers
    if is_main:
        run_folder.write_run_files(cfg.out_dir, tokenizer, raw_model)  # every check has passed
    model = raw_model  # FSDP: sharded in place, no wrapper

    if not cfg.stream:  # --stream: train_ds reads its own sub-streams, read_ahead() below (docs/streaming.md)
        # each rank reads every world_size-th sample of the epoch's permutation: together, train_dp.py's batch
        sampler = data.ResumableDistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                                   seed=cfg.seed, drop_last=True)
        loader = DataLoader(train_ds, batch_size=micro_batch, sampler=sampler, drop_last=True,
                            pin_memory=device.type == "cuda")
    val_loader = evaluation.val_loader(val_ds, rank, world_size, micro_batch, same_length=True)  # FSDP: see there
    writer = sharded_checkpoint.ShardedCheckpointWriter(cfg.out_dir, cfg.keep_checkpoints, cfg.timeout_minutes)
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
                batches = train_ds.read_ahead(device, control)
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
        dist.all_reduce(n_tokens)  # count the targets of every rank's share of the step
        for i, (x, y, *packing) in enumerate(profiler.micro_steps(micro_batches)):  # see train_dp.py
            # FSDP: no no_sync. Every micro-step reduce-scatters into the shards (torchtitan's choice):
            # syncing only the last would save traffic but hold whole, unsharded gradients till then.
            # HSDP: the replicas' all-reduce of the shards, though, waits for the last (torchtitan#1929)
            model.set_requires_all_reduce(i == cfg.grad_accum - 1)
            loss_sum = model(x, y, *packing)[0].sum()
            (loss_sum * world_size / n_tokens).backward()  # FSDP averages over ranks too: times world_size, a sum
            train_totals[0] += loss_sum.detach()
        train_totals[1] += n_tokens

        # ---- the optimizer step: clip, step, next LR, clear gradients ----
        # the gradient norm before clipping, logged as grad_norm (max_norm inf: no clipping)
        grad_norm = clip_grad_norm(model, cfg.grad_clip or math.inf)  # FSDP: of the shards, above
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        speedometer.step()
        pbar.update()
        preempted = stopping.agreed(stop.requested, control)  # real jobs: every rank stops after the same step

        if step % cfg.log_every == 0 or step == last_step:
            dist.all_reduce(train_totals[:1])  # loss sums of every rank (the counts are global already)
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
                # FSDP: the check above all-reduces (the weights are shards), and every rank writes its
                # own shards, from a background thread after a copy in memory; no rank gathers the whole state
                writer.save(raw_model, optimizer,
                            checkpoint.run_state(raw_model, scheduler, cfg, step, train_ds, divergence))
            if evaluating:
                totals = evaluation.evaluate(raw_model, val_loader, device)  # the plain module: no wrapper
                dist.all_reduce(totals)  # [loss sum, targets] over every rank's shard
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
        full_state = sharded_checkpoint.full_model_state(raw_model)  # FSDP: a gather, so every rank calls it
    if is_main:
        if step == total_steps:
            run_folder.save_model(cfg.out_dir, full_state)
        trained = speedometer.trained + round(train_totals[1].item())  # and the steps since the last log
        seconds = time.perf_counter() - started - profiler.writing_seconds  # writing a trace is not training
        print(metrics.summary(cfg, step, total_steps, first_step, trained, seconds, log.latest, preempted,
                              writer.checkpoint_at(step)))
    log.close()  # the trackers' last writes (a W&B upload), once no rank waits for this one
    dist.destroy_process_group()


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)  # real jobs: bad input is one line on stderr and exit status 2
