"""--stream's rows: a canonical sub-stream's documents cut into windows as data.py cuts them, in
rows padded as PaddedSequenceDataset pads them or packed online, every token a target once an
epoch, resumed bitwise from the state after any row, across pieces, shards and epochs."""

import io
import itertools

import datasets
import numpy as np
import pytest
import torch

import data
from model import IGNORE_INDEX
from test_data import hostile_texts, windows_of_whole_documents
from test_stream_shards import write, write_lines
from training import tokenized
from training.errors import UsageError
from training.stream.order import Cursor, SubStreams, documents
from training.stream.packer import OnlinePacker, row_tensors
from training.stream.rows import SubStreamRows
from training.stream.shards import find_shards, read_documents

SEQ_LEN, SEED, EPOCHS = 8, 5, 2
OPEN_ROWS = 3  # few: rows leave the packer because one too many is open, as well as full
PIECE_CHARS = 60  # data.py's, lowered: a document over 120 characters is encoded in pieces (200,000 in a run)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    monkeypatch.setattr(data, "PIECE_CHARS", PIECE_CHARS)


def texts(n: int, seed: int) -> list[str]:
    return [text[:90] for text in hostile_texts(n, seed)]  # "[EOT]" in a text is text


LONG = " ".join(["gradients flow back through every layer"] * 12)  # 480 characters: 8 pieces, ~20 windows


@pytest.fixture(scope="module")
def tokenizer():
    return data.train_tokenizer(datasets.Dataset.from_dict({"text": texts(200, 1) + [LONG]}), vocab_size=300)


class Corpus:
    """A folder of shards, each piece (a parquet row group, a JSON Lines file) one of the run's
    pieces, its size its rows; read(piece, start_row) reads one as the run does."""

    def __init__(self, folder):
        self.source = str(folder)
        self.pieces = [(shard, i) for shard in find_shards(self.source, "text") for i in range(len(shard.pieces))]
        self.sizes = [shard.pieces[i] if shard.kind == "parquet" else sum(1 for _ in self.read(p, 0))
                      for p, (shard, i) in enumerate(self.pieces)]

    def read(self, piece: int, start_row: int):
        shard, i = self.pieces[piece]
        return read_documents(self.source, shard, i, start_row, "text")


@pytest.fixture
def corpus(tmp_path) -> Corpus:
    """Shards of every kind: a parquet file of row groups of 4 rows, one of them the long
    document and two of them empty documents; a shard of one document; an empty shard of each
    kind; a compressed one in a folder below."""
    first = texts(13, 2)
    first[2], first[5], first[9] = "", "   \n", LONG
    write(tmp_path / "a.parquet", first, row_group_size=4)
    write(tmp_path / "b.jsonl", ["the only document of its shard"])
    write_lines(tmp_path / "c.jsonl", [])
    write(tmp_path / "d.parquet", [])
    (tmp_path / "e").mkdir()
    write(tmp_path / "e" / "f.jsonl.gz", texts(6, 3))
    write(tmp_path / "g.parquet", texts(5, 4), row_group_size=2)
    corpus = Corpus(tmp_path)
    assert len(corpus.pieces) == 11 and corpus.sizes.count(0) == 2
    return corpus


def rows_of(corpus: Corpus, tokenizer, streams: int, stream: int, pack: bool, epochs: int = EPOCHS) -> SubStreamRows:
    return SubStreamRows(SubStreams(corpus.sizes, streams, SEED), stream, corpus.read, tokenizer, SEQ_LEN, pack,
                         epochs, open_rows=OPEN_ROWS)


def texts_of(corpus: Corpus, streams: int, stream: int, epochs: int = EPOCHS) -> list[str]:
    """The sub-stream's documents in order (order.py's own tests prove them)."""
    return list(documents(Cursor(SubStreams(corpus.sizes, streams, SEED), stream), corpus.read, epochs))


def equal(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(len(r) == len(s) and all(torch.equal(t, u) and t.dtype == u.dtype
                                                              for t, u in zip(r, s)) for r, s in zip(a, b))


def test_padded_rows_of_one_sub_stream_are_the_rows_of_the_map_style_dataset(corpus, tokenizer):
    """A streamed run and a map-style one over the same documents in the same order train on
    the same rows: tokenized.tokenize's windows padded by PaddedSequenceDataset, row for row."""
    order = texts_of(corpus, 1, 0, epochs=1)
    assert LONG in order and "the only document of its shard" in order and len(order) == 23
    windows = tokenized.tokenize(datasets.Dataset.from_dict({"text": order}), tokenizer, SEQ_LEN)
    dataset = data.PaddedSequenceDataset(windows, SEQ_LEN, tokenizer.token_to_id(data.PAD))
    streamed = list(rows_of(corpus, tokenizer, 1, 0, pack=False, epochs=1))
    assert equal(streamed, [dataset[i] for i in range(len(dataset))]) and len(streamed) > 60


def windows_from_rows(rows: list[tuple], packed: bool) -> list[list[int]]:
    """The windows the rows hold, their tokens read back from x and y: padded, a row's real
    targets; packed, each stretch of cu_seqlens."""
    windows = []
    for row in rows:
        x, y = row[0].tolist(), row[1].tolist()
        bounds = row[3].tolist() if packed else [0, sum(t != IGNORE_INDEX for t in y)]
        for start, end in zip(bounds, bounds[1:]):
            if end > start and y[start] != IGNORE_INDEX:  # not the padding's window
                windows.append(x[start:end] + [y[end - 1]])
                assert IGNORE_INDEX not in y[start:end] and x[start + 1:end] == y[start:end - 1]
                assert not packed or row[2][start:end].tolist() == list(range(end - start))
    return windows


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("streams", [1, 2])
def test_every_token_of_every_document_is_a_target_exactly_once_an_epoch(corpus, tokenizer, streams, pack):
    """The windows in the rows are, window for window, those of each document encoded whole
    (tokenizer.encode), its long documents included: in the documents' order padded, placed by
    one packer from the first epoch to the last (then its flush) packed: an epoch's end does not
    flush it (sub-streams run on)."""
    for stream in range(streams):
        order = texts_of(corpus, streams, stream)
        expected = windows_of_whole_documents(order, tokenizer, SEQ_LEN)
        rows = list(rows_of(corpus, tokenizer, streams, stream, pack))
        if not pack:
            assert windows_from_rows(rows, packed=False) == expected
            continue
        assert sorted(windows_from_rows(rows, packed=True)) == sorted(expected)
        packer, placed = OnlinePacker(SEQ_LEN, OPEN_ROWS), []
        for window in expected:
            placed += packer.add(np.array(window))
        placed += packer.flush()
        pad_id = tokenizer.token_to_id(data.PAD)
        assert equal(rows, row_tensors(placed, SEQ_LEN, pad_id, packer.max_windows))


def test_a_long_document_is_encoded_in_pieces_and_its_windows_are_the_whole_documents(corpus, tokenizer,
                                                                                      monkeypatch):
    """As tokenized.tokenize encodes it: in pieces (its memory that of a piece), cut where no token
    changes, so that its windows are those of the document encoded whole (the test above)."""
    cut, real = [], data.pieces
    monkeypatch.setattr(data, "pieces", lambda text, *args: cut.append(text) or real(text, *args))
    rows = list(rows_of(corpus, tokenizer, 1, 0, pack=False, epochs=1))
    assert cut == [LONG] and len(LONG) > 2 * PIECE_CHARS  # the one document over 2 x PIECE_CHARS
    long = windows_of_whole_documents([LONG], tokenizer, SEQ_LEN)
    windows = windows_from_rows(rows, packed=False)
    assert len(long) > 10 and any(windows[i:i + len(long)] == long for i in range(len(windows)))


def through_a_checkpoint(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("streams", [1, 2])
def test_a_state_taken_after_any_row_resumes_with_the_rest(corpus, tokenizer, streams, pack):
    """At every cut, within a document and between two, across row groups, shards and the
    epoch's end, and in the packer's final flush: the resumed rows are the rest, bitwise."""
    for stream in range(streams):
        everything = list(rows_of(corpus, tokenizer, streams, stream, pack))
        uninterrupted = rows_of(corpus, tokenizer, streams, stream, pack)
        for cut in range(len(everything) + 1):
            state = through_a_checkpoint(uninterrupted.state_dict())
            resumed = rows_of(corpus, tokenizer, streams, stream, pack)  # in another process
            resumed.load_state_dict(state)
            assert equal(list(resumed), everything[cut:]), (stream, cut)
            next(uninterrupted, None)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_the_targets_a_state_counts_are_the_real_targets_of_the_rows_handed_out(corpus, tokenizer, pack):
    """A sub-stream's state counts the real targets of every row it has handed out: a resumed
    run's tokens_seen starts from their sum over the sub-streams (dataset.StreamedDataset). Real
    targets are the positions neither padding nor ignored: after every row, the count is theirs,
    through both epochs and the packer's flush; in all, every window's targets (its tokens but
    the first), which the padding of the rows outnumbers. Saved and loaded after any row, the
    count goes on from where it stood."""
    streams, stream = 2, 1
    rows, made, states = rows_of(corpus, tokenizer, streams, stream, pack), [], []
    assert rows.state_dict()["targets"] == 0
    for row in rows:
        made.append(row)
        states.append(through_a_checkpoint(rows.state_dict()))
    real = list(itertools.accumulate(int((row[1] != IGNORE_INDEX).sum()) for row in made))
    assert [state["targets"] for state in states] == real
    windows = windows_of_whole_documents(texts_of(corpus, streams, stream), tokenizer, SEQ_LEN)
    assert real[-1] == sum(len(window) - 1 for window in windows) < sum(row[1].numel() for row in made)
    for cut, state in enumerate(states):
        resumed = rows_of(corpus, tokenizer, streams, stream, pack)
        resumed.load_state_dict(state)
        assert resumed.state_dict()["targets"] == real[cut]
        counted = [resumed.state_dict()["targets"] for _ in resumed]
        assert counted == real[cut + 1:], cut


def test_the_end_is_the_packers_flush_oldest_first_then_stop_iteration_at_every_later_call(corpus, tokenizer):
    rows, made, states = rows_of(corpus, tokenizer, 1, 0, pack=True), [], []
    for row in rows:
        made.append(row)
        states.append(rows.state_dict())
    last = states[-1]  # the state after the last row: the documents read, the packer's open rows handed out
    assert last["cursor"]["epoch"] == EPOCHS and last["window"] == 0 and last["flushed"] == OPEN_ROWS
    assert [state["flushed"] for state in states[-OPEN_ROWS - 1:]] == list(range(OPEN_ROWS + 1))
    packer = OnlinePacker(SEQ_LEN, OPEN_ROWS)
    packer.load_state_dict(last["packer"])  # the open rows as they were before the flush
    assert equal(made[-OPEN_ROWS:], row_tensors(packer.flush(), SEQ_LEN, tokenizer.token_to_id(data.PAD),
                                                packer.max_windows))
    with pytest.raises(StopIteration):
        next(rows)
    assert next(rows, None) is None
    resumed = rows_of(corpus, tokenizer, 1, 0, pack=True)
    resumed.load_state_dict(through_a_checkpoint(last))
    assert next(resumed, None) is None and resumed.state_dict()["flushed"] == OPEN_ROWS


def test_a_sub_stream_without_end_runs_on_into_later_epochs(corpus, tokenizer):
    rows = SubStreamRows(SubStreams(corpus.sizes, 1, SEED), 0, corpus.read, tokenizer, SEQ_LEN, False, None)
    three_epochs = sum(1 for _ in rows_of(corpus, tokenizer, 1, 0, pack=False, epochs=3))
    assert len(list(itertools.islice(rows, three_epochs + 1))) == three_epochs + 1
    assert rows.cursor.epoch == 3


# ---------------------------------------------------------------------------------------
# A hostile or stale state: one line, and nothing changes


def hostile(corpus: Corpus, rows: SubStreamRows, state: dict, packed: dict) -> list[tuple[dict, str]]:
    """(a state, what the line refusing it says), for rows of one sub-stream in the long document."""
    sub_streams = SubStreams(corpus.sizes, 1, SEED)

    def at(epoch: int) -> dict:  # a cursor at the start of an epoch, as the run deals it
        return {**state["cursor"], "epoch": epoch, "piece": 0, "row": 0, "dealt": sub_streams.fingerprint(0, epoch),
                "digest": "0" * 16}
    where = "sub-stream 0's rows in the checkpoint"
    cases = [
        ([1, 2], f"{where} are not a sub-stream's state: it holds list, not cursor, window, packer, flushed, targets, "
                 "read"),
        ({k: v for k, v in state.items() if k != "flushed"}, "it holds ['cursor', 'packer', 'read', 'targets', "
                                                             "'window']"),
        ({**state, "window": True}, f"{where}: window is True, not a whole number from 0 to 2**63 - 1"),
        ({**state, "window": -1}, "window is -1, not"),
        ({**state, "flushed": 2**63}, "flushed is 9223372036854775808, not"),
        ({**state, "cursor": {**state["cursor"], "stream": 1, "streams": 2}}, "is sub-stream 1 of 2, not 0 of 1"),
        ({**state, "window": 10_000}, f"{where}: window 10000 of the document at row {state['cursor']['row']} of "
                                      f"piece {state['cursor']['piece']} of epoch 0, which is cut into "
                                      f"{len(rows._windows)} (another tokenizer or --seq-len?)"),
        ({**state, "cursor": at(EPOCHS)}, f"{where}: window {state['window']} of a document in progress, and no "
                                          f"document is left from row 0 of piece 0 of epoch {EPOCHS} on"),
        ({**state, "cursor": at(EPOCHS + 1)}, f"{where} stand in epoch {EPOCHS + 1}, past this run's {EPOCHS} epochs"),
        ({**state, "flushed": 1}, f"{where}: the packer's flush at the end handed out 1 rows"),
        # what it read: a digest that is none, or not the documents', and a table of pieces read that is none
        ({**state, "cursor": {**state["cursor"], "digest": "xyz"}}, "position in the checkpoint: digest is 'xyz', not "
                                                                    "16 hex digits"),
        ({**state, "cursor": {**at(0), "digest": "1" * 16}}, "position in the checkpoint: a digest of documents "
                                                             "before row 0"),
        ({**state, "cursor": {**state["cursor"], "digest": "1" * 16}},
         f"piece {sub_streams.pieces(0, 0)[state['cursor']['piece']]}, row {state['cursor']['row']}: the documents "
         "before it differ from those the run read there: the shard was rewritten since the run read it"),
        ({**state, "read": [[0, 1]]}, f"{where}: the pieces it read are list, not (piece, digest) rows of int64"),
        ({**state, "read": torch.zeros(2, 2, dtype=torch.int32)}, "the pieces it read are a torch.int32 tensor of "
                                                                  "shape (2, 2), not"),
        ({**state, "read": torch.tensor([[11, 5]])}, f"{where}: the pieces it read name piece 11 of 11"),
        ({**state, "read": torch.tensor([[3, 5], [3, 5]])}, f"{where}: the pieces it read name piece 3 twice"),
    ]
    if rows.packer is None:
        return cases + [({**state, "packer": packed["packer"]}, f"{where} are packed, and this run's are padded")]
    other = OnlinePacker(2 * SEQ_LEN, OPEN_ROWS).state_dict()
    return cases + [
        ({**state, "packer": None}, f"{where} are padded, and this run's are packed (--pack)"),
        ({**state, "packer": other}, f"{where}: the packer: seq_len 16, and this packer's is 8"),
        ({**state, "cursor": at(EPOCHS), "window": 0, "flushed": len(state["packer"]["windows"]) + 1},
         f"handed out {len(state['packer']['windows']) + 1} rows of its {len(state['packer']['windows'])} open rows"),
    ]


def a_state_mid_document(corpus, tokenizer, pack: bool) -> tuple[SubStreamRows, dict]:
    """Rows a few windows into the long document, and their state."""
    rows = rows_of(corpus, tokenizer, 1, 0, pack)
    long_windows = len(windows_of_whole_documents([LONG], tokenizer, SEQ_LEN))
    while not (rows.state_dict()["window"] >= 3 and len(rows._windows) == long_windows):
        next(rows)
    return rows, rows.state_dict()


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_hostile_or_stale_state_is_one_line_and_changes_nothing(corpus, tokenizer, pack):
    rows, state = a_state_mid_document(corpus, tokenizer, pack)
    _, packed = a_state_mid_document(corpus, tokenizer, pack=True)
    resumed = rows_of(corpus, tokenizer, 1, 0, pack)
    resumed.load_state_dict(state)
    rest = list(resumed)
    for bad, said in hostile(corpus, rows, state, packed):
        with pytest.raises(UsageError) as error:
            rows.load_state_dict(bad)
        assert said in str(error.value) and "\n" not in str(error.value), (said, str(error.value))
    assert equal(list(rows), rest) and len(rest) > 20  # refused, each left the rows as they were
