"""The data: framing into windows and padding, the tokenizer, tokenization done once, and a
sampler that gives every world size the same global batches."""

import contextlib
import json
import os
import shutil
import stat
import threading

import datasets
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import data
from data import BOT, EOT, PAD, PaddedSequenceDataset, ResumableDistributedSampler, ResumableRandomSampler
from model import IGNORE_INDEX
from training import caches, corpus, tokenized
from training.errors import RankError, UsageError

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
        {"input_ids": datasets.Sequence(datasets.Value("uint16"))}))  # as tokenized.tokenize stores them
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
    framed = tokenized.tokenize(datasets.Dataset.from_dict({"text": DOCS}), tokenizer, seq_len=16)
    assert framed.features["input_ids"].feature.dtype == stored


def test_a_document_longer_than_seq_len_is_cut_into_windows_that_overlap_by_one_token(tokenizer):
    text = " ".join(DOCS)
    texts = datasets.Dataset.from_dict({"text": [text]})
    framed = [tokenizer.token_to_id(BOT), *tokenizer.encode(text).ids, tokenizer.token_to_id(EOT)]
    windows = tokenized.tokenize(texts, tokenizer, seq_len=8)["input_ids"]
    assert windows[0] == framed[:9] and len(windows) == -(-(len(framed) - 1) // 8)
    assert all(len(w) == 9 for w in windows[:-1]) and 2 <= len(windows[-1]) <= 9  # only the last one short
    assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))  # each begins where the one before ends
    ds = PaddedSequenceDataset(tokenized.tokenize(texts, tokenizer, 8), 8, 0)
    targets = [t for i in range(len(ds)) for t in ds[i][1].tolist() if t != IGNORE_INDEX]
    assert targets == framed[1:]  # every token after [BOT] a target, once: the last window padded


def test_tokenize_frames_every_document_with_bot_and_eot(tokenizer):
    framed = tokenized.tokenize(datasets.Dataset.from_dict({"text": DOCS}), tokenizer, seq_len=512)
    for text, ids in zip(DOCS, framed["input_ids"]):
        assert ids[0] == tokenizer.token_to_id(BOT) and ids[-1] == tokenizer.token_to_id(EOT)
        assert tokenizer.decode(ids[1:-1]) == text


def test_tokenizer_round_trip_and_special_tokens(tokenizer, tmp_path):
    assert [tokenizer.token_to_id(t) for t in (PAD, BOT, EOT)] == [0, 1, 2]
    for text in DOCS + ["never seen: 日本語 and tabs\t\n"]:  # byte-level: nothing is unknown
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    tokenizer.save(str(tmp_path / "tok.json"))
    assert tokenized.load_tokenizer(tmp_path / "tok.json").to_str() == tokenizer.to_str()


def test_tokenizer_without_special_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(UsageError, match=r"lacks the special tokens \[PAD\], \[BOT\], \[EOT\]"):
        tokenized.load_tokenizer(tmp_path / "plain.json")


def test_tokenizing_happens_once_and_is_read_back_from_the_cache(tokenizer, tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(DOCS) + "\n")
    texts = corpus.load_corpus(str(tmp_path / "c.txt"))
    first = tokenized.tokenize(texts, tokenizer, seq_len=16)
    written = [os.stat(f["filename"]) for f in first.cache_files]
    second = tokenized.tokenize(texts, tokenizer, seq_len=16)  # what the other ranks do
    assert first.cache_files and first.cache_files == second.cache_files
    # read back, not computed again: the cache file is the same file, unwritten since
    assert [(st.st_ino, st.st_mtime_ns) for st in map(os.stat, (f["filename"] for f in second.cache_files))] == \
        [(st.st_ino, st.st_mtime_ns) for st in written]
    assert second["input_ids"] == first["input_ids"]


@pytest.fixture
def cached_windows(tokenizer, tmp_path):
    """Documents, and their windows at seq_len 16 as `datasets` caches them: (texts, windows, the cache file)."""
    (tmp_path / "c.txt").write_text("\n".join(DOCS * 3) + "\n")
    texts = corpus.load_corpus(str(tmp_path / "c.txt"))
    windows = tokenized.tokenize(texts, tokenizer, seq_len=16)
    return texts, list(windows["input_ids"]), windows.cache_files[0]["filename"]  # a copy: the file is damaged


def write_windows(windows: list[list[int]], path):
    """A well-formed windows cache file holding `windows`, in place of the one at path."""
    from datasets.arrow_writer import ArrowWriter
    with ArrowWriter(path=f"{path}.tmp", features=datasets.Features(
            {"input_ids": datasets.Sequence(datasets.Value("uint16"))})) as writer:
        writer.write_batch({"input_ids": windows})
        writer.finalize()
    os.replace(f"{path}.tmp", path)


@pytest.mark.parametrize("damage, problem", [
    (lambda windows, path: write_windows([w[:1] for w in windows], path), "holds 15 windows without a target "
                                                                          "(fewer than 2 tokens)"),
    (lambda windows, path: write_windows([windows[0] + windows[1], *windows[2:]], path),
     "holds a window of 20 tokens, more than --seq-len + 1 (17)"),
    (lambda windows, path: open(path, "r+b").truncate(os.path.getsize(path) // 2), "cannot be read ("),
], ids=["windows-without-targets", "a-window-over-seq-len", "truncated"])
def test_a_damaged_windows_cache_is_tokenized_again_with_a_warning_naming_it(tokenizer, cached_windows, capsys, damage,
                                                                            problem):
    """The windows cache is a file read back: truncated, or holding windows no tokenizer cuts
    (no target, longer than a window), it is never trained on: the corpus is tokenized again,
    and said."""
    texts, windows, path = cached_windows
    damage(windows, path)
    assert list(tokenized.tokenize(texts, tokenizer, seq_len=16)["input_ids"]) == windows
    err = capsys.readouterr().err
    assert f"warning: the cached windows {path} {problem}" in err and "tokenizing the corpus again" in err
    assert list(tokenized.tokenize(texts, tokenizer, seq_len=16)["input_ids"]) == windows and not capsys.readouterr().err


@pytest.mark.timeout(60)  # without the check, the FIFO's read blocked forever (and SIGTERM, SIGINT with it)
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_windows_cache_that_is_not_a_regular_file_is_one_line_and_left_as_it_is(tokenizer, cached_windows, kind):
    """A FIFO where the windows cache belongs would block its read forever; a folder failed
    with a traceback. Either is refused in one line before anything reads it, and stays."""
    texts, windows, path = cached_windows
    os.unlink(path)
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    with pytest.raises(UsageError) as refused:
        tokenized.tokenize(texts, tokenizer, seq_len=16)
    assert str(refused.value) == (f"the cached windows {path} is not a regular file (a FIFO, a device or a folder): "
                                  "replace it with the file it should be, or remove it")
    assert (stat.S_ISFIFO if kind == "fifo" else stat.S_ISDIR)(os.stat(path).st_mode)
    os.unlink(path) if kind == "fifo" else shutil.rmtree(path)
    assert list(tokenized.tokenize(texts, tokenizer, seq_len=16)["input_ids"]) == windows  # removed: tokenized again


@pytest.fixture
def windows_of_two_processes(tokenizer, tmp_path, monkeypatch):
    """10,000 documents tokenized by 2 processes (tokenized.tokenize's split, on any machine), as
    `datasets` caches them: a file a process, cache-KEY_00000_of_00002.arrow and _00001_of_00002.
    (texts, windows, the cache files)."""
    monkeypatch.setattr(tokenized, "usable_cores", lambda: 2)
    (tmp_path / "c.txt").write_text("".join(f"document {i} of the corpus, read by one of two processes\n"
                                            for i in range(10_000)))
    texts = corpus.load_corpus(str(tmp_path / "c.txt"))
    windows = tokenized.tokenize(texts, tokenizer, seq_len=16)
    files = [f["filename"] for f in windows.cache_files]
    assert [f[f.rindex("_", 0, f.rindex("_of_")):] for f in files] == ["_00000_of_00002.arrow", "_00001_of_00002.arrow"]
    return texts, list(windows["input_ids"]), files


@contextlib.contextmanager
def never_blocking(fifo):
    """A FIFO that code under test may open to read, which would wait forever for a writer: a
    thread waits to write to it, so that such a read ends at once (end of file: the test fails,
    and does not hang); at the end the test opens it to read itself, which lets the thread go.
    Both reach it through a handle (O_PATH, opened by neither) that holds it even once the code
    has replaced or removed it."""
    handle = os.open(fifo, os.O_PATH)
    itself = f"/proc/self/fd/{handle}"
    thread = threading.Thread(target=lambda: os.close(os.open(itself, os.O_WRONLY)), daemon=True)
    thread.start()
    try:
        yield
    finally:
        reader = os.open(itself, os.O_RDONLY | os.O_NONBLOCK)
        thread.join()  # its open returns while a reader holds the FIFO open
        os.close(reader)
        os.close(handle)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "folder"])
def test_a_cache_file_of_one_of_several_processes_that_is_not_a_regular_file_is_one_line(tokenizer,
                                                                                        windows_of_two_processes,
                                                                                        kind):
    """10,000 documents or more on 2 cores or more are tokenized by a process a core, and their
    cache is a file a process: each is checked before anything reads it, not the first alone or
    the single-process name (a FIFO in the second process's place blocked the run forever; a
    link to /dev/zero was read). Refused in one line naming it, left as it is; removed, the
    corpus is tokenized again."""
    texts, windows, files = windows_of_two_processes
    path = files[1]
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        os.mkdir(path)
    else:
        os.symlink("/dev/zero", path)
    with never_blocking(path) if kind == "fifo" else contextlib.nullcontext():
        with pytest.raises(UsageError) as refused:
            tokenized.tokenize(texts, tokenizer, seq_len=16)
    assert str(refused.value) == (f"the cached windows {path} is not a regular file (a FIFO, a device or a folder): "
                                  "replace it with the file it should be, or remove it")
    made = {"fifo": stat.S_ISFIFO, "folder": stat.S_ISDIR, "link-to-dev-zero": stat.S_ISLNK}[kind]
    assert made(os.lstat(path).st_mode) and os.path.isfile(files[0])
    os.rmdir(path) if kind == "folder" else os.unlink(path)
    assert list(tokenized.tokenize(texts, tokenizer, seq_len=16)["input_ids"]) == windows  # removed: tokenized again


@pytest.mark.parametrize("window", [[1], [], [1, *range(3, 20)]], ids=["one-token", "empty", "over-seq-len"])
def test_a_window_read_back_without_a_target_or_too_long_is_damaged_data_in_one_line(window):
    """A window cut from a document holds 2 to seq_len + 1 tokens. One read back otherwise (a
    cache zeroed or rewritten under the run) is damaged data, said by the rank that reads it,
    never a batch of rows without targets (whole batches of them made the loss 0 / 0: "training
    diverged ... lower --lr"). A run's dataset says it through the read_back it is given, which
    names the cache; data.py's alone, without one, still refuses the window."""
    windows = rows([1, 10, 2], window, [1, 11, 2])
    ds = PaddedSequenceDataset(windows, seq_len=8, pad_id=0, read_back=caches.ReadBack(windows, "the cached windows"))
    assert [y.tolist()[:2] for _, y in ds.__getitems__([0, 2])] == [[10, 2], [11, 2]]
    with pytest.raises(RankError) as damaged:
        ds.__getitems__([0, 1, 2])
    assert str(damaged.value) == (f"damaged data in the cached windows (in memory): a window of {len(window)} tokens "
                                  "(each holds 2 to 9). Remove that cache (`datasets` makes it again) and run again "
                                  "with --resume")
    with pytest.raises(ValueError) as unnamed:
        PaddedSequenceDataset(windows, seq_len=8, pad_id=0).__getitems__([0, 1, 2])
    assert str(unnamed.value) == f"damaged windows: a window of {len(window)} tokens (each holds 2 to 9)"


def test_special_token_lookalikes_in_a_document_are_text(tokenizer):
    """Only the framing makes [BOT] and [EOT]: a document that spells them out is encoded as text."""
    special = {tokenizer.token_to_id(t) for t in (PAD, BOT, EOT)}
    doc = "before [PAD] middle [BOT][EOT] after"
    framed = tokenized.tokenize(datasets.Dataset.from_dict({"text": [doc]}), tokenizer, seq_len=128)["input_ids"][0]
    assert framed[0] == tokenizer.token_to_id(BOT) and framed[-1] == tokenizer.token_to_id(EOT)
    assert not special & set(framed[1:-1])
    assert tokenizer.decode(framed[1:-1]) == doc


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
    windows = tokenized.tokenize(datasets.Dataset.from_dict({"text": texts}), tokenizer, seq_len)["input_ids"]
    assert windows == windows_of_whole_documents(texts, tokenizer, seq_len)
    encoded = data.text_only(tokenizer).encode_batch(texts, add_special_tokens=False)
    assert len(windows) == sum(-(-(len(e.ids) + 1) // seq_len) for e in encoded)  # ceil(targets / seq_len)
    assert sum(len(w) - 1 for w in windows) == sum(len(e.ids) + 1 for e in encoded)  # each target once


def test_a_huge_document_is_encoded_in_pieces_never_whole(tokenizer, monkeypatch):
    """45 MB in one line would take gigabytes to encode whole: the encoder is given pieces cut
    where no token changes, and the windows are those of the whole document. One piece of
    letters with no such cut is cut anyway, and no character is lost. Pieces of 1,000 to
    2,000 characters here (100,000 to 200,000 in a run), documents 80 times that: the same
    cuts, a hundredth of the text."""
    monkeypatch.setattr(data, "PIECE_CHARS", 1_000)
    seen = []

    class Recording:  # the real tokenizer, recording how much text it is given
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode_batch_fast(self, texts, **kwargs):
            seen.extend(map(len, texts))
            return tokenizer.encode_batch_fast(texts, **kwargs)

    huge = " ".join(["gradients flow back through every layer"] * 2_000)  # 80 pieces' worth
    minified = json.dumps([{"layer": i, "grad": [0.5, 1.5]} for i in range(2_000)], separators=(",", ":"))
    letters = "abcdefgh" * 10_000  # one piece: no cut between two tokens is known to be exact
    specials = data.special_ids(tokenizer)
    windows = data.batch_windows({"text": [huge, minified, DOCS[0]]}, Recording(), seq_len=512, exact_cuts=True,
                                 specials=specials)["input_ids"]
    assert [w.tolist() for w in windows] == windows_of_whole_documents([huge, minified, DOCS[0]], tokenizer, 512)
    assert max(seen) <= 2 * data.PIECE_CHARS + 16  # never a whole document
    windows = data.batch_windows({"text": [letters]}, Recording(), seq_len=512, exact_cuts=True,
                                 specials=specials)["input_ids"]
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


def test_a_byte_level_bpe_that_adds_a_prefix_space_cannot_be_cut_exactly(tokenizer):
    """Each piece of a long document would get a space of its own: 200,003 tokens instead of
    199,999 for 480,000 characters of "hello\\nworld\\n" when it was allowed."""
    prefixed = Tokenizer.from_str(tokenizer.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert data.clip_is_exact(tokenizer) and not data.clip_is_exact(prefixed)


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
    windows = tokenized.tokenize(datasets.Dataset.from_dict({"text": long_docs}), lowercase, 8)["input_ids"]
    assert windows == windows_of_whole_documents(long_docs, lowercase, 8) and capsys.readouterr().err == ""
    monkeypatch.setattr(data, "PIECE_CHARS", 1_000)
    tokenized.tokenize(datasets.Dataset.from_dict({"text": long_docs}), lowercase, 8)
    assert capsys.readouterr().err.startswith("warning: documents longer than 2,000 characters are encoded in pieces")


def test_a_large_corpus_is_tokenized_by_one_process_per_core_with_the_same_result(tokenizer, tmp_path, monkeypatch):
    """12,000 documents on 2 cores (faked, so that a 1-core machine runs this path too): two
    processes of 5,000 documents or more each."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    texts = [f"document {i}: " + DOCS[i % 3].replace("\n", " ") for i in range(12_000)]
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    framed = tokenized.tokenize(corpus.load_corpus(str(tmp_path / "c.txt")), tokenizer, seq_len=16)
    assert len(framed.cache_files) == 2  # one cache file per process
    assert framed["input_ids"] == windows_of_whole_documents(texts, tokenizer, 16)


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
    """And train_dp.py's one-process sampler deals the same permutation: the same batches."""
    for epoch in (0, 1):
        one = global_batches(103, 12, 1, epoch)
        sampler = ResumableRandomSampler(range(103), seed=3)
        sampler.set_epoch(epoch)
        alone = list(sampler)
        assert one == [sorted(alone[s * 12:(s + 1) * 12]) for s in range(8)]
        sampler.set_epoch(epoch, start=30)
        assert list(sampler) == alone[30:] and len(sampler) == 73
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
