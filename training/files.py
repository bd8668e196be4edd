"""Files written whole or not at all, and read without running code. Every file a run
writes goes through atomic_save (or atomic_write); every .pt file it reads, through load_pt.
"""

import errno
import os
import shutil
from pathlib import Path

import torch

from training import corpus
from training.errors import UsageError, first_line


def atomic_save(obj, path: Path):
    """Write to a temp file, flush it to disk, then rename: a crash mid-write leaves the
    previous file intact, never a torn one. A failed write removes its temp file, and a
    full disk is one line that says where and how much space is missing."""
    atomic_write(path, lambda f: f.write(obj.encode()) if isinstance(obj, str) else torch.save(obj, f), nbytes(obj))


def atomic_write(path: Path, write, needed: int):
    """atomic_save's guarantees for whatever write(f) puts in the open binary file f, about
    `needed` bytes (the full disk's line says so)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(e, path, needed)
        raise
    fsync_dir(path.parent)


def check_output(path: str, flag: str):
    """A file a script will write, checked before the work whose result it holds: its folder
    exists and this process may write there, and nothing but a file stands at its name (a FIFO
    would block the write, a folder fail it)."""
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: its folder does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: no permission to write in {folder}")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise UsageError(f"{flag} {path} exists and is not a file: choose another name")


def raise_if_disk_full(error: BaseException, path: Path, needed: int):
    """Turn a write that failed for want of space into one UsageError line."""
    message = disk_full(error, path, needed)
    if message:
        raise UsageError(message) from None


def disk_full(error: BaseException, path: Path, needed: int) -> str | None:
    """The line for a write of `needed` bytes to `path` that failed for want of space, or None
    if it failed for another reason."""
    full = out_of_space(error, path.parent, needed)
    if full is None:
        return None
    free, mount = full
    return (f"no space left to write {path} (on the disk mounted at {mount}): it needs about "
            f"{needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free. Free some space, then run again "
            "(with --resume if a checkpoint was saved)")


def out_of_space(error: BaseException, folder: Path, needed: int) -> tuple[int, Path] | None:
    """(the bytes free, where the disk is mounted) if a write of `needed` bytes into `folder`
    failed for want of space, else None. torch.save does not always say so itself ("unexpected
    pos"), nor does kineto, the profiler's exporter: then the free space decides."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < needed:
        return free, mounted_at(folder)
    return None


def mounted_at(folder: Path) -> Path:
    """Where the disk that holds folder is mounted."""
    return next(p for p in [folder.absolute(), *folder.absolute().parents] if os.path.ismount(p))


def nbytes(obj) -> int:
    """About how many bytes saving obj writes: its tensors' and strings' sizes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 8


def fsync_dir(folder: Path):
    """Make a rename within `folder` durable: the folder's own entry list, flushed to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_pt(path, what: str):
    """Read any .pt file of a run. weights_only: tensors and plain containers only, so a
    crafted file cannot run code; map_location: every rank loads onto the CPU instead of
    all onto GPU 0; mmap: the tensors stay in the file (the page cache, shared by every rank
    of a node) until they are copied where they belong, instead of a private copy of the
    weights and optimizer state in each rank's memory. A file that cannot be read is one
    UsageError line."""
    corpus.regular_file(path, what)  # a FIFO would block torch.load, a device feed it forever
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
            # torch.save's legacy format (_use_new_zipfile_serialization=False) cannot be
            # memory-mapped: read whole, as safely
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot load {what} {path}: {first_line(e)}") from None
