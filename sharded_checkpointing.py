"""Sharded checkpoints for train_fsdp.py, with torch.distributed.checkpoint (DCP).

Under FSDP no rank holds the whole model or optimizer, and none should gather them to save:
every rank writes its own shards, in parallel. A checkpoint is a folder:

    out/checkpoint-00000400/
        __0_0.distcp  __1_0.distcp  ...   the model and AdamW shards of rank 0, rank 1, ...
        .metadata                         which piece of which tensor is where (written last)
        train_state.pt                    step, data position, scheduler, RNG, configs (small)

It is written as checkpoint-<step>.tmp/ and renamed once every rank has written its part,
so a folder with the final name is always complete. DCP reshards on load: a checkpoint
saved by N ranks resumes on any number of ranks.
"""

import os
import shutil
import threading
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from checkpointing import CheckpointWriter, _fsync_dir, atomic_save, load_pt, sharded_checkpoints
from errors import UsageError
from launcher import warn

TRAIN_STATE = "train_state.pt"


def load_latest_checkpoint(out_dir) -> dict:
    """The train state of the newest complete sharded checkpoint, or, if it cannot be read,
    of the newest older one that can. The shards themselves are read later, by restore(),
    once the model is sharded."""
    failures = []
    for path in reversed(sharded_checkpoints(Path(out_dir))):
        try:
            if not (path / ".metadata").is_file():
                raise UsageError(f"{path} has no .metadata: not a complete checkpoint")
            ckpt = load_pt(path / TRAIN_STATE, "checkpoint")
            if not isinstance(ckpt, dict) or not {"step", "scheduler", "model_config", "train_config"} <= ckpt.keys():
                raise UsageError(f"{path / TRAIN_STATE} is not a checkpoint of this trainer")
        except UsageError as e:
            failures.append(str(e))
            continue
        if failures:
            warn(f"{failures[0]}; falling back to {path.name}")
        ckpt.update(path=str(path), inode=path.stat().st_ino, sharded=True)
        return ckpt
    raise UsageError(failures[0] if failures else f"{out_dir} holds no sharded checkpoint")


class ShardedCheckpointWriter(CheckpointWriter):
    """Saves sharded checkpoints without stalling training for the disk. save() is a
    collective: every rank copies its shards to CPU memory (the only part training waits
    for) and writes them from a background thread, coordinated over `group` (gloo), not over
    the group training uses. When all ranks have written, rank 0 adds the train state and
    renames the folder into place. One save at a time: the next one, and the end of the
    run, wait for the previous one (wait() is CheckpointWriter's)."""

    def __init__(self, out_dir: str, keep: int, group):
        super().__init__(out_dir, keep)
        self.out, self.group = Path(out_dir), group

    @property
    def latest(self) -> Path:
        return sharded_checkpoints(self.out)[-1]  # the newest folder: the one --resume reads

    def save(self, model, optimizer, train_state: dict):
        self.wait()
        final = self.out / f"checkpoint-{train_state['step']:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash
        dist.barrier(group=self.group)
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards (DTensors)
        # The writer stages the shards into CPU memory here, before async_save returns. It
        # copies nothing ahead from a GPU (per_thread_copy_ahead=0): by default DCP's writer
        # thread would, on GPU 0's stream whatever this rank's GPU, opening a CUDA context
        # there from every rank (0.3-0.5 GiB each) for tensors already in CPU memory.
        writer = FileSystemWriter(tmp, per_thread_copy_ahead=0)
        future = dcp.async_save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer,
                                process_group=self.group)
        self.thread = threading.Thread(target=self._finish, args=(future, tmp, final, train_state),
                                       name="checkpoint-writer")
        self.thread.start()

    def _finish(self, future, tmp: Path, final: Path, train_state: dict):
        try:
            future.result()  # this rank's shards are written; on rank 0, every rank's and .metadata too
            if dist.get_rank() == 0:
                atomic_save(train_state, tmp / TRAIN_STATE)
                shutil.rmtree(final, ignore_errors=True)  # only if a restarted run saves the same step again
                os.replace(tmp, final)  # the checkpoint becomes visible, complete
                _fsync_dir(self.out)
                for old in sharded_checkpoints(self.out)[:-self.keep]:
                    shutil.rmtree(old)
        except BaseException as e:  # re-raised in the training thread by wait()
            self.error = e


def restore(ckpt: dict, model, optimizer) -> None:
    """Load a sharded checkpoint into the sharded model and optimizer, resharding it when the
    world size changed. The templates come from get_state_dict: a fresh AdamW has no state
    yet, and its own state_dict() would be a template without the moments to load into."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=ckpt["path"])
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def full_model_state(model) -> dict:
    """The whole model as a plain state_dict on rank 0's CPU (an empty dict on the others),
    gathered one tensor at a time: what model.pt holds for every script. All ranks call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
