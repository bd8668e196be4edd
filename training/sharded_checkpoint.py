"""Sharded checkpoints for train_fsdp.py, with torch.distributed.checkpoint (DCP): the sibling
of pt_checkpoint.py, over the same base (checkpoint.py).

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

import datetime
import io
import math
import os
import pickle
import shutil
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from training import checkpoint, corpus, files
from training.errors import UsageError, first_line, warn
from training.run_folder import sharded_checkpoints

TRAIN_STATE = "train_state.pt"


# ---- reading a checkpoint that may be hostile --------------------------------------------
# DCP reads .metadata with plain pickle and every non-tensor value in the shards (AdamW's
# hyperparameters) with torch.load(weights_only=False): either file, crafted, would run code
# on every rank at --resume. We read both ourselves: .metadata with an unpickler that builds
# only the classes DCP's metadata is made of, the values with weights_only=True.

_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: Path) -> Metadata:
    """A checkpoint folder's .metadata, read without running code, and checked against the
    folder: every shard file it names is there (a bare name in the folder) and long enough,
    and every non-tensor value in them loads with weights_only. Anything else is one
    UsageError line."""
    corpus.regular_file(path / ".metadata", "checkpoint metadata")  # a FIFO would block the read
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:
        raise UsageError(f"cannot read {path / '.metadata'}: {e}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UsageError(f"{path / '.metadata'} is not the metadata of a sharded checkpoint")
    for fqn, meta in metadata.state_dict_metadata.items():  # a weight saved as integers would be cast in silence
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if fqn.startswith("model.") and isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise UsageError(f"{path / '.metadata'}: {fqn.removeprefix('model.')} is saved as {dtype}, not floating "
                             "point: the checkpoint is damaged")
    for fqn, meta in metadata.state_dict_metadata.items():  # a piece left out loads nothing, in silence
        if isinstance(meta, BytesStorageMetadata):
            continue
        if problem := _pieces_problem(fqn, meta, metadata.storage_data):
            raise UsageError(f"{path / '.metadata'}: {fqn.removeprefix('model.')}'s pieces {problem}: the checkpoint "
                             "is damaged")
    sizes = {}
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise UsageError(f"{path / '.metadata'} names a shard outside its folder: {name!r}")
        if getattr(info, "transform_descriptors", None):  # compression and the like: we never write any
            raise UsageError(f"{path / '.metadata'} asks for transforms this trainer does not write")
        if name not in sizes:
            sizes[name] = (path / name).stat().st_size if (path / name).is_file() else None
        if sizes[name] is None:
            raise UsageError(f"{path / name} is missing: the checkpoint is incomplete")
        if not all(isinstance(n, int) and 0 <= n for n in (getattr(info, "offset", None), getattr(info, "length", None))):
            raise UsageError(f"{path / '.metadata'} gives {name} a negative or no offset or length: it is damaged")
        if info.offset + info.length > sizes[name]:
            raise UsageError(f"{path / name} is shorter than its .metadata says: the checkpoint is truncated")
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            with open(path / info.relative_path, "rb") as f:  # a few bytes: AdamW's lr, betas, ...
                f.seek(info.offset)
                value = io.BytesIO(f.read(info.length))
            try:
                torch.load(value, map_location="cpu", weights_only=True)
            except Exception as e:
                raise UsageError(f"cannot load {index.fqn} from {path / info.relative_path}: {first_line(e)}") from None
    return metadata


def _pieces_problem(fqn: str, meta, storage_data: dict) -> str | None:
    """What is wrong with the pieces .metadata names for one tensor (a rank's shard each, cut by
    FSDP and TP), or None: each within the tensor, with bytes in a shard file, and together
    covering each element once. DCP loads what the pieces cover and leaves the rest of each
    tensor as it was: a piece left out would resume with those elements as the fresh model
    drew them, without a word. (Pieces sorted by their first offset: only those still open
    along the first dimension can overlap the next.)"""
    size, chunks = getattr(meta, "size", None), getattr(meta, "chunks", None)
    if not (isinstance(size, torch.Size) and isinstance(chunks, list)):
        return "are not described as a tensor's"
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size) and len(offsets) == len(sizes) ==
                len(size) and all(0 <= o and 0 <= n and o + n <= whole for o, n, whole in zip(offsets, sizes, size))):
            return f"include one outside its shape {tuple(size)}"
        if MetadataIndex(fqn, offsets) not in storage_data:
            return f"include one at {tuple(offsets)} whose bytes no shard file holds"
        boxes.append((tuple(offsets), tuple(sizes)))
    if sum(math.prod(n) for _, n in boxes) != math.prod(size):
        return f"do not add up to its shape {tuple(size)}"
    open_boxes = []
    for offsets, sizes in sorted(boxes):
        open_boxes = [(o, n) for o, n in open_boxes if not size or o[0] + n[0] > offsets[0]]
        if any(all(a < b + m and b < a + k for a, k, b, m in zip(offsets, sizes, o, n)) for o, n in open_boxes):
            return "overlap"
        open_boxes.append((offsets, sizes))
    return None


class _SafeReader(FileSystemReader):
    """DCP's file reader, given the metadata read_metadata() checked instead of unpickling it."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.checked = read_metadata(Path(path))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.checked.storage_meta is None:
            self.checked.storage_meta = StorageMeta()
        self.checked.storage_meta.load_id = self.load_id  # as FileSystemReader sets it
        return self.checked


class _SafePlanner(DefaultLoadPlanner):
    """DCP's planner, loading the checkpoint's non-tensor values with weights_only=True."""

    def load_bytes(self, read_item, value):
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_latest_checkpoint(out_dir) -> dict:
    """The train state of the newest complete sharded checkpoint, or, if it cannot be read,
    of the newest older one that can. The shards themselves are read later, by restore(),
    once the model is sharded."""
    failures = []
    for path in reversed(sharded_checkpoints(Path(out_dir))):
        try:
            if not (path / ".metadata").is_file():
                raise UsageError(f"{path} has no .metadata: not a complete checkpoint")
            read_metadata(path)
            ckpt = files.load_pt(path / TRAIN_STATE, "checkpoint")
            checkpoint.check_checkpoint(ckpt, path / TRAIN_STATE, sharded=True)
        except UsageError as e:
            failures.append(str(e))
            continue
        for failure in failures:
            warn(f"{failure}; falling back to {path.name}")
        ckpt.update(path=str(path), inode=path.stat().st_ino, sharded=True)
        return ckpt
    raise UsageError(failures[0] if failures else f"{out_dir} holds no sharded checkpoint")


class ShardedCheckpointWriter(checkpoint.CheckpointWriter):
    """Saves sharded checkpoints without stalling training for the disk. save() is a
    collective: every rank copies its shards to CPU memory (the only part training waits
    for) and writes them from a background thread, coordinated over a gloo group of the
    writer's own, not over the group training uses. When all ranks have written, rank 0 adds
    the train state and renames the folder into place. Creating it is a collective too (the
    group)."""

    def __init__(self, out_dir: str, keep: int, timeout_minutes: float):
        super().__init__(out_dir, keep)
        # Its own group: the main thread's collectives go on meanwhile, on the training group.
        # A save's waits are bounded like a training collective's: a rank that dies mid-save
        # ends the others' wait within --timeout-minutes.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))

    def checkpoint_at(self, step: int) -> Path:
        return self.out / f"checkpoint-{step:08d}"

    def _stage(self, model, optimizer, train_state: dict):
        final = self.checkpoint_at(train_state["step"])
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
        nbytes = files.nbytes([model_state, optimizer_state, train_state])  # a DTensor counts its whole size
        return partial(self._finish, future, tmp, final, train_state, nbytes)

    def _finish(self, future, tmp: Path, final: Path, train_state: dict, nbytes: int):
        error = None
        try:
            future.result()  # this rank's shards are written; on rank 0, every rank's and .metadata too
            if dist.get_rank() == 0:
                files.atomic_save(train_state, tmp / TRAIN_STATE)
        except BaseException as e:
            error = e
        # Every rank learns whether any rank failed, and whether for want of space (which
        # only the rank that wrote can tell: the disk is full now, not once the partial
        # folder is gone), so that all of them stop with the same one line.
        outcome = (error is not None, error and files.disk_full(_own_failure(error), tmp, nbytes))
        outcomes = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(outcomes, outcome, group=self.group)
        if any(failed for failed, _ in outcomes):
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a full disk would stay full
            full = next((message for _, message in outcomes if message), None)
            if full:
                raise UsageError(full.replace(str(tmp), str(final)))
            raise error or UsageError(f"saving {final} failed on another rank")
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)  # only if a restarted run saves the same step again
            os.replace(tmp, final)  # the checkpoint becomes visible, complete
            files.fsync_dir(self.out)
            for old in checkpoint.to_prune(sharded_checkpoints(self.out), final, self.keep):
                shutil.rmtree(old)


def _own_failure(error: BaseException) -> BaseException:
    """What failed on this rank: DCP's CheckpointException carries every rank's failure."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and dist.get_rank() in failures:
        return failures[dist.get_rank()][0]
    return error


def restore(ckpt: dict, model, optimizer) -> None:
    """Load a sharded checkpoint into the sharded model and optimizer, resharding it when the
    world size changed. The templates come from get_state_dict: a fresh AdamW has no state
    yet, and its own state_dict() would be a template without the moments to load into."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    _load({"model": model_state, "optimizer": optimizer_state}, Path(ckpt["path"]))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def _load(state: dict, path: Path):
    """dcp.load from a folder whose .metadata read_metadata() checked (again: a UsageError line
    of its own), its failures one line: a shard whose bytes are not what .metadata says, a
    tensor of another shape. (DCP raises CheckpointException, which is no Exception.)"""
    reader = _SafeReader(path)
    try:
        with warnings.catch_warnings():  # in one process without a process group, DCP warns that it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=_SafePlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        cause = next(iter(getattr(e, "failures", {}).values()), e)  # CheckpointException: each rank's error
        cause = cause[0] if isinstance(cause, tuple) else getattr(cause, "exc", cause)
        raise UsageError(f"cannot load {path}: {first_line(cause)}: the checkpoint is damaged; move it away (to "
                         "resume from the one before it)") from None


def model_shapes(ckpt: dict) -> dict:
    """The shape of every model weight in a sharded checkpoint, from its .metadata."""
    metadata = read_metadata(Path(ckpt["path"])).state_dict_metadata
    return {name.removeprefix("model."): getattr(meta, "size", None) for name, meta in metadata.items()
            if name.startswith("model.")}


def load_model(path: Path, model) -> None:
    """The weights alone (no optimizer state) of a sharded checkpoint folder, into a model
    sharded in any way or whole: DCP reads each rank's part of every tensor (the whole of it
    in one process without a process group: generate.py, export_hf.py, an --init-from)."""
    state = {"model": get_model_state_dict(model)}
    _load(state, path)
    set_model_state_dict(model, state["model"])


def full_model_state(model) -> dict:
    """The whole model as a plain state_dict on rank 0's CPU (an empty dict on the others),
    gathered one tensor at a time: what model.pt holds for every script. All ranks call it."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if model.config.tie_word_embeddings and state:  # gathered twice, one tensor: saved once, as the others save it
        state["lm_head.weight"] = state["base_model.embed_tokens.weight"]
    return state
