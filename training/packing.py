"""--pack: the windows of data.py placed several to a row of seq_len positions, so that a
row is mostly tokens rather than padding. Which windows share a row is decided once (pack,
best-fit decreasing) and cached beside the windows; PackedSequenceDataset reads the rows,
each window with its positions from 0, and ops/packed_attention.py keeps each window to itself.
"""

import functools
import hashlib
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow.compute
import torch

from data import IGNORE_INDEX, PaddedSequenceDataset, window_targets
from training import caches
from training.errors import UsageError


def pack(windows: datasets.Dataset, seq_len: int, seed: int) -> datasets.Dataset:
    """Which windows each row of seq_len positions holds (column "windows": their indices),
    decided once: `datasets` caches it beside the windows, under a key of everything that
    decides it (the windows, seq_len, the seed and this file's packing code). A window fills
    as many positions as it has targets. Only the windows' lengths are read (from the Arrow
    column), so memory is a few integers a window, whatever their tokens.

    What the cache gives back is checked before it is used (caches.cached_map): every window
    exactly once, no row over seq_len positions. A cache file that is not a regular file is
    refused in one line; anything else is packed again, with a warning naming the file."""
    if len(windows) >= 2**31:
        raise UsageError(f"--pack: {len(windows):,} windows, more than one packing holds (2**31 - 1): "
                         "train on part of the corpus at a time, or without --pack")
    key = datasets.fingerprint.Hasher.hash([windows._fingerprint, seq_len, seed, PACKING_CODE])
    targets = window_targets(windows)
    rows = caches.cached_map(
        windows.with_format("arrow"), key, "--pack: the cached packing", "packing the windows again",
        lambda rows: wrong_rows(rows, targets, seq_len),
        function=_pack, batched=True, batch_size=None, remove_columns=windows.column_names,  # all windows at once
        fn_kwargs={"seq_len": seq_len, "seed": seed}, desc="packing",
        features=datasets.Features({"windows": datasets.Sequence(datasets.Value("uint32"))}))
    return rows.with_format(None)


def wrong_rows(rows: datasets.Dataset, targets: np.ndarray, seq_len: int) -> str | None:
    """What is wrong with a packing of windows whose targets are `targets` into rows of seq_len
    positions (None: nothing). It must hold every window exactly once (counted: a window in two
    rows would train twice an epoch), each row at least one, and no row more positions than
    seq_len."""
    column = rows.with_format("arrow")[:]["windows"].combine_chunks()  # uint32: `datasets` refuses a -1
    placed, per_row = column.flatten().to_numpy(), np.diff(column.offsets.to_numpy())
    if len(placed) and placed.max() >= len(targets):
        return f"places window {placed.max():,}, and the corpus has {len(targets):,}"
    counts = np.bincount(placed, minlength=len(targets))
    if (counts > 1).any():
        twice = int(np.argmax(counts > 1))
        return f"places window {twice:,} {counts[twice]:,} times ({(counts > 1).sum():,} windows more than once)"
    if (counts == 0).any():
        return f"leaves out {(counts == 0).sum():,} of the {len(targets):,} windows"
    if (per_row == 0).any():
        return f"holds {(per_row == 0).sum():,} empty rows"
    used = np.add.reduceat(targets[placed], np.cumsum(per_row) - per_row) if len(per_row) else per_row
    if (used > seq_len).any():
        return f"holds a row of {used.max():,} positions, more than --seq-len {seq_len}"
    return None


def _pack(table, seq_len: int, seed: int):
    import pyarrow as pa
    positions = pyarrow.compute.list_value_length(table["input_ids"]).to_numpy() - 1  # x = window[:-1]
    order, windows_per_row = best_fit_decreasing(positions, seq_len, seed)
    offsets = np.concatenate([[0], np.cumsum(windows_per_row)]).astype(np.int32)
    return pa.table({"windows": pa.ListArray.from_arrays(offsets, order.astype(np.uint32))})


def best_fit_decreasing(sizes: np.ndarray, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Bins of `capacity` for items of `sizes` (each 1 to capacity): the items, largest first,
    each into the fullest bin it fits (a new one if none), ties between items of one size
    broken by a shuffle of `seed`. Returns the items bin after bin, each bin's in the order
    they went in, and the number of items in each bin. Deterministic: the same sizes and seed
    give the same bins, on every rank.

    Sizes are integers up to capacity, so the items of one size are placed together: while
    the fullest bins that fit them (all with the same room) can take several each, they take
    as many as fit, as one at a time would; then the next fullest. A Python step per group,
    not per item: 1.2 million windows of FineWeb-shaped documents in 0.3 s."""
    n = len(sizes)
    shuffled = np.random.default_rng(seed).permutation(n)
    order = shuffled[np.argsort(-sizes[shuffled], kind="stable")]  # largest first; ties in the seed's order
    per_size = np.bincount(sizes, minlength=capacity + 1)
    bin_of = np.empty(n, dtype=np.int64)
    with_room = [[] for _ in range(capacity)]  # with_room[r]: the open bins with r positions free, oldest first
    bins = placed = 0
    for size in range(capacity, 0, -1):
        left = int(per_size[size])
        while left:
            room = next((r for r in range(size, capacity) if with_room[r]), capacity)  # the fullest that fits
            each = room // size  # items of this size one such bin takes
            if room == capacity:  # none fits: new bins
                targets, bins = list(range(bins, bins + -(-left // each))), bins + -(-left // each)
            else:
                k = min(len(with_room[room]), -(-left // each))
                targets, with_room[room] = with_room[room][:k], with_room[room][k:]
            taken = np.full(len(targets), each)
            taken[-1] = min(left, each * len(targets)) - each * (len(targets) - 1)  # the last may take fewer
            bin_of[order[placed:placed + taken.sum()]] = np.repeat(targets, taken)
            placed, left = placed + int(taken.sum()), left - int(taken.sum())
            for b, r in zip(targets, (room - taken * size).tolist()):
                if r:
                    with_room[r].append(b)
    by_bin = order[np.argsort(bin_of[order], kind="stable")]
    return by_bin, np.bincount(bin_of, minlength=bins)



# The code that decides the rows, in the packing's cache key: edited, it packs otherwise, and
# rows cached by the code before it must not be taken for its own (caches.code_hash)
PACKING_CODE = caches.code_hash(_pack, best_fit_decreasing)


def packed_rows(starts: np.ndarray, tokens: np.ndarray, per_row: np.ndarray, seq_len: int, pad_id: int,
                bounds: int) -> list[tuple[torch.Tensor, ...]]:
    """Rows of windows as PackedSequenceDataset's items, (x, y, position_ids, cu_seqlens) a row:
    the windows' tokens one after another (`tokens`, window i from starts[i] to starts[i + 1]),
    the first per_row[0] windows in the first row, and so on; cu_seqlens `bounds` long. The
    offline packing (PackedSequenceDataset) and the online one (training/stream/packer.py) make
    their rows here, so that the same windows make the same tensors. The caller has checked the
    rows: each fills at most seq_len positions with at most bounds - 2 windows."""
    tokens = tokens.astype(np.int64)
    fills = np.diff(starts) - 1  # positions each window fills: its targets
    used = np.add.reduceat(fills, np.cumsum(per_row) - per_row)  # positions each row's windows fill
    # For every input position of the rows, in window order: its position in its window,
    # where its token lies in `tokens`, and where it goes in the (rows, seq_len) batch.
    before = np.repeat(np.cumsum(fills) - fills, fills)  # positions of the windows before its own
    within = np.arange(fills.sum()) - before
    source = np.repeat(starts[:-1], fills) + within
    row_start = np.repeat(np.arange(len(per_row)) * seq_len - (np.cumsum(used) - used), used)
    target = row_start + np.arange(fills.sum())
    x = np.full((len(per_row), seq_len), pad_id, dtype=np.int64)
    y = np.full((len(per_row), seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.maximum(np.arange(seq_len) - used[:, None], 0)  # after the windows: 0, 1, 2, ...
    x.flat[target], y.flat[target], position_ids.flat[target] = tokens[source], tokens[source + 1], within
    # each row's bounds: 0, where each of its windows ends, then seq_len (the padding's end) repeated
    cu_seqlens = np.full((len(per_row), bounds), seq_len, dtype=np.int32)
    cu_seqlens[:, 0] = 0
    first = np.cumsum(per_row) - per_row  # each row's first window, in window order
    column = np.arange(len(fills)) - np.repeat(first, per_row) + 1
    cu_seqlens[np.repeat(np.arange(len(per_row)), per_row), column] = (
        np.cumsum(fills) - np.repeat(np.cumsum(used) - used, per_row))
    return list(zip(*(torch.from_numpy(a) for a in (x, y, position_ids, cu_seqlens))))


@dataclass
class PackedSequenceDataset(PaddedSequenceDataset):
    """--pack: the windows of PaddedSequenceDataset, placed several to a row by `pack`, so
    that a row of seq_len positions is mostly tokens rather than padding. Items are (x, y,
    position_ids, cu_seqlens): x, y and position_ids (seq_len,) int64, a row's windows one
    after another, each window's inputs and targets as PaddedSequenceDataset gives them and
    its positions counted from 0, then padding to seq_len (positions again from 0: a window of
    padding, which no real token sees); cu_seqlens (max_windows + 1,) int32, where each window
    of the row ends, after a 0 and before seq_len repeated: the same length for every row of
    the dataset, so that a batch has one shape (varlen_attn's input: ops/packed_attention.py).
    The model keeps each window to itself (packed_attention.window_mask)."""

    packing: datasets.Dataset | None = None  # column "windows": the windows each row holds, in order

    def __post_init__(self):
        self.packing_read_back = caches.ReadBack(self.packing, "--pack's cached packing")

    def __len__(self):
        return len(self.packing)

    @functools.cached_property
    def packing_fingerprint(self) -> str:
        """A hash of which windows each row holds, in order: a checkpoint records it, and a
        resume must find the same rows (another packing would put its data position elsewhere)."""
        column = self.packing.with_format("arrow")[:]["windows"].combine_chunks()
        offsets, placed = column.offsets.to_numpy().astype(np.int64), column.flatten().to_numpy().astype(np.int64)
        return hashlib.blake2b(offsets.tobytes() + placed.tobytes(), digest_size=16).hexdigest()

    @functools.cached_property
    def max_windows(self) -> int:
        """The most windows a row holds, a window of padding included."""
        offsets = self.packing.with_format("arrow")[:]["windows"].combine_chunks().offsets.to_numpy()
        return int(np.diff(offsets).max(initial=0)) + 1

    @functools.cached_property
    def targets(self) -> np.ndarray:
        """The real targets of each row: those of its windows."""
        column = self.packing.with_format("arrow")[:]["windows"].combine_chunks()
        return np.add.reduceat(self.window_targets[column.flatten().to_numpy()], column.offsets.to_numpy()[:-1])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        # The packing was checked when read back (wrong_rows); what changed since is damaged data
        self.packing_read_back.check()
        packed = self.packing.with_format("arrow")[indices]["windows"].combine_chunks()
        per_row = np.diff(packed.offsets.to_numpy())  # windows in each row
        placed = packed.flatten().to_numpy()
        if not ((per_row >= 1) & (per_row < self.max_windows)).all():
            wrong = per_row[(per_row < 1) | (per_row >= self.max_windows)][0]
            raise self.packing_read_back.damaged(f"a row of {wrong} windows (each holds 1 to {self.max_windows - 1})")
        if len(placed) and placed.max() >= len(self.rows):
            raise self.packing_read_back.damaged(f"a row places window {placed.max():,} of {len(self.rows):,}")
        starts, tokens = self.read_windows(placed.tolist())  # the batch's windows, one after another
        used = np.add.reduceat(np.diff(starts) - 1, np.cumsum(per_row) - per_row)  # positions each row fills
        if (used > self.seq_len).any():
            raise self.packing_read_back.damaged(f"a row of {used.max()} positions, more than --seq-len "
                                                 f"{self.seq_len}")
        return packed_rows(starts, tokens, per_row, self.seq_len, self.pad_id, self.max_windows + 1)

    def padding_row(self):
        bounds = torch.full((self.max_windows + 1,), self.seq_len, dtype=torch.int32)
        bounds[0] = 0
        return (*super().padding_row(), torch.arange(self.seq_len), bounds)  # one window of padding
