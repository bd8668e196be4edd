"""The corpus: every --dataset form (files, folders, compressed shards, the Hub), the
embedded default, the fingerprint a resume checks, and the held-out split."""

import gzip
import json
import lzma
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data
from training import config, corpus, run_data
from training.errors import UsageError


def test_txt_file_is_one_document_per_line_and_blank_lines_are_dropped(tmp_path):
    (tmp_path / "c.txt").write_text("first doc\n\n   \nsecond doc\nthird doc\n")
    assert corpus.load_corpus(str(tmp_path / "c.txt"))["text"] == ["first doc", "second doc", "third doc"]


def test_jsonl_json_and_parquet_files_with_a_text_column(tmp_path):
    records = [{"body": "alpha", "id": 1}, {"body": "beta", "id": 2}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "b.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json", "c.parquet"):
        ds = corpus.load_corpus(str(tmp_path / name), text_column="body")
        assert ds.column_names == ["text"] and ds["text"] == ["alpha", "beta"]


def test_csv_files_and_bz2_shards_are_read(tmp_path):
    """A .csv file with a text column, and a .txt compressed with bzip2: alone and in a folder."""
    import bz2
    (tmp_path / "a.csv").write_text('id,text\n1,"first, with a comma"\n2,second\n')
    (tmp_path / "b.txt.bz2").write_bytes(bz2.compress(b"from bz2\nand more\n"))
    assert corpus.load_corpus(str(tmp_path / "a.csv"))["text"] == ["first, with a comma", "second"]
    assert corpus.load_corpus(str(tmp_path / "b.txt.bz2"))["text"] == ["from bz2", "and more"]
    assert sorted(corpus.load_corpus(str(tmp_path))["text"]) == ["and more", "first, with a comma", "from bz2",
                                                                 "second"]


def test_the_default_validation_split_is_one_percent_at_least_1_at_most_1000(runs):
    assert [corpus.default_val_docs(n) for n in (5, 240, 12_345, 10**7)] == [1, 2, 123, 1000]
    cfg = config.parse_args(["--dataset", str(runs.corpus)])  # no --val-docs (the tests' corpus: 240 lines)
    train_text, val_text, _ = run_data.load_text(cfg)
    assert len(val_text) == 2 and len(train_text) == 238


def test_folder_of_mixed_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.txt").write_text("from txt\n")
    (tmp_path / "sub" / "two.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"text": "from parquet"}]), tmp_path / "three.parquet")
    (tmp_path / "README.md").write_text("not data")  # other files are ignored
    assert sorted(corpus.load_corpus(str(tmp_path))["text"]) == ["from jsonl", "from parquet", "from txt"]


def test_a_folder_yields_every_file_datasets_can_read_and_names_what_it_skips(tmp_path, capsys):
    """Symlinked folders are followed, compressed shards read, suffixes matched in any case;
    a file read twice through links counts once; whatever is left out is named."""
    import gzip
    import lzma
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "b.txt").write_text("from a linked folder\n")
    root = tmp_path / "data"
    root.mkdir()
    (root / "a.txt").write_text("from txt\n")
    (root / "more").symlink_to("../shards")  # a folder given by a link
    (root / "again").symlink_to("../shards")  # the same folder twice: read once
    (root / "loop").symlink_to(".")  # a link back up: no endless walk
    (root / "part-0.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    with gzip.open(root / "part-1.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "from jsonl.gz"}) + "\n")
    with lzma.open(root / "part-2.txt.xz", "wt") as f:
        f.write("from txt.xz\n")
    (root / "extra.TXT").write_text("from TXT\n")
    (root / "README.md").write_text("not data")
    (root / ".git").mkdir()
    (root / ".git" / "config.txt").write_text("not data either")
    texts = corpus.load_corpus(str(root))["text"]
    assert sorted(texts) == sorted(["from txt", "from a linked folder", "from jsonl", "from jsonl.gz",
                                    "from txt.xz", "from TXT"])
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: --dataset {root}: skipping 4 entries"), warning
    for skipped in ["README.md", ".git/ (hidden)", "more/ (already read as ../shards)",
                    "loop/ (already read as .)"]:
        assert skipped in warning[0]


def test_a_folder_that_cannot_be_listed_is_one_line_naming_it(tmp_path, unlistable):
    """A subfolder of mode 000 (to a user without root's override): os.walk passed over it in
    silence, and the run trained on the other folders' documents (59 of 111 in round six)."""
    root = tmp_path / "data"
    for folder in ("a", "b", "b/deeper"):
        (root / folder).mkdir(parents=True)
        (root / folder / "part.txt").write_text(f"a document of {folder}\n")
    assert len(corpus.load_corpus(str(root))) == 3
    unlistable(root / "b")
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(root))
    assert str(refused.value) == f"cannot list the folder {root / 'b'} of --dataset {root} (Permission denied): " \
                                 "its files would be left out of the run; make it readable, or move it out of the folder"


def test_the_embedded_corpus_names_a_folder_it_cannot_list(unlistable, capsys):
    """The interpreter's own files, not the user's: the run goes on without them, and says so."""
    json_folder = next(f for f in corpus.stdlib_files() if f.endswith("/json/decoder.py")).rsplit("/", 1)[0]
    unlistable(json_folder)
    files = corpus.stdlib_files()
    assert files and not [f for f in files if f.startswith(json_folder + "/")]
    assert capsys.readouterr().err == f"warning: the embedded corpus (stdlib) leaves out {json_folder}: it cannot be " \
                                      "listed (Permission denied)\n"


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.txt.xz"])
def test_a_compressed_file_of_0_bytes_is_damaged_not_empty(tmp_path, name):
    """`gzip -t` refuses it, as it refuses a file cut short anywhere else (a file compressed from
    nothing still holds a header): it was read as a file of no documents, in silence."""
    (tmp_path / "a.txt").write_text("a document\n")
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(tmp_path))
    assert str(refused.value) == f"cannot read {tmp_path / name}: it is empty (0 bytes), and a compressed file " \
                                 "holds at least its header: it is damaged or was cut short; replace it, or remove it"
    raw = b'{"text": "repaired"}\n' if ".jsonl" in name else b"repaired\n"
    (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else lzma.compress(raw))
    assert sorted(corpus.load_corpus(str(tmp_path))["text"]) == ["a document", "repaired"]


@pytest.mark.parametrize("name, raw", [("c.jsonl.gz", gzip.compress(b"", mtime=0)), ("c.jsonl", b"\n  \n"),
                                       ("c.jsonl.xz", lzma.compress(b"\n\n"))],
                         ids=["gzip-of-nothing", "blank-lines", "xz-of-blank-lines"])
def test_a_json_lines_file_of_blanks_alone_holds_no_documents(tmp_path, name, raw):
    """Whole, and holding nothing but blanks once decompressed: no documents, beside other
    files' and alone. `datasets` took JSON's columns from the first line read, and failed
    without one: "cannot read DIR: StopIteration", which names nothing of the cause."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_bytes(raw)
    (tmp_path / "data" / "b.txt").write_text("a document\n")
    assert corpus.load_corpus(str(tmp_path / "data"))["text"] == ["a document"]
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(tmp_path / "data" / name))
    assert str(refused.value) == f"dataset {tmp_path / 'data' / name} has no non-empty documents"


def test_a_zstd_shard_is_read_or_names_the_package_it_needs(tmp_path):
    import importlib.util
    (tmp_path / "part-0.jsonl.zst").write_bytes(b"(\xb5/\xfd not really zstd")
    if importlib.util.find_spec("zstandard") is None:
        with pytest.raises(UsageError, match="needs the zstandard package: pip install zstandard"):
            corpus.load_corpus(str(tmp_path))
    else:  # the package is there: the damaged shard is then a one-line read error
        with pytest.raises(UsageError, match="cannot read"):
            corpus.load_corpus(str(tmp_path))


def test_a_damaged_row_in_one_of_several_files_names_that_file(tmp_path):
    """`datasets` says "JSON parse error ... in row 30" without the file; among hundreds of
    shards the user needs the file."""
    rows = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(30))
    (tmp_path / "a.jsonl").write_text(rows)
    (tmp_path / "b.jsonl").write_text(rows + '{"text": broken\n')
    (tmp_path / "c.jsonl").write_text(rows)
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(tmp_path))
    assert str(refused.value) == f"cannot read {tmp_path / 'b.jsonl'}: JSON parse error on line 31: Expecting value " \
                                 "at column 10"


@pytest.mark.parametrize("name, lines, blank, bad, said", [
    ("c.jsonl", 300, (), 281, "Expecting value at column 10"),
    ("c.jsonl", 300, (10, 20), 283, "Expecting value at column 10"),  # after two blank lines
    ("c.jsonl", 40_000, (), 35_001, "Expecting value at column 10"),  # pyarrow said "row 3617": from a block's start
    ("c.jsonl.gz", 50, (), 41, "Expecting value at column 10"),
    ("c.jsonl", 50, (), 41, "a list, where each line is an object"),  # pyarrow said "row 0"
], ids=["line-281", "after-blank-lines", "in-a-later-block", "compressed", "an-array"])
def test_a_line_that_is_not_json_is_numbered_as_the_files_lines_are(tmp_path, name, lines, blank, bad, said):
    """Line N of the file, counted from 1 with its blank lines, as an editor or `sed -n Np`
    finds it: never pyarrow's row, counted from 0 without the blank lines and again from 0 in
    each block it parses ("row 280" for the 281st line)."""
    text = [json.dumps({"text": f"doc {i} " + "x" * 40}) for i in range(lines)]
    for i in blank:
        text.insert(i, "")
    text[bad - 1] = '["x"]' if "list" in said else '{"text": broken'
    path = tmp_path / name
    with (gzip.open if name.endswith(".gz") else open)(path, "wt") as f:
        f.write("\n".join(text) + "\n")
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(path))
    assert str(refused.value) == f"cannot read {path}: JSON parse error on line {bad}: {said}"


@pytest.mark.parametrize("line", ["[" * 100_000, '{"text": "x", "meta": ' + "[" * 5000 + "]" * 5000 + "}"],
                         ids=["not-json", "json-nested-5000-deep"])
def test_a_line_nested_deeper_than_json_can_read_is_one_line_naming_it(tmp_path, line):
    """Python's JSON reader recurses a level at a time, and `datasets` reads a schema so: a
    RecursionError traceback (exit 1), or a line that named neither the file nor the line."""
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(30)) + line + "\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(tmp_path))
    assert str(refused.value) == f"cannot read {path}: JSON parse error on line 31: arrays or objects nested deeper " \
                                 f"than Python's JSON reader can follow (its recursion limit, " \
                                 f"{sys.getrecursionlimit():,} levels)"


def test_a_document_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    """pyarrow's JSON reader takes any bytes as a string; the first read of the text was a
    UnicodeDecodeError traceback from deep inside `datasets`."""
    good = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)).encode()
    path = tmp_path / "c.jsonl"
    path.write_bytes(good[:good.index(b'{"text": "document 20"')] + b'{"text": "bad \xff\xfe"}\n' + good)
    with pytest.raises(UsageError) as refused:
        corpus.load_corpus(str(path))
    assert str(refused.value) == f"dataset {path}: document 21 is not UTF-8 text: fix or drop it"


def test_the_fingerprint_is_the_content_not_the_path(tmp_path):
    lines = [f"document {i}" for i in range(50)]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "copy.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "appended.txt").write_text("\n".join(lines + ["one more"]) + "\n")
    (tmp_path / "swapped.txt").write_text("\n".join(lines[1:2] + lines[:1] + lines[2:]) + "\n")
    (tmp_path / "regrouped.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                      for t in ["document 0document 1"] + lines[2:] + [""]))
    fp = {name: corpus.fingerprint(corpus.load_corpus(str(tmp_path / name)))
          for name in ["a.txt", "sub/copy.txt", "appended.txt", "swapped.txt", "regrouped.jsonl"]}
    assert fp["a.txt"] == fp["sub/copy.txt"] and fp["a.txt"]["documents"] == 50
    assert fp["appended.txt"]["documents"] == 51
    assert fp["swapped.txt"]["documents"] == 50 and fp["swapped.txt"] != fp["a.txt"]
    assert len({fp["a.txt"]["blake2b"], fp["swapped.txt"]["blake2b"], fp["regrouped.jsonl"]["blake2b"]}) == 3


def test_a_byte_order_mark_is_not_text(tmp_path):
    """An editor that adds or strips a UTF-8 byte-order mark changes no document: the file is
    the same data (the same fingerprint, so a resume accepts it)."""
    lines = "first document\nsecond document\n"
    (tmp_path / "plain.txt").write_text(lines, encoding="utf-8")
    (tmp_path / "bom.txt").write_text(lines, encoding="utf-8-sig")
    assert (tmp_path / "bom.txt").read_bytes().startswith(b"\xef\xbb\xbf")
    plain, bom = (corpus.load_corpus(str(tmp_path / name)) for name in ("plain.txt", "bom.txt"))
    assert bom["text"] == plain["text"] == ["first document", "second document"]
    assert corpus.fingerprint(bom) == corpus.fingerprint(plain)


def test_hub_dataset_id_passes_config_and_split_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict({"content": ["a hub document", ""], "n": [1, 2]})

    monkeypatch.setattr(data.datasets, "load_dataset", fake_load_dataset)
    ds = corpus.load_corpus("HuggingFaceFW/fineweb", "sample-10BT", "train[:1%]", text_column="content")
    assert calls == [("HuggingFaceFW/fineweb", "sample-10BT", "train[:1%]")]
    assert ds["text"] == ["a hub document"]  # the empty document is dropped
    corpus.load_corpus("some/dataset", text_column="content")
    assert calls[-1] == ("some/dataset", None, "train")


def test_unreachable_hub_dataset_is_a_clear_error():
    with pytest.raises(UsageError, match="cannot load Hub dataset 'no-such-user/no-such-dataset'"):
        corpus.load_corpus("no-such-user/no-such-dataset")  # offline in the tests


@pytest.mark.parametrize("setup, kwargs, message", [
    (None, {"dataset": "missing/corpus.txt"}, "not found"),
    ("", {}, "no non-empty documents"),
    ("\n  \n", {}, "no non-empty documents"),
    ('{"body": "x"}\n', {"text_column": "text"}, "has no column 'text' \\(columns: body\\)"),
    ('{"text": 5}\n', {}, "not text"),
    (None, {"dataset_config": "x"}, "apply to Hub datasets only"),
    (None, {"split": "test"}, "apply to Hub datasets only"),
])
def test_bad_datasets_are_clear_errors(tmp_path, setup, kwargs, message):
    path = tmp_path / ("c.jsonl" if setup and "{" in setup else "c.txt")
    if setup is not None:
        path.write_text(setup)
    kwargs = {"dataset": str(path) if setup is not None else corpus.EMBEDDED_CORPUS, **kwargs}
    with pytest.raises(UsageError, match=message):
        corpus.load_corpus(**kwargs)


def test_embedded_corpus_is_pythons_standard_library_without_tests():
    files = corpus.stdlib_files()
    assert len(files) > 300
    assert not [f for f in files if "/test/" in f or "/tests/" in f or "site-packages" in f
                or f.rsplit("/", 1)[1].startswith("test_")]
    assert any(f.endswith("/json/decoder.py") for f in files)
    ds = corpus.load_corpus(corpus.EMBEDDED_CORPUS)  # offline: HF_HUB_OFFLINE is set for the tests
    assert len(ds) > 3000
    lengths = [len(t) for t in ds["text"][:2000]]
    assert sum(lengths) / len(lengths) > 300 and sorted(lengths)[len(lengths) // 2] <= 1500


def test_validation_split_is_held_out_and_deterministic():
    ds = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(100)]})
    train, val = corpus.split_train_val(ds, 7, seed=1)
    assert len(val) == 7 and len(train) == 93
    assert not set(train["text"]) & set(val["text"])
    assert corpus.split_train_val(ds, 7, seed=1)[1]["text"] == val["text"]
    with pytest.raises(UsageError):
        corpus.split_train_val(ds, 100, seed=1)




def test_text_bytes_counts_utf8_bytes_not_characters():
    texts = datasets.Dataset.from_dict({"text": ["héllo", "日本語", "abc", "x"]}).select([0, 1, 2])  # an index mapping
    assert corpus.text_bytes(texts) == len("héllo".encode()) + len("日本語".encode()) + 3 == 18
