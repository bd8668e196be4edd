"""Continuing a run: whether this run continues the one in --out-dir (--resume, or torchrun
restarting failed workers), from which checkpoint (the newest that can be read), and
restoring it exactly: the same model, data, batch and schedule, or one line saying what
changed.
"""

import dataclasses
import math
import os
from pathlib import Path

import data
from training import checkpoint, pt_checkpoint, stopping, weights
from training.config import TrainConfig
from training.errors import UsageError, first_line, is_rank0
from training.launch import restart_count
from training.metrics import read_metrics
from training.run_folder import (CHECKPOINT, FOLDERS, METRICS, MODEL, RUN_FILES, numbered_checkpoints,
                                 sharded_checkpoints)


def resuming(out_dir: str, resume: bool) -> bool:
    """Whether this run continues the one in out_dir: on --resume, or when torchrun restarts
    the job after a failure. Checked before anything is written: a new run refuses a folder
    that holds another run."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out-dir {out} exists and is not a folder")
    # where the run writes a file, a folder or a FIFO would fail its write after training
    files = [out / name for name in RUN_FILES if name not in FOLDERS] + numbered_checkpoints(out)
    if in_the_way := next((p for p in files if os.path.lexists(p) and not p.is_file()), None):
        raise UsageError(f"{in_the_way} is not a regular file, and this run writes a file there: move it away")
    checkpoints = [p for p in [out / CHECKPOINT, *numbered_checkpoints(out)] if p.is_file()]
    checkpoints += sharded_checkpoints(out)
    if resume or (restart_count() and checkpoints):
        if not checkpoints:
            raise UsageError(f"nothing to resume: {out} holds no checkpoint")
        return True
    if restart_count():
        return False  # killed before its first checkpoint: start again over this job's own files
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if checkpoints or (out / MODEL).exists():
        raise UsageError(f"{out} already holds a run ({', '.join(existing) or checkpoints[0].name}): "
                         "pass --resume to continue it, or choose another --out-dir")
    if existing:
        raise UsageError(f"{out} holds files of a run that never saved a checkpoint "
                         f"({', '.join(existing)}): delete them, or choose another --out-dir")
    return False


def load_run(out_dir: str, sharded: bool = False) -> dict:
    """What a resumed run continues: its newest readable checkpoint, and a metrics.jsonl
    that can be read (the run appends to it). sharded: train_fsdp.py's and train_tp.py's checkpoints."""
    read_metrics(Path(out_dir) / METRICS)
    out = Path(out_dir)
    has_sharded = bool(sharded_checkpoints(out))
    if sharded and not has_sharded:
        raise UsageError(f"{out} holds checkpoints of train_dp.py/train_ddp.py, not sharded ones: continue that "
                         "run with train_ddp.py (or train_dp.py)")
    if not sharded and has_sharded:
        raise UsageError(f"{out} holds sharded checkpoints of train_fsdp.py or train_tp.py: continue that run with "
                         "either (each resumes the other's)")
    if sharded:
        from training import sharded_checkpoint  # as in from_checkpoint(): only train_fsdp.py needs DCP
        return sharded_checkpoint.load_latest_checkpoint(out)
    return pt_checkpoint.load_latest_checkpoint(out)


def from_checkpoint(ckpt: dict | None, cfg: TrainConfig, model, optimizer, scheduler, steps_per_epoch: int) -> int:
    """Load a checkpoint into freshly built objects (on every rank) and return its step; 0
    for a new run. A resumed run must be the same run: same model, data, global batch and
    schedule (the flags marked same_on_resume). Once restored, ckpt is emptied, so that no
    rank keeps a second copy of the weights and optimizer state for the whole run."""
    if ckpt is None:
        return 0
    all_epochs = cfg.epochs * steps_per_epoch
    if ckpt["step"] > (last := min(cfg.max_steps, all_epochs) if cfg.max_steps else all_epochs):
        raise UsageError(f"{ckpt['path']} is at step {ckpt['step']}, past this run's last step ({last}): the "
                         "checkpoint is damaged; move it away to resume from the one before it")
    for f in dataclasses.fields(cfg):  # the flags first: they name what changed in the user's words
        was, now = ckpt["train_config"].get(f.name), getattr(cfg, f.name)
        if f.name == "vocab_size" and now is None:  # not given: the run's own tokenizer.json decides it
            cfg.vocab_size = was  # and its checkpoints keep recording what the run was started with
            continue
        if f.metadata["same_on_resume"] and was != now:
            raise UsageError(f"--{f.name.replace('_', '-')} was {was!r} in the checkpoint's run, now {now!r}: "
                             "resume with the same value")
    ours = dataclasses.asdict(model.config)
    for key, value in ckpt["model_config"].items():
        if ours.get(key) != value:
            raise UsageError(f"checkpoint's model has {key}={value}, this run's has {ours.get(key)}")
    if ckpt.get("framing") not in (data.FRAMING, data.PACKED_FRAMING):  # each document's first seq_len tokens
        raise UsageError(f"{Path(ckpt['path']).name} was trained on documents clipped to one row each (an earlier "
                         "version of this trainer); this one trains on every token, in windows: start a new run")
    if ckpt["framing"] != data.framing(cfg.pack):  # other rows: its data position would point elsewhere
        packed = ckpt["framing"] == data.PACKED_FRAMING
        raise UsageError(f"{Path(ckpt['path']).name} was trained {'with' if packed else 'without'} --pack "
                         f"(its rows hold {'several windows' if packed else 'one window'} each): resume "
                         f"{'with' if packed else 'without'} --pack")
    if ckpt["steps_per_epoch"] != steps_per_epoch:
        raise UsageError(f"the dataset changed since the checkpoint ({steps_per_epoch} steps per epoch, "
                         f"was {ckpt['steps_per_epoch']})")
    if not ckpt.get("sharded") and (name := weights.unusable_weight(ckpt["model"])):  # int: cast in silence
        raise UsageError(f"{ckpt['path']}: {name} is not finite floating point (NaN, inf or integers): the "
                         "checkpoint is damaged; move it away to resume from the one before it")
    try:  # what the checks above cannot see (a weight's shape, a moment's, a generator state) torch refuses
        if ckpt.get("sharded"):  # train_fsdp.py's: every rank reads the shards it needs, resharding them
            from training import sharded_checkpoint  # here: DCP takes 0.7 s to import, which DP and DDP never need
            sharded_checkpoint.restore(ckpt, model, optimizer)
            step = checkpoint.restore_run_state(ckpt, scheduler)
        else:
            step = pt_checkpoint.restore(ckpt, model, optimizer, scheduler)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise UsageError(f"{ckpt['path']} cannot be restored ({first_line(e)}): the checkpoint is damaged; move it "
                         "away to resume from the one before it") from None
    lrs = [group["lr"] for group in optimizer.param_groups] + list(scheduler.base_lrs)
    rates_finite = all(isinstance(lr, float) and math.isfinite(lr) for lr in lrs)
    if not stopping.weights_finite(model, optimizer) or not rates_finite:
        # a run saves only finite weights, moments and rates: these were damaged since
        raise UsageError(f"{ckpt['path']} holds weights or optimizer state that are not finite: the checkpoint is "
                         "damaged; move it away to resume from the one before it")
    if is_rank0():
        print(f"resumed from {ckpt['path']} at step {step} (restart {restart_count()})")
    ckpt.clear()  # all of it is in the model, optimizer and scheduler now: let the loaded file go
    return step
