"""--stream's loader: one rank's share of each step's global batch, as the micro-batches the
training loop takes, tokenized in DataLoader workers; and where each of the rank's sub-streams
stands after the last step handed out, so that a checkpoint resumes bitwise at the same world
size and with the same global batches at any other that divides the sub-streams.

The layout is order.py's: a global batch of B rows takes B/S rows from each of the S
sub-streams; rank r of W produces its sub-streams owned = order.owned(S, W, r), and its local
row i (of B/W) is the (i // (S/W))-th row this step of owned[i % (S/W)], which is global row
r + W*i: the rows of a batch shared out as DistributedSampler shares them. With grad_accum the
local rows are cut, in that order, into micro-batches of B/(W*grad_accum) rows; each field
stacked as the DataLoader's default collate stacks rows.

Workers: each gets whole sub-streams (worker w of n: owned[w::n]), so that a sub-stream's rows
come from one SubStreamRows, in order, wherever its worker runs. A worker yields one item a step:
its sub-streams' B/S rows each, one tensor a field (each tensor a worker sends is a segment of
shared memory that the main process maps: tenths of a millisecond, however small), and each
sub-stream's state after them (its table of the pieces it has read, a tensor, only in the step
it changed: _Shares._unsent). One item a step and not one a share: the DataLoader takes its
workers' items in turn, one each, and a worker with more sub-streams than another would fall
further behind in items every step (n dividing S/W keeps the workers equally busy; n is at most
S/W). The main process puts each worker's columns in place.

State: workers read ahead (the DataLoader's prefetch, two items each), and ReadAhead a step or
two more, so where a worker stands is not where the trainer does: each step's rows come with
their sub-streams' states, state_dict() gives those of the last step handed out, and
read_ahead() those of the last step handed to the loop. The cost, every step for every owned
sub-stream: a cursor (a few ints) and, with --pack, the packer's open rows, up to OPEN_ROWS x
seq_len tokens of int32. bench_stream.py --sections loader (its 100 MB corpus, 128 rows open):
0.24 / 0.49 / 1.02 MB at --seq-len 512 / 1024 / 2048, made in 0.08 / 0.13 / 0.22 ms in the
worker, and received by the main process in about 0.5 / 0.6 / 0.8 ms against 0.13 ms for a
cursor alone (the median of 200; two runs on a shared 2-core machine): a rank of 8 packed
sub-streams at 512 spends about 3 ms a step more on them than on cursors (an H100's step of 64
rows of `article` takes about 70 ms), in ReadAhead's thread while the step before runs.

The end: the first step some owned sub-stream cannot give its B/S rows ends the feed
(StopIteration, at that call and every later one; the rows the others hold are dropped, as
order.py's rule says). A rank sees only its own sub-streams, so ranks end at different steps:
the run ends at the earliest (the W = 1 feed's end), which only a collective can tell every
rank. The loop asks next_step() (one all-reduce of an int a step), not next() alone: through
AgreedSteps, which also raises on every rank the line of a shard that one rank cannot read.
"""

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from training import tokenized
from training.errors import UsageError
from training.read_ahead import ReadAhead
from training.stream import order
from training.stream.order import SubStreams
from training.stream.packer import OPEN_ROWS
from training.stream.rows import SubStreamRows


class StreamFeed(Iterator[list[tuple[torch.Tensor, ...]]]):
    """next(feed): the next step's `grad_accum` micro-batches of rank `rank` of `world_size`, each
    a tuple (x, y) padded or (x, y, position_ids, cu_seqlens) packed (pinned with pin_memory),
    of a global batch of `batch_size` rows taken from sub_streams' S sub-streams (the module's
    docstring: the layout, the workers, the end).

    Guarantees: the ranks' rows of a step, put in global order (rank r's local row i is global
    row r + W*i), are the same global batch at every world size that divides S. A feed given
    the states of its sub-streams after any step (state_dict(), gathered from the ranks of any
    world size) gives, bitwise, the steps the uninterrupted feed gives after it. Workers read
    ahead; the state is that of the steps handed out. Building and iterating leave torch's
    global RNG untouched (the DataLoader draws its workers' seeds from a generator of its own).
    """

    def __init__(self, sub_streams: SubStreams, read: order.Read, tokenizer: Tokenizer, seq_len: int, pack: bool,
                 epochs: int | None, batch_size: int, world_size: int, rank: int, grad_accum: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, open_rows: int = OPEN_ROWS, specials=None):
        streams = sub_streams.streams
        self.owned = order.owned(streams, world_size, rank)  # W that does not divide S: one line
        if batch_size % streams:
            raise UsageError(f"--batch-size {batch_size} is not a multiple of the run's {streams} sub-streams: "
                             "each step takes as many rows from every one")
        if grad_accum < 1 or (batch_size // world_size) % grad_accum:
            raise UsageError(f"--batch-size {batch_size} over {world_size} ranks is {batch_size // world_size} rows "
                             f"a rank, which {grad_accum} micro-batches cannot share evenly")
        self.where = f"rank {rank} of {world_size}"
        self.grad_accum, self.micro_batch = grad_accum, batch_size // (world_size * grad_accum)
        self.share = batch_size // streams  # rows a step of each sub-stream
        self.pin_memory = pin_memory
        # Whole sub-streams to a worker; a worker without one would only end at once
        self.workers = min(num_workers, len(self.owned))
        self._settings = (sub_streams, read, tokenizer, seq_len, pack, epochs, open_rows, specials)
        self._known = {}  # the digests of the pieces read by the checkpoint's sub-streams: load_state_dict's
        self._states = {stream: self._rows(stream).state_dict() for stream in self.owned}
        self._items, self._ended = None, False
        self.steps = 0  # handed out since built or loaded

    def _rows(self, stream: int, state: dict | None = None) -> SubStreamRows:
        """Sub-stream `stream`'s rows, from `state` (SubStreamRows checks it: one line naming it)."""
        sub_streams, read, tokenizer, seq_len, pack, epochs, open_rows, specials = self._settings
        rows = SubStreamRows(sub_streams, stream, read, tokenizer, seq_len, pack, epochs, open_rows, self._known,
                             specials)
        if state is not None:
            rows.load_state_dict(state)
        return rows

    def start(self) -> None:
        """Start the workers now, in the calling thread (read_ahead: the main one), not at the
        first next() (ReadAhead's thread): a process forked while another of its threads runs
        holds, in the child, whatever locks that thread held (an allocator's, OpenMP's)."""
        if self._items is None and not self._ended:
            self._items = iter(self._loader())

    def __next__(self) -> list[tuple[torch.Tensor, ...]]:
        if self._ended:
            raise StopIteration
        self.start()
        parts, states = [], {}
        for _ in range(max(self.workers, 1)):  # one item of each worker, in turn
            step, item = next(self._items)
            if item is None or isinstance(item, UsageError):  # the end, or a shard that cannot be read
                self._ended, self._items = item is None, None  # the workers stop
                if item is None:
                    raise StopIteration
                raise item
            if step != self.steps:  # the workers' items out of turn: the layout would be wrong
                raise RuntimeError(f"step {self.steps}'s shares, and a worker gave step {step}'s")
            streams, fields, stream_states = item
            parts.append(([self.owned.index(stream) for stream in streams], fields))
            for stream, state in zip(streams, stream_states):  # a table of pieces read as before: not sent again
                states[stream] = state if state["read"] is not None else {**state, "read": self._states[stream]["read"]}
        # Local row i is row i // k of owned[i % k] (k = S/W): a (B/S, k, ...) tensor, each
        # worker's sub-streams in their columns, flattened. Pinned, each micro-batch is a slice of it.
        step_fields = []
        for f, first in enumerate(parts[0][1]):
            rows = torch.empty((self.share, len(self.owned), *first.shape[2:]), dtype=first.dtype,
                               pin_memory=self.pin_memory)
            for columns, fields in parts:
                rows[:, columns] = fields[f]
            step_fields.append(rows.flatten(0, 1))
        self._states = {stream: states[stream] for stream in self.owned}  # a new dict: one handed out stays
        self.steps += 1
        return [tuple(field[m * self.micro_batch:(m + 1) * self.micro_batch] for field in step_fields)
                for m in range(self.grad_accum)]

    def _loader(self) -> DataLoader:
        # generator: the iterator's seed for its workers is drawn from it, not from torch's global
        # RNG (which would change the model's dropout). fork: the run's read function is a closure,
        # which a spawned worker could not be sent; a worker forked reads through the parent's.
        more = {"multiprocessing_context": "fork"} if self.workers else {}
        with tokenized.tokenizer_threads(1):  # forked workers tokenize on one thread each, and tokenizers says nothing
            loader = DataLoader(_Shares(self._rows, self.owned, self.share, self._states), batch_size=None,
                                num_workers=self.workers, collate_fn=_as_is, generator=torch.Generator(), **more)
            return iter(loader)

    def state_dict(self) -> dict[int, dict]:
        """{sub-stream: its SubStreamRows.state_dict()} for each sub-stream this rank owns, after
        the last step handed out (a new dict each step: one taken stays as it was). torch.save
        and torch.load(weights_only=True) carry it; a checkpoint gathers every rank's, S in all."""
        return dict(self._states)

    def load_state_dict(self, states: dict, known: dict[int, int] | None = None) -> None:
        """Continue from the states of the sub-streams this rank owns (at another world size
        they are others than it saved: the caller picks them from all S), `known` the digests
        of the pieces all S had read (integrity.known_pieces), against which each piece read
        again is checked. Each state is checked as SubStreamRows checks one (its document in
        progress read again) before anything changes; anything wrong is one UsageError and
        leaves the feed as it was."""
        where = f"the sub-stream states given to {self.where}"
        if not isinstance(states, dict):
            raise UsageError(f"{where} are a {type(states).__name__}, not a dict of sub-stream to state")
        if not all(type(stream) is int for stream in states):  # type(): a bool is no index
            bad = next(stream for stream in states if type(stream) is not int)
            raise UsageError(f"{where} name a sub-stream {bad!r}, not a sub-stream's number")
        others = sorted(stream for stream in states if stream not in self.owned)
        missing = [stream for stream in self.owned if stream not in states]
        if others or missing:
            problem = f"hold sub-streams {others} it does not own" if others else f"lack its sub-streams {missing}"
            raise UsageError(f"{where} {problem} (it owns {self.owned}: give each rank the states of its own)")
        kept, self._known = self._known, known if known is not None else {}
        try:
            for stream in self.owned:
                self._rows(stream, states[stream])
        except BaseException:
            self._known = kept
            raise
        self._states, self._items, self._ended, self.steps = {s: states[s] for s in self.owned}, None, False, 0


class _Shares(IterableDataset):
    """In each worker (or the main process, without workers): its sub-streams from their states,
    and an item a step, (step, (its sub-streams, each field of their B/S rows a step as one
    tensor (B/S, sub-streams, ...), each one's state after them, its table of pieces read None
    where it was sent before)); at the end (step, None), or
    (step, the UsageError) where a shard cannot be read: raised in a worker, it would reach the
    main process wrapped in a traceback, and it is one line."""

    def __init__(self, rows, owned: list[int], share: int, states: dict[int, dict]):
        self.rows, self.owned, self.share, self.states = rows, owned, share, states

    def __iter__(self):
        worker = get_worker_info()
        mine = self.owned[worker.id::worker.num_workers] if worker else self.owned
        step = 0
        try:
            sub_streams = [self.rows(stream, self.states[stream]) for stream in mine]
            sent = {}  # sub-stream: the table of pieces read last sent with its state
            for step in itertools.count():
                shares = []
                for rows in sub_streams:
                    shares.append(list(itertools.islice(rows, self.share)))
                    if len(shares[-1]) < self.share:  # order.py's end: this step cannot be whole
                        yield step, None
                        return
                # row i of each share, sub-stream after sub-stream: one tensor a field, (B/S, its sub-streams, ...)
                fields = default_collate([share[i] for i in range(self.share) for share in shares])
                yield step, (mine, [field.unflatten(0, (self.share, len(mine))) for field in fields],
                             [self._unsent(stream, rows.state_dict(), sent) for stream, rows in zip(mine, sub_streams)])
        except UsageError as e:
            yield step, e

    @staticmethod
    def _unsent(stream: int, state: dict, sent: dict) -> dict:
        """The state to send: its table of pieces read (integrity.PiecesRead.table(), the same
        tensor until a piece is added) as None where it was sent before, which StreamFeed fills
        in from the step before. Sent each step, a table of 12,500 pieces cost the main process
        0.8 ms a sub-stream (bench_stream.py --sections integrity); it changes once a piece."""
        if sent.get(stream) is state["read"]:
            return {**state, "read": None}
        sent[stream] = state["read"]
        return state


def _as_is(item):
    return item  # the items are made in the workers; the main process assembles them (default_convert walks them)


def read_ahead(feed: StreamFeed, device: torch.device) -> ReadAhead:
    """The feed's steps read one ahead onto the device while the step before runs (ReadAhead),
    until the feed ends; its state_dict() is the feed's after the step last handed to the loop,
    which is what a checkpoint saves (the feed itself stands a step or two ahead)."""
    feed.start()
    return ReadAhead(itertools.chain.from_iterable(feed), feed.grad_accum, device, steps=None,
                     state_dict=feed.state_dict)


FAILED = 2  # next_step's word for a feed that met a shard it cannot read (0: a step, 1: the end)


def next_step(steps: Iterator[list], group=None) -> list | None:
    """The next step's micro-batches, or None on every rank once some rank's feed has ended: a
    rank sees only its own sub-streams, so the ranks' feeds end at different steps, and every
    rank must stop before the same one. A shard that one rank's feed cannot read (a UsageError
    naming the file and the row) is raised on every rank, the lowest such rank's line: raised
    on that rank alone, it would leave the others in the step's collectives, to end in
    gloo's traceback when its connection closes (NCCL: its timeout). One all-reduce of one int
    a step (stopping.agreed's way, on `group`: the trainers' gloo control group), every rank
    calling it, and one exchange of the line where a rank failed. No process group (`group`
    None and none initialized): the step, or the error, as next() gives it."""
    try:
        step, failed = next(steps, None), None
    except UsageError as e:
        step, failed = None, e
    if group is None and not dist.is_initialized():
        if failed is not None:
            raise failed
        return step
    said = torch.tensor([FAILED if failed is not None else int(step is None)], dtype=torch.int32)
    dist.all_reduce(said, op=dist.ReduceOp.MAX, group=group)
    if said.item() == FAILED:
        lines = [None] * (group.size() if group is not None else dist.get_world_size())
        dist.all_gather_object(lines, None if failed is None else str(failed), group=group)
        raise UsageError(next(line for line in lines if line is not None))  # the same line everywhere
    return None if said.item() else step


class AgreedSteps(Iterator[list]):
    """What the loop takes: next() is next_step's (StopIteration on every rank at the same step;
    a shard one rank cannot read, its line on every rank), state_dict() ReadAhead's (that of the
    steps handed to the loop, for gather_states)."""

    def __init__(self, steps: ReadAhead, group=None):
        self.steps, self.group = steps, group

    def __next__(self) -> list:
        step = next_step(self.steps, self.group)
        if step is None:
            raise StopIteration
        return step

    def state_dict(self) -> dict[int, dict]:
        return self.steps.state_dict()
