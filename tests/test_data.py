"""The data: framing and padding, the tokenizer, every --dataset form, the embedded corpus,
tokenization done once, and a sampler that gives every world size the same global batches."""

import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import data
from data import BOT, EOT, PAD, PaddedSequenceDataset, ResumableDistributedSampler
from errors import UsageError
from model import IGNORE_INDEX

DOCS = ["def add(a, b):\n    return a + b", "héllo wörld — ünïcode ✓", "x = [i * i for i in range(10)]"]


@pytest.fixture(scope="module")
def tokenizer():
    texts = datasets.Dataset.from_dict({"text": DOCS * 20})
    return data.train_tokenizer(texts, vocab_size=300)


def rows(*id_lists):
    return datasets.Dataset.from_dict({"input_ids": [list(ids) for ids in id_lists]})


def test_framing_padding_and_the_shift_by_one():
    # a framed document [BOT]=1, 10, 11, 12, [EOT]=2 with seq_len 8: padded with [PAD]=0
    ds = PaddedSequenceDataset(rows([1, 10, 11, 12, 2]), seq_len=8, pad_id=0)
    x, y = ds[0]
    assert x.tolist() == [1, 10, 11, 12, 0, 0, 0, 0]
    assert y.tolist() == [10, 11, 12, 2] + [IGNORE_INDEX] * 4
    assert x.dtype == y.dtype == torch.long


def one_row_at_a_time(ds: PaddedSequenceDataset, i: int):
    """The plain formulation of a row, which the batched read replaces: a Python list of ids,
    copied into a padded tensor."""
    ids = torch.tensor(ds.rows[i]["input_ids"], dtype=torch.long)
    n = len(ids) - 1
    x = torch.full((ds.seq_len,), ds.pad_id, dtype=torch.long)
    y = torch.full((ds.seq_len,), IGNORE_INDEX, dtype=torch.long)
    x[:n], y[:n] = ids[:-1], ids[1:]
    return x, y


def test_a_batch_is_read_at_once_and_equals_its_rows_read_one_at_a_time():
    """The DataLoader asks for a batch's indices at once (__getitems__, one call a batch): the
    rows of every length, from 2 tokens to seq_len + 1, in the sampler's order."""
    g = torch.Generator().manual_seed(0)
    lengths = [2, 17, 5, 3, 9, 17, 11] * 6
    ids = [[1, *torch.randint(3, 60_000, (n - 2,), generator=g).tolist(), 2] for n in lengths]
    stored = datasets.Dataset.from_dict({"input_ids": ids}, features=datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value("uint16"))}))  # as data.tokenize stores them
    # an index mapping, as a split or a shuffle leaves: rows read through it, not in storage order
    ds = PaddedSequenceDataset(stored.shuffle(seed=0).select(range(35)), seq_len=16, pad_id=0)
    order = torch.randperm(len(ds), generator=g).tolist()
    calls = []
    real = PaddedSequenceDataset.__getitems__
    ds.__getitems__ = lambda indices: calls.append(indices) or real(ds, indices)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=8, sampler=order, drop_last=True))
    assert calls == [order[i:i + 8] for i in range(0, 32, 8)]  # 35 rows: the last 3 are dropped
    for (x, y), indices in zip(batches, calls):
        expected = [one_row_at_a_time(ds, i) for i in indices]
        assert torch.equal(x, torch.stack([e[0] for e in expected])) and torch.equal(y, torch.stack([e[1] for e in expected]))
        assert x.dtype == y.dtype == torch.long


@pytest.mark.parametrize("vocab_size, stored", [(300, "uint16"), (65_536, "uint16"), (65_537, "uint32")])
def test_token_ids_are_stored_in_the_narrowest_type_that_holds_the_vocabulary(vocab_size, stored, monkeypatch):
    tokenizer = data.train_tokenizer(datasets.Dataset.from_dict({"text": DOCS * 20}), vocab_size=300)
    monkeypatch.setattr(type(tokenizer), "get_vocab_size", lambda self, with_added_tokens=True: vocab_size)
    framed = data.tokenize(datasets.Dataset.from_dict({"text": DOCS}), tokenizer, seq_len=16)
    assert framed.features["input_ids"].feature.dtype == stored


def test_a_document_longer_than_seq_len_is_cut_into_windows_that_overlap_by_one_token(tokenizer):
    text = " ".join(DOCS)
    texts = datasets.Dataset.from_dict({"text": [text]})
    framed = [tokenizer.token_to_id(BOT), *tokenizer.encode(text).ids, tokenizer.token_to_id(EOT)]
    windows = data.tokenize(texts, tokenizer, seq_len=8)["input_ids"]
    assert windows[0] == framed[:9] and len(windows) == -(-(len(framed) - 1) // 8)
    assert all(len(w) == 9 for w in windows[:-1]) and 2 <= len(windows[-1]) <= 9  # only the last one short
    assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))  # each begins where the one before ends
    ds = PaddedSequenceDataset(data.tokenize(texts, tokenizer, 8), 8, 0)
    targets = [t for i in range(len(ds)) for t in ds[i][1].tolist() if t != IGNORE_INDEX]
    assert targets == framed[1:]  # every token after [BOT] a target, once: the last window padded


def test_tokenize_frames_every_document_with_bot_and_eot(tokenizer):
    framed = data.tokenize(datasets.Dataset.from_dict({"text": DOCS}), tokenizer, seq_len=512)
    for text, ids in zip(DOCS, framed["input_ids"]):
        assert ids[0] == tokenizer.token_to_id(BOT) and ids[-1] == tokenizer.token_to_id(EOT)
        assert tokenizer.decode(ids[1:-1]) == text


def test_tokenizer_round_trip_and_special_tokens(tokenizer, tmp_path):
    assert [tokenizer.token_to_id(t) for t in (PAD, BOT, EOT)] == [0, 1, 2]
    for text in DOCS + ["never seen: 日本語 and tabs\t\n"]:  # byte-level: nothing is unknown
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    tokenizer.save(str(tmp_path / "tok.json"))
    assert data.load_tokenizer(tmp_path / "tok.json").to_str() == tokenizer.to_str()


def test_tokenizer_without_special_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(UsageError, match=r"lacks the special tokens \[PAD\], \[BOT\], \[EOT\]"):
        data.load_tokenizer(tmp_path / "plain.json")


def test_tokenizing_happens_once_and_is_read_back_from_the_cache(tokenizer, tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(DOCS) + "\n")
    texts = data.load_corpus(str(tmp_path / "c.txt"))
    first = data.tokenize(texts, tokenizer, seq_len=16)
    written = [os.stat(f["filename"]) for f in first.cache_files]
    second = data.tokenize(texts, tokenizer, seq_len=16)  # what the other ranks do
    assert first.cache_files and first.cache_files == second.cache_files
    # read back, not computed again: the cache file is the same file, unwritten since
    assert [(st.st_ino, st.st_mtime_ns) for st in map(os.stat, (f["filename"] for f in second.cache_files))] == \
        [(st.st_ino, st.st_mtime_ns) for st in written]
    assert second["input_ids"] == first["input_ids"]


def hostile_texts(n, seed=0):
    """Documents built to trip an encoding in pieces: runs of spaces and tabs, Windows line ends,
    no-break and ideographic spaces, control characters that Python counts as whitespace and
    the tokenizer does not, contractions, special-token look-alikes, CJK without spaces."""
    import random
    rng = random.Random(seed)
    pieces = ["word", "tokens", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\x1c", "\xa0", "\u3000", "日本語", "it's",
              "'s", " 'll", "[EOT]", "[PAD]", "12345", "!!!", "...", "é", "x" * 40, " " * 30]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 300))) for _ in range(n)]


def unbroken_texts(n=60, seed=0):
    """Long documents without a single whitespace character: minified JSON, base64, digits,
    letters glued to digits and punctuation, contractions, CJK. Only the tokenizer's own
    pieces can be cut between."""
    import base64
    import random
    rng = random.Random(seed)
    makers = [
        lambda: json.dumps([{"id": i, "name": f"n{i}", "tags": ["a", "b"]} for i in range(rng.randint(5, 200))],
                           separators=(",", ":")),
        lambda: base64.b64encode(rng.randbytes(rng.randint(100, 6000))).decode(),
        lambda: "".join(rng.choice(["abc", "123", "x9", "don't", "it's", "'s", "!!", "日本語", "é", ".", "'"])
                        for _ in range(rng.randint(50, 2000))),
        lambda: "".join(rng.choice("abcdefgh") for _ in range(rng.randint(50, 5000))),  # one piece
    ]
    return [rng.choice(makers)() for _ in range(n)]


def windows_of_whole_documents(texts, tokenizer, seq_len):
    """The reference, from the tokenizer's own encoding of every document whole (special-token
    look-alikes as text): framed, [BOT] + ids + [EOT], then cut so that window k holds tokens
    k * seq_len to k * seq_len + seq_len (one more than it predicts), while any target is left."""
    bot, eot = tokenizer.token_to_id(BOT), tokenizer.token_to_id(EOT)
    windows = []
    for encoding in data.text_only(tokenizer).encode_batch(texts, add_special_tokens=False):
        framed = [bot] + encoding.ids + [eot]
        k = 0
        while k * seq_len < len(framed) - 1:
            windows.append(framed[k * seq_len:k * seq_len + seq_len + 1])
            k += 1
    return windows


@pytest.mark.parametrize("seq_len", [8, 32, 128])
def test_every_token_of_every_document_is_a_target_once(seq_len, monkeypatch):
    """Long documents, hostile ones among them, encoded in pieces of 1,000 to 2,000 characters
    (PIECE_CHARS lowered: they are over 2 x 100,000 in real use) give the windows of the whole
    documents: as many as their tokens need, and every token after [BOT] predicted in exactly
    one of them."""
    monkeypatch.setattr(data, "PIECE_CHARS", 1_000)
    # (a text that is one piece for the tokenizer, 2,000 letters or more with nothing between,
    # has no exact cut: the next test shows that it loses nothing all the same)
    one_piece = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    unbroken = [t for t in unbroken_texts() if max(len(p) for p, _ in one_piece(t)) < 1_000]
    texts = hostile_texts(600) + unbroken + [" ".join(["the model reads tokens"] * 200)] + DOCS
    tokenizer = data.train_tokenizer(datasets.Dataset.from_dict({"text": texts}), vocab_size=400)
    assert data.clip_is_exact(tokenizer) and max(map(len, texts)) > 2_016
    windows = data.tokenize(datasets.Dataset.from_dict({"text": texts}), tokenizer, seq_len)["input_ids"]
    assert windows == windows_of_whole_documents(texts, tokenizer, seq_len)
    encoded = data.text_only(tokenizer).encode_batch(texts, add_special_tokens=False)
    assert len(windows) == sum(-(-(len(e.ids) + 1) // seq_len) for e in encoded)  # ceil(targets / seq_len)
    assert sum(len(w) - 1 for w in windows) == sum(len(e.ids) + 1 for e in encoded)  # each target once


def test_a_huge_document_is_encoded_in_pieces_never_whole(tokenizer):
    """45 MB in one line would take gigabytes to encode whole: the encoder is given pieces cut
    where no token changes, and the windows are those of the whole document. One piece of
    8 MB of letters has no such cut: it is cut anyway, and no character is lost."""
    seen = []

    class Recording:  # the real tokenizer, recording how much text it is given
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode_batch_fast(self, texts, **kwargs):
            seen.extend(map(len, texts))
            return tokenizer.encode_batch_fast(texts, **kwargs)

    huge = " ".join(["gradients flow back through every layer"] * 200_000)  # 8 MB
    minified = json.dumps([{"layer": i, "grad": [0.5, 1.5]} for i in range(200_000)], separators=(",", ":"))
    letters = "abcdefgh" * 1_000_000  # 8 MB, one piece: no cut between two tokens is known to be exact
    windows = data._encode({"text": [huge, minified, DOCS[0]]}, Recording(), seq_len=512, exact_cuts=True)["input_ids"]
    assert [w.tolist() for w in windows] == windows_of_whole_documents([huge, minified, DOCS[0]], tokenizer, 512)
    assert max(seen) <= 2 * data.PIECE_CHARS + 16  # never a whole document
    windows = data._encode({"text": [letters]}, Recording(), seq_len=512, exact_cuts=True)["input_ids"]
    ids = [t for w in windows for t in w.tolist()[1:]]
    assert tokenizer.decode(ids[:-1]) == letters and max(seen) <= 2 * data.PIECE_CHARS + 16


def test_the_bpe_trainer_reads_long_documents_in_pieces_and_learns_what_it_learns_from_them_whole(monkeypatch):
    """Given one 45 MB document whole, the BPE trainer took 4 GB. It is given pieces cut
    between words instead, here of 1,000 to 2,000 characters: it counts the same words, so it
    learns the same tokenizer as the plain formulation, the trainer given each document whole."""
    texts = [" ".join(hostile_texts(400)), "".join(unbroken_texts()), "the model reads tokens " * 3_000, *DOCS]
    whole = Tokenizer(models.BPE())
    whole.pre_tokenizer, whole.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    whole.train_from_iterator([texts], trainers.BpeTrainer(
        vocab_size=400, special_tokens=data.SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    given = []
    real_train = Tokenizer.train_from_iterator

    def recording(self, iterator, trainer):
        return real_train(self, (given.append(list(batch)) or batch for batch in iterator), trainer)

    monkeypatch.setattr(Tokenizer, "train_from_iterator", recording)
    monkeypatch.setattr(data, "PIECE_CHARS", 1_000)
    pieced = data.train_tokenizer(datasets.Dataset.from_dict({"text": texts}), vocab_size=400)
    assert max(map(len, texts)) > 60_000 and max(len(piece) for batch in given for piece in batch) <= 2_016
    assert "".join(piece for batch in given for piece in batch) == "".join(texts)
    assert pieced.to_str() == whole.to_str()


def test_a_tokenizer_that_cutting_could_change_encodes_documents_whole_or_says_so(monkeypatch, capsys):
    """A normalizer could change a token at a cut: documents up to 2 x PIECE_CHARS characters
    are encoded whole; a longer one is cut before whitespace all the same (its memory stays
    bounded), and one line says that the tokens at those cuts may differ."""
    from tokenizers import normalizers
    texts = datasets.Dataset.from_dict({"text": DOCS * 20})
    lowercase = data.train_tokenizer(texts, vocab_size=300)
    lowercase.normalizer = normalizers.Lowercase()
    assert not data.clip_is_exact(lowercase)
    long_docs = [" ".join(DOCS * 30)] * 3  # 3,000 characters
    windows = data.tokenize(datasets.Dataset.from_dict({"text": long_docs}), lowercase, 8)["input_ids"]
    assert windows == windows_of_whole_documents(long_docs, lowercase, 8) and capsys.readouterr().err == ""
    monkeypatch.setattr(data, "PIECE_CHARS", 1_000)
    data.tokenize(datasets.Dataset.from_dict({"text": long_docs}), lowercase, 8)
    assert capsys.readouterr().err.startswith("warning: documents longer than 2,000 characters are encoded in pieces")


def test_a_large_corpus_is_tokenized_by_one_process_per_core_with_the_same_result(tokenizer, tmp_path, monkeypatch):
    """12,000 documents on 2 cores (faked, so that a 1-core machine runs this path too): two
    processes of 5,000 documents or more each."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    texts = [f"document {i}: " + DOCS[i % 3].replace("\n", " ") for i in range(12_000)]
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    framed = data.tokenize(data.load_corpus(str(tmp_path / "c.txt")), tokenizer, seq_len=16)
    assert len(framed.cache_files) == 2  # one cache file per process
    assert framed["input_ids"] == windows_of_whole_documents(texts, tokenizer, 16)


# ---- every --dataset form ---------------------------------------------------------------

def test_txt_file_is_one_document_per_line_and_blank_lines_are_dropped(tmp_path):
    (tmp_path / "c.txt").write_text("first doc\n\n   \nsecond doc\nthird doc\n")
    assert data.load_corpus(str(tmp_path / "c.txt"))["text"] == ["first doc", "second doc", "third doc"]


def test_jsonl_json_and_parquet_files_with_a_text_column(tmp_path):
    records = [{"body": "alpha", "id": 1}, {"body": "beta", "id": 2}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "b.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json", "c.parquet"):
        ds = data.load_corpus(str(tmp_path / name), text_column="body")
        assert ds.column_names == ["text"] and ds["text"] == ["alpha", "beta"]


def test_csv_files_and_bz2_shards_are_read(tmp_path):
    """A .csv file with a text column, and a .txt compressed with bzip2: alone and in a folder."""
    import bz2
    (tmp_path / "a.csv").write_text('id,text\n1,"first, with a comma"\n2,second\n')
    (tmp_path / "b.txt.bz2").write_bytes(bz2.compress(b"from bz2\nand more\n"))
    assert data.load_corpus(str(tmp_path / "a.csv"))["text"] == ["first, with a comma", "second"]
    assert data.load_corpus(str(tmp_path / "b.txt.bz2"))["text"] == ["from bz2", "and more"]
    assert sorted(data.load_corpus(str(tmp_path))["text"]) == ["and more", "first, with a comma", "from bz2",
                                                                 "second"]


def test_the_default_validation_split_is_one_percent_at_least_1_at_most_1000(corpus):
    assert [data.default_val_docs(n) for n in (5, 240, 12_345, 10**7)] == [1, 2, 123, 1000]
    import training
    cfg = training.parse_args(["--dataset", str(corpus)])  # no --val-docs
    train_text, val_text, _ = training.load_text(cfg)
    assert len(val_text) == 2 and len(train_text) == 238


def test_folder_of_mixed_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.txt").write_text("from txt\n")
    (tmp_path / "sub" / "two.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"text": "from parquet"}]), tmp_path / "three.parquet")
    (tmp_path / "README.md").write_text("not data")  # other files are ignored
    assert sorted(data.load_corpus(str(tmp_path))["text"]) == ["from jsonl", "from parquet", "from txt"]


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
    texts = data.load_corpus(str(root))["text"]
    assert sorted(texts) == sorted(["from txt", "from a linked folder", "from jsonl", "from jsonl.gz",
                                    "from txt.xz", "from TXT"])
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: --dataset {root}: skipping 4 entries"), warning
    for skipped in ["README.md", ".git/ (hidden)", "more/ (already read as ../shards)",
                    "loop/ (already read as .)"]:
        assert skipped in warning[0]


def test_a_zstd_shard_is_read_or_names_the_package_it_needs(tmp_path):
    import importlib.util
    (tmp_path / "part-0.jsonl.zst").write_bytes(b"(\xb5/\xfd not really zstd")
    if importlib.util.find_spec("zstandard") is None:
        with pytest.raises(UsageError, match="needs the zstandard package: pip install zstandard"):
            data.load_corpus(str(tmp_path))
    else:  # the package is there: the damaged shard is then a one-line read error
        with pytest.raises(UsageError, match="cannot read"):
            data.load_corpus(str(tmp_path))


def test_the_fingerprint_is_the_content_not_the_path(tmp_path):
    lines = [f"document {i}" for i in range(50)]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "copy.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "appended.txt").write_text("\n".join(lines + ["one more"]) + "\n")
    (tmp_path / "swapped.txt").write_text("\n".join(lines[1:2] + lines[:1] + lines[2:]) + "\n")
    (tmp_path / "regrouped.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                      for t in ["document 0document 1"] + lines[2:] + [""]))
    fp = {name: data.fingerprint(data.load_corpus(str(tmp_path / name)))
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
    plain, bom = (data.load_corpus(str(tmp_path / name)) for name in ("plain.txt", "bom.txt"))
    assert bom["text"] == plain["text"] == ["first document", "second document"]
    assert data.fingerprint(bom) == data.fingerprint(plain)


def test_special_token_lookalikes_in_a_document_are_text(tokenizer):
    """Only the framing makes [BOT] and [EOT]: a document that spells them out is encoded as text."""
    special = {tokenizer.token_to_id(t) for t in (PAD, BOT, EOT)}
    doc = "before [PAD] middle [BOT][EOT] after"
    framed = data.tokenize(datasets.Dataset.from_dict({"text": [doc]}), tokenizer, seq_len=128)["input_ids"][0]
    assert framed[0] == tokenizer.token_to_id(BOT) and framed[-1] == tokenizer.token_to_id(EOT)
    assert not special & set(framed[1:-1])
    assert tokenizer.decode(framed[1:-1]) == doc


def test_hub_dataset_id_passes_config_and_split_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict({"content": ["a hub document", ""], "n": [1, 2]})

    monkeypatch.setattr(data.datasets, "load_dataset", fake_load_dataset)
    ds = data.load_corpus("HuggingFaceFW/fineweb", "sample-10BT", "train[:1%]", text_column="content")
    assert calls == [("HuggingFaceFW/fineweb", "sample-10BT", "train[:1%]")]
    assert ds["text"] == ["a hub document"]  # the empty document is dropped
    data.load_corpus("some/dataset", text_column="content")
    assert calls[-1] == ("some/dataset", None, "train")


def test_unreachable_hub_dataset_is_a_clear_error():
    with pytest.raises(UsageError, match="cannot load Hub dataset 'no-such-user/no-such-dataset'"):
        data.load_corpus("no-such-user/no-such-dataset")  # offline in the tests


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
    kwargs = {"dataset": str(path) if setup is not None else data.EMBEDDED_CORPUS, **kwargs}
    with pytest.raises(UsageError, match=message):
        data.load_corpus(**kwargs)


def test_embedded_corpus_is_pythons_standard_library_without_tests():
    files = data.stdlib_files()
    assert len(files) > 300
    assert not [f for f in files if "/test/" in f or "/tests/" in f or "site-packages" in f
                or f.rsplit("/", 1)[1].startswith("test_")]
    assert any(f.endswith("/json/decoder.py") for f in files)
    ds = data.load_corpus(data.EMBEDDED_CORPUS)  # offline: HF_HUB_OFFLINE is set for the tests
    assert len(ds) > 3000
    lengths = [len(t) for t in ds["text"][:2000]]
    assert sum(lengths) / len(lengths) > 300 and sorted(lengths)[len(lengths) // 2] <= 1500


def test_validation_split_is_held_out_and_deterministic():
    ds = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(100)]})
    train, val = data.split_train_val(ds, 7, seed=1)
    assert len(val) == 7 and len(train) == 93
    assert not set(train["text"]) & set(val["text"])
    assert data.split_train_val(ds, 7, seed=1)[1]["text"] == val["text"]
    with pytest.raises(UsageError):
        data.split_train_val(ds, 100, seed=1)


# ---- the sampler ------------------------------------------------------------------------

def global_batches(n, batch_size, world_size, epoch, seed=3):
    """What each step's global batch is when world_size ranks each take batch_size/world_size."""
    per_rank = batch_size // world_size
    shards = []
    for rank in range(world_size):
        sampler = ResumableDistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                              shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    steps = n // batch_size
    return [sorted(i for shard in shards for i in shard[s * per_rank:(s + 1) * per_rank]) for s in range(steps)]


def test_every_world_size_sees_the_same_global_batches():
    for epoch in (0, 1):
        one = global_batches(103, 12, 1, epoch)
        assert len(one) == 8
        assert global_batches(103, 12, 2, epoch) == one
        assert global_batches(103, 12, 4, epoch) == one
    assert global_batches(103, 12, 1, 0) != global_batches(103, 12, 1, 1)  # set_epoch reshuffles


def test_sampler_can_start_part_way_through_an_epoch():
    sampler = ResumableDistributedSampler(range(50), num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4, start=6)
    assert list(sampler) == full[6:] and len(sampler) == len(full) - 6


def test_text_bytes_counts_utf8_bytes_not_characters():
    texts = datasets.Dataset.from_dict({"text": ["héllo", "日本語", "abc", "x"]}).select([0, 1, 2])  # an index mapping
    assert data.text_bytes(texts) == len("héllo".encode()) + len("日本語".encode()) + 3 == 18
