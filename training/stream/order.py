"""--stream's order: which documents each of a run's S canonical sub-streams reads, epoch after
epoch, and where each stands (a Cursor), so that a resumed run reads on exactly as the
uninterrupted one would have, at the same world size or at any other that divides S.

The corpus is a list of pieces (a parquet row group, or a whole .jsonl file), each with a size
(rows, or bytes: one unit for the whole corpus). Each epoch the pieces are shuffled by (seed,
epoch) and dealt in that order, each to the sub-stream with the least size so far (deal): every
piece to exactly one sub-stream, and no sub-stream more than the largest piece ahead of another.
A sub-stream reads its pieces in the order dealt, each piece's rows in order (the shuffle is of
pieces: a packer's buffer mixes documents locally), then its pieces of the next epoch: a sequence
of documents that is a function of the pieces, S and the seed alone, whoever reads it.

The world: rank r of W produces the sub-streams s with s % W == r (owned). Row j of a global
batch of B rows (S divides B) is the (j // S)-th row the step takes from sub-stream j % S, so
rank r's rows are j = r, r + W, r + 2W, ... (a batch shared out as DistributedSampler shares it
in data.py): its own sub-streams taken in turn, local row i from owned[i % (S // W)]. The union
over the ranks is the same global batch at every W, so a run of S sub-streams resumes at any
world size that divides S, each sub-stream from its cursor in the checkpoint. S is the run's
for good: another S deals other sub-streams.

Epochs and the end, the rule proposed for the loader (it works on rows, which exist only after
tokenizing and packing; this module knows documents): a sub-stream runs on from one epoch into
the next without waiting for the others (documents() does), the loader takes B/S rows from every
sub-stream a step, and the run ends at the first step some sub-stream cannot give its B/S rows
before the end of the run's last epoch (documents' `epochs`); what the others hold then is
dropped. With R_s rows in sub-stream s and T steps, that is sum(R_s) - T * B rows, at most
(S - 1) x (max R_s - min R_s) + S x (B/S - 1), once a run. Each epoch's deal keeps the sizes'
spread within the largest piece, so over N epochs the spread is at most N largest pieces (a sum
of independent deals: typically far less), in rows as far as rows follow the sizes. An epoch
barrier instead (every epoch ending at its first sub-stream to run dry) would drop the spread
every epoch and flush every packer's buffer into padding at each boundary. What running on costs:
a batch near an epoch's end holds rows of two epochs, and how many steps a run has is known only
once its corpus is read (--max-steps, or a count before the run: the loader's choice).
"""

import functools
import hashlib
import heapq
import json
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from training.errors import UsageError
from training.stream import integrity
from training.stream.integrity import PiecesRead

# read(piece, start_row): the (row, text) of a piece's documents from start_row on, rows rising
Read = Callable[[int, int], Iterable[tuple[int, str]]]
# describe(piece, row): where that is, for a line ("shard b.jsonl, line 58"); row None: the piece
Describe = Callable[[int, int | None], str]
LIMIT = 2**63  # epochs, rows and the like in a checkpoint: what a seed may be (training/config.py)


def deal(piece_sizes: list[int], streams: int, seed: int, epoch: int) -> list[list[int]]:
    """Each sub-stream's pieces (indices into piece_sizes) in `epoch`, in reading order: the pieces
    shuffled by (seed, epoch), each in turn to the sub-stream with the least size so far, ties to
    the lowest index. Every piece goes to exactly one sub-stream, and no sub-stream's size exceeds
    another's by more than the largest piece (the piece that made it the largest went to the
    least). The same on every machine: numpy's default_rng seeded with the pair (seed, epoch),
    never seed + epoch, under which seed 1's first epoch would be seed 0's second.

    A sub-stream without data could give no rows to a batch: at least `streams` pieces must hold
    some (least-first deals one to each before any takes a second)."""
    sizes = [int(size) for size in piece_sizes]  # Python ints: sums that cannot overflow
    if streams < 1 or min(sizes, default=0) < 0 or not (0 <= seed < LIMIT and 0 <= epoch < LIMIT):
        raise ValueError(f"deal: {streams} sub-streams, seed {seed}, epoch {epoch}, a size {min(sizes, default=0)}")
    holding = sum(size > 0 for size in sizes)
    if holding < streams:
        raise UsageError(f"the corpus has {holding} pieces that hold data (a parquet row group or a .jsonl file "
                         f"each), fewer than the {streams} sub-streams that read it: each needs one at least")
    least = [(0, stream) for stream in range(streams)]  # a heap of (size so far, sub-stream): least, then lowest
    dealt = [[] for _ in range(streams)]
    for piece in np.random.default_rng([seed, epoch]).permutation(len(sizes)).tolist():
        size, stream = least[0]
        dealt[stream].append(piece)
        heapq.heapreplace(least, (size + sizes[piece], stream))
    return dealt


class SubStreams:
    """A run's pieces dealt to its `streams` sub-streams (deal), epoch by epoch: what every Cursor
    of the run reads. One for all the cursors of a process: an epoch is dealt once, not once a
    sub-stream (a million pieces take seconds). describe(piece, row) names a place in a piece
    for a line (shards.describe: the shard and the row group or line)."""

    def __init__(self, piece_sizes: list[int], streams: int, seed: int, describe: Describe | None = None):
        self.piece_sizes, self.streams, self.seed = [int(size) for size in piece_sizes], streams, seed
        self.describe = describe or (lambda piece, row: f"piece {piece}" + (f", row {row}" if row is not None else ""))
        # a few epochs kept: the sub-streams of a process cross into the next epoch at different times
        self.dealt = functools.lru_cache(maxsize=4)(lambda epoch: deal(self.piece_sizes, streams, seed, epoch))
        self.dealt(0)  # a corpus that cannot be dealt is refused here, before anything is read

    def pieces(self, stream: int, epoch: int) -> list[int]:
        return self.dealt(epoch)[stream]

    def fingerprint(self, stream: int, epoch: int) -> str:
        """Which pieces sub-stream `stream` reads in `epoch`, as a short hash: a checkpoint's cursor
        names the pieces its position counts, so that one of another deal (another corpus, seed, or
        numpy that shuffles otherwise) is refused rather than read from the wrong place."""
        listed = json.dumps(self.pieces(stream, epoch)).encode()
        return hashlib.blake2b(listed, digest_size=8).hexdigest()


class Cursor:
    """Where sub-stream `stream` stands: its next document is at row `row` (or the first row after
    it that holds one) of the `piece`-th of its pieces in `epoch`; `digest`, the chain over that
    piece's documents before `row` (integrity.py), which a resume checks as it reads them again.
    documents() moves it before it hands out each document, so that state_dict() taken after
    any document resumes with the next."""

    FIELDS = ("stream", "streams", "epoch", "piece", "row", "dealt", "digest")

    def __init__(self, sub_streams: SubStreams, stream: int):
        if not 0 <= stream < sub_streams.streams:
            raise ValueError(f"sub-stream {stream} of {sub_streams.streams}")
        self.sub_streams, self.stream = sub_streams, stream
        self.epoch = self.piece = self.row = 0
        self.digest = integrity.START

    def moved_to(self, other: "Cursor") -> None:
        self.epoch, self.piece, self.row, self.digest = other.epoch, other.piece, other.row, other.digest

    def state_dict(self) -> dict:
        return {"stream": self.stream, "streams": self.sub_streams.streams, "epoch": self.epoch,
                "piece": self.piece, "row": self.row, "dealt": self.sub_streams.fingerprint(self.stream, self.epoch),
                "digest": self.digest.hex()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict() of this sub-stream; one line for anything a checkpoint of it
        cannot hold (the checkpoint may be hostile or stale): nothing is read from a wrong place."""
        where = f"sub-stream {self.stream}'s position in the checkpoint"
        if not isinstance(state, dict) or set(state) != set(self.FIELDS):  # keys of any type
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise UsageError(f"{where} is not one: it holds {got}, not {', '.join(self.FIELDS)}")
        for field in self.FIELDS[:-2]:
            if type(state[field]) is not int or not 0 <= state[field] < LIMIT:  # type(): a bool is no row
                raise UsageError(f"{where}: {field} is {state[field]!r}, not a whole number from 0 to 2**63 - 1")
        if (state["stream"], state["streams"]) != (self.stream, self.sub_streams.streams):
            raise UsageError(f"{where} is sub-stream {state['stream']} of {state['streams']}, "
                             f"not {self.stream} of {self.sub_streams.streams}")
        epoch, piece, row = state["epoch"], state["piece"], state["row"]
        pieces = self.sub_streams.pieces(self.stream, epoch)
        if piece > len(pieces) or (piece == len(pieces) and row):
            raise UsageError(f"{where}: row {row} of piece {piece} in epoch {epoch}, and the sub-stream reads "
                             f"{len(pieces)} pieces that epoch")
        if state["dealt"] != self.sub_streams.fingerprint(self.stream, epoch):  # any other type differs too
            raise UsageError(f"{where}: it counts in other pieces than this run deals it in epoch {epoch} "
                             "(another corpus or seed, or a numpy that shuffles otherwise)")
        digest = integrity.checked_digest(state["digest"], where)
        if row == 0 and digest != integrity.START:
            raise UsageError(f"{where}: a digest of documents before row 0")
        self.epoch, self.piece, self.row, self.digest = epoch, piece, row, digest


def documents(cursor: Cursor, read: Read, epochs: int | None = None, seen: PiecesRead | None = None) -> Iterator[str]:
    """The documents of the cursor's sub-stream from where it stands, piece after piece and epoch
    after epoch, until epoch `epochs` (None: without end), moving the cursor as it goes.

    read(piece, start_row) yields (row, text) for a piece's documents from start_row on, rows
    rising: a row it leaves out (an empty document, say) is not yielded and not counted. A
    start_row past the piece's end is read's to refuse: only it knows where the piece ends.

    What is read again is checked (integrity.py): a piece entered mid-way (a resume), its
    documents before the cursor's row against the cursor's digest; with `seen`, a piece read
    whole before, whole, before any of it is handed out (entered at its start or mid-way);
    each piece read whole is recorded in `seen`, or checked against what it holds."""
    describe = cursor.sub_streams.describe
    while epochs is None or cursor.epoch < epochs:
        pieces = cursor.sub_streams.pieces(cursor.stream, cursor.epoch)
        whole_epoch, found = (cursor.piece, cursor.row) == (0, 0), False
        while cursor.piece < len(pieces):
            piece = pieces[cursor.piece]
            if seen is not None and seen.expected(piece) is not None:  # read before: checked whole first, a
                seen.finished(piece, integrity.piece_digest(read(piece, 0)), describe)  # resume inside it too
            for row, text in read_checked(cursor, read):
                if row < cursor.row:  # a resume at row + 1 would read it again
                    raise ValueError(f"read({piece}, ...) gave row {row} after asked for row {cursor.row} on")
                cursor.row, cursor.digest, found = row + 1, integrity.chained(cursor.digest, row, text), True
                yield text  # the cursor points past it already: a state taken now resumes after it
            if seen is not None:
                seen.finished(piece, cursor.digest, describe)
            cursor.piece, cursor.row, cursor.digest = cursor.piece + 1, 0, integrity.START
        if whole_epoch and not found:  # on without end, the next epochs would be searched forever
            raise UsageError(f"sub-stream {cursor.stream} read no document in epoch {cursor.epoch}: its pieces "
                             f"{pieces[:8]} hold none, though their sizes say they hold data")
        cursor.epoch, cursor.piece, cursor.row = cursor.epoch + 1, 0, 0


def read_checked(cursor: Cursor, read: Read) -> Iterator[tuple[int, str]]:
    """read(piece, cursor.row) for the cursor's piece, where a cursor inside it (row > 0: a
    resume) reads its documents before that row too (read from row 0, as a compressed stream
    must be anyway) and checks that they chain to the cursor's digest before handing out the
    first document after them: one line naming the row otherwise (integrity.py)."""
    piece, start = cursor.sub_streams.pieces(cursor.stream, cursor.epoch)[cursor.piece], cursor.row
    if start == 0:
        yield from read(piece, 0)
        return
    read(piece, start)  # a row the piece lacks, or a shard that is not as listed: read's own line, at once
    digest, checked = integrity.START, False
    for row, text in read(piece, 0):
        if row < start:
            digest = integrity.chained(digest, row, text)
            continue
        if not checked:
            _check_prefix(cursor, piece, digest)
            checked = True
        yield row, text
    if not checked:  # no document at or after the cursor's row: the piece may end before that row,
        if digest != cursor.digest:  # which only reading from it tells (a JSON Lines file's line
            for _ in read(piece, start):  # count): that, not the digest, is the line
                pass
        _check_prefix(cursor, piece, digest)


def _check_prefix(cursor: Cursor, piece: int, digest: bytes) -> None:
    if digest != cursor.digest:
        raise UsageError(f"{cursor.sub_streams.describe(piece, cursor.row)}: the documents before it differ from "
                         f"those the run read there: {integrity.CHANGED}")


def check_read(cursor: Cursor, read: Read) -> None:
    """The documents before the cursor in its piece, read again and checked (read_checked), as a
    resume's check of a checkpoint's position; a cursor at the end of its epoch has none."""
    if cursor.piece < len(cursor.sub_streams.pieces(cursor.stream, cursor.epoch)):
        for _ in read_checked(cursor, read):
            break


def owned(streams: int, world_size: int, rank: int, units: str = "ranks") -> list[int]:
    """The sub-streams rank `rank` of `world_size` produces: s with s % world_size == rank, so
    that every rank produces as many and the ranks' rows of a batch interleave as
    DistributedSampler's do (the module's docstring). units: what a refusal calls the ranks
    (launch.data_parallel_units: under TP, data-parallel groups)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}")
    if streams % world_size:
        sizes = [str(w) for w in range(1, streams + 1) if streams % w == 0]
        raise UsageError(f"{world_size} {units} cannot share the run's {streams} sub-streams evenly: "
                         f"it runs and resumes at {', '.join(sizes)} {units}")
    return list(range(rank, streams, world_size))
