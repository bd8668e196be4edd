"""--stream's order (training/stream/order.py): each epoch the corpus's pieces shuffled by the
seed and the epoch and dealt, balanced, to a fixed number of sub-streams; each sub-stream a
fixed sequence of documents that a cursor taken after any document resumes exactly, across
pieces and epochs; the sub-streams shared out to any world size that divides their number."""

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from training.errors import UsageError
from training.stream.order import Cursor, SubStreams, deal, documents, owned

SEED = 1337


def least_first(sizes: list[int], streams: int, seed: int, epoch: int) -> list[list[int]]:
    """The deal as it is usually written: the pieces in the shuffle of (seed, epoch), each to the
    sub-stream with the least size so far, the lowest of those that tie."""
    dealt, loads = [[] for _ in range(streams)], [0] * streams
    for piece in np.random.default_rng([seed, epoch]).permutation(len(sizes)).tolist():
        stream = min(range(streams), key=lambda s: (loads[s], s))
        dealt[stream].append(piece)
        loads[stream] += sizes[piece]
    return dealt


# ---- the deal ----------------------------------------------------------------------------------

def test_the_deal_is_the_same_everywhere():
    sizes = [5, 3, 8, 1, 0, 7, 2, 2]
    assert deal(sizes, 3, SEED, 0) == deal(list(np.array(sizes)), 3, SEED, 0)  # numpy's sizes: the same
    # written out: a numpy (or anything) that dealt otherwise would read other documents on resume
    assert deal(sizes, 3, SEED, 0) == [[5, 1], [3, 6, 4, 7, 0], [2]]
    assert deal(sizes, 3, SEED, 1) == [[5, 1], [4, 0, 6, 3], [7, 2]]


@pytest.mark.parametrize("streams", [1, 2, 3, 8])
def test_every_piece_goes_to_one_sub_stream_least_size_first(streams):
    rng = np.random.default_rng(streams)
    for trial in range(20):
        sizes = rng.integers(0, 1000, rng.integers(streams, 60)).tolist()
        sizes[:streams] = [1] * streams  # enough pieces hold data
        sizes = [size * size // 1000 if trial % 2 else size for size in sizes]  # skewed: a few large pieces
        sizes[:streams] = [max(size, 1) for size in sizes[:streams]]
        for epoch in range(3):
            dealt = deal(sizes, streams, trial, epoch)
            assert sorted(itertools.chain(*dealt)) == list(range(len(sizes)))  # every piece once
            assert dealt == least_first(sizes, streams, trial, epoch)
            loads = [sum(sizes[p] for p in pieces) for pieces in dealt]
            assert max(loads) - min(loads) <= max(sizes)  # within the largest piece of each other


def test_each_epoch_and_each_seed_deal_otherwise():
    sizes = [10] * 20
    deals = {(seed, epoch): deal(sizes, 4, seed, epoch) for seed in (0, 1, SEED) for epoch in range(3)}
    assert len({json.dumps(d) for d in deals.values()}) == len(deals)
    assert deals[(1, 0)] != deals[(0, 1)]  # seeded by the pair: not seed + epoch


@pytest.mark.parametrize("seed", [0, 7, SEED])
def test_the_sub_streams_follow_the_deal_of_their_own_seed(seed):
    """SubStreams, which every cursor of a run reads by (and so every row it trains), deals by
    the seed it is given, epoch after epoch, and names that deal in every cursor's state: 20
    pieces into 4 sub-streams, where the three seeds deal otherwise in every epoch (asserted, so
    that a seed fixed anywhere on the way cannot pass). test_stream_scripts.py holds the other
    end: a script's --seed reaching it."""
    sizes = [10] * 20
    sub_streams, others = SubStreams(sizes, 4, seed), [other for other in (0, 7, SEED) if other != seed]
    for epoch in range(3):
        dealt = deal(sizes, 4, seed, epoch)
        assert [sub_streams.pieces(stream, epoch) for stream in range(4)] == dealt
        assert dealt == deal(sizes, 4, seed, epoch) and all(deal(sizes, 4, other, epoch) != dealt for other in others)
    first = [Cursor(sub_streams, stream).state_dict()["dealt"] for stream in range(4)]
    assert all(first != [Cursor(SubStreams(sizes, 4, other), stream).state_dict()["dealt"] for stream in range(4)]
               for other in others)


def test_a_corpus_with_fewer_pieces_of_data_than_sub_streams_is_refused():
    with pytest.raises(UsageError, match=r"^the corpus has 1 pieces that hold data .* fewer than the 2 sub-streams"):
        SubStreams([3, 0, 0], 2, SEED)
    assert deal([3], 1, SEED, 0) == [[0]]  # a single piece: one sub-stream


# ---- the world ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_the_ranks_share_the_sub_streams_and_rebuild_the_global_batch(world_size):
    streams, batch = 8, 32
    shares = [owned(streams, world_size, rank) for rank in range(world_size)]
    assert sorted(itertools.chain(*shares)) == list(range(streams))
    assert all(len(share) == streams // world_size and all(s % world_size == rank for s in share)
               for rank, share in enumerate(shares))
    # the layout in the module's docstring: rank r's local row i, from its sub-streams in turn, is
    # row j = r + W i of the global batch, which is row j // S of this step from sub-stream j % S
    per_rank = batch // world_size
    placed = {rank + world_size * i: (share[i % len(share)], i // len(share))
              for rank, share in enumerate(shares) for i in range(per_rank)}
    assert placed == {j: (j % streams, j // streams) for j in range(batch)}


def test_a_world_size_that_does_not_divide_the_sub_streams_is_refused():
    with pytest.raises(UsageError, match=r"^3 ranks cannot share the run's 8 sub-streams evenly: "
                                         r"it runs and resumes at 1, 2, 4, 8 ranks$"):
        owned(8, 3, 0)


# ---- the documents -----------------------------------------------------------------------------

class Corpus:
    """Pieces in memory: piece p holds rows 0 .. rows[p] - 1, the document of row r "p{p}r{r}",
    but for the rows in `skipped` (empty documents, which a reader leaves out)."""

    def __init__(self, rows: list[int], skipped: set[tuple[int, int]] = frozenset()):
        self.rows, self.reads = rows, 0
        self.pieces = [[(r, f"p{p}r{r}") for r in range(n) if (p, r) not in skipped] for p, n in enumerate(rows)]

    def read(self, piece: int, start_row: int):
        self.reads += 1  # a cursor that never moves on could read an empty piece forever, yielding nothing
        assert self.reads < 10**5, "read forever"
        if start_row > self.rows[piece]:
            raise UsageError(f"piece {piece} has {self.rows[piece]} rows, and the cursor is at row {start_row}")
        return iter([(row, text) for row, text in self.pieces[piece] if row >= start_row])

    def expected(self, sub_streams: SubStreams, stream: int, epochs: int) -> list[str]:
        """What the sub-stream reads, written out from the deal."""
        return [text for epoch in range(epochs) for piece in sub_streams.pieces(stream, epoch)
                for _, text in self.pieces[piece]]


CORPORA = {  # made afresh for each test, its reads counted from 0
    # pieces of many sizes, two empty, two with rows left out (the first and last of one)
    "pieces": lambda: Corpus([3, 0, 5, 1, 4, 2, 0, 6, 3], skipped={(4, 1), (7, 0), (7, 5)}),
    "one piece": lambda: Corpus([4]),
}
EPOCHS = 3


def read_through(cursor: Cursor, read, limit: int) -> list[str]:
    """The documents from the cursor to the end, no more than `limit` (a cursor that never moves
    on would read forever)."""
    return list(itertools.islice(documents(cursor, read, EPOCHS), limit))


@pytest.mark.parametrize("name, streams", [("pieces", 1), ("pieces", 2), ("pieces", 3), ("one piece", 1)])
def test_a_cursor_taken_after_any_document_resumes_with_the_rest(name, streams):
    corpus = CORPORA[name]()
    sub_streams = SubStreams(corpus.rows, streams, SEED)
    for stream in range(streams):
        everything = corpus.expected(sub_streams, stream, EPOCHS)
        assert read_through(Cursor(sub_streams, stream), corpus.read, len(everything) + 1) == everything
        for cut in range(len(everything) + 1):
            cursor = Cursor(sub_streams, stream)
            first = list(itertools.islice(documents(cursor, corpus.read, EPOCHS), cut))
            state = json.loads(json.dumps(cursor.state_dict()))  # as a checkpoint holds it
            resumed = Cursor(SubStreams(corpus.rows, streams, SEED), stream)  # in another process
            resumed.load_state_dict(state)
            assert first + read_through(resumed, corpus.read, len(everything) + 1) == everything, cut


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_the_sub_streams_of_an_epoch_read_every_document_once(streams):
    corpus = CORPORA["pieces"]()
    sub_streams = SubStreams(corpus.rows, streams, SEED)
    every = sorted(text for piece in corpus.pieces for _, text in piece)
    for epoch in range(EPOCHS):
        read = Counter()
        for stream in range(streams):
            cursor = Cursor(sub_streams, stream)
            cursor.epoch = epoch
            read.update(itertools.islice(documents(cursor, corpus.read, epoch + 1), len(every) + 1))
        assert sorted(read.elements()) == every


def test_pieces_that_hold_no_document_are_one_line_not_a_search_without_end():
    asked = Counter()

    def nothing(piece, start_row):
        asked[piece] += 1
        assert asked[piece] < 100, "read forever"
        return iter([])

    with pytest.raises(UsageError, match=r"^sub-stream 0 read no document in epoch 0: its pieces \[0\] hold none"):
        next(documents(Cursor(SubStreams([5], 1, SEED), 0), nothing))


def test_rows_that_do_not_rise_are_refused():
    def backwards(piece, start_row):
        return iter([(start_row, "a"), (start_row, "b")])

    with pytest.raises(ValueError, match=r"gave row 0 after asked for row 1 on"):
        list(documents(Cursor(SubStreams([5], 1, SEED), 0), backwards, epochs=1))


# ---- the checkpoint ----------------------------------------------------------------------------

def mid_stream() -> tuple[Cursor, dict]:
    """A cursor part-way through the second epoch's second piece, and its state."""
    corpus = CORPORA["pieces"]()
    sub_streams = SubStreams(corpus.rows, 2, SEED)
    cursor = Cursor(sub_streams, 1)
    for _ in documents(cursor, corpus.read):
        if (cursor.epoch, cursor.piece, cursor.row) >= (1, 1, 2):
            break
    return cursor, cursor.state_dict()


def hostile(state: dict, pieces: int) -> dict:
    """Each state a damaged or stale checkpoint could hold, and what its line says."""
    return {
        "a list": ([1, 2], "is not one: it holds list"),
        "a field missing": ({k: v for k, v in state.items() if k != "row"}, "is not one: it holds"),
        "a field too many": ({**state, "buffer": []}, "is not one: it holds"),
        "a key not a string": ({**state, 1: 2}, "is not one: it holds"),
        "a negative row": ({**state, "row": -1}, "row is -1, not a whole number"),
        "a row of True": ({**state, "row": True}, "row is True, not a whole number"),
        "a row of 2.0": ({**state, "row": 2.0}, "row is 2.0, not a whole number"),
        "a piece in a string": ({**state, "piece": "1"}, "piece is '1', not a whole number"),
        "an epoch past 2**63": ({**state, "epoch": 2**63}, f"epoch is {2**63}, not a whole number"),
        "another sub-stream": ({**state, "stream": 0}, "is sub-stream 0 of 2, not 1 of 2"),
        "another count": ({**state, "streams": 4}, "is sub-stream 1 of 4, not 1 of 2"),
        "a piece past the last": ({**state, "piece": pieces + 1}, f"reads {pieces} pieces that epoch"),
        "a row past the last piece": ({**state, "piece": pieces, "row": 1}, f"reads {pieces} pieces that epoch"),
        "another deal": ({**state, "dealt": "0" * 16}, "counts in other pieces than this run deals it"),
        "another epoch's deal": ({**state, "epoch": 0}, "counts in other pieces than this run deals it"),
        "a deal not a string": ({**state, "dealt": 7}, "counts in other pieces than this run deals it"),
    }


@pytest.mark.parametrize("case", list(hostile({}, 0)))
def test_a_hostile_or_stale_state_is_refused_in_one_line(case):
    cursor, state = mid_stream()
    pieces = len(cursor.sub_streams.pieces(1, state["epoch"]))
    bad, says = hostile(state, pieces)[case]
    with pytest.raises(UsageError) as refused:
        cursor.load_state_dict(bad)
    assert str(refused.value).startswith("sub-stream 1's position in the checkpoint") and says in str(refused.value)
    assert "\n" not in str(refused.value)
    assert cursor.state_dict() == state  # nothing moved
