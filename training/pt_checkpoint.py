"""Checkpoints as one .pt file (train_dp.py, train_ddp.py): rank 0 holds the whole state and
writes checkpoint-<step>.pt, then makes checkpoint.pt a second name for it. Never torn:
written whole to a temp file, then renamed. Resumed from the newest one that can be read.
"""

import os
import shutil
from functools import partial
from pathlib import Path

import torch

from training import checkpoint, files
from training.errors import UsageError, warn
from training.run_folder import CHECKPOINT, numbered_checkpoints


def save_checkpoint(state: dict, out_dir, keep: int):
    """Write checkpoint-<step>.pt, then make checkpoint.pt a second name for it with one
    atomic rename, then delete all but the newest `keep` numbered checkpoints. At every
    moment checkpoint.pt is a complete checkpoint: the previous one or this one."""
    out = Path(out_dir)
    numbered = out / f"checkpoint-{state['step']:08d}.pt"
    files.atomic_save(state, numbered)
    link = out / (CHECKPOINT + ".tmp")
    link.unlink(missing_ok=True)  # a leftover of a crash
    try:
        os.link(numbered, link)
    except OSError:  # a file system without hard links
        shutil.copyfile(numbered, link)
    os.replace(link, out / CHECKPOINT)
    files.fsync_dir(out)
    for old in checkpoint.to_prune(numbered_checkpoints(out), numbered, keep):
        old.unlink()


def snapshot(model, optimizer, run_state: dict) -> dict:
    """The whole checkpoint, copied into CPU memory: training goes on changing the live tensors."""
    return _cpu_copy({"model": model.state_dict(),  # the plain module: no `module.` / `_orig_mod.` prefixes
                      "optimizer": optimizer.state_dict(), **run_state})


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class PtCheckpointWriter(checkpoint.CheckpointWriter):
    """checkpoint-<step>.pt and checkpoint.pt, from a background thread (see CheckpointWriter).
    Only rank 0 calls save(): no collective inside."""

    def _stage(self, model, optimizer, run_state: dict):
        return partial(save_checkpoint, snapshot(model, optimizer, run_state), self.out, self.keep)

    def checkpoint_at(self, step: int) -> Path:
        return self.out / CHECKPOINT


def load_latest_checkpoint(out_dir) -> dict:
    """checkpoint.pt or, if it cannot be read, the newest older checkpoint that can."""
    out = Path(out_dir)
    candidates = [out / CHECKPOINT, *reversed(numbered_checkpoints(out))]
    failures = []
    for path in (p for p in candidates if os.path.lexists(p)):  # a FIFO or a dangling link is one failure more
        try:
            ckpt = load_checkpoint(path)
        except UsageError as e:
            failures.append(str(e))
            continue
        if failures:
            warn(f"{failures[0]}; falling back to {path.name}")
        ckpt["path"], ckpt["inode"] = str(path), path.stat().st_ino
        return ckpt
    raise UsageError(failures[0] if failures else f"{out} holds no checkpoint")


def load_checkpoint(path) -> dict:
    ckpt = files.load_pt(path, "checkpoint")
    checkpoint.check_checkpoint(ckpt, path)
    return ckpt


def restore(ckpt: dict, model, optimizer, scheduler) -> int:
    """Load a checkpoint into freshly built objects (on every rank); return its step."""
    model.load_state_dict(ckpt["model"])  # copies into the parameters
    optimizer.load_state_dict(ckpt["optimizer"])
    # On the CPU the optimizer keeps the loaded tensors themselves, which live in the
    # checkpoint's memory-mapped file (files.load_pt): copies of its own let the file go, so that
    # its disk space is freed once a newer checkpoint replaces it.
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                state[key] = value.clone()
    return checkpoint.restore_run_state(ckpt, scheduler)
