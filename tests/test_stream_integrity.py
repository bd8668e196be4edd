"""--stream checks what it reads again against what it read (training/stream/integrity.py): a
shard rewritten at the same size where its 64 KiB digest does not look (shards.changed passes
it) is one line naming the shard and the place once the run reads that part again, before any
of the changed text is handed out: the piece in progress at a resume (the documents before its
cursor), and a piece read whole before, in a later epoch, whichever sub-stream read it first."""

import json

import pytest
import torch

from training.errors import UsageError
from training.stream import integrity, shards
from training.stream.order import Cursor, SubStreams, documents
from training.stream.rows import SubStreamRows

SEED = 5
FILLER = "x" * 1000  # each document about 1 KB: a shard of 100 is past the 64 KiB the shard digest reads


def text(shard: int, i: int) -> str:
    return f"shard {shard} document {i:03d} {FILLER}"


@pytest.fixture
def folder(tmp_path):
    """Four JSON Lines shards of 100 documents, each file about 100 KB."""
    for shard in range(4):
        lines = [json.dumps({"text": text(shard, i)}) for i in range(100)]
        (tmp_path / f"s{shard}.jsonl").write_text("".join(line + "\n" for line in lines))
    return tmp_path


def run_of(folder, streams: int, seed: int = SEED):
    """The corpus as a run sees it: its shards, their pieces dealt to `streams` sub-streams
    (every piece 100 rows, sized by bytes as JSON Lines are), the run's reader."""
    found = shards.find_shards(str(folder), "text")
    sub_streams = SubStreams(shards.piece_sizes(found), streams, seed, shards.describe(str(folder), found))
    return found, sub_streams, shards.reader(str(folder), found, "text")


def rewrite_same_size(path, document: int):
    """One document's text changed in place, the file's size and its first 64 KiB as they were."""
    raw = path.read_bytes()
    at = raw.index(f"document {document:03d} ".encode())
    assert at > shards.DIGEST_BYTES
    path.write_bytes(raw[:at] + b"DOCUMENT" + raw[at + 8:])


def unchanged_to_a_resume(folder, found) -> None:
    """What a resume checks of every shard (size, 64 KiB digest, pieces) sees nothing."""
    assert shards.changed([s.to_dict() for s in found], shards.find_shards(str(folder), "text")) is None


def through_a_checkpoint(state: dict) -> dict:
    import io
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=True)


def stopped_at_row_80(sub_streams, read) -> dict:
    """The state, through a checkpoint, of sub-stream 0 of 1 once its cursor is 80 documents into its first piece."""
    rows = SubStreamRows(sub_streams, 0, read, tokenizer(), 64, False, epochs=1)
    while rows.state_dict()["cursor"]["row"] < 80:
        next(rows)
    return through_a_checkpoint(rows.state_dict())


def test_the_piece_in_progress_is_checked_up_to_its_cursor_at_a_resume(folder):
    """A sub-stream stopped 80 documents into a shard; a document it read there is changed at
    the same size past the shard's first 64 KiB: the resume (its state loaded, as the feed loads
    it while the data is prepared) is one line naming the shard and the cursor's line. One
    changed after the cursor, not read yet, is read as it is now."""
    found, sub_streams, read = run_of(folder, 1)
    state = stopped_at_row_80(sub_streams, read)
    piece = sub_streams.pieces(0, 0)[state["cursor"]["piece"]]
    path = folder / found[piece].name  # one piece a shard
    good = path.read_bytes()
    rewrite_same_size(path, 70)
    unchanged_to_a_resume(folder, found)
    resumed = SubStreamRows(sub_streams, 0, read, tokenizer(), 64, False, epochs=1)
    with pytest.raises(UsageError) as error:
        resumed.load_state_dict(state)
    assert str(error.value) == (
        f"shard {path}, line {state['cursor']['row'] + 1}: the documents before it differ from those the run read "
        "there: the shard was rewritten since the run read it. Restore it as the run read it, or start a new run")
    path.write_bytes(good)
    rewrite_same_size(path, 95)  # not read yet: the run reads it as it is
    resumed.load_state_dict(state)
    assert sum(1 for _ in resumed) > 0


def test_a_cursor_past_its_pieces_last_line_is_refused_as_that_not_as_a_rewritten_shard(folder):
    """A checkpoint may be hostile or stale: a cursor at line 151 of a JSON Lines shard of 100
    is JSON Lines' own line (a parquet row past its row group is refused before any reading);
    the digest of the 100 it did read cannot match, and must not be what the line blames."""
    found, sub_streams, read = run_of(folder, 1)
    state = stopped_at_row_80(sub_streams, read)
    path = folder / found[sub_streams.pieces(0, 0)[state["cursor"]["piece"]]].name
    state["cursor"]["row"] = 150
    with pytest.raises(UsageError) as error:
        SubStreamRows(sub_streams, 0, read, tokenizer(), 64, False, epochs=1).load_state_dict(state)
    assert str(error.value) == \
        f"shard {path} has 100 lines, none numbered 150 (from 0): the file changed during the run"


def sub_stream_documents(sub_streams, stream: int, read, seen, state: dict | None = None):
    cursor = Cursor(sub_streams, stream)
    if state is not None:
        cursor.load_state_dict(state)
    return cursor, documents(cursor, read, epochs=2, seen=seen)


def test_a_piece_read_before_is_checked_whole_before_any_of_it_is_read_again(folder):
    """One sub-stream reads epoch 0 and the start of epoch 1; a shard it read whole in epoch 0
    is changed at the same size past its first 64 KiB: in epoch 1 the run stops at that shard
    in one line naming it, and no document of it was handed out in epoch 1."""
    found, sub_streams, read = run_of(folder, 1)
    seen = integrity.PiecesRead()
    cursor, texts = sub_stream_documents(sub_streams, 0, read, seen)
    first_epoch = [next(texts) for _ in range(400)]
    assert cursor.epoch == 0 and len(seen.own) == 3  # the fourth is recorded once the next document is asked for
    changed = sub_streams.pieces(0, 1)[1]  # the second piece epoch 1 reads
    path = folder / found[changed].name
    rewrite_same_size(path, 90)
    unchanged_to_a_resume(folder, found)
    then = []
    with pytest.raises(UsageError) as error:
        for document in texts:
            then.append(document)
    assert str(error.value) == (f"shard {path}: its documents differ from those the run read there: the shard was "
                                "rewritten since the run read it. Restore it as the run read it, or start a new run")
    assert then == [d for d in first_epoch if d.startswith(f"shard {sub_streams.pieces(0, 1)[0]} ")]
    assert len(first_epoch) == 400 and len(then) == 100  # the first piece of epoch 1 whole, none of the changed one


def test_a_resume_inside_a_piece_read_before_checks_it_whole_before_handing_out_its_rest(folder):
    """A resume in epoch 1, 50 documents into a piece read whole in epoch 0; a document after the
    cursor is changed at the same size: the prefix check passes (the documents before the cursor
    are as they were), so the piece is checked whole before any of its rest is handed out, as in
    an epoch entered at its start. Without that, its 50 remaining documents, the changed one
    among them, would be trained on before the piece's end caught it."""
    found, sub_streams, read = run_of(folder, 1)
    seen = integrity.PiecesRead()
    cursor, texts = sub_stream_documents(sub_streams, 0, read, seen)
    for _ in range(400 + 100 + 50):  # epoch 0, epoch 1's first piece, half its second
        next(texts)
    assert (cursor.epoch, cursor.piece, cursor.row) == (1, 1, 50)
    state = through_a_checkpoint(cursor.state_dict())
    path = folder / found[sub_streams.pieces(0, 1)[1]].name
    rewrite_same_size(path, 90)
    unchanged_to_a_resume(folder, found)
    resumed, rest = sub_stream_documents(sub_streams, 0, read, integrity.PiecesRead(known=dict(seen.own)), state)
    then = []
    with pytest.raises(UsageError) as error:
        for document in rest:
            then.append(document)
    assert str(error.value) == (f"shard {path}: its documents differ from those the run read there: the shard was "
                                "rewritten since the run read it. Restore it as the run read it, or start a new run")
    assert then == []


def test_after_a_resume_every_sub_stream_checks_the_pieces_any_of_them_read(folder):
    """Two sub-streams; each piece is dealt anew in epoch 1, most to the sub-stream that did not
    read it in epoch 0. Resumed from both states, a sub-stream checks a piece the other read
    (integrity.known_pieces, as the dataset gives its feed); two states that read a piece as two
    texts are one line."""
    found, sub_streams, read = run_of(folder, 2, seed=0)  # each sub-stream reads a piece in epoch 1 the other read
    states = {}
    for stream in range(2):
        rows = SubStreamRows(sub_streams, stream, read, tokenizer(), 64, False, epochs=2)
        while rows.cursor.epoch == 0:  # through epoch 0, into epoch 1's first document
            next(rows)
        states[stream] = through_a_checkpoint(rows.state_dict())
    read_by = {piece: stream for stream in range(2) for piece in sub_streams.pieces(stream, 0)}
    ahead = {s: sub_streams.pieces(s, 1)[states[s]["cursor"]["piece"] + 1 if states[s]["cursor"]["epoch"] else 0:]
             for s in range(2)}  # the pieces each reads after its state
    stream, later = next((s, p) for s in range(2) for p in ahead[s] if read_by[p] != s)
    path = folder / found[later].name
    rewrite_same_size(path, 80)
    unchanged_to_a_resume(folder, found)
    known = integrity.known_pieces(states, 4, sub_streams.describe)
    assert sorted(known) == [0, 1, 2, 3]
    resumed = SubStreamRows(sub_streams, stream, read, tokenizer(), 64, False, epochs=2, known=known)
    resumed.load_state_dict(states[stream])
    with pytest.raises(UsageError) as error:
        for _ in resumed:
            pass
    assert str(error.value).startswith(f"shard {path}: its documents differ from those the run read there")
    other = 1 - read_by[later]
    table = states[other]["read"]
    states[other]["read"] = torch.cat([table, torch.tensor([[later, known[later] ^ 1]])])
    with pytest.raises(UsageError) as error:
        integrity.known_pieces(states, 4, sub_streams.describe)
    assert str(error.value) == (f"shard {path}: the checkpoint's sub-streams read it as two different texts: the "
                                "shard was rewritten since the run read it. Restore it as the run read it, or start "
                                "a new run")


_TOKENIZER = []


def tokenizer():
    """A small BPE of the corpus's words, made once."""
    if not _TOKENIZER:
        import datasets
        import data
        texts = [text(shard, i) for shard in range(4) for i in range(0, 100, 10)]
        _TOKENIZER.append(data.train_tokenizer(datasets.Dataset.from_dict({"text": texts}), vocab_size=300))
    return _TOKENIZER[0]


def test_bench_stream_measures_the_checks_cost_at_toy_size(tmp_path, capsys):
    """bench_stream.py --sections integrity on a 1 MB corpus: reading and rows with the check and
    without, a later epoch's check, a resume's, and the state's table of pieces read."""
    from benchmarks import bench_stream
    results = bench_stream.main(["--mb", "1", "--seq-lens", "64", "--vocab-size", "300", "--data-dir", str(tmp_path),
                                 "--sections", "integrity"])
    assert list(results) == ["integrity"]
    measured = results["integrity"]
    assert all(measured[check][key] > 0 for check in ("with", "without") for key in ("documents_per_s", "rows_per_s"))
    assert measured["later_epoch"]["check_s"] > 0 and measured["resume"]["checked_s"] > 0
    assert measured["state"]["mb"] == 12_500 * 16 / 1e6 and measured["state"]["table_ms"] > 0
    assert "checking what is read again" in capsys.readouterr().out
