"""Corpus loading, the BPE tokenizer and the padded-sequence dataset.

A document becomes `[BOT] + ids + [EOT]`, clipped or right-padded to seq_len + 1 tokens;
x = tokens[:-1] and y = tokens[1:], with the targets at [PAD] positions set to IGNORE_INDEX
so the loss skips them. The corpus is tokenized once with `datasets.map`, which caches the
result on disk: later epochs, later runs and the other ranks of a DDP job read the cache.
"""

import contextlib
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from errors import UsageError, first_line
from launcher import warn
from model import IGNORE_INDEX

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]
EMBEDDED_CORPUS = "stdlib"
# local file suffix -> the `datasets` builder that reads it
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# A UTF-8 byte-order mark (some Windows editors write one) is not part of the first document:
# the same file with and without it is the same data. The json and csv readers drop it already.
BUILDER_OPTIONS = {"text": {"encoding": "utf-8-sig"}}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # `datasets` decompresses these as it reads (.zst: with zstandard)
KNOWN_FILES = f"{'/'.join(FILE_BUILDERS)} (optionally {'/'.join(COMPRESSIONS)})"
# The tokenizer is trained on at most this much text: plenty for a BPE, and it keeps a
# run on a 10B-token corpus from spending hours on tokenizer training.
TOKENIZER_TRAIN_CHARS = 200_000_000
# The BPE trainer splits each text it is given into words all at once, at about 80 bytes of
# memory a character: a 45 MB document took 4 GB. It is given long documents in pieces cut
# between words, and counts the same words; the encoder is given them in the same pieces.
PIECE_CHARS = 100_000
# How documents become rows, recorded in checkpoints: every document's tokens, cut into
# windows of seq_len + 1 (earlier versions clipped each document to one row).
FRAMING = "windows"


# ---------------------------------------------------------------------------------------
# The embedded default corpus: the Python standard library that ships with the interpreter


def stdlib_files() -> list[str]:
    """The standard library's .py files, test suites and installed packages left out."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in skip)  # sorted: same order everywhere
        files += [os.path.join(folder, n) for n in sorted(names)
                  if n.endswith(".py") and not n.startswith("test_")]
    return files


def stdlib_documents(files: list[str], max_chars: int = 1500):
    """Split each file at blank lines and pack consecutive blocks into documents of at
    most max_chars characters (about 400 tokens: one function or class, roughly)."""
    for path in files:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        doc = ""
        for block in text.split("\n\n"):
            if doc and len(doc) + len(block) + 2 > max_chars:
                yield {"text": doc}
                doc = ""
            doc = f"{doc}\n\n{block}" if doc else block
        if doc.strip():
            yield {"text": doc}


# ---------------------------------------------------------------------------------------
# Loading a corpus: the embedded one, local files, or a Hub dataset


def file_builder(path: Path) -> str | None:
    """The `datasets` builder that reads a file, judged by its name, or None. Case does not
    matter, and a compression suffix may follow: `part-0.jsonl.gz` is JSON Lines."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes.pop()
    return FILE_BUILDERS.get(suffixes[-1]) if suffixes else None


def _local_files(path: Path) -> list[Path]:
    """The data files of --dataset: the file itself, or every file a folder holds at any depth,
    symlinked folders followed. Whatever is skipped is named in one warning."""
    if path.is_file():
        if file_builder(path) is None:
            raise UsageError(f"unsupported dataset file {path}: expected {KNOWN_FILES}")
        files = [path]
    else:
        files, skipped = _walk(path)
        if skipped:
            shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            warn(f"--dataset {path}: skipping {len(skipped)} {'entry' if len(skipped) == 1 else 'entries'}: {shown} "
                 f"(data files end in {KNOWN_FILES})")
        if not files:
            raise UsageError(f"folder {path} holds no {KNOWN_FILES} files")
    for f in files:
        if not os.access(f, os.R_OK):
            raise UsageError(f"cannot read dataset file {f}")
        if f.name.lower().endswith(".zst") and importlib.util.find_spec("zstandard") is None:
            raise UsageError(f"reading {f} needs the zstandard package: pip install zstandard")
    return files


def _walk(root: Path) -> tuple[list[Path], list[str]]:
    """Data files under root, sorted (the same order on every rank), each real file once;
    and what was left out, with the reason for the less obvious cases."""
    files, skipped, seen_dirs, seen_files = [], [], set(), {}
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen_dirs:  # a symlink loop, or a second link to a folder already read
            skipped.append(f"{os.path.relpath(folder, root)}/ (already read as {os.path.relpath(real, root)})")
            subfolders[:] = []
            continue
        seen_dirs.add(real)
        hidden = sorted(d for d in subfolders if d.startswith("."))
        skipped += [f"{os.path.relpath(os.path.join(folder, d), root)}/ (hidden)" for d in hidden]
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in sorted(names):
            f = Path(folder, name)
            rel = str(f.relative_to(root))
            if file_builder(f) is None or not f.is_file():
                skipped.append(rel)
            elif (real_file := os.path.realpath(f)) in seen_files:
                skipped.append(f"{rel} (same file as {seen_files[real_file]})")
            else:
                seen_files[real_file] = rel
                files.append(f)
    return sorted(files), skipped


def looks_local(dataset: str) -> bool:
    """A path, as opposed to a Hub id such as `HuggingFaceFW/fineweb`."""
    return (os.path.exists(dataset) or dataset.startswith((".", "/", "~"))
            or file_builder(Path(dataset)) is not None)


def check_dataset_flags(dataset: str, dataset_config: str | None, split: str | None):
    """Cheap checks that need no loading, so every rank can run them before any download."""
    if dataset == EMBEDDED_CORPUS or looks_local(dataset):
        if not (dataset == EMBEDDED_CORPUS or os.path.exists(os.path.expanduser(dataset))):
            raise UsageError(f"dataset file or folder not found: {dataset}")
        if dataset_config is not None or split is not None:
            raise UsageError("--dataset-config and --split apply to Hub datasets only, "
                            f"not to {dataset!r}")


def load_corpus(dataset: str, dataset_config: str | None = None, split: str | None = None,
                text_column: str = "text") -> datasets.Dataset:
    """Load documents as a `datasets.Dataset` with one column, "text", empty ones dropped."""
    check_dataset_flags(dataset, dataset_config, split)
    if dataset == EMBEDDED_CORPUS:
        ds = datasets.Dataset.from_generator(stdlib_documents, gen_kwargs={"files": stdlib_files()})
        ds = _text_column(ds, text_column, dataset)
    elif looks_local(dataset):
        # an empty file has no documents (and makes some `datasets` builders fail)
        files = [f for f in _local_files(Path(dataset).expanduser()) if f.stat().st_size > 0]
        if not files:
            raise UsageError(f"dataset {dataset} has no non-empty documents")
        parts = []
        for builder in sorted({file_builder(f) for f in files}):
            data_files = [str(f) for f in files if file_builder(f) == builder]
            try:
                with _reported_by_us():
                    part = datasets.load_dataset(builder, data_files=data_files, split="train",
                                                 **BUILDER_OPTIONS.get(builder, {}))
            except Exception as e:  # datasets raises many types for unreadable files
                raise UsageError(f"cannot read {dataset}: {first_line(e)}") from None
            parts.append(_text_column(part, text_column, dataset))
        if len({part.features["text"].dtype for part in parts}) > 1:  # .csv reads large_string, .txt string
            parts = [part.cast_column("text", datasets.Value("large_string")) for part in parts]
        ds = datasets.concatenate_datasets(parts)
    else:
        try:
            with _reported_by_us():
                ds = datasets.load_dataset(dataset, dataset_config, split=split or "train")
        except Exception as e:  # offline, unknown id, bad config or split
            raise UsageError(f"cannot load Hub dataset {dataset!r}: {first_line(e)}") from None
        ds = _text_column(ds, text_column, dataset)
    ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(ds) == 0:
        raise UsageError(f"dataset {dataset} has no non-empty documents")
    return ds


def _text_column(ds: datasets.Dataset, column: str, name: str) -> datasets.Dataset:
    if column not in ds.column_names:
        raise UsageError(f"dataset {name} has no column {column!r} (columns: {', '.join(ds.column_names)})")
    feature = ds.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__.lower()
        raise UsageError(f"column {column!r} of dataset {name} holds {kind}, not text")
    ds = ds.select_columns([column])
    return ds.rename_column(column, "text") if column != "text" else ds


@contextlib.contextmanager
def _reported_by_us():
    """`datasets` logs some errors (with tracebacks) before raising them. We report each as
    one line ourselves, so its error log is silenced while it loads."""
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def fingerprint(ds: datasets.Dataset) -> dict:
    """What a resumed run must find again: how many documents, and a hash of their text in
    order. The content, not the path: the same file under another name is the same data,
    while one appended or reordered line is not (it would redraw the held-out split). One
    pass over the text, about 3 seconds per GB."""
    digest = hashlib.blake2b(digest_size=16)
    for batch in ds.iter(batch_size=10_000):
        for text in batch["text"]:
            raw = text.encode("utf-8", "surrogatepass")
            digest.update(len(raw).to_bytes(8, "little") + raw)  # the length keeps "ab","c" apart from "a","bc"
    return {"documents": len(ds), "blake2b": digest.hexdigest()}


def split_train_val(ds: datasets.Dataset, val_docs: int, seed: int):
    """Hold out val_docs documents, chosen by a seeded shuffle (deterministic on every rank)."""
    if not 0 < val_docs < len(ds):
        raise UsageError(f"cannot hold out {val_docs} validation documents from a dataset of {len(ds)}")
    parts = ds.train_test_split(test_size=val_docs, seed=seed)
    return parts["train"], parts["test"]


def default_val_docs(n_docs: int) -> int:
    """1% of the documents, at least 1 and at most 1000."""
    return max(1, min(1000, n_docs // 100))


# ---------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: datasets.Dataset, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (every string is encodable, no unknown token) on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # (not tokenizer's: it is busy training)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def batches():
        seen = 0
        for batch in texts.iter(batch_size=1000):
            yield [piece for text in batch["text"] for piece in pieces(text, PIECE_CHARS, pre_tokenizer)]
            seen += sum(map(len, batch["text"]))
            if seen >= TOKENIZER_TRAIN_CHARS:
                return

    tokenizer.train_from_iterator(batches(), trainer)
    return tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        raise UsageError(f"cannot load tokenizer {path}: {first_line(e)}") from None
    # The model has one embedding row per token, ids 0 to size - 1: a larger id would fail
    # mid-training (an index out of range), and a huge one makes to_str() build a list that long.
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= tokenizer.get_vocab_size():
        raise UsageError(f"tokenizer {path} has {tokenizer.get_vocab_size():,} tokens but ids up to {largest:,}: "
                         "a tokenizer whose ids have gaps is not supported (ids must run from 0 to its size - 1)")
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise UsageError(f"tokenizer {path} lacks the special tokens {', '.join(missing)}")
    model = json.loads(tokenizer.to_str())["model"]
    unknown = model.get("unk_token")
    if model["type"] in ("WordLevel", "WordPiece") and tokenizer.token_to_id(unknown or "") is None:
        # it would fail on the first word outside its vocabulary, mid-tokenization
        raise UsageError(f"tokenizer {path} is a {model['type']} tokenizer without its unknown token "
                         f"({unknown!r} is not in its vocabulary): it cannot encode words it has not seen")
    return tokenizer


def clip_is_exact(tokenizer: Tokenizer) -> bool:
    """Whether cutting a text just before a whitespace character that follows a
    non-whitespace one leaves every token before the cut as it was. True for byte-level BPE
    tokenizers like ours and GPT-2's: their pre-tokenizer puts whitespace only at the start
    of a piece, so such a cut falls between two pieces, and BPE encodes each piece on its own.
    Anything that could look across the cut (a normalizer, BPE dropout, a special token with
    whitespace in it or stripping around it) rules it out."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and spec["model"]["type"] == "BPE" and spec["model"].get("dropout") is None
            and not any(re.search(r"\s", t["content"]) or t.get("lstrip") or t.get("rstrip")
                        for t in spec["added_tokens"]))


# A space, tab or newline right after a non-whitespace character. (Only these four: Python's
# \s also matches a few control characters that the tokenizer's own regex does not.)
_CUT = re.compile(r"(?<=\S)[ \t\n\r]")


def clip_text(text: str, chars: int, pre_tokenizer=None) -> tuple[str, bool]:
    """(clip, exact): the text up to the first cut between `chars` and 2 x `chars` characters
    that changes no token before it (see clip_is_exact), and True. A cut falls before a space,
    tab or newline after a non-whitespace character, or else (minified JSON, base64, text
    without spaces) where the tokenizer's own pre-tokenizer starts a new piece. Where one
    piece runs past 2 x `chars` (40 MB of letters), no cut is exact: the first 2 x `chars`
    characters, and False."""
    if len(text) <= chars:
        return text, True
    end = 2 * chars
    cut = _CUT.search(text, chars, end)
    if cut:
        return text[:cut.start()], True
    if len(text) <= end:
        return text, True
    if pre_tokenizer is not None:
        # The pre-tokenizer reads left to right and looks at most two characters past a piece,
        # so the pieces of text[:end + 16] that start by `end` are the whole text's pieces too.
        pieces = pre_tokenizer.pre_tokenize_str(text[:end + 16])
        starts = [start for _, (start, _) in pieces[1:] if chars <= start <= end]
        if starts:
            return text[:starts[0]], True
    return text[:end], False


def pieces(text: str, chars: int, pre_tokenizer):
    """text, cut into pieces of `chars` to 2 x `chars` characters where no token changes (see
    clip_text): the pre-tokenizer splits them into the words it splits the whole text into."""
    start = 0
    while start < len(text):
        piece, _ = clip_text(text[start:start + 2 * chars + 16], chars, pre_tokenizer)  # a window: no copy of the rest
        yield piece
        start += len(piece)


def text_only(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of the tokenizer that encodes "[PAD]", "[EOT]" and the like in a text as the
    text they are, never as special ids: only the trainer's framing makes those. (The setting
    is not saved with the tokenizer and not pickled: set it again where it is used.)"""
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    tokenizer.encode_special_tokens = True
    return tokenizer


def _encode(batch, tokenizer: Tokenizer, seq_len: int, exact_cuts: bool):
    """Frame every document, [BOT] + ids + [EOT], and cut it into windows of seq_len + 1
    tokens that overlap by one: every token after [BOT] is a target in exactly one window,
    and only a document's last window is short (padded later, as a short document's one
    window is). A long document is encoded in pieces cut where no token changes (see
    clip_text; with a tokenizer that could change one there, exact_cuts is False and
    tokenize has warned), so its memory stays that of a piece."""
    tokenizer.encode_special_tokens = True  # text is text (see text_only); lost when pickled to a worker
    bot, eot = tokenizer.token_to_id(BOT), tokenizer.token_to_id(EOT)
    texts = batch["text"]
    short = [i for i, t in enumerate(texts) if len(t) <= 2 * PIECE_CHARS]
    ids = dict(zip(short, (e.ids for e in tokenizer.encode_batch_fast([texts[i] for i in short],
                                                                        add_special_tokens=False))))
    windows = []
    for i, text in enumerate(texts):
        if i in ids:
            framed = np.array([bot, *ids.pop(i), eot], dtype=np.int64)
        else:  # a long document: 16 pieces at a time, each group's encodings freed before the next
            cut = pieces(text, PIECE_CHARS, tokenizer.pre_tokenizer if exact_cuts else None)
            groups = iter(lambda: list(itertools.islice(cut, 16)), [])
            framed = np.concatenate([[bot], *(np.array(e.ids, dtype=np.int64) for group in groups
                                              for e in tokenizer.encode_batch_fast(group, add_special_tokens=False)),
                                     [eot]])
        windows.extend(framed[start:start + seq_len + 1] for start in range(0, len(framed) - 1, seq_len))
    return {"input_ids": windows}


def tokenize(texts: datasets.Dataset, tokenizer: Tokenizer, seq_len: int) -> datasets.Dataset:
    """Frame every document and cut it into windows of seq_len + 1 tokens, once: `datasets`
    caches the result on disk. Large corpora are split over one process per core, each
    encoding with one thread."""
    tokenizer = text_only(tokenizer)
    exact_cuts = clip_is_exact(tokenizer)
    if not exact_cuts and _longest(texts) > 2 * PIECE_CHARS:
        warn(f"documents longer than {2 * PIECE_CHARS:,} characters are encoded in pieces cut before "
             "whitespace, and this tokenizer (not a byte-level BPE) may encode a few characters at each cut "
             "differently from the whole text")
    num_proc = min(len(os.sched_getaffinity(0)), len(texts) // 5000) if hasattr(os, "sched_getaffinity") else 1
    # token ids in the narrowest type that holds them: 2 bytes each below 65,536 (8 as Python ints)
    ids = datasets.Value("uint16" if tokenizer.get_vocab_size() <= 2**16 else "uint32")
    with _tokenizer_threads(1 if num_proc > 1 else None):
        return texts.map(_encode, batched=True, remove_columns=["text"], num_proc=num_proc if num_proc > 1 else None,
                         fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "exact_cuts": exact_cuts},
                         features=datasets.Features({"input_ids": datasets.Sequence(ids)}), desc="tokenizing")


def text_bytes(texts: datasets.Dataset) -> int:
    """The UTF-8 bytes of every document's text, from the Arrow column (no Python strings)."""
    return pyarrow.compute.sum(pyarrow.compute.binary_length(texts.with_format("arrow")[:]["text"])).as_py() or 0


def _longest(texts: datasets.Dataset) -> int:
    """The longest document's characters, from the Arrow column (no Python strings)."""
    lengths = pyarrow.compute.utf8_length(texts.data.column("text"))
    return pyarrow.compute.max(lengths).as_py() or 0


@contextlib.contextmanager
def _tokenizer_threads(threads: int | None):
    """With one process per core, each process's tokenizer uses one thread. Setting
    TOKENIZERS_PARALLELISM before `datasets` forks the processes also keeps `tokenizers`
    from warning that it was forked after using its threads (to train the BPE)."""
    if threads is None:
        yield
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# ---------------------------------------------------------------------------------------
# The dataset the DataLoader reads


@dataclass
class PaddedSequenceDataset(torch.utils.data.Dataset):
    """Items are (x, y), each (seq_len,) int64: inputs right-padded with [PAD], targets
    shifted by one with IGNORE_INDEX wherever there is no real next token. The DataLoader
    asks for a whole batch at once (__getitems__): its rows come out of the Arrow table as
    one array of uint16 (or uint32) token ids and are padded together, with no Python loop
    over tokens or rows."""

    rows: datasets.Dataset  # column "input_ids": windows of [BOT] + ids + [EOT], at most seq_len + 1 long
    seq_len: int
    pad_id: int
    corpus: dict | None = None  # the fingerprint of the corpus it was cut from; checkpoints record it
    documents: int | None = None  # how many documents the windows were cut from
    text_bytes: int | None = None  # the UTF-8 bytes of their text (for bits per byte)

    def __len__(self):
        return len(self.rows)

    def facts(self) -> dict:
        """What an epoch trains on: documents, windows, tokens (targets, not padding), and the
        share of positions that are padding."""
        lengths = pyarrow.compute.list_value_length(self.rows.with_format("arrow")[:]["input_ids"])
        tokens = pyarrow.compute.sum(lengths).as_py() - len(self.rows)  # each window predicts all but its first
        return {"documents": self.documents, "windows": len(self.rows), "tokens_per_epoch": tokens,
                "padding": 1 - tokens / (len(self.rows) * self.seq_len)}

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        column = self.rows.with_format("arrow")[indices]["input_ids"].combine_chunks()
        lengths = np.diff(column.offsets.to_numpy())  # tokens in each row, [BOT] and [EOT] included
        if (lengths > self.seq_len + 1).any():
            raise ValueError(f"a row is longer than seq_len + 1 = {self.seq_len + 1} tokens")
        tokens = np.full((len(indices), self.seq_len + 1), self.pad_id, dtype=np.int64)
        tokens[np.arange(self.seq_len + 1) < lengths[:, None]] = column.flatten().to_numpy()  # row after row
        real = np.arange(self.seq_len) < (lengths - 1)[:, None]  # positions with a real next token
        x = torch.from_numpy(np.where(real, tokens[:, :-1], self.pad_id))
        y = torch.from_numpy(np.where(real, tokens[:, 1:], IGNORE_INDEX))
        return list(zip(x, y))  # the DataLoader's collate stacks them back: one copy of the batch


class ResumableDistributedSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that can begin part-way through an epoch.

    DistributedSampler shuffles with a generator seeded by seed + epoch and hands rank r
    the indices r, r + W, r + 2W, ... of that permutation. So the s-th batch of every rank
    together is always the s-th block of `batch_size` indices of the same permutation,
    whatever the world size W: one process (W = 1) and DDP at any W see the same global
    batches. `set_epoch(epoch, start)` skips this rank's first `start` samples, so a
    resumed run continues with exactly the batch an uninterrupted run would have seen.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self):
        return self.num_samples - self.start
