"""--stream's shards: which files a source holds, what each is (pieces, size, digest), the
documents of a piece read from any row, what a resume finds changed, and every damaged or
hostile shard as one line that names the file and the row."""

import dataclasses
import gzip
import importlib.util
import json
import os
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.errors import UsageError
from training.stream import json_lines, shards
from training.stream.shards import Shard, changed, find_shards, read_documents

HAS_ZSTANDARD = importlib.util.find_spec("zstandard") is not None
KINDS = ["parquet", "jsonl", "jsonl.gz",
         pytest.param("jsonl.zst", marks=pytest.mark.skipif(not HAS_ZSTANDARD, reason="zstandard not installed"))]


def compressed(kind: str, raw: bytes) -> bytes:
    if kind == "jsonl.gz":
        return gzip.compress(raw, mtime=0)
    if kind == "jsonl.zst":
        import zstandard
        return zstandard.ZstdCompressor().compress(raw)
    return raw


def write_lines(path, lines: list, kind: str | None = None):
    """A JSON Lines shard of these lines (str or bytes), compressed as its name says."""
    raw = b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines)
    path.write_bytes(compressed(kind or shards.shard_kind(path), raw))


def write(path, texts: list, row_group_size: int | None = None):
    """A shard of these texts: a parquet column "text", or one JSON object a line."""
    if shards.shard_kind(path) == "parquet":
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=row_group_size)
    else:
        write_lines(path, [json.dumps({"text": t}) for t in texts])


def read(source, shard: Shard, piece: int = 0, start_row: int = 0) -> list:
    return list(read_documents(str(source), shard, piece, start_row, "text"))


def refused(call, *args) -> str:
    with pytest.raises(UsageError) as error:
        call(*args)
    return str(error.value)


# ---------------------------------------------------------------------------------------
# Reading: whole, from any row, by piece


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_read_whole_and_from_every_row_the_rest_of_the_whole(tmp_path, monkeypatch, kind):
    """A row is a parquet row or a file's line: an empty or blank text is no document, and its
    row is still counted. Parquet texts are read a few rows at a time: the cuts fall across batches."""
    monkeypatch.setattr(shards, "READ_ROWS", 5)
    texts = [f"document {i} " + "é" * i for i in range(23)]
    texts[3], texts[7], texts[12] = "", "  \n ", " padded, kept as it is "
    path = tmp_path / f"part-0.{kind}"
    write(path, texts)
    [shard] = find_shards(str(path), "text")
    whole = read(path, shard)
    assert whole == [(row, text) for row, text in enumerate(texts) if text.strip()] and len(whole) == 21
    for start in range(len(texts) + 1):
        assert read(path, shard, 0, start) == [(row, text) for row, text in whole if row >= start], start


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz"])
def test_a_json_lines_row_is_its_line_blank_lines_and_a_byte_order_mark_included(tmp_path, kind):
    """Row r is line r + 1 as an editor counts it; "\\r\\n" ends a line as "\\n" does, and a
    U+2028 inside a document does not end it (a text-mode reader would split there)."""
    path = tmp_path / f"c.{kind}"
    fourth = json.dumps({"text": "fourth\u2028same line"}, ensure_ascii=False) + "\r"
    write_lines(path, [b"\xef\xbb\xbf" + json.dumps({"text": "first"}).encode(), "", "   ", fourth,
                       json.dumps({"text": "fifth"})])
    [shard] = find_shards(str(path), "text")
    assert read(path, shard) == [(0, "first"), (3, "fourth\u2028same line"), (4, "fifth")]
    assert read(path, shard, 0, 1) == [(3, "fourth\u2028same line"), (4, "fifth")]
    assert read(path, shard, 0, 5) == []


def test_a_parquet_shard_has_one_piece_a_row_group_each_read_alone(tmp_path):
    texts = [f"document {i}" for i in range(10)]
    path = tmp_path / "p.parquet"
    write(path, texts, row_group_size=4)
    [shard] = find_shards(str(path), "text")
    assert shard.pieces == (4, 4, 2)
    for piece, first in enumerate([0, 4, 8]):
        rows = [(row, texts[first + row]) for row in range(shard.pieces[piece])]
        assert read(path, shard, piece) == rows
        assert read(path, shard, piece, 1) == rows[1:]
    assert [text for piece in range(3) for _, text in read(path, shard, piece)] == texts


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_shard_and_a_shard_of_one_document(tmp_path, kind):
    empty, one = tmp_path / f"empty.{kind}", tmp_path / f"one.{kind}"
    if kind == "parquet":
        write(empty, [])
    else:
        empty.write_bytes(compressed(kind, b""))
    write(one, ["the only document"])
    found = find_shards(str(tmp_path), "text")
    assert [s.name for s in found] == [empty.name, one.name]
    pieces = (0,) if kind == "parquet" else (None,)
    assert found[0].pieces == pieces and found[1].pieces == ((1,) if kind == "parquet" else (None,))
    assert read(tmp_path, found[0]) == [] and read(tmp_path, found[0], 0, 0) == []
    assert read(tmp_path, found[1]) == [(0, "the only document")] and read(tmp_path, found[1], 0, 1) == []


# ---------------------------------------------------------------------------------------
# Finding the shards of a source


def test_a_folder_is_walked_at_any_depth_and_its_shards_named_by_their_path_below_it(tmp_path, capsys):
    root = tmp_path / "data"
    (root / "b" / "deeper").mkdir(parents=True)
    (root / ".cache").mkdir()
    write(root / "b" / "deeper" / "x.PARQUET", ["parquet"])
    write(root / "b" / "a.jsonl.gz", ["gz"])
    write(root / "c.jsonl", ["plain"])
    write(root / ".cache" / "hidden.jsonl", ["not read"])
    (root / "notes.txt").write_text("not a shard")
    (root / "link").symlink_to("b")  # the same folder again, after it: read once
    found = find_shards(str(root), "text")
    assert [(s.name, s.kind) for s in found] == [("b/a.jsonl.gz", "jsonl.gz"), ("b/deeper/x.PARQUET", "parquet"),
                                                 ("c.jsonl", "jsonl")]
    assert [read(root, s) for s in found] == [[(0, "gz")], [(0, "parquet")], [(0, "plain")]]
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: --dataset {root}: skipping 3 entries: ") and "notes.txt" in warning
    assert ".cache/ (hidden)" in warning and "link/ (already read as b)" in warning
    [alone] = find_shards(str(root / "c.jsonl"), "text")  # a lone file: its name, read from its path
    assert alone == found[2] and read(root / "c.jsonl", alone) == [(0, "plain")]


def test_nothing_to_read_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("a .txt is no shard\n")
    for folder in ("empty", "text"):
        assert refused(find_shards, str(tmp_path / folder), "text") == \
            f"folder {tmp_path / folder} holds no .parquet/.jsonl/.jsonl.gz/.jsonl.zst files"
    assert refused(find_shards, str(tmp_path / "text" / "a.txt"), "text") == \
        f"unsupported shard {tmp_path / 'text' / 'a.txt'}: expected .parquet/.jsonl/.jsonl.gz/.jsonl.zst"
    assert refused(find_shards, str(tmp_path / "nowhere"), "text") == \
        f"dataset file or folder not found: {tmp_path / 'nowhere'}"


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "dangling"])
@pytest.mark.parametrize("alone", [False, True], ids=["in-a-folder", "alone"])
def test_a_fifo_a_device_or_a_dangling_link_where_a_shard_should_be_is_one_line_not_a_hang(tmp_path, kind, alone):
    """Opened, a FIFO would wait forever for a writer and /dev/zero never end; skipped, the run
    would train on part of the data. Refused before anything is opened."""
    write(tmp_path / "a.jsonl", ["fine"])
    path = tmp_path / "b.parquet"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero" if kind == "dev_zero" else tmp_path / "gone.parquet")
    said = refused(find_shards, str(path if alone else tmp_path), "text")
    assert said == (f"cannot read shard {path}: [Errno 2] No such file or directory: '{path}'" if kind == "dangling"
                    else f"shard {path} is not a regular file (a FIFO, a device or a folder): replace it with the "
                         "file it should be, or remove it")


def test_a_shard_that_cannot_be_read_is_one_line(tmp_path):
    """Run as root, every file can be read: then the test is skipped (run it under
    `capsh --drop=cap_dac_override,cap_dac_read_search -- -c "python -m pytest ..."`)."""
    path = tmp_path / "a.jsonl"
    write(path, ["secret"])
    path.chmod(0)
    try:
        path.open("rb").close()
        pytest.skip("this process reads any file (root)")
    except PermissionError:
        pass
    assert refused(find_shards, str(tmp_path), "text") == \
        f"cannot read shard {path}: [Errno 13] Permission denied: '{path}'"


def test_a_parquet_shard_without_a_text_column_is_refused_from_its_footer(tmp_path):
    no_text, numbers = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": ["x"], "id": [1]}), no_text)
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    assert refused(find_shards, str(no_text), "text") == \
        f"shard {no_text} has no columns named 'text' (columns: body, id)"
    assert find_shards(str(no_text), "body")[0].pieces == (1,)
    assert refused(find_shards, str(numbers), "text") == f"column 'text' of shard {numbers} holds int64, not text"


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz"])
def test_a_json_lines_shard_is_checked_by_its_first_document_before_training(tmp_path, kind):
    """The wrong --text-column is said at the start, not after hours of other shards."""
    path = tmp_path / f"a.{kind}"
    write_lines(path, ['{"body": "x"}'] * 3)
    assert refused(find_shards, str(path), "text") == \
        f"cannot read shard {path}: line 1: no 'text' (absent or null; its fields: body): fix that line, or choose " \
        "another field with --text-column"


def test_a_missing_zstandard_is_one_line_naming_the_install(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(b"(\xb5/\xfd whatever follows")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` raises ImportError
    assert refused(find_shards, str(tmp_path), "text") == \
        f"reading {path} needs the zstandard package: pip install zstandard"


# ---------------------------------------------------------------------------------------
# What a run records, and what a resume finds changed


def test_a_shard_is_recorded_as_json_and_read_back_the_same(tmp_path):
    write(tmp_path / "a.parquet", ["x"] * 5, row_group_size=2)
    write(tmp_path / "b.jsonl.gz", ["y"])
    found = find_shards(str(tmp_path), "text")
    assert found[0].to_dict() == {"name": "a.parquet", "kind": "parquet", "size": found[0].size,
                                  "digest": found[0].digest, "pieces": [2, 2, 1]}  # a list, as JSON reads it back
    recorded = json.loads(json.dumps([s.to_dict() for s in found]))
    assert recorded == [s.to_dict() for s in found]
    assert recorded[1]["pieces"] == [None] and len(recorded[1]["digest"]) == 32
    assert [Shard.from_dict(d) for d in recorded] == found and changed(recorded, found) is None


GOOD = {"name": "d/a.parquet", "kind": "parquet", "size": 10, "digest": "0" * 32, "pieces": [3, 0]}


@pytest.mark.parametrize("record, problem", [
    ("a.parquet", "expected the fields name, kind, size, digest, pieces"),
    ({k: v for k, v in GOOD.items() if k != "digest"}, "expected the fields name, kind, size, digest, pieces"),
    ({**GOOD, "extra": 1}, "expected the fields name, kind, size, digest, pieces"),
    ({**GOOD, "kind": "jsonl"}, "its kind is not its name's"),
    ({**GOOD, "name": 5}, "its kind is not its name's"),
    ({**GOOD, "size": -1}, "its size is not a count of bytes"),
    ({**GOOD, "size": True}, "its size is not a count of bytes"),
    ({**GOOD, "size": "10"}, "its size is not a count of bytes"),
    ({**GOOD, "digest": "0" * 31}, "its digest is not 32 hex digits"),
    ({**GOOD, "digest": "A" * 32}, "its digest is not 32 hex digits"),
    ({**GOOD, "pieces": [3, -1]}, "its pieces are not row counts"),
    ({**GOOD, "pieces": [None]}, "its pieces are not row counts"),
    ({**GOOD, "pieces": "3"}, "its pieces are not row counts"),
    ({**GOOD, "name": "a.jsonl", "kind": "jsonl", "pieces": [3]}, "its pieces are not row counts"),
    ({**GOOD, "name": "a.jsonl", "kind": "jsonl", "pieces": [None, None]}, "its pieces are not row counts"),
])
def test_a_hostile_or_stale_shard_record_is_one_line(record, problem):
    assert Shard.from_dict(GOOD).pieces == (3, 0)
    assert refused(Shard.from_dict, record) == f"shard record {str(record)[:100]}: {problem}"
    assert refused(changed, [record], []) == f"shard record {str(record)[:100]}: {problem}"


def test_a_record_that_is_no_list_or_names_a_shard_twice_is_one_line():
    assert refused(changed, {"a": 1}, []) == "the shard record is a dict, not a list"
    assert refused(changed, [GOOD, GOOD], []) == "the shard record lists d/a.parquet twice"


def test_changed_names_the_first_shard_added_removed_renamed_or_resized(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    write(root / "a.jsonl", [f"a{i}" for i in range(5)])
    write(root / "b.parquet", [f"b{i}" for i in range(10)], row_group_size=4)
    write(root / "c.jsonl", ["c"])
    recorded = [s.to_dict() for s in find_shards(str(root), "text")]
    now = lambda: find_shards(str(root), "text")  # noqa: E731
    assert changed(recorded, now()) is None
    write(root / "sub" / "d.jsonl", ["new"])
    assert changed(recorded, now()) == "shard sub/d.jsonl was added"
    (root / "sub" / "d.jsonl").unlink()
    (root / "c.jsonl").rename(root / "sub" / "c.jsonl")
    assert changed(recorded, now()) == "shard c.jsonl is now named sub/c.jsonl"
    (root / "sub" / "c.jsonl").rename(root / "c.jsonl")
    (root / "c.jsonl").unlink()
    assert changed(recorded, now()) == "shard c.jsonl was removed"
    write(root / "c.jsonl", ["another c"])
    write(root / "a.jsonl", [f"a{i}" for i in range(6)])
    size = (root / "a.jsonl").stat().st_size
    assert changed(recorded, now()) == f"shard a.jsonl holds {size:,} bytes, where it held {recorded[0]['size']:,}"
    write(root / "a.jsonl", [f"a{i}" for i in range(5)])
    assert changed(recorded, now()) == \
        f"shard c.jsonl holds {(root / 'c.jsonl').stat().st_size} bytes, where it held {recorded[2]['size']}"
    write(root / "c.jsonl", ["c"])
    stale = [*recorded[:1], {**recorded[1], "pieces": [5, 5]}, *recorded[2:]]  # the same footer, other row groups
    assert changed(stale, now()) == "shard b.parquet holds row groups of [4, 4, 2] rows, where it held [5, 5]"
    assert changed(recorded, now()) is None


def test_the_digest_is_a_parquet_shards_end_and_a_json_lines_shards_start(tmp_path):
    """A change of the same size is seen where each kind changes when it is rewritten: a
    parquet file's footer (its end), a JSON Lines file's first line. Both files are larger
    than the digest reads (the other end would not see the change)."""
    texts = [f"{i:06d} " + "".join(chr(0x4e00 + (i * 7919 + j * 104729) % 20000) for j in range(40))
             for i in range(2000)]
    table = pa.table({"text": texts})
    parquet, lines = tmp_path / "a.parquet", tmp_path / "b.jsonl"
    pq.write_table(table.replace_schema_metadata({"edition": "1"}), parquet, compression="none")
    write(lines, texts)
    recorded = [s.to_dict() for s in find_shards(str(tmp_path), "text")]
    assert min(d["size"] for d in recorded) > 2 * shards.DIGEST_BYTES
    pq.write_table(table.replace_schema_metadata({"edition": "2"}), parquet, compression="none")  # the footer
    found = find_shards(str(tmp_path), "text")
    assert found[0].size == recorded[0]["size"] and found[0].digest != recorded[0]["digest"]
    assert changed(recorded, found) == "shard a.parquet changed: its last 64 KiB differ"
    pq.write_table(table.replace_schema_metadata({"edition": "1"}), parquet, compression="none")
    assert changed(recorded, find_shards(str(tmp_path), "text")) is None
    write(lines, ["999999" + texts[0][6:]] + texts[1:])  # the first line, as long as it was
    found = find_shards(str(tmp_path), "text")
    assert found[1].size == recorded[1]["size"] and found[1].digest != recorded[1]["digest"]
    assert changed(recorded, found) == "shard b.jsonl changed: its first 64 KiB differ"


# ---------------------------------------------------------------------------------------
# Damage found while reading: one line, the file and the row


def the_sixth_line(tmp_path, kind: str, line: bytes) -> tuple:
    """A JSON Lines shard of ten documents whose sixth line is `line`, listed while it was whole."""
    path = tmp_path / f"c.{kind}"
    good = [json.dumps({"text": f"document {i}"}).encode() for i in range(10)]
    write_lines(path, good)
    [shard] = find_shards(str(path), "text")
    write_lines(path, good[:5] + [line] + good[6:])
    return path, Shard(shard.name, shard.kind, path.stat().st_size, shard.digest, shard.pieces)


@pytest.mark.parametrize("line, said", [
    (b'{"text": broken', "JSON parse error: Expecting value at column 10"),
    (b'["x"]', "JSON parse error: a list, where each line is an object"),
    (b'{"body": "x"}', "no 'text' (absent or null; its fields: body): fix that line, or choose another field with "
                       "--text-column"),
    (b'{"text": null}', "no 'text' (absent or null; its fields: text): fix that line, or choose another field with "
                        "--text-column"),
    (b'{"text": 5}', "'text' holds 5, not text"),
    (b'{"text": ["a", "b"]}', """'text' holds ["a", "b"], not text"""),
    (b'{"text": "bad \xff\xfe"}', "not UTF-8 text (byte 15)"),
    (b'{"text": "half a pair \\ud800"}', "'text' holds a lone surrogate escape, not UTF-8 text"),
    (b"[" * 100_000, "JSON parse error: arrays or objects nested deeper than Python's JSON reader can follow (its "
                     f"recursion limit, {sys.getrecursionlimit():,} levels)"),  # a RecursionError traceback, exit 1
], ids=["not-json", "a-list", "no-text", "null", "a-number", "a-list-of-text", "not-utf8", "lone-surrogate",
        "nested-100000-deep"])
@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz"])
def test_a_bad_json_line_in_the_middle_is_one_line_naming_the_file_and_the_line(tmp_path, kind, line, said):
    path, shard = the_sixth_line(tmp_path, kind, line)
    documents = read_documents(str(path), shard, 0, 0, "text")
    assert [next(documents) for _ in range(5)] == [(i, f"document {i}") for i in range(5)]  # read up to it
    assert refused(next, documents) == f"cannot read shard {path}: line 6: {said}"
    assert read(path, shard, 0, 6) == [(i, f"document {i}") for i in range(6, 10)]  # a resume past it is not refused


def test_a_line_longer_than_any_document_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(json_lines, "MAX_LINE_BYTES", 100)
    path, shard = the_sixth_line(tmp_path, "jsonl", json.dumps({"text": "x" * 99}).encode())
    assert refused(read, path, shard) == \
        f"cannot read shard {path}: line 6 is longer than 100 bytes, more than any document"
    path, shard = the_sixth_line(tmp_path, "jsonl", json.dumps({"text": "x" * 85}).encode())  # 99 bytes, and "\n"
    assert len(read(path, shard)) == 10


@pytest.mark.parametrize("kind", ["jsonl.gz", pytest.param("jsonl.zst", marks=pytest.mark.skipif(
    not HAS_ZSTANDARD, reason="zstandard not installed"))])
def test_a_compressed_shard_cut_short_is_one_line_naming_the_line_it_ends_in(tmp_path, kind):
    """zstandard's own stream reader ends quietly where a file is cut: the documents before it
    are read, the cut is said."""
    path = tmp_path / f"c.{kind}"
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 50)}) for i in range(20_000)]
    write_lines(path, lines)
    [whole] = find_shards(str(path), "text")
    path.write_bytes(path.read_bytes()[:whole.size // 2])
    [shard] = find_shards(str(path), "text")  # its start is whole
    documents = read_documents(str(path), shard, 0, 0, "text")
    read_before = []
    with pytest.raises(UsageError) as error:
        for row, text in documents:
            read_before.append(text)
    assert read_before == [json.loads(line)["text"] for line in lines[:len(read_before)]] and len(read_before) > 1000
    cut = ("Compressed file ended before the end-of-stream marker was reached" if kind == "jsonl.gz"
           else "the file ends in the middle of a zstd frame: it was cut short")
    assert str(error.value) == f"cannot read shard {path}: line {len(read_before) + 1}: {cut}"


CUTS = {  # the file as it is left while its reader is past its first 500 lines, and what ends the reading
    ("jsonl", "mid-line"): (lambda raw, half: raw[:half], "the file ends at byte {size:,}, where it held {listed:,} "
                            "bytes when listed: it changed during the run"),
    ("jsonl", "at-a-line-end"): (lambda raw, half: raw[:raw.index(b"\n", half) + 1], "the file ends at byte "
                                 "{size:,}, where it held {listed:,} bytes when listed: it changed during the run"),
    ("jsonl", "grown"): (lambda raw, half: raw + raw[:half], "the file goes on past byte {listed:,}, where it held "
                         "{listed:,} bytes when listed: it changed during the run"),
    ("jsonl.gz", "mid-stream"): (lambda raw, half: raw[:half], "Compressed file ended before the end-of-stream "
                                 "marker was reached"),
    ("jsonl.gz", "between-streams"): (None, "the file ends at byte {size:,}, where it held {listed:,} bytes when "
                                            "listed: it changed during the run"),
    ("jsonl.zst", "mid-stream"): (lambda raw, half: raw[:half], "the file ends in the middle of a zstd frame: it "
                                  "was cut short"),
    ("jsonl.zst", "between-frames"): (None, "the file ends at byte {size:,}, where it held {listed:,} bytes when "
                                            "listed: it changed during the run"),
}


@pytest.mark.parametrize("kind, cut", [pytest.param(*case, marks=pytest.mark.skipif(
    case[0] == "jsonl.zst" and not HAS_ZSTANDARD, reason="zstandard not installed")) for case in CUTS])
def test_a_json_lines_shard_cut_short_while_it_is_read_is_one_line_naming_the_file_and_the_line(tmp_path, kind,
                                                                                                 cut):
    """Opened whole, the file is cut (or grown) under its reader: the reading must not end
    early, with the piece's last documents left out without a word. A plain file, and a
    compressed one cut between its streams (gzip members, zstd frames: either ends cleanly
    there), must end at the size listed; one cut inside a stream is its decompressor's EOFError."""
    rng = random.Random(0)  # text that compresses about 3 times: a few MB raw, far more than a reader buffers
    texts = [f"document {i} " + " ".join(str(rng.random()) for _ in range(12)) for i in range(20_000)]
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    path = tmp_path / f"c.{kind}"
    whole = b"".join(compressed(kind, b"".join(lines[at:at + 5_000])) for at in range(0, 20_000, 5_000))
    path.write_bytes(whole)
    [shard] = find_shards(str(path), "text")
    cut_to, said = CUTS[kind, cut]
    if cut_to is None:  # the file's first two streams: 10,000 lines whole
        cut_to = lambda raw, half: compressed(kind, b"".join(lines[:5_000])) + \
            compressed(kind, b"".join(lines[5_000:10_000]))  # noqa: E731
    documents, read_before = read_documents(str(path), shard, 0, 0, "text"), []
    with pytest.raises(UsageError) as error:
        for row, text in documents:
            read_before.append(text)
            if row == 500:
                path.write_bytes(cut_to(whole, len(whole) // 2))
    assert read_before == texts[:len(read_before)] and 500 < len(read_before) <= 20_000  # grown: all it held
    said = said.format(size=path.stat().st_size, listed=shard.size)
    assert str(error.value) == f"cannot read shard {path}: line {len(read_before) + 1}: {said}"


@pytest.mark.parametrize("kind", ["jsonl.gz", pytest.param("jsonl.zst", marks=pytest.mark.skipif(
    not HAS_ZSTANDARD, reason="zstandard not installed"))])
def test_a_compressed_shard_of_0_bytes_is_damaged_not_empty(tmp_path, kind):
    """`gzip -t` refuses it, as it refuses a file cut short anywhere else (a stream compressed
    from nothing still holds a header); gzip and zstd read it as no lines, in silence. Refused at
    listing, and at a read if it is cut to nothing since."""
    path = tmp_path / "data" / f"c.{kind}"
    path.parent.mkdir()
    write(tmp_path / "data" / "a.jsonl", ["a document"])
    path.write_bytes(b"")
    said = f"cannot read shard {path}: it is empty (0 bytes), and a compressed file holds at least its header: it " \
           "is damaged or was cut short; replace it, or remove it"
    assert refused(find_shards, str(tmp_path / "data"), "text") == said
    assert refused(find_shards, str(path), "text") == said
    path.write_bytes(compressed(kind, b""))  # compressed from nothing: a shard of no documents
    [_, shard] = find_shards(str(tmp_path / "data"), "text")
    assert read(tmp_path / "data", shard) == []
    path.write_bytes(b"")
    assert refused(read, tmp_path / "data", dataclasses.replace(shard, size=0)) == said


def test_a_folder_that_cannot_be_listed_is_one_line_naming_it(tmp_path, unlistable):
    """A subfolder of mode 000 (to a user without root's override): os.walk passed over it in
    silence, and the run trained on 3 shards of 4."""
    root = tmp_path / "data"
    for name in ("a/x.jsonl", "b/y.jsonl", "b/deeper/z.jsonl", "c.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        write(root / name, [name])
    assert len(find_shards(str(root), "text")) == 4
    unlistable(root / "b" / "deeper")
    assert refused(find_shards, str(root), "text") == \
        f"cannot list the folder {root / 'b' / 'deeper'} of --dataset {root} (Permission denied): its files would be " \
        "left out of the run; make it readable, or move it out of the folder"


def test_parquet_damage_names_the_row_group_and_the_row(tmp_path, monkeypatch):
    """Rows counted from 0 in their row group, as pyarrow counts them: a null, text that is not
    UTF-8 (parquet stores any bytes as a string), a row group whose pages are damaged."""
    monkeypatch.setattr(shards, "READ_ROWS", 3)
    texts = [f"document {i} " * 20 for i in range(30)]
    path = tmp_path / "p.parquet"
    write(path, texts[:17] + [None] + texts[18:], row_group_size=10)
    [shard] = find_shards(str(path), "text")
    assert read(path, shard, 0) == list(enumerate(texts[:10])) and read(path, shard, 1, 8) == [(8, texts[18]),
                                                                                             (9, texts[19])]
    assert refused(read, path, shard, 1) == \
        f"cannot read shard {path}, row group 1, row 7: 'text' is null: fix that row, or choose another column with " \
        "--text-column"
    raw = b"".join(t.encode() for t in texts)
    offsets = [0]
    for t in texts:
        offsets.append(offsets[-1] + len(t.encode()))
    raw = raw[:offsets[14]] + b"\xff" + raw[offsets[14] + 1:]  # row 4 of row group 1
    column = pa.Array.from_buffers(pa.string(), len(texts), [None, pa.array(offsets, pa.int32()).buffers()[1],
                                                            pa.py_buffer(raw)])
    pq.write_table(pa.table({"text": column}), path, row_group_size=10)
    [shard] = find_shards(str(path), "text")
    assert refused(read, path, shard, 1) == f"cannot read shard {path}, row group 1, row 4: not UTF-8 text"
    # a page of row group 1 damaged: the length before row 15's text (its row 5) says 100 MB
    pq.write_table(pa.table({"text": texts}), path, row_group_size=10, use_dictionary=False, compression="none",
                   data_page_size=500)
    [shard] = find_shards(str(path), "text")
    damaged = bytearray(path.read_bytes())
    at = damaged.index(texts[15].encode())
    damaged[at - 4:at] = (10**8).to_bytes(4, "little")
    path.write_bytes(damaged)
    assert read(path, shard, 2) == list(enumerate(texts[20:]))  # the other row groups are whole
    documents, read_before = read_documents(str(path), shard, 1, 0, "text"), []
    with pytest.raises(UsageError) as error:
        for row, text in documents:
            read_before.append((row, text))
    assert read_before == list(enumerate(texts[10:13]))  # its batches of 3 rows before the damaged page
    said = str(error.value)
    assert said.startswith(f"cannot read shard {path}, row group 1, row 3 on: ") and "\n" not in said, said
    write(path, texts, row_group_size=10)  # compressed (snappy): damaged, it fails to decompress (an OSError)
    [shard] = find_shards(str(path), "text")
    pages = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = pages.dictionary_page_offset or pages.data_page_offset
    damaged = bytearray(path.read_bytes())
    damaged[start + 40:start + 240] = bytes(range(200))
    path.write_bytes(damaged)
    said = refused(read, path, shard, 1)
    assert said.startswith(f"cannot read shard {path}, row group 1, row 0 on: ") and "\n" not in said, said


def test_a_parquet_shard_cut_short_is_one_line_before_training_and_during_it(tmp_path):
    path = tmp_path / "p.parquet"
    write(path, [f"document {i}" for i in range(100)], row_group_size=10)
    [shard] = find_shards(str(path), "text")
    whole = path.stat().st_size
    path.write_bytes(path.read_bytes()[:whole // 2])
    assert refused(find_shards, str(path), "text") == f"cannot read shard {path}: Parquet magic bytes not found " \
        "in footer. Either the file is corrupted or this is not a parquet file."
    assert refused(read, path, shard, 3, 4) == f"cannot read shard {path}, row group 3, row 4 on: it holds " \
        f"{whole // 2:,} bytes, where it held {whole:,} when listed: it changed during the run"


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_position_the_shard_does_not_have_is_one_line(tmp_path, kind):
    """A checkpoint may be hostile or stale: a piece or a row past the shard's end is refused,
    never read as an empty rest; a bool is no position."""
    path = tmp_path / f"a.{kind}"
    write(path, ["one", "two", "three"], **({"row_group_size": 2} if kind == "parquet" else {}))
    [shard] = find_shards(str(path), "text")
    pieces = len(shard.pieces)
    assert pieces == (2 if kind == "parquet" else 1)
    for piece in (-1, pieces, True):
        assert refused(read, path, shard, piece) == f"shard {path}: there is no piece {piece} (it has {pieces})"
    held = " (row group 0 holds 2)" if kind == "parquet" else ""
    for start in (-1, False) + ((3,) if kind == "parquet" else ()):
        assert refused(read, path, shard, 0, start) == f"shard {path}: there is no row {start} to start at{held}"
    assert read(path, shard, 0, 2) == ([] if kind == "parquet" else [(2, "three")])
    if kind == "jsonl":
        assert read(path, shard, 0, 3) == []
        assert refused(read, path, shard, 0, 4) == \
            f"shard {path} has 3 lines, none numbered 4 (from 0): the file changed during the run"


def test_a_parquet_shard_rewritten_during_the_run_at_the_same_size_is_one_line(tmp_path):
    """Its footer is read again with each row group: other row counts, or no text column."""
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["one", "two", "three"]}), path, row_group_size=2)
    [shard] = find_shards(str(path), "text")
    stale = Shard(shard.name, shard.kind, shard.size, shard.digest, (3, 0))
    assert refused(read, path, stale, 0) == \
        f"shard {path}, row group 0 holds 2 rows, where it held 3 when listed: the file changed during the run"
    pq.write_table(pa.table({"txet": ["one", "two", "three"]}), path, row_group_size=2)
    assert path.stat().st_size == shard.size
    assert refused(read, path, shard, 1) == f"shard {path} has no columns named 'text' (columns: txet)"
