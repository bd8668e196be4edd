"""--stream's rows: one canonical sub-stream's documents (order.documents), each framed and cut
into windows exactly as the map-style dataset cuts them (data.document_windows), each window a
row of its own, padded as PaddedSequenceDataset pads it, or placed in rows as they come by an
OnlinePacker (--pack); every row as the tensors the trainers take.

Where a sub-stream stands after any row: the document in progress and the next of its windows,
and with --pack the packer's open rows. The document is kept as the position it was read from
(the cursor as it stood before it), not as its windows: a resume reads it again and tokenizes it
again, which gives the same windows (tokenizing is deterministic), where a checkpoint holding
them would hold megabytes for a long document. The packer's open rows are held whole: the
documents they came from are consumed.

Epochs and the end: the sub-stream runs on from one epoch into the next (order's rule), and so
does its packer, whose open rows take the next epoch's first windows. After the last epoch the
packer's open rows come out, oldest first (OnlinePacker.flush), and then the sub-stream is
exhausted: next() raises StopIteration (next(rows, None) gives None), at that call and every
later one, a resumed object's included.
"""

from collections.abc import Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

import data
from training.errors import UsageError
from training.stream import order
from training.stream.integrity import PiecesRead
from training.stream.order import LIMIT, Cursor, SubStreams
from model import IGNORE_INDEX
from training.stream.packer import OPEN_ROWS, OnlinePacker, row_tensors


_FOR_TEXT = {}  # id(tokenizer) -> (the tokenizer, kept so that its id is not reused; its copy; exact cuts)


def _for_text(tokenizer: Tokenizer) -> tuple[Tokenizer, bool]:
    """data.text_only's copy of the tokenizer, and whether cutting a text before whitespace is
    exact for it: a quarter of a second for a BPE of 50,000 tokens, made once a process and
    tokenizer, not once a sub-stream (a feed makes each sub-stream's rows several times: for its
    first state, to check a checkpoint's, and in a worker, which inherits this). Encoding is
    safe from several threads: the copy is shared."""
    if id(tokenizer) not in _FOR_TEXT:
        if len(_FOR_TEXT) == 4:  # a process holds a run's tokenizer; tests make many
            _FOR_TEXT.pop(next(iter(_FOR_TEXT)))
        copy = data.text_only(tokenizer)
        _FOR_TEXT[id(tokenizer)] = (tokenizer, copy, data.clip_is_exact(copy))
    return _FOR_TEXT[id(tokenizer)][1:]


class SubStreamRows(Iterator[tuple[torch.Tensor, ...]]):
    """Sub-stream `stream`'s rows, from its first document of epoch 0 until its last of epoch
    `epochs` - 1 (None: without end), each as the trainers take one: (x, y) padded, each
    (seq_len,) int64, as PaddedSequenceDataset gives a row; (x, y, position_ids, cu_seqlens)
    packed, as PackedSequenceDataset gives one (packer.row_tensors).

    Guarantees: padded, the rows are the sub-stream's documents' windows in their order, each
    exactly as tokenized.tokenize cuts it and PaddedSequenceDataset pads it; packed, they are
    those windows through one OnlinePacker, from the first epoch's to the last epoch's, then its
    flush. Either way every token of every document (after its [BOT]) is a target exactly once
    an epoch. An object given state_dict() taken after any row gives the rows this one gives
    next, bitwise. read(piece, start_row) is the run's reader (order.Read); `tokenizer` the
    run's, its [PAD] the padding (specials: an imported model's own ids instead). What it
    reads again is checked against what it read
    (integrity.py); `known`: the digests of the pieces the run had read by the checkpoint it
    resumed from (integrity.known_pieces)."""

    def __init__(self, sub_streams: SubStreams, stream: int, read: order.Read, tokenizer: Tokenizer, seq_len: int,
                 pack: bool, epochs: int | None, open_rows: int = OPEN_ROWS, known: dict[int, int] | None = None,
                 specials: data.SpecialIds | None = None):
        self.read, self.seq_len, self.epochs = read, seq_len, epochs
        self.seen = PiecesRead(known)
        self.tokenizer, self.exact_cuts = _for_text(tokenizer)  # a copy: "[EOT]" in a text is text
        self.specials = specials or data.special_ids(tokenizer)  # the run's framing: ours, or a model's own
        self.pad_id = self.specials.pad
        self.cursor = Cursor(sub_streams, stream)  # where reading stands: past the document in progress
        self._start(self.cursor, OnlinePacker(seq_len, open_rows) if pack else None)

    def _start(self, cursor: Cursor, packer: OnlinePacker | None, flushed: int = 0, targets: int = 0) -> None:
        self.cursor, self.packer = cursor, packer
        self._targets = targets  # real targets in the rows handed out since epoch 0: a run's tokens_seen
        self._at = Cursor(cursor.sub_streams, cursor.stream)  # where the document in progress was read from
        self._documents = order.documents(cursor, self.read, self.epochs, self.seen)
        self._windows, self._window = [], 0  # the document in progress's windows, and the next one's index
        self._flush = None  # at the stream's end: (the packer's state before its flush, the rows it flushed)
        self._flushed = flushed  # of those, the rows handed out

    def _next_window(self) -> np.ndarray | None:
        """The next window of the sub-stream, or None: it has no more documents."""
        while self._window == len(self._windows):
            self._at.moved_to(self.cursor)
            text = next(self._documents, None)
            if text is None:
                return None
            self._windows, self._window = self._cut(text), 0
        self._window += 1
        return self._windows[self._window - 1]

    def _cut(self, text: str) -> list[np.ndarray]:
        return data.document_windows(text, self.tokenizer, self.seq_len, self.exact_cuts, specials=self.specials)

    def __next__(self) -> tuple[torch.Tensor, ...]:
        row = self._next_row()
        self._targets += int((row[1] != IGNORE_INDEX).sum())
        return row

    def _next_row(self) -> tuple[torch.Tensor, ...]:
        if self.packer is None:
            window = self._next_window()
            if window is None:
                raise StopIteration
            return data.padded_rows(np.array([0, len(window)]), window, self.seq_len, self.pad_id)[0]
        while self._flush is None:
            window = self._next_window()
            if window is None:  # the end: the open rows, oldest first
                self._flush = self.packer.state_dict(), self.packer.flush()
            elif closed := self.packer.add(window):
                return self._packed(closed)
        rows = self._flush[1]
        if self._flushed == len(rows):
            raise StopIteration
        self._flushed += 1
        return self._packed(rows[self._flushed - 1:self._flushed])

    def _packed(self, rows: list[list[np.ndarray]]) -> tuple[torch.Tensor, ...]:
        return row_tensors(rows, self.seq_len, self.pad_id, self.packer.max_windows)[0]

    def state_dict(self) -> dict:
        """{"cursor": the position of the document in progress (a Cursor's state_dict), or of the
        next document where none is; "window": the index of that document's next window (0 where
        none is in progress); "packer": the OnlinePacker's state_dict (None for padded rows), at
        the stream's end its state before its flush; "flushed": the rows of that flush handed
        out; "targets": the real (non-pad) targets of every row handed out, for the run's count;
        "read": the digests of the pieces it has read whole (integrity.PiecesRead.table(), a
        tensor of (piece, digest) rows)}. Ints, strs and tensors: torch.load(weights_only=True)
        reads it."""
        in_progress = self._window < len(self._windows)
        packer = None if self.packer is None else self._flush[0] if self._flush else self.packer.state_dict()
        return {"cursor": (self._at if in_progress else self.cursor).state_dict(),
                "window": self._window if in_progress else 0, "packer": packer, "flushed": self._flushed,
                "targets": self._targets, "read": self.seen.table()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict() of this sub-stream, in a run of the same corpus, seed,
        tokenizer, seq_len and epochs. Everything is checked before anything changes (a
        checkpoint may be hostile or stale): anything wrong is one UsageError naming what, and
        leaves this object as it was. The document in progress is read and tokenized again, and
        the documents before it in its piece checked against the cursor's digest (integrity.py)."""
        where = f"sub-stream {self.cursor.stream}'s rows in the checkpoint"
        keys = ("cursor", "window", "packer", "flushed", "targets", "read")
        if not isinstance(state, dict) or set(state) != set(keys):
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise UsageError(f"{where} are not a sub-stream's state: it holds {got}, not {', '.join(keys)}")
        for key in ("window", "flushed", "targets"):
            if type(state[key]) is not int or not 0 <= state[key] < LIMIT:  # type(): a bool is no index
                raise UsageError(f"{where}: {key} is {state[key]!r}, not a whole number from 0 to 2**63 - 1")
        if (state["packer"] is None) != (self.packer is None):
            framing = ("padded", "packed")
            raise UsageError(f"{where} are {framing[state['packer'] is not None]}, and this run's are "
                             f"{framing[self.packer is not None]} (--pack)")
        cursor = Cursor(self.cursor.sub_streams, self.cursor.stream)
        cursor.load_state_dict(state["cursor"])
        if self.epochs is not None and cursor.epoch > self.epochs:
            raise UsageError(f"{where} stand in epoch {cursor.epoch}, past this run's {self.epochs} epochs")
        packer = None
        if self.packer is not None:
            packer = OnlinePacker(self.seq_len, self.packer.open_rows, self.packer.max_windows)
            packer.load_state_dict(state["packer"], f"{where}: the packer")
        window, flushed = state["window"], state["flushed"]
        if flushed and not (packer is not None and cursor.epoch == self.epochs and flushed <= len(packer)):
            of = f" of its {len(packer)} open rows" if packer is not None else ""
            raise UsageError(f"{where}: the packer's flush at the end handed out {flushed} rows{of}, and they stand "
                             f"in epoch {cursor.epoch} of {self.epochs} (a packer flushes after the last)")
        seen = PiecesRead(self.seen.known)
        seen.load(state["read"], len(cursor.sub_streams.piece_sizes), where)
        kept = dict(vars(self))
        try:
            self.seen = seen
            self._start(cursor, packer, flushed, state["targets"])
            if window and self._next_window() is None:  # the document in progress, read and cut again
                raise UsageError(f"{where}: window {window} of a document in progress, and no document is left "
                                 f"from row {self._at.row} of piece {self._at.piece} of epoch {self._at.epoch} on")
            if not window:  # the next document's place, and the documents before it in its piece, checked now
                order.check_read(cursor, self.read)  # (with window, reading the document in progress did)
            if window and window >= len(self._windows):
                raise UsageError(f"{where}: window {window} of the document at row {self._at.row} of piece "
                                 f"{self._at.piece} of epoch {self._at.epoch}, which is cut into "
                                 f"{len(self._windows)} (another tokenizer or --seq-len?)")
        except BaseException:  # a shard that cannot be read, too: nothing changed
            vars(self).clear()
            vars(self).update(kept)
            raise
        self._window = window
