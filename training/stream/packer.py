"""--stream --pack: a stream's windows placed several to a row as they arrive, in bounded
memory, each row as --pack makes it (its windows one after another, each with its positions
from 0: training/packing.py).

Offline, packing.best_fit_decreasing sees every window's size before it places the first; a
stream sees one window at a time and can hold only a few rows back. OnlinePacker holds at
most `open_rows` rows open: each window goes into the open row with the least room that still
fits it (best fit), else into a new row; a row leaves as soon as it is full, and when one row
too many is open, the fullest leaves. benchmarks/bench_stream.py measures the padding this
leaves against offline packing of the same windows.

Rows of one window each (--stream without --pack) need no packer: every window is its own row.
"""

import bisect

import numpy as np
import torch

from training.errors import UsageError
from training.packing import packed_rows

# Rows held open. bench_stream.py on a 100 MB FineWeb-shaped corpus (bench_data.py's): the
# padding of the rows closed in stream, less that of offline best-fit decreasing over the same
# windows (0.06% / 0.04% / 0.03%), in points, at --seq-len 512 / 1024 / 2048:
#     8 rows 2.00 / 1.62 / 0.85    32 rows 0.88 / 0.77 / 0.43
#   128 rows 0.63 / 0.59 / 0.33   512 rows 0.54 / 0.49 / 0.27
# 32 already meets the goal (within 1 point), barely at 512; 128 leaves a margin for corpora of
# other shapes, at the cost of a state of at most 128 x seq_len tokens (1 MB of int32 at 2048)
# for each packer a checkpoint holds, and of a flush of at most 128 rows at a stream's end.
OPEN_ROWS = 128
# A row's cu_seqlens holds as many bounds at every step (one shape a batch: no recompile), so
# the most windows a row may hold is fixed before the stream is read. Any number up to seq_len
# could come (a window of one target is an empty document, or a document's last token), and
# varlen attention would visit seq_len + 1 bounds a row, nearly all of them empty windows. So a
# row holds at most seq_len / SHORTEST_MEAN_WINDOW windows (and at least 16: short rows still
# pack) and then leaves, full or not: rows whose windows fill 16 positions or more on average
# never meet the bound. On bench_stream.py's corpus no row held a fifth of it.
SHORTEST_MEAN_WINDOW = 16


def window_bound(seq_len: int) -> int:
    """The most windows a row of seq_len positions holds, a window of padding included, as
    PackedSequenceDataset.max_windows counts them (its cu_seqlens are one longer)."""
    return min(seq_len, max(16, -(-seq_len // SHORTEST_MEAN_WINDOW))) + 1


class OnlinePacker:
    """Windows (arrays of 2 to seq_len + 1 token ids: a window of n tokens fills n - 1
    positions, x = window[:-1] and y = window[1:]) placed in rows of seq_len positions as they
    come. add() places one and returns the rows it closed; flush() closes the rest at the
    stream's end.

    Guarantees: every window added leaves in exactly one row, whole, and each row holds its
    windows in the order they came; no row fills more than seq_len positions or holds more
    than max_windows - 1 windows (row_tensors: the padding is one more); at most open_rows rows
    (their windows) are held. The same windows in the same order give the same rows, and a
    packer given state_dict() taken after any add() gives the rows the packer it was taken
    from would have given."""

    def __init__(self, seq_len: int, open_rows: int = OPEN_ROWS, max_windows: int | None = None):
        self.seq_len, self.open_rows = seq_len, open_rows
        self.max_windows = window_bound(seq_len) if max_windows is None else max_windows
        if seq_len < 1 or open_rows < 1 or self.max_windows < 2:
            raise ValueError(f"OnlinePacker({seq_len}, {open_rows}, {self.max_windows}): each must be at least 1 "
                             "(max_windows 2)")
        self._rows = {}  # each open row's windows, by its number: the order rows were opened in (oldest first)
        self._by_room = []  # (free positions, number) of each open row, sorted: the fullest first, ties the oldest
        self._opened = 0  # the next new row's number

    def __len__(self) -> int:
        """The rows open now."""
        return len(self._rows)

    def add(self, window: np.ndarray) -> list[list[np.ndarray]]:
        """Place the window in the open row with the least room that still fits it (of those,
        the oldest), or in a new row. Returns the rows this closed (none or one): the row the
        window filled, or holds max_windows - 1 windows; else, if it opened a row one too
        many, the fullest open row (of those, the oldest), which may be the new one."""
        fills = len(window) - 1
        if not 1 <= fills <= self.seq_len:
            raise ValueError(f"a window of {len(window)} tokens: each holds 2 to seq_len + 1 ({self.seq_len + 1})")
        at = bisect.bisect_left(self._by_room, (fills, -1))  # the first row with room for it
        if at < len(self._by_room):
            room, row = self._by_room.pop(at)
        else:
            room, row = self.seq_len, self._opened
            self._rows[row], self._opened = [], self._opened + 1
        self._rows[row].append(window)
        room -= fills
        if room == 0 or len(self._rows[row]) == self.max_windows - 1:
            return [self._rows.pop(row)]
        bisect.insort(self._by_room, (room, row))
        if len(self._rows) > self.open_rows:
            # The fullest leaves: its padding is the least of any row's, while a row with more room
            # can still take a window that no fuller row fits. (The oldest leaving instead, at 128
            # rows: 0.95% / 0.84% / 0.46% padding at 512 / 1024 / 2048, against 0.70% / 0.63% / 0.36%.)
            _, fullest = self._by_room.pop(0)
            return [self._rows.pop(fullest)]
        return []

    def flush(self) -> list[list[np.ndarray]]:
        """Close every open row, the oldest first: the stream has ended."""
        rows = list(self._rows.values())
        self._rows, self._by_room = {}, []
        return rows

    def state_dict(self) -> dict:
        """{"seq_len", "open_rows", "max_windows": the packer's settings; "windows": each open
        row's windows' lengths in tokens, the rows oldest first (their order decides where later
        windows go: ties go to the oldest); "tokens": those windows' tokens one after another, an
        int32 tensor (the documents they came from are consumed, so a resume has them from here
        alone)}. Ints, lists and a tensor: torch.load(weights_only=True) reads it back."""
        rows = list(self._rows.values())
        windows = [window for row in rows for window in row]
        tokens = np.concatenate(windows) if windows else np.zeros(0, dtype=np.int64)
        if len(tokens) and not 0 <= tokens.min() <= tokens.max() < 2**31:
            raise ValueError(f"token ids from {tokens.min()} to {tokens.max()}: an int32 holds 0 to 2**31 - 1")
        return {"seq_len": self.seq_len, "open_rows": self.open_rows, "max_windows": self.max_windows,
                "windows": [[len(window) for window in row] for row in rows],
                "tokens": torch.from_numpy(tokens.astype(np.int32))}

    def load_state_dict(self, state: dict, source: str = "the packer's state") -> None:
        """Resume from state_dict()'s state. Everything in it is checked first (a checkpoint may
        be hostile or stale): the packer's settings, each open row's windows and room, and the
        tokens; anything wrong is one UsageError naming `source` and the row, and leaves this
        packer as it was. Windows come back as int64 arrays."""
        lengths, tokens = self._checked(state, source)
        windows = np.split(tokens.numpy().astype(np.int64), np.cumsum([n for row in lengths for n in row])[:-1])
        self._rows, at = {}, 0
        for number, row in enumerate(lengths):
            self._rows[number], at = windows[at:at + len(row)], at + len(row)
        self._by_room = sorted((self.seq_len - sum(n - 1 for n in row), number) for number, row in enumerate(lengths))
        self._opened = len(lengths)

    def _checked(self, state, source: str) -> tuple[list[list[int]], torch.Tensor]:
        """The state's open rows (their windows' lengths) and tokens, once every part is checked."""
        def wrong(problem):
            return UsageError(f"{source}: {problem}")
        keys = ["seq_len", "open_rows", "max_windows", "windows", "tokens"]
        if not isinstance(state, dict) or sorted(state) != sorted(keys):
            found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise wrong(f"not an online packer's state (it holds {found}; one holds {', '.join(keys)})")
        for key in keys[:3]:
            if type(state[key]) is not int:
                raise wrong(f"{key} is {state[key]!r}, not a whole number")
            if state[key] != getattr(self, key):
                raise wrong(f"{key} {state[key]}, and this packer's is {getattr(self, key)} (the rows would differ "
                            "from those of the run it resumes)")
        rows = state["windows"]
        if type(rows) is not list:
            raise wrong(f"its open rows are a {type(rows).__name__}, not a list")
        if len(rows) > self.open_rows:
            raise wrong(f"{len(rows)} open rows, and the packer holds at most {self.open_rows}")
        for r, row in enumerate(rows):
            if type(row) is not list:
                raise wrong(f"open row {r} is a {type(row).__name__}, not a list of its windows' lengths")
            if not 1 <= len(row) < self.max_windows - 1:
                raise wrong(f"open row {r} holds {len(row)} windows (an open row holds 1 to {self.max_windows - 2})")
            if not all(type(n) is int and 2 <= n <= self.seq_len + 1 for n in row):
                bad = next(n for n in row if not (type(n) is int and 2 <= n <= self.seq_len + 1))
                raise wrong(f"open row {r} holds a window of {bad!r} tokens (each holds 2 to {self.seq_len + 1})")
            if sum(n - 1 for n in row) >= self.seq_len:
                raise wrong(f"open row {r} fills {sum(n - 1 for n in row)} of its {self.seq_len} positions (a full row "
                            "leaves at once: it is never open)")
        tokens, expected = state["tokens"], sum(map(sum, rows))
        if not (isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int32 and tokens.layout == torch.strided
                and tokens.device.type == "cpu" and tokens.dim() == 1):
            what = (f"a {tokens.dim()}-d {tokens.dtype} tensor on {tokens.device}" if isinstance(tokens, torch.Tensor)
                    else f"a {type(tokens).__name__}")
            raise wrong(f"its tokens are {what}, not a 1-d torch.int32 tensor on the CPU")
        if len(tokens) != expected:
            raise wrong(f"{len(tokens):,} tokens, and the open rows' windows hold {expected:,}")
        if len(tokens) and tokens.min() < 0:
            raise wrong(f"a token id of {tokens.min()}")
        return rows, tokens.detach()


def row_tensors(rows: list[list[np.ndarray]], seq_len: int, pad_id: int,
                max_windows: int) -> list[tuple[torch.Tensor, ...]]:
    """Each row's (x, y, position_ids, cu_seqlens), as PackedSequenceDataset gives its items
    (packing.packed_rows makes both): cu_seqlens max_windows + 1 long, whatever the row."""
    if not rows:
        return []
    windows = [window for row in rows for window in row]
    starts = np.concatenate([[0], np.cumsum([len(window) for window in windows])])
    return packed_rows(starts, np.concatenate(windows), np.array([len(row) for row in rows]), seq_len, pad_id,
                       max_windows + 1)
