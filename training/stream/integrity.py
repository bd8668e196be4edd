"""What a streamed run has read, so that a piece it reads again is the piece it read.

A resume checks each shard's size and a digest of 64 KiB of it (shards.changed): reading every
shard whole at every start would take hours at 100 GB. A shard rewritten at the same size
outside those 64 KiB would pass, and the run would train text other than the text it began on.
So each piece is also checked whenever the run reads it again, against what it was when first
read, at no more reading than the run does anyway:
- the piece in progress at a resume: the rows before the cursor are read again to reach it (a
  compressed stream has no other way in), and their documents must chain to the digest the
  cursor holds (order.Cursor's `digest`, a chain over the piece's documents before its row);
- every piece read whole before, when it is read again in a later epoch (the piece in progress
  at a resume too): read once whole and checked before any of its documents is handed out (so
  none of a changed piece is trained on), then read again for its rows. Each piece's digest
  is recorded as it is first read whole (PiecesRead); the sub-stream's state carries those it
  recorded, and a resume gives every sub-stream those of all the checkpoint's sub-streams
  (pieces are dealt anew each epoch, to other sub-streams).
A digest covers what training takes from a piece: each document's row and text. Other columns
or fields, and a line the run never read (a bad line repaired), may change.

What it cannot see: text the run has not read yet (after a resume it reads it as it is then),
and, within one run, a piece that another sub-stream read before (that digest is in another
worker, or on another rank, until a checkpoint gathers it). A mismatch is one UsageError
naming the shard and the piece (the row, where it is the prefix of the piece in progress):
raised where the piece is read, it ends every rank in that line (loader.next_step), or the
resume before anything is written (the feed loads its states as the data is prepared).
"""

import hashlib
import re

import torch

from training.errors import UsageError

DIGEST_BYTES = 8  # a chance of 2**-64 that a changed piece passes
START = bytes(DIGEST_BYTES)  # the chain's value at a piece's start, before any document
CHANGED = "the shard was rewritten since the run read it. Restore it as the run read it, or start a new run"


def chained(digest: bytes, row: int, text: str) -> bytes:
    """The chain over a piece's documents, after the document (row, text): SHA-256, which CPUs
    compute in hardware (on this EPYC about twice blake2b's speed: bench_stream.py --sections
    integrity gives the cost), its first DIGEST_BYTES. The text is hashed where it lies, not
    copied after the rest."""
    chain = hashlib.sha256(digest + row.to_bytes(8, "little"))
    chain.update(text.encode())
    return chain.digest()[:DIGEST_BYTES]


def checked_digest(value, where: str) -> bytes:
    """A digest as a state holds it (hex), checked: the state may be hostile or stale."""
    if not (isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}", value)):
        raise UsageError(f"{where}: digest is {str(value)[:40]!r}, not {2 * DIGEST_BYTES} hex digits")
    return bytes.fromhex(value)


def piece_digest(documents) -> bytes:
    """The chain over a whole piece's documents, (row, text) each."""
    digest = START
    for row, text in documents:
        digest = chained(digest, row, text)
    return digest


class PiecesRead:
    """The digests of the pieces a sub-stream has read whole (keyed by corpus piece, as
    order.py numbers them): `own`, those it recorded (its state carries them into the
    checkpoint), and `known`, those all the sub-streams of the checkpoint it resumed from had
    recorded (the same dict for every sub-stream of a process, never changed)."""

    def __init__(self, known: dict[int, int] | None = None):
        self.own, self.known = {}, known if known is not None else {}
        self._table = torch.empty((0, 2), dtype=torch.int64)  # own as a tensor, a new one when a piece is added

    def expected(self, piece: int) -> int | None:
        return self.own.get(piece, self.known.get(piece))

    def finished(self, piece: int, digest: bytes, describe) -> None:
        """Piece `piece` read whole, its documents chaining to `digest`: recorded, or checked
        against its digest where one is known (describe(piece, None) names it)."""
        value = _as_int(digest)
        was = self.expected(piece)
        if was is None:  # one row more: a copy in C of what it held (1.6 MB at 100,000 pieces), once a piece
            self.own[piece] = value
            self._table = torch.cat([self._table, torch.tensor([[piece, value]], dtype=torch.int64)])
        elif was != value:
            raise UsageError(f"{describe(piece, None)}: its documents differ from those the run read there: {CHANGED}")

    def table(self) -> torch.Tensor:
        """`own` as the state holds it: (piece, digest) int64 rows, in the order recorded. The
        same tensor until a piece is added (a state handed out stays as it was), so that a
        worker sends it through shared memory once, not once a step."""
        return self._table

    def load(self, table, pieces: int, where: str) -> None:
        self.own = table_entries(table, pieces, where)
        self._table = torch.tensor(list(self.own.items()), dtype=torch.int64).reshape(-1, 2)


def _as_int(digest: bytes) -> int:
    return int.from_bytes(digest, "little", signed=True)  # an int64, as a tensor holds it


def table_entries(table, pieces: int, where: str) -> dict[int, int]:
    """A state's table of pieces read (PiecesRead.table()) as {piece: digest}, checked: a
    tensor of (piece, digest) int64 rows, each piece one of the corpus's `pieces`, once."""
    if not (isinstance(table, torch.Tensor) and table.dtype == torch.int64 and table.dim() == 2
            and table.shape[1] == 2 and table.layout == torch.strided):
        shown = f"a {table.dtype} tensor of shape {tuple(table.shape)}" if isinstance(table, torch.Tensor) \
            else type(table).__name__
        raise UsageError(f"{where}: the pieces it read are {shown}, not (piece, digest) rows of int64")
    entries = {}
    for piece, digest in table.tolist():
        if not 0 <= piece < pieces or piece in entries:
            problem = "twice" if piece in entries else f"of {pieces}"
            raise UsageError(f"{where}: the pieces it read name piece {piece} {problem}")
        entries[piece] = digest
    return entries


def known_pieces(states: dict, pieces: int, describe, source: str = "the checkpoint") -> dict[int, int]:
    """The digests of the pieces every sub-stream of a checkpoint had read (all S states, each
    checked), for every sub-stream of the resumed run: two that read a piece as different
    texts saw it rewritten during the run, which is one line naming it."""
    known = {}
    for stream, state in sorted(states.items()):
        if not (isinstance(state, dict) and "read" in state):
            raise UsageError(f"{source}'s sub-stream {stream} holds no pieces it read: the checkpoint is damaged, or "
                             "of another version of this trainer")
        for piece, digest in table_entries(state["read"], pieces, f"{source}'s sub-stream {stream}").items():
            if known.setdefault(piece, digest) != digest:
                raise UsageError(f"{describe(piece, None)}: the checkpoint's sub-streams read it as two different "
                                 f"texts: {CHANGED}")
    return known
