"""The files `datasets` caches beside the corpus and a run reads back: the windows and their
packing. Any of them may have been replaced, truncated or left by other code, so each is
checked when it is read back (its kind first: a FIFO would block the read forever, a folder
is no cache) and again while the run reads it (one changed in place is damaged data, said
in one line, never trained on).
"""

import hashlib
import inspect
import os
from pathlib import Path

import datasets
import pyarrow

from training.corpus import regular_file
from training.errors import RankError, first_line, warn


def code_hash(*functions) -> str:
    """A hash of the functions' source, for a cache key: `datasets` hashes a function by its
    name and module, not by what it or the functions it calls do, so a cache made by the code
    before an edit would be taken for the edited code's."""
    return hashlib.blake2b("".join(inspect.getsource(f) for f in functions).encode(), digest_size=16).hexdigest()


def cached_map(ds: datasets.Dataset, key: str, what: str, again: str, wrong, **map_kwargs) -> datasets.Dataset:
    """ds.map(**map_kwargs), cached by `datasets` beside ds under `key` (a hash of everything
    that decides the result), and read back checked. A cache file that is not a regular file is
    refused in one line before anything reads it: it is someone's, and never replaced. One that
    cannot be read, or whose rows are wrong (`wrong` says what is wrong with them, or None), is
    made again, with a warning: "{what} {file} {problem}: {again}"."""
    folder = Path(ds.cache_files[0]["filename"]).parent if ds.cache_files else None
    files = sorted(folder.glob(f"cache-{key}*.arrow")) if folder else []  # num_proc > 1: one a process
    for f in files:
        regular_file(f, what)

    def mapped(reuse: bool) -> datasets.Dataset:
        return ds.map(**map_kwargs, new_fingerprint=key, load_from_cache_file=reuse)
    if files:
        try:
            result = mapped(reuse=True)
            problem = wrong(result)
        except (OSError, pyarrow.ArrowException, KeyError, TypeError, ValueError) as e:  # truncated, another schema
            problem = f"cannot be read ({first_line(e)})"
        if problem is None:
            return result
        warn(f"{what} {files[0] if len(files) == 1 else folder / f'cache-{key}_*.arrow'} {problem}: {again}")
    result = mapped(reuse=False)
    if problem := wrong(result):  # what this code made itself: a bug, never data
        raise RuntimeError(f"{what}, just made, {problem}")
    return result


def wrong_windows(targets, seq_len: int) -> str | None:
    """What is wrong with windows cut for seq_len, each with `targets` real targets (None:
    nothing): each holds 2 to seq_len + 1 tokens, a target at least. (Their type `datasets`
    checks as it reads them back.)"""
    if (targets < 1).any():
        return f"holds {(targets < 1).sum():,} windows without a target (fewer than 2 tokens)"
    if (targets > seq_len).any():
        return f"holds a window of {targets.max() + 1:,} tokens, more than --seq-len + 1 ({seq_len + 1})"
    return None


class ReadBack:
    """The cache files of a dataset as the run opened them, checked before each read: `datasets`
    maps them into memory, so a file truncated in place would kill the process with SIGBUS at
    the next read of a page it lost, and one overwritten in place (truncated and grown again:
    zeros) would be trained on. Replaced or removed, the mapping still holds the file that was
    opened: nothing to say. One os.stat a file a batch, on the host: it sees a change made
    before the batch is read (its size, or its time of change), not one made during the read
    or within the file system's time resolution at the same size."""

    def __init__(self, ds: datasets.Dataset, what: str):
        self.what = what
        self.opened = {}
        for f in ds.cache_files:
            try:
                self.opened[f["filename"]] = _identity(os.stat(f["filename"]))
            except FileNotFoundError:  # removed since `datasets` mapped it: the mapping holds what it read
                pass

    @property
    def name(self) -> str:
        return ", ".join(self.opened) or "(in memory)"

    def check(self):
        for path, opened in self.opened.items():
            try:
                now = _identity(os.stat(path))
            except FileNotFoundError:
                continue
            if now[0] == opened[0] and now != opened:  # the same file, written since it was opened
                how = f"{opened[1]:,} bytes, now {now[1]:,}" if now[1] != opened[1] else "written in place"
                raise self.damaged(f"it changed while this run read it ({how})")

    def damaged(self, problem: str | Exception) -> RankError:
        """The one line for data found damaged while the run reads it (`problem`: what is wrong, or
        what reading it raised). A RankError: the rank that read the row says it, whatever its number."""
        if isinstance(problem, Exception):
            problem = first_line(problem)
        return RankError(f"damaged data in {self.what} {self.name}: {problem}. Remove that cache (`datasets` makes "
                         "it again) and run again with --resume")


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns
