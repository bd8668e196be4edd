"""--stream --pack: training/stream/packer.py places a stream's windows in rows as they come,
best fit over a bounded number of open rows; its state resumes it exactly; its rows make the
tensors --pack makes."""

import io

import datasets
import numpy as np
import pytest
import torch

import data
from test_packing import stored_windows
from training import packing
from training.errors import UsageError
from training.packing import PackedSequenceDataset
from training.stream import packer as stream_packer
from training.stream.packer import OnlinePacker, row_tensors


def stream(n: int, seq_len: int, seed: int = 0) -> list[np.ndarray]:
    """n windows of every size a stream brings (full ones, any size, many small ones, some of
    one target), window i's first token i: a window is known by it wherever it goes."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 4, n)
    fills = np.where(kinds == 0, seq_len, np.where(kinds == 1, rng.integers(1, seq_len + 1, n),
                                                   np.where(kinds == 2, rng.integers(1, max(2, seq_len // 4), n), 1)))
    return [np.array([i, *rng.integers(3, 1000, fills[i])], dtype=np.int64) for i in range(n)]


def packed(packer: OnlinePacker, windows) -> list[list[np.ndarray]]:
    """Every row the windows make, the flush's last, checking each add on the way: it closes
    at most one row, and leaves at most open_rows open."""
    rows = []
    for window in windows:
        closed = packer.add(window)
        assert len(closed) <= 1 and len(packer) <= packer.open_rows
        rows += closed
    return rows + packer.flush()


def numbers(rows) -> list[list[int]]:
    return [[int(window[0]) for window in row] for row in rows]


def plain_online_best_fit(fills: list[int], seq_len: int, open_rows: int, most: int) -> list[list[int]]:
    """The rule as it is usually written, a window at a time over a list of open rows, oldest
    first: the open row with the least room that fits the window (of those, the oldest), else
    a new row; a row closes when full or holding `most` windows; one row too many open, the
    fullest closes (of those, the oldest). The rows closed, then the rest oldest first."""
    open_rows_, closed = [], []

    def room(row):
        return seq_len - sum(fills[i] for i in row)
    for i, n in enumerate(fills):
        fits = [row for row in open_rows_ if room(row) >= n]
        row = min(fits, key=room) if fits else None  # min: the first of equals, the oldest
        if row is None:
            row = []
            open_rows_.append(row)
        row.append(i)
        if room(row) == 0 or len(row) == most:
            open_rows_.remove(row)
            closed.append(row)
        elif len(open_rows_) > open_rows:
            fullest = min(open_rows_, key=room)
            open_rows_.remove(fullest)
            closed.append(fullest)
    return closed + open_rows_


@pytest.mark.parametrize("seq_len, open_rows, max_windows", [(32, 8, None), (64, 3, None), (16, 5, 4), (32, 1, None)])
def test_each_window_goes_to_the_open_row_it_fits_best_and_leaves_in_exactly_one_row(seq_len, open_rows, max_windows):
    windows = stream(600, seq_len, seed=seq_len + open_rows)
    packer = OnlinePacker(seq_len, open_rows, max_windows)
    rows = packed(packer, windows)
    fills = [len(window) - 1 for window in windows]
    assert numbers(rows) == plain_online_best_fit(fills, seq_len, open_rows, packer.max_windows - 1)
    placed = [window for row in rows for window in row]
    assert sorted(int(w[0]) for w in placed) == list(range(len(windows)))  # each once
    assert all(w is windows[int(w[0])] for w in placed)  # whole: the window itself
    assert all(numbers([row])[0] == sorted(numbers([row])[0]) for row in rows)  # in the order they came
    assert max(sum(len(w) - 1 for w in row) for row in rows) <= seq_len
    assert max(map(len, rows)) <= packer.max_windows - 1
    assert len(rows) < 0.8 * len(windows)  # several a row: packed
    # the same windows in the same order: the same rows
    assert numbers(packed(OnlinePacker(seq_len, open_rows, max_windows), windows)) == numbers(rows)


def test_windows_that_fill_a_row_leave_at_once_one_a_row():
    packer = OnlinePacker(16, open_rows=4)
    for window in stream(50, 16):
        if len(window) == 17:
            assert [[w is window for w in row] for row in packer.add(window)] == [[True]]
            assert len(packer) == 0
    assert packer.flush() == []


def test_a_row_of_as_many_windows_as_its_bound_leaves_and_every_row_has_one_cu_seqlens_length():
    """Windows of one target (empty documents) fill a row of 512 positions 32 at a time: it
    leaves with room to spare, and its cu_seqlens are as long as every other row's."""
    assert [stream_packer.window_bound(n) for n in (8, 16, 512, 1024, 2048)] == [9, 17, 33, 65, 129]
    packer = OnlinePacker(512, open_rows=4)
    rows = packed(packer, [np.array([i, 5]) for i in range(100)] + stream(50, 512))
    assert [len(row) for row in rows[:3]] == [32, 32, 32]
    tensors = row_tensors(rows, 512, pad_id=0, max_windows=packer.max_windows)
    assert {tuple(cu_seqlens.shape) for *_, cu_seqlens in tensors} == {(34,)}
    assert tensors[0][3][:34].tolist() == [*range(33), 512]  # 32 windows of one, then the padding


def test_a_window_outside_1_to_seq_len_positions_is_refused():
    packer = OnlinePacker(8, open_rows=2)
    for tokens in (1, 10):
        with pytest.raises(ValueError, match=f"a window of {tokens} tokens: each holds 2 to seq_len \\+ 1 \\(9\\)"):
            packer.add(np.arange(tokens))
    assert len(packer) == 0


def round_trip(state: dict) -> dict:
    """The state as a checkpoint holds it: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("seq_len, open_rows", [(32, 8), (64, 3)])
def test_a_packer_resumed_from_its_state_after_any_window_gives_the_rows_of_the_uninterrupted_one(seq_len, open_rows):
    """At every cut of 300 windows: the rows a packer restored from the state gives are,
    token for token and in order, those the uninterrupted packer gives after the cut."""
    windows = stream(300, seq_len, seed=open_rows)
    packer, after = OnlinePacker(seq_len, open_rows), []  # after[c]: the rows closed by window c on
    states = []
    for window in windows:
        states.append(round_trip(packer.state_dict()))
        after.append(packer.add(window))
    after.append(packer.flush())
    for cut, state in enumerate(states):
        resumed = OnlinePacker(seq_len, open_rows)
        resumed.load_state_dict(state)
        rows = [resumed.add(window) for window in windows[cut:]] + [resumed.flush()]
        assert len(rows) == len(after[cut:])
        for got, expected in zip(rows, after[cut:]):
            assert [[w.tolist() for w in row] for row in got] == [[w.tolist() for w in row] for row in expected], cut
    assert any(len(state["windows"]) == open_rows for state in states)  # cuts with every row open


def a_state(seq_len=16, open_rows=4) -> dict:
    packer = OnlinePacker(seq_len, open_rows)
    windows = iter(stream(400, seq_len, seed=3))
    while len(packer) < open_rows:  # every row open
        packer.add(next(windows))
    return packer.state_dict()


def edited(**changes):
    def edit(state):
        state.update(changes)
        return state
    return edit


def row_edit(change):
    def edit(state):
        change(state["windows"])
        return state
    return edit


def changed_tokens(make):
    def edit(state):
        state["tokens"] = make(state["tokens"])
        return state
    return edit


HOSTILE_STATES = [
    (lambda state: [state], "not an online packer's state (it holds list"),
    (lambda state: {k: v for k, v in state.items() if k != "tokens"},
     "not an online packer's state (it holds ['max_windows', 'open_rows', 'seq_len', 'windows']"),
    (edited(seq_len=32), "seq_len 32, and this packer's is 16"),
    (edited(seq_len=16.0), "seq_len is 16.0, not a whole number"),  # equal, but not an int
    (edited(open_rows=8), "open_rows 8, and this packer's is 4"),
    (edited(max_windows="17"), "max_windows is '17', not a whole number"),
    (edited(windows={}), "its open rows are a dict, not a list"),
    (row_edit(lambda rows: rows.extend([[2]] * 4)), " open rows, and the packer holds at most 4"),
    (row_edit(lambda rows: rows.__setitem__(1, [])), "open row 1 holds 0 windows (an open row holds 1 to 15)"),
    (row_edit(lambda rows: rows.__setitem__(1, [2] * 16)), "open row 1 holds 16 windows (an open row holds 1 to 15)"),
    (row_edit(lambda rows: rows.__setitem__(0, "22")), "open row 0 is a str, not a list of its windows' lengths"),
    (row_edit(lambda rows: rows[2].append(1)), "open row 2 holds a window of 1 tokens (each holds 2 to 17)"),
    (row_edit(lambda rows: rows[2].append(18)), "open row 2 holds a window of 18 tokens (each holds 2 to 17)"),
    (row_edit(lambda rows: rows[0].append(2.0)), "open row 0 holds a window of 2.0 tokens"),
    (row_edit(lambda rows: rows.__setitem__(0, [9, 9])), "open row 0 fills 16 of its 16 positions (a full row leaves"),
    (changed_tokens(lambda t: t.long()),
     "its tokens are a 1-d torch.int64 tensor on cpu, not a 1-d torch.int32 tensor on the CPU"),
    (changed_tokens(lambda t: t.tolist()), "its tokens are a list, not a 1-d torch.int32 tensor"),
    (changed_tokens(lambda t: t[None]), "its tokens are a 2-d torch.int32 tensor on cpu, not"),
    (changed_tokens(lambda t: t.to("meta")), "its tokens are a 1-d torch.int32 tensor on meta, not"),
    (changed_tokens(lambda t: t[:-1]), "tokens, and the open rows' windows hold"),
    (changed_tokens(lambda t: torch.cat([t[:-1], torch.tensor([-4], dtype=torch.int32)])), "a token id of -4"),
]


@pytest.mark.parametrize("edit, message", HOSTILE_STATES, ids=[m for _, m in HOSTILE_STATES])
def test_a_hostile_or_stale_state_is_one_line_naming_it_and_leaves_the_packer_as_it_was(edit, message):
    packer = OnlinePacker(16, open_rows=4)
    for window in stream(20, 16, seed=9):
        packer.add(window)
    before = packer.state_dict()
    with pytest.raises(UsageError) as refused:
        packer.load_state_dict(edit(round_trip(a_state())), source="ckpt.pt's sub-stream 3")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("ckpt.pt's sub-stream 3: ") and message in line, line
    after = packer.state_dict()
    assert after["windows"] == before["windows"] and torch.equal(after["tokens"], before["tokens"])


def test_the_state_holds_the_open_rows_oldest_first_and_loads_as_it_was_taken():
    state = a_state()
    packer = OnlinePacker(16, open_rows=4)
    packer.load_state_dict(state)
    again = packer.state_dict()
    assert again["windows"] == state["windows"] and torch.equal(again["tokens"], state["tokens"])
    assert [w.tolist() for row in packer.flush() for w in row] == [
        w.tolist() for w in np.split(state["tokens"].numpy(), np.cumsum(sum(state["windows"], []))[:-1])]


def test_online_rows_make_the_tensors_packed_sequence_dataset_makes_of_the_same_windows():
    """The same windows in the same rows: x, y, position_ids and cu_seqlens bitwise those of
    PackedSequenceDataset (the offline --pack), whose cu_seqlens are as long as its fullest row
    needs; the packer's bound only adds more of seq_len."""
    lengths = np.random.default_rng(4).integers(2, 18, 300).tolist() + [17] * 20
    windows = stored_windows(lengths)
    arrays = [np.asarray(w, dtype=np.uint16) for w in windows["input_ids"]]
    index = {id(a): i for i, a in enumerate(arrays)}
    packer = OnlinePacker(16, open_rows=6)
    rows = packed(packer, arrays)
    features = datasets.Features({"windows": datasets.Sequence(datasets.Value("uint32"))})
    placed = datasets.Dataset.from_dict({"windows": [[index[id(w)] for w in row] for row in rows]}, features=features)
    assert packing.wrong_rows(placed, data.window_targets(windows), 16) is None  # each window once, none over
    dataset = PackedSequenceDataset(windows, seq_len=16, pad_id=0, packing=placed)
    offline = dataset.__getitems__(list(range(len(dataset))))
    assert dataset.max_windows < packer.max_windows
    for bound, cut in ((dataset.max_windows, None), (packer.max_windows, dataset.max_windows + 1)):
        online = row_tensors(rows, 16, pad_id=0, max_windows=bound)
        assert len(online) == len(offline)
        for got, expected in zip(online, offline):
            assert all(torch.equal(g, e) for g, e in zip(got[:3], expected[:3]))
            assert torch.equal(got[3][:cut], expected[3]) and (got[3][dataset.max_windows + 1:] == 16).all()
    assert row_tensors([], 16, 0, packer.max_windows) == []


def test_bench_stream_measures_offline_and_online_padding_at_toy_size(tmp_path, capsys):
    """bench_stream.py on a 1 MB corpus: a table a --seq-len, a row for offline packing and one
    for each --open-rows, over the same windows (the same tokens in every packing's rows)."""
    from benchmarks import bench_stream
    results = bench_stream.main(["--mb", "1", "--seq-lens", "64", "128", "--open-rows", "2", "16",
                                 "--vocab-size", "300", "--data-dir", str(tmp_path), "--sections", "packer"])
    printed = capsys.readouterr().out
    assert sorted(results) == [64, 128] and all(sorted(r, key=str) == [16, 2, "offline", "rows_per_s"]
                                                for r in results.values())
    for seq_len, result in results.items():
        assert f"--seq-len {seq_len}: " in printed
        made = result.pop("rows_per_s")  # one sub-stream's rows a second
        assert sorted(made) == ["packed", "padded"] and min(made.values()) > 0
        tokens = {round(row["rows"] * seq_len * (1 - row["padding"])) for row in result.values()}
        assert len(tokens) == 1
        assert 0 <= result["offline"]["padding"] <= result[16]["padding"] < 1
        assert all(result[n]["windows_per_s"] > 0 and result[n]["most_windows"] <= result[n]["bound"] for n in (2, 16))
    assert printed.count("  online 16 ") == 2
