"""What every checkpoint holds, and how it is saved without stalling training. Two formats
build on this, siblings that never import each other: pt_checkpoint.py (one .pt file,
written by rank 0: train_dp.py and train_ddp.py) and sharded_checkpoint.py (a folder of
every rank's shards: train_fsdp.py). Both load with weights_only=True: a file crafted to
run code on load is refused instead.
"""

import dataclasses
import math
import threading
from pathlib import Path

import torch

import data
from training import stopping
from training.errors import UsageError


def run_state(model, scheduler, cfg, step, train_ds, divergence) -> dict:
    """Everything in a checkpoint besides the model's and the optimizer's tensors."""
    steps_per_epoch = len(train_ds) // cfg.batch_size
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    return {
        "scheduler": scheduler.state_dict(),
        "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "steps_per_epoch": steps_per_epoch,
        "framing": data.framing(cfg.pack),  # how documents became rows: a resume needs the same rows
        "corpus": train_ds.corpus,  # what data the run trains on (corpus.fingerprint): a resume must match it
        "packing": train_ds.packing_fingerprint,  # --pack: which windows each row holds; a resume must find them
        # --stream: what the run reads and where each sub-stream stands (gathered from the ranks)
        "stream": train_ds.saved if cfg.stream else None,
        "highest_loss": list(divergence.highest),  # and its step: what stopping.Divergence has seen
        # Nothing in training draws random numbers after initialization (the data order comes
        # from seed + epoch), but saving the generators keeps any future dropout exact too.
        # The CUDA generator only where the model is on a GPU: reading it opens a CUDA context
        # (0.3-0.5 GiB of GPU 0), which a run with --device cpu on a GPU machine must not.
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if next(model.parameters()).device.type == "cuda" else None},
        "model_config": dataclasses.asdict(model.config),
        "train_config": dataclasses.asdict(cfg),
    }


def restore_run_state(ckpt: dict, scheduler) -> int:
    """What run_state saved, back in place; returns the step."""
    scheduler.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if ckpt["rng"]["cuda"] is not None and torch.cuda.is_initialized():  # a run on a GPU (see run_state)
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    return ckpt["step"]


# What run_state writes (and a .pt checkpoint adds: pt_checkpoint.snapshot), by kind: a resume reads each
RUN_STATE_KINDS = {"train_config": dict, "model_config": dict, "scheduler": dict, "rng": dict, "step": int,
                   "steps_per_epoch": int}


def check_checkpoint(ckpt, path, sharded: bool = False):
    """A checkpoint of this trainer holds what run_state wrote, of the kinds it wrote: anything
    else is one line here (and the run falls back to an older checkpoint), not a traceback
    later, nor a run that trains on from a step it never reached."""
    kinds = {**RUN_STATE_KINDS, **({} if sharded else {"model": dict, "optimizer": dict})}
    if not isinstance(ckpt, dict) or not kinds.keys() <= ckpt.keys():
        raise UsageError(f"{path} is not a checkpoint of this trainer")
    for key, kind in kinds.items():
        if not isinstance(ckpt[key], kind) or isinstance(ckpt[key], bool):
            raise UsageError(f"{path} is damaged: its {key} is not a {kind.__name__}, as this trainer saves it")
    if not isinstance(ckpt.get("packing"), (str, type(None))):
        raise UsageError(f"{path} is damaged: its packing is not a fingerprint, as this trainer saves it")
    highest = ckpt.get("highest_loss", [-math.inf, 0])  # (an older checkpoint has none: nothing seen)
    if not (isinstance(highest, list) and len(highest) == 2 and isinstance(highest[0], float)
            and not math.isnan(highest[0]) and type(highest[1]) is int):
        raise UsageError(f"{path} is damaged: its highest_loss is not a loss and a step, as this trainer saves it")
    if ckpt["step"] < 0 or ckpt["steps_per_epoch"] < 1 or not isinstance(ckpt.get("corpus", {}), (dict, type(None))):
        raise UsageError(f"{path} is damaged: step {ckpt['step']}, {ckpt['steps_per_epoch']} steps per epoch")


def room_to_keep(model) -> int:
    """About the most disk the run's own files still take once a trace is written, which
    --profile leaves free (training/profiling.py): a checkpoint (the weights and AdamW's two
    moments of each, all as the weights' dtype) and model.pt (the weights again), and 1 MiB
    for the rest (the run state, metrics rows). Every rank keeps it whole: the ranks may share
    the disk. Under FSDP a DTensor counts its whole size, not this rank's shard."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * weights + 2**20


def to_prune(checkpoints: list[Path], saved: Path, keep: int) -> list[Path]:
    """After `saved` is written: all but the newest `keep` of the checkpoints up to it. Newer
    ones (steps a run took before it was stopped and resumed from an older checkpoint, the
    newer one being unreadable) are left alone: pruning by count would delete the good
    checkpoints and keep the unreadable one, leaving nothing to resume from."""
    return checkpoints[:checkpoints.index(saved) + 1][:-keep]


class CheckpointWriter:
    """Saves checkpoints from a background thread: the training loop (and every other rank,
    which would wait for the saving one in the next collective) pays only for a copy of the
    state in memory, never for a slow disk. One save at a time: a disk slower than
    --save-every makes the next save wait for the previous one. Each format says what save()
    copies before it returns (_stage) and where a run stopped at a step resumes from."""

    def __init__(self, out_dir: str, keep: int):
        self.out, self.keep = Path(out_dir), keep
        self.thread, self.error = None, None
        # an error in the training loop lets a save in flight complete
        stopping.finish_before_exit(self.wait, "the checkpoint being saved")

    def save(self, model, optimizer, run_state: dict):
        """Checkpoint the model, the optimizer and run_state() (the step, the data position...)."""
        self.wait()
        write = self._stage(model, optimizer, run_state)  # what training may change from now on is copied
        self.thread = threading.Thread(target=self._in_background, args=(write,), name="checkpoint-writer")
        self.thread.start()

    def _in_background(self, write):
        try:
            write()
        except BaseException as e:  # re-raised in the training thread by wait()
            self.error = e

    def wait(self):
        """Block until the last checkpoint is on disk; raise if writing it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _stage(self, model, optimizer, run_state: dict):
        """Copy what is saved and return the function that writes it, in the background."""
        raise NotImplementedError

    def checkpoint_at(self, step: int) -> Path:
        """The checkpoint of a run stopped after `step` (saved then, or resumed from if it
        took no step), which --resume continues from: as the user is told it."""
        raise NotImplementedError
