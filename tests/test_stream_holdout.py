"""--stream's held-out documents and BPE (training/stream/holdout.py): the validation set is the
corpus's first documents in shard order, across pieces and shards; training reads every other
document exactly once and never one of them, from any piece and any start row; the BPE is trained
on a prefix of the training documents only, the same each time."""

import itertools
import json

import pytest
from test_stream_shards import write

import data
from training import corpus
from training.errors import UsageError
from training.stream import holdout, shards
from training.stream.holdout import (HeldOut, skip_held_out, train_stream_tokenizer, training_documents,
                                     validation_documents)
from training.stream.shards import corpus_pieces, find_shards

# the shards as written, in name order: (name, texts, parquet row group size); "" is an empty row
SHARDS = [("a.parquet", ["d0", "d1", "", "d2", "d3", "d4", "d5", "", ""], 3),  # row groups 0-2, 3-5, 6-8
          ("b.jsonl", ["d6", "", "d7"], None),
          ("c/a.parquet", ["", "d8", "d9", "d10", "d11"], 2),
          ("c/b.jsonl", ["d12"], None)]
DOCUMENTS = [f"d{i}" for i in range(13)]


def written(tmp_path, listed=SHARDS) -> tuple[str, list]:
    for name, texts, row_group_size in listed:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write(tmp_path / name, texts, row_group_size)
    return str(tmp_path), find_shards(str(tmp_path), "text")


def piece_rows(found) -> list[int]:
    """Each piece's row count, a JSON Lines file's from SHARDS."""
    lines = {name: len(texts) for name, texts, _ in SHARDS}
    return [shard.pieces[piece] if shard.kind == "parquet" else lines[shard.name]
            for shard, piece in corpus_pieces(found)]


def test_the_held_out_documents_are_the_first_in_shard_order_across_pieces_and_shards(tmp_path):
    source, found = written(tmp_path)
    assert [(shard.name, piece) for shard, piece in corpus_pieces(found)] == [
        ("a.parquet", 0), ("a.parquet", 1), ("a.parquet", 2), ("b.jsonl", 0),
        ("c/a.parquet", 0), ("c/a.parquet", 1), ("c/a.parquet", 2), ("c/b.jsonl", 0)]
    # where each document is, as (corpus piece, row), written out from SHARDS
    where = {"d0": (0, 0), "d1": (0, 1), "d2": (1, 0), "d3": (1, 1), "d4": (1, 2), "d5": (2, 0), "d6": (3, 0),
             "d7": (3, 2), "d8": (4, 1), "d9": (5, 0), "d10": (5, 1), "d11": (6, 0), "d12": (7, 0)}
    for count in range(1, len(DOCUMENTS)):
        texts, held_out = validation_documents(source, found, "text", count)
        assert texts == DOCUMENTS[:count]
        assert held_out == HeldOut(count, *where[DOCUMENTS[count]])  # the first training document
    # 4 held out end in the second piece, 7 in the fourth, past a shard's empty last piece
    assert validation_documents(source, found, "text", 4)[1] == HeldOut(4, 1, 2)
    assert validation_documents(source, found, "text", 7)[1] == HeldOut(7, 3, 2)


def test_the_default_count_is_val_docs_rule_counted_no_further_than_it_needs(tmp_path, monkeypatch):
    assert (corpus.default_val_docs(holdout.ENOUGH_TO_COUNT - 1) < holdout.MOST_HELD_OUT
            == corpus.default_val_docs(holdout.ENOUGH_TO_COUNT) == corpus.default_val_docs(10**12) == 1000)
    source, found = written(tmp_path, [("a.parquet", [f"d{i}" for i in range(250)], 64)])
    texts, held_out = validation_documents(source, found, "text")
    assert texts == ["d0", "d1"] and held_out == HeldOut(2, 0, 2)  # 1% of 250
    monkeypatch.setattr(holdout, "ENOUGH_TO_COUNT", 199)  # as if its rule gave its most from 199 on
    monkeypatch.setattr(holdout, "MOST_HELD_OUT", 1)
    assert validation_documents(source, found, "text") == (["d0"], HeldOut(1, 0, 1))


def test_a_corpus_with_no_document_left_to_train_on_is_one_line(tmp_path):
    source, found = written(tmp_path)
    assert validation_documents(source, found, "text", 12)[1] == HeldOut(12, 7, 0)  # one left: enough here
    for count in (13, 14, 1000):
        with pytest.raises(UsageError, match=f"^cannot hold out {count} validation documents from {source}: "
                                             "it holds 13, and training would have none"):
            validation_documents(source, found, "text", count)
    one = tmp_path / "one"
    one.mkdir()
    source, found = written(one, [("a.jsonl", ["", "only"], None)])
    with pytest.raises(UsageError, match="^cannot hold out 1 validation documents .* it holds 1,"):
        validation_documents(source, found, "text")  # the default: 1


class Reads:
    """A read that counts its calls, piece by piece."""
    def __init__(self, read):
        self.inner, self.pieces = read, []

    def __call__(self, piece, start_row):
        self.pieces.append(piece)
        return self.inner(piece, start_row)


def test_training_reads_no_held_out_document_from_any_piece_and_any_start_row(tmp_path):
    """A start row inside the held-out range (the piece where they end, from a row before the
    first training document: row 0, as every epoch starts it) reads that piece's training
    documents, all of them; a piece wholly held out is not even read."""
    source, found = written(tmp_path)
    read, rows = shards.reader(source, found, "text"), piece_rows(found)
    for count in range(1, len(DOCUMENTS)):
        held, held_out = validation_documents(source, found, "text", count)
        reads = Reads(read)
        training_read = skip_held_out(reads, held_out)
        for piece, start in ((piece, start) for piece in range(len(rows)) for start in range(rows[piece] + 1)):
            got = list(training_read(piece, start))
            assert got == [(row, text) for row, text in read(piece, start) if text not in held], (count, piece, start)
            if piece == held_out.piece and start <= held_out.row:  # inside the held-out range: from its end on
                assert got == [(row, text) for row, text in read(piece, 0) if text not in held]
        assert min(reads.pieces) == held_out.piece  # the pieces before it never read
        # every piece from the start, as a sub-stream reads it: every document not held out, once
        trained = [text for piece in range(len(rows)) for _, text in training_read(piece, 0)]
        assert trained == DOCUMENTS[count:] == list(training_documents(source, found, "text", held_out))
        assert sorted(held + trained) == sorted(DOCUMENTS) and not set(held) & set(trained)


def test_a_deal_sees_the_pieces_wholly_held_out_as_empty():
    assert HeldOut(7, 3, 2).training_sizes([3, 3, 3, 3, 5, 2]) == [0, 0, 0, 3, 5, 2]
    assert HeldOut(1, 0, 1).training_sizes([3, 3]) == [3, 3]


def test_the_held_out_record_is_checked_when_read_and_when_resumed(tmp_path):
    source, found = written(tmp_path)
    held_out = validation_documents(source, found, "text", 5)[1]
    recorded = json.loads(json.dumps(held_out.to_dict()))  # as a run records it
    assert recorded == {"count": 5, "piece": 2, "row": 0} and HeldOut.from_dict(recorded) == held_out
    held_out.check(recorded)  # a resume on the same shards holds out the same documents
    again = validation_documents(source, found, "text", recorded["count"])[1]
    again.check(recorded)
    for other in ({**recorded, "row": 1}, {**recorded, "piece": 1}):  # this code would read other documents
        with pytest.raises(UsageError, match="^the 5 validation documents this run held out end at row "):
            held_out.check(other)
    with pytest.raises(UsageError, match="^this run held out 6 validation documents, not 5: resume with --val-docs 6"):
        held_out.check({**recorded, "count": 6})
    hostile = [None, [], {"count": 5, "piece": 2}, {**recorded, "extra": 0}, {**recorded, "count": 0},
               {**recorded, "row": -1}, {**recorded, "row": True}, {**recorded, "piece": "2"},
               {**recorded, "count": 2**63}, {**recorded, "row": 1.0}]
    for record in hostile:
        with pytest.raises(UsageError, match="^held-out record .*: expected count, piece, row, whole numbers"):
            held_out.check(record)


# ---- the BPE -----------------------------------------------------------------------------------

def fed(monkeypatch) -> list:
    """What data.train_tokenizer reads of each dataset it is given, recorded as it reads it."""
    texts, train = [], data.train_tokenizer

    class Spy:
        def __init__(self, dataset):
            self.dataset = dataset

        def iter(self, batch_size):
            for batch in self.dataset.iter(batch_size=batch_size):
                texts.extend(batch["text"])
                yield batch
    monkeypatch.setattr(data, "train_tokenizer", lambda dataset, *args: train(Spy(dataset), *args))
    return texts


def test_the_bpe_is_trained_on_training_documents_only_the_same_each_time(tmp_path, monkeypatch):
    """The first documents are held out and hold the only non-ASCII letter: had the BPE seen
    them, it would have merged its two bytes into one token, as it does when none is held out."""
    omega, merged = "Ω", "Î©"  # Ω's two bytes as the byte-level BPE writes them, joined
    texts = [f"{omega * 50} {omega}{omega}", f"{omega}x " * 40] + [f"word{i % 7} the cat sat" for i in range(40)]
    source, found = written(tmp_path, [("a.parquet", texts, 16)])
    held, held_out = validation_documents(source, found, "text", 2)
    seen = fed(monkeypatch)
    first = train_stream_tokenizer(source, found, "text", 300, held_out)
    assert seen == texts[2:] and merged not in first.get_vocab()
    assert first.to_str() == train_stream_tokenizer(source, found, "text", 300, held_out).to_str()
    holding_none = train_stream_tokenizer(source, found, "text", 300, HeldOut(1, 0, 0))  # skips nothing
    assert merged in holding_none.get_vocab()


def test_the_bpe_reads_the_stream_as_far_as_its_budget_and_no_further(tmp_path, monkeypatch):
    """train_tokenizer reads batches of 1000 documents until the budget is reached: the stream is
    read as far as that, and a larger budget reads on (and learns other words)."""
    texts = [f"early{i % 50} words" for i in range(1500)] + [f"later{i % 50} other" for i in range(1500)]
    source, found = written(tmp_path, [("a.parquet", texts, 700), ("b.jsonl", ["unread"], None)])
    held_out = validation_documents(source, found, "text", 3)[1]
    read, documents = shards.read_documents, []

    def counted(*args):
        for row, text in read(*args):
            documents.append(text)
            yield row, text
    monkeypatch.setattr(shards, "read_documents", counted)
    seen = fed(monkeypatch)
    small = train_stream_tokenizer(source, found, "text", 320, held_out, chars=1)
    assert seen == texts[3:1003] and documents == texts[3:1003]  # one batch, read lazily
    seen.clear()
    documents.clear()
    every = train_stream_tokenizer(source, found, "text", 320, held_out, chars=10**9)
    assert seen == documents == texts[3:] + ["unread"]
    assert small.to_str() != every.to_str()
    assert "later" in every.get_vocab() and "later" not in small.get_vocab()
    assert list(itertools.islice(training_documents(source, found, "text", held_out), 2)) == texts[3:5]


def test_bench_stream_trains_the_bpe_both_ways_at_toy_size(tmp_path):
    """bench_stream.py --sections bpe on a 1 MB corpus: the map-style BPE and the stream's, each in a process of its
    own, each holding documents out and giving a tokenizer of the size asked for."""
    from benchmarks import bench_stream
    from tokenizers import Tokenizer
    results = bench_stream.main(["--mb", "1", "--vocab-size", "300", "--data-dir", str(tmp_path), "--sections", "bpe"])
    assert sorted(results) == ["bpe"] and sorted(results["bpe"]) == ["map-style", "stream"]
    for row in results["bpe"].values():
        assert row["held_out"] > 0 and row["bpe_s"] > 0 and row["peak_mb"] > 0
        assert Tokenizer.from_str(row["tokenizer"]).get_vocab_size() == 300
