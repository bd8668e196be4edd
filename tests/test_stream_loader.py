"""--stream's loader (training/stream/loader.py): one rank's share of each global batch, laid out
as order.py lays it, the same global batches at every world size; resumed bitwise from the
states of the steps handed out (not of the rows its workers read ahead), at the same world size
and at another; each sub-stream produced by one worker; the end, and a shard one rank cannot
read, agreed by the ranks."""

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from benchmarks.stream_state import on_gloo_ranks
from test_stream_rows import SEED, Corpus, corpus, small_pieces, through_a_checkpoint, tokenizer  # noqa: F401
from test_stream_shards import write, write_lines
from training.errors import UsageError
from training.stream import order
from training.stream.loader import AgreedSteps, StreamFeed, next_step, read_ahead
from training.stream.order import SubStreams
from training.stream.rows import SubStreamRows

STREAMS, BATCH, SEQ_LEN, EPOCHS, OPEN_ROWS = 4, 8, 8, 2, 3
SHARE = BATCH // STREAMS  # rows a step of each sub-stream
FRAMINGS = pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])


def feed_of(corpus: Corpus, tokenizer, pack: bool, world_size: int = 1, rank: int = 0, grad_accum: int = 1,
            num_workers: int = 0) -> StreamFeed:
    return StreamFeed(SubStreams(corpus.sizes, STREAMS, SEED), corpus.read, tokenizer, SEQ_LEN, pack, EPOCHS,
                      BATCH, world_size, rank, grad_accum, num_workers, open_rows=OPEN_ROWS)


def local_rows(step: list[tuple]) -> tuple:
    """A step's micro-batches put back together: the rank's rows of the step, field by field."""
    return tuple(torch.cat(field) for field in zip(*step))


def global_batch(steps_of_ranks: list[list[tuple]]) -> tuple:
    """The ranks' rows of one step in global order: rank r's local row i is global row r + W*i."""
    world_size = len(steps_of_ranks)
    fields = []
    for f in range(len(steps_of_ranks[0])):
        rows = torch.empty((BATCH, *steps_of_ranks[0][f].shape[1:]), dtype=steps_of_ranks[0][f].dtype)
        for rank, local in enumerate(steps_of_ranks):
            rows[rank::world_size] = local[f]
        fields.append(rows)
    return tuple(fields)


def expected_batches(corpus: Corpus, tokenizer, pack: bool) -> list[tuple]:
    """order.py's layout, from each sub-stream's rows alone: row j of step t is the (j // S)-th
    row that step takes from sub-stream j % S; the run ends at the first step a sub-stream
    cannot give its B/S rows."""
    sub_streams = SubStreams(corpus.sizes, STREAMS, SEED)
    rows = [list(SubStreamRows(sub_streams, s, corpus.read, tokenizer, SEQ_LEN, pack, EPOCHS, OPEN_ROWS))
            for s in range(STREAMS)]
    steps = min(len(r) for r in rows) // SHARE
    return [default_collate([rows[j % STREAMS][t * SHARE + j // STREAMS] for j in range(BATCH)]) for t in range(steps)]


def equal(a, b) -> bool:
    return len(a) == len(b) and all(t.dtype == u.dtype and torch.equal(t, u) for t, u in zip(a, b))


def same_steps(a: list[list[tuple]], b: list[list[tuple]]) -> bool:
    return len(a) == len(b) and all(len(s) == len(t) and all(map(equal, s, t)) for s, t in zip(a, b))


@FRAMINGS
def test_the_ranks_rows_are_the_same_global_batches_at_every_world_size(corpus, tokenizer, pack):
    """For every step of a 2-epoch run: W = 1's step is order.py's layout of the sub-streams'
    rows, and the ranks' rows at W = 2 and 4, put in global order, are the same batch; each
    micro-batch stacked as the DataLoader's default collate stacks its rows. The ranks' feeds
    end at different steps; the earliest is W = 1's end."""
    expected = expected_batches(corpus, tokenizer, pack)
    assert len(expected) > 10
    for world_size, grad_accum in [(1, 1), (1, 4), (2, 1), (2, 2), (4, 1)]:
        ranks = [list(feed_of(corpus, tokenizer, pack, world_size, rank, grad_accum)) for rank in range(world_size)]
        assert min(map(len, ranks)) == len(expected), world_size
        for t, batch in enumerate(expected):
            steps = [ranks[rank][t] for rank in range(world_size)]
            assert all(len(step) == grad_accum for step in steps)
            assert all(len(micro[0]) == BATCH // (world_size * grad_accum) for step in steps for micro in step)
            assert equal(global_batch([local_rows(step) for step in steps]), batch), (world_size, t)
        if world_size == 4:
            assert len(set(map(len, ranks))) > 1  # the ranks alone would end apart: they must agree
    first = feed_of(corpus, tokenizer, pack, 2, 1, grad_accum=2)
    micro = next(first)[1]  # rank 1's local rows 2 and 3: global rows 5 and 7
    assert equal(micro, default_collate([tuple(field[j] for field in expected[0]) for j in (5, 7)]))


@FRAMINGS
def test_workers_give_the_same_steps_each_sub_stream_built_in_one_worker(corpus, tokenizer, pack, monkeypatch,
                                                                         tmp_path):
    """Two workers, each given whole sub-streams: every owned sub-stream is built once, in one
    worker, both workers busy; the steps are those of the feed without workers."""
    built, real = tmp_path / "built", StreamFeed._rows

    def logged(self, stream, state=None):
        with open(built, "a") as log:
            log.write(f"{os.getpid()} {stream}\n")
        return real(self, stream, state)
    monkeypatch.setattr(StreamFeed, "_rows", logged)
    without = list(feed_of(corpus, tokenizer, pack, world_size=1))
    built.unlink()
    with_workers = list(feed_of(corpus, tokenizer, pack, world_size=1, num_workers=2))
    assert same_steps(with_workers, without)
    in_workers = [line.split() for line in built.read_text().splitlines() if line.split()[0] != str(os.getpid())]
    assert sorted(int(stream) for _, stream in in_workers) == list(range(STREAMS))  # each once
    assert len({pid for pid, _ in in_workers}) == 2


@FRAMINGS
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_states_after_any_step_resume_with_the_rest(corpus, tokenizer, pack, num_workers):
    """At W = 2, rank 1 (and W = 1 with workers: two sub-streams a worker), from the states
    after every step, through torch.save and torch.load(weights_only=True): the rest, bitwise,
    the end included. The workers read ahead; the states are those of the steps handed out."""
    world_size = 1 if num_workers else 2
    rank = world_size - 1
    everything = list(feed_of(corpus, tokenizer, pack, world_size, rank))
    uninterrupted = feed_of(corpus, tokenizer, pack, world_size, rank, num_workers=num_workers)
    alone = {stream: SubStreamRows(SubStreams(corpus.sizes, STREAMS, SEED), stream, corpus.read, tokenizer, SEQ_LEN,
                                   pack, EPOCHS, open_rows=OPEN_ROWS)
             for stream in order.owned(STREAMS, world_size, rank)}
    for cut in range(len(everything) + 1):
        states = through_a_checkpoint(uninterrupted.state_dict())
        assert sorted(states) == order.owned(STREAMS, world_size, rank)
        # each as the sub-stream's rows alone give it after as many rows: its table of pieces read
        # too, which a worker sends only in the step it changes (loader._Shares._unsent)
        assert all(torch.equal(states[stream]["read"], rows.state_dict()["read"]) and
                   states[stream]["cursor"] == rows.state_dict()["cursor"] for stream, rows in alone.items()), cut
        assert any(len(state["read"]) for state in states.values()) or cut < len(everything) // 2
        for rows in alone.values():
            for _ in range(SHARE):
                next(rows, None)
        resumed = feed_of(corpus, tokenizer, pack, world_size, rank, num_workers=num_workers)
        resumed.load_state_dict(states)
        assert same_steps(list(resumed), everything[cut:]), cut
        if cut < len(everything):
            assert same_steps([next(uninterrupted)], everything[cut:cut + 1])
    assert next(uninterrupted, None) is None and next(uninterrupted, None) is None


@FRAMINGS
def test_states_saved_at_two_ranks_resume_at_one_and_at_four(corpus, tokenizer, pack):
    """The states of W = 2's ranks after step k, gathered, each new rank given those of the
    sub-streams it owns: W = 1 and W = 4 train the uninterrupted run's global batches after k."""
    expected = expected_batches(corpus, tokenizer, pack)
    saving = [feed_of(corpus, tokenizer, pack, 2, rank) for rank in range(2)]
    for cut in range(len(expected) + 1):
        saved = through_a_checkpoint({s: state for feed in saving for s, state in feed.state_dict().items()})
        for world_size in (1, 4):
            ranks = []
            for rank in range(world_size):
                resumed = feed_of(corpus, tokenizer, pack, world_size, rank)
                resumed.load_state_dict({s: saved[s] for s in order.owned(STREAMS, world_size, rank)})
                ranks.append([local_rows(step) for step in resumed])
            assert min(map(len, ranks)) == len(expected) - cut, (cut, world_size)
            assert all(equal(global_batch([r[t] for r in ranks]), expected[cut + t])
                       for t in range(len(expected) - cut)), (cut, world_size)
        for feed in saving:
            next(feed, None)


def test_the_ranks_agree_on_the_end_through_one_all_reduce_a_step(corpus, tokenizer):
    """Four ranks, each its gloo process group in a thread: every rank stops before the step the
    earliest rank's feed lacks, W = 1's end, though the others could go on alone."""
    steps, store, errors = len(expected_batches(corpus, tokenizer, False)), dist.HashStore(), []
    alone = [sum(1 for _ in feed_of(corpus, tokenizer, False, 4, rank)) for rank in range(4)]
    taken = [0] * 4

    def rank_loop(rank):
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("end", store), rank, 4, datetime.timedelta(seconds=60))
            feed = feed_of(corpus, tokenizer, False, 4, rank)
            while next_step(feed, group) is not None:
                taken[rank] += 1
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and taken == [steps] * 4 and max(alone) > steps == min(alone), (errors, taken, alone)


def test_a_shard_one_rank_cannot_read_ends_every_rank_before_the_same_step_with_its_line():
    """Rank 2's feed meets a damaged shard at its fourth step; ranks 0, 1 and 3 could read on.
    Through AgreedSteps (the loop's next()), every rank raises rank 2's line before step 4, none
    left in a collective the others never join. Four gloo ranks, each a thread."""
    said = "cannot read shard s.jsonl: line 9: JSON parse error"

    def steps(rank):
        for step in range(10):
            if rank == 2 and step == 3:
                raise UsageError(said)
            yield [(torch.full((1, 2), step),)]

    def rank_loop(rank, group):
        taken = 0
        try:
            for _ in AgreedSteps(steps(rank), group):
                taken += 1
        except UsageError as e:
            return taken, str(e)
        return taken, None
    assert on_gloo_ranks(4, rank_loop) == [(3, said)] * 4


@FRAMINGS
def test_read_ahead_gives_the_state_of_the_steps_the_loop_took(corpus, tokenizer, pack):
    """Through ReadAhead the feed stands a step or two ahead of the loop; read_ahead's
    state_dict() is that of the steps the loop took, and resumes with the rest; at the end,
    StopIteration at every call."""
    everything = list(feed_of(corpus, tokenizer, pack, 2, 0, grad_accum=2))
    feed = feed_of(corpus, tokenizer, pack, 2, 0, grad_accum=2)
    batches = read_ahead(feed, torch.device("cpu"))
    for cut in range(len(everything) + 1):
        deadline = time.monotonic() + 60
        while feed.steps < min(cut + 1, len(everything)) and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread reads the step after the loop's
        state = through_a_checkpoint(batches.state_dict())
        assert cut == len(everything) or feed.steps > cut  # the feed stands ahead of the loop
        resumed = feed_of(corpus, tokenizer, pack, 2, 0, grad_accum=2)
        resumed.load_state_dict(state)
        assert same_steps(list(resumed), everything[cut:]), cut
        if cut < len(everything):
            assert same_steps([next(batches)], everything[cut:cut + 1])
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(batches)


def test_iterating_leaves_torchs_global_rng_as_it_was(corpus, tokenizer):
    """A DataLoader's iterator draws its workers' seed from torch's RNG unless given a generator:
    the model's dropout would then depend on whether the run streams."""
    before = torch.get_rng_state()
    for num_workers in (0, 1):
        next(feed_of(corpus, tokenizer, True, num_workers=num_workers))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_shard_damaged_mid_stream_is_one_line_from_a_worker(tmp_path, tokenizer):
    """A bad JSON line that a worker meets: one line naming the file and the line, as the main
    process would say it, not the DataLoader's traceback of the worker."""
    for i in range(4):
        write(tmp_path / f"{i}.parquet", [f"document {i} {j} " * 5 for j in range(30)])
    write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', '{"text": "fine too"}'])
    corpus = Corpus(tmp_path)
    write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', '{"text": "fine too"]'])  # the size it was listed at
    with pytest.raises(UsageError) as error:
        list(feed_of(corpus, tokenizer, False, num_workers=2))
    assert "bad.jsonl: line 2: JSON parse error" in str(error.value) and "\n" not in str(error.value)


def test_a_line_nested_too_deep_for_json_mid_stream_is_one_line_from_a_worker(tmp_path, tokenizer):
    """A line of 100,000 "[" that a worker meets: Python's JSON reader recursed into a
    RecursionError, the worker's traceback, exit 1. Now the line any bad JSON line is."""
    for i in range(4):
        write(tmp_path / f"{i}.parquet", [f"document {i} {j} " * 5 for j in range(30)])
    fine = '{"text": "' + "x" * 100_000 + '"}'
    write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', fine])
    corpus = Corpus(tmp_path)
    write_lines(tmp_path / "bad.jsonl", ['{"text": "fine"}', "[" * len(fine)])  # the size it was listed at
    with pytest.raises(UsageError) as error:
        list(feed_of(corpus, tokenizer, False, num_workers=2))
    assert "bad.jsonl: line 2: JSON parse error: arrays or objects nested deeper than Python's JSON reader can " \
           "follow" in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------
# What a run is given: one line for what cannot work


def test_a_batch_the_sub_streams_or_the_micro_batches_cannot_share_is_one_line(corpus, tokenizer):
    sub_streams = SubStreams(corpus.sizes, STREAMS, SEED)

    def refused(batch_size, world_size, grad_accum=1) -> str:
        with pytest.raises(UsageError) as error:
            StreamFeed(sub_streams, corpus.read, tokenizer, SEQ_LEN, False, EPOCHS, batch_size, world_size, 0,
                       grad_accum)
        return str(error.value)
    assert "--batch-size 6 is not a multiple of the run's 4 sub-streams" in refused(6, 1)
    assert "3 ranks cannot share the run's 4 sub-streams evenly: it runs and resumes at 1, 2, 4" in refused(12, 3)
    assert "--batch-size 8 over 2 ranks is 4 rows a rank, which 3 micro-batches cannot share" in refused(8, 2, 3)


def test_hostile_states_are_one_line_and_change_nothing(corpus, tokenizer):
    feed = feed_of(corpus, tokenizer, True, 2, 1)
    for _ in range(3):
        next(feed)
    states, rest = feed.state_dict(), list(feed_of(corpus, tokenizer, True, 2, 1))[3:]
    where = "the sub-stream states given to rank 1 of 2"
    cases = [
        ([1, 3], f"{where} are a list, not a dict of sub-stream to state"),
        ({**states, "1": states[1]}, f"{where} name a sub-stream '1', not a sub-stream's number"),
        ({True: states[1], 3: states[3]}, f"{where} name a sub-stream True"),
        ({**states, 0: states[1]}, f"{where} hold sub-streams [0] it does not own (it owns [1, 3]: give each rank"),
        ({1: states[1]}, f"{where} lack its sub-streams [3] (it owns [1, 3]"),
        ({1: states[1], 3: [1, 2]}, "sub-stream 3's rows in the checkpoint are not a sub-stream's state: it holds "
                                    "list"),
        ({1: states[3], 3: states[1]}, "sub-stream 1's position in the checkpoint is sub-stream 3 of 4, not 1 of 4"),
    ]
    for bad, said in cases:
        with pytest.raises(UsageError) as error:
            feed.load_state_dict(bad)
        assert said in str(error.value) and "\n" not in str(error.value), (said, str(error.value))
    assert same_steps(list(feed), rest) and len(rest) > 5  # each refused, and the feed went on as it was


def test_bench_stream_measures_the_state_a_step_at_toy_size(tmp_path, capsys):
    """bench_stream.py --sections loader on a 1 MB corpus: a packed sub-stream's state, its size,
    the time to make it and to receive it from a worker, against its cursor alone."""
    from benchmarks import bench_stream
    results = bench_stream.main(["--mb", "1", "--seq-lens", "64", "--vocab-size", "300", "--data-dir", str(tmp_path),
                                 "--sections", "loader"])
    assert list(results) == ["loader"] and list(results["loader"]) == [64]
    row = results["loader"][64]
    assert 0 < row["open_rows"] <= 128 and 0 < row["mb"] <= 128 * 2 * 64 * 4 / 1e6  # open rows of 64 positions
    assert min(row["make_ms"], row["receive_ms"], row["cursor_ms"]) > 0 and row["received_mb"] == row["mb"]
    assert "the loader's state a step" in capsys.readouterr().out
