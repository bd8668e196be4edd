"""The BPE tokenizer and the padded-sequence dataset (the corpus itself: training/corpus.py).

A document becomes `[BOT] + ids + [EOT]`, cut into windows of seq_len + 1 tokens that
overlap by one, the last one right-padded; x = window[:-1] and y = window[1:], with the
targets at [PAD] positions set to IGNORE_INDEX so the loss skips them. Every token after
[BOT] is thus a target exactly once. A run cuts its corpus once, with `datasets.map`,
which caches the windows on disk (training/tokenized.py): later epochs, later runs and the
other ranks of a DDP job read the cache. This file imports nothing from training/: the
machinery calls the lesson, never the reverse.

With --pack, the same windows are placed several to a row (packing.py), each with its own
positions, so that a row is mostly tokens rather than padding.
"""

import functools
import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from typing import NamedTuple

import datasets
import numpy as np
import pyarrow.compute
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model import IGNORE_INDEX

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]
# The tokenizer is trained on at most this much text: plenty for a BPE, and it keeps a
# run on a 10B-token corpus from spending hours on tokenizer training.
TOKENIZER_TRAIN_CHARS = 200_000_000
# The BPE trainer splits each text it is given into words all at once, at about 80 bytes of
# memory a character: a 45 MB document took 4 GB. It is given long documents in pieces cut
# between words, and counts the same words; the encoder is given them in the same pieces.
PIECE_CHARS = 100_000
# How documents become rows, recorded in checkpoints: every document's tokens, cut into
# windows of seq_len + 1, one a row (earlier versions clipped each document to one row), or
# several a row with --pack.
FRAMING = "windows"
PACKED_FRAMING = "packed windows"


def framing(pack: bool) -> str:
    return PACKED_FRAMING if pack else FRAMING


class SpecialIds(NamedTuple):
    bos: int  # begins every document
    eos: int  # ends it: the model learns where a document stops
    pad: int  # fills a row after its last window (its targets are ignored, whatever the id)


def special_ids(tokenizer: Tokenizer, config=None) -> SpecialIds:
    """The ids documents are framed with and rows padded with: an imported model's own, where its
    config (a model.LlamaConfig) names them (Llama 3's <|begin_of_text|> and <|end_of_text|>:
    the framing it was pretrained on), else our tokenizer's [BOT], [EOT], [PAD]."""
    if config is not None and config.own_special_tokens:  # no pad token (Llama 3): any id pads
        pad = config.eos_token_id if config.pad_token_id is None else config.pad_token_id
        return SpecialIds(config.bos_token_id, config.eos_token_id, pad)
    return SpecialIds(*(tokenizer.token_to_id(token) for token in (BOT, EOT, PAD)))


# ---------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: datasets.Dataset | datasets.IterableDataset, vocab_size: int,
                    chars: int = TOKENIZER_TRAIN_CHARS) -> Tokenizer:
    """Train a byte-level BPE (every string is encodable, no unknown token) on `texts`: their
    first batches of 1000 until `chars` characters are read (an IterableDataset is read no further)."""
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
            if seen >= chars:
                return

    tokenizer.train_from_iterator(batches(), trainer)
    return tokenizer


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of which token each id stands for, special tokens included: two tokenizers of one
    size can still give a text other ids. (Of the vocabulary, not of tokenizer.json's text,
    whose layout changes between versions of `tokenizers` for the same tokenizer.)"""
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    special = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
    return hashlib.blake2b(json.dumps([vocab, special]).encode(), digest_size=16).hexdigest()


def clip_is_exact(tokenizer: Tokenizer) -> bool:
    """Whether cutting a text just before a whitespace character that follows a
    non-whitespace one leaves every token before the cut as it was. True for byte-level BPE
    tokenizers like ours and GPT-2's: their pre-tokenizer puts whitespace only at the start
    of a piece, so such a cut falls between two pieces, and BPE encodes each piece on its own.
    Anything that could look across the cut (a normalizer, BPE dropout, a special token with
    whitespace in it or stripping around it) rules it out, and so does add_prefix_space,
    which would give every piece of a long document a space of its own."""
    spec = json.loads(tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)
            and spec["model"]["type"] == "BPE" and spec["model"].get("dropout") is None
            and not any(re.search(r"\s", t["content"]) or t.get("lstrip") or t.get("rstrip")
                        for t in spec["added_tokens"]))


# A space, tab or newline right after a non-whitespace character. (Only these four: Python's
# \s also matches a few control characters that the tokenizer's own regex does not.)
CUT = re.compile(r"(?<=\S)[ \t\n\r]")


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
    cut = CUT.search(text, chars, end)
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


def document_windows(text: str, tokenizer: Tokenizer, seq_len: int, exact_cuts: bool, ids: list[int] | None = None,
                     *, specials: SpecialIds) -> list[np.ndarray]:
    """One document framed, [BOT] + ids + [EOT] (specials: their ids, or an imported model's own
    tokens), and cut into windows of seq_len + 1 tokens that overlap by one: every token after
    [BOT] is a target in exactly one window, and only the last window is short (padded later,
    as a short document's one window is). A document longer than 2 x PIECE_CHARS is encoded in
    pieces cut where no token changes (see clip_text; with a tokenizer that could change one
    there, exact_cuts is False and the caller has warned), so its memory stays that of a piece.
    `ids`: a short document's ids, where the caller encoded it already (batch_windows).
    `tokenizer` encodes special tokens as text (text_only)."""
    if ids is None:  # pieces, 16 at a time: each group's encodings freed before the next
        cut = (iter([text]) if len(text) <= 2 * PIECE_CHARS
               else pieces(text, PIECE_CHARS, tokenizer.pre_tokenizer if exact_cuts else None))
        groups = iter(lambda: list(itertools.islice(cut, 16)), [])
        ids = np.concatenate([np.array(e.ids, dtype=np.int64) for group in groups
                              for e in tokenizer.encode_batch_fast(group, add_special_tokens=False)])
    framed = np.concatenate([[specials.bos], np.asarray(ids, dtype=np.int64), [specials.eos]])
    return [framed[start:start + seq_len + 1] for start in range(0, len(framed) - 1, seq_len)]


def batch_windows(batch, tokenizer: Tokenizer, seq_len: int, exact_cuts: bool, specials: SpecialIds):
    """Every document of a batch cut into its windows (document_windows), the short ones
    encoded together: on all of the tokenizer's threads where the corpus is mapped by one
    process (training/tokenized.py maps this function over it)."""
    tokenizer.encode_special_tokens = True  # text is text (see text_only); lost when pickled to a worker
    texts = batch["text"]
    short = [i for i, t in enumerate(texts) if len(t) <= 2 * PIECE_CHARS]
    ids = dict(zip(short, (e.ids for e in tokenizer.encode_batch_fast([texts[i] for i in short],
                                                                        add_special_tokens=False))))
    return {"input_ids": [window for i, text in enumerate(texts)
                          for window in document_windows(text, tokenizer, seq_len, exact_cuts, ids.pop(i, None),
                                                         specials=specials)]}


# ---------------------------------------------------------------------------------------
# The dataset the DataLoader reads


def window_targets(windows: datasets.Dataset) -> np.ndarray:
    """The real targets of each window: all its tokens but the first, from the Arrow column."""
    return pyarrow.compute.list_value_length(windows.with_format("arrow")[:]["input_ids"]).to_numpy() - 1


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
    # The files under `rows`, checked before each batch is read and named when a window is
    # damaged: a run's is training/caches.py's ReadBack. None: nothing to check (rows in memory).
    read_back: object = None

    def __len__(self):
        return len(self.rows)

    @functools.cached_property
    def window_targets(self) -> np.ndarray:
        """The real targets of each window, counted once (window_targets)."""
        return window_targets(self.rows)

    packing_fingerprint = None  # one window a row: the corpus, the tokenizer and seq_len decide the rows

    @property
    def targets(self) -> np.ndarray:
        """The real targets of each row: here a row is a window."""
        return self.window_targets

    @functools.cached_property
    def facts(self) -> dict:
        """What an epoch trains on: documents, windows, the rows they fill, tokens (targets,
        not padding), and the share of positions that are padding."""
        tokens = int(self.targets.sum())
        return {"documents": self.documents, "windows": len(self.rows), "rows": len(self),
                "tokens_per_epoch": tokens, "padding": 1 - tokens / (len(self) * self.seq_len)}

    def targets_before(self, step: int, batch_size: int, seed: int) -> int:
        """The real targets of the first `step` global batches, in the order the samplers
        deal them: the tokens a run has seen when it resumes at `step`."""
        steps_per_epoch = len(self) // batch_size
        sampler, seen = ResumableRandomSampler(self, seed), 0
        for first in range(0, step, steps_per_epoch):  # each epoch's first step
            sampler.set_epoch(first // steps_per_epoch)
            batches = min(step - first, steps_per_epoch)
            seen += int(self.targets[sampler.permutation()[:batches * batch_size].numpy()].sum())
        return seen

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def read_windows(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The windows `indices` of self.rows: where each begins among their tokens (and where the
        last ends), and their tokens one after another. Checked as they are read: a cache file
        changed in place since it was opened (read_back), or a window outside 2 to seq_len + 1
        tokens, is damaged data, one line naming the file, never trained on (a window of zeros
        has no target: whole batches of them made the loss 0 / 0)."""
        if self.read_back is not None:
            self.read_back.check()
        try:
            column = self.rows.with_format("arrow")[indices]["input_ids"].combine_chunks()
        except (pyarrow.ArrowException, IndexError) as e:
            raise self.damaged(e) from None
        starts = column.offsets.to_numpy()
        lengths = np.diff(starts)  # tokens in each window, [BOT] and [EOT] included
        if not ((lengths >= 2) & (lengths <= self.seq_len + 1)).all():
            wrong = lengths[(lengths < 2) | (lengths > self.seq_len + 1)][0]
            raise self.damaged(f"a window of {wrong} tokens (each holds 2 to {self.seq_len + 1})")
        return starts, column.flatten().to_numpy()

    def damaged(self, problem: str | Exception) -> Exception:
        """The error for windows read back damaged: read_back's, which names their files, or else
        a ValueError saying the problem."""
        if self.read_back is None:
            return ValueError(f"damaged windows: {problem}")
        return self.read_back.damaged(problem)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return padded_rows(*self.read_windows(indices), self.seq_len, self.pad_id)

    def padding_row(self):
        """A row of padding alone, whose targets are all ignored (see training.val_loader)."""
        return (torch.full((self.seq_len,), self.pad_id, dtype=torch.long),
                torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long))


def padded_rows(starts: np.ndarray, flat: np.ndarray, seq_len: int, pad_id: int) -> list[tuple[torch.Tensor, ...]]:
    """Windows as PaddedSequenceDataset's items, (x, y) a window: window i's tokens are
    flat[starts[i]:starts[i + 1]]. --stream's rows (training/stream/rows.py) are made here too."""
    lengths = np.diff(starts)  # tokens in each row, [BOT] and [EOT] included
    tokens = np.full((len(lengths), seq_len + 1), pad_id, dtype=np.int64)
    tokens[np.arange(seq_len + 1) < lengths[:, None]] = flat  # row after row
    real = np.arange(seq_len) < (lengths - 1)[:, None]  # positions with a real next token
    x = torch.from_numpy(np.where(real, tokens[:, :-1], pad_id))
    y = torch.from_numpy(np.where(real, tokens[:, 1:], IGNORE_INDEX))
    return list(zip(x, y))  # the DataLoader's collate stacks them back: one copy of the batch


class ResumableRandomSampler(torch.utils.data.Sampler):
    """One process's shuffling sampler that can begin part-way through an epoch: the
    permutation of seed + epoch, whole, that ResumableDistributedSampler (below) deals out
    to the ranks. `set_epoch(epoch, start)` reshuffles and skips the first `start` samples."""

    def __init__(self, dataset, seed: int):
        self.n, self.seed, self.epoch, self.start = len(dataset), seed, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def permutation(self) -> torch.Tensor:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # as DistributedSampler seeds its shuffle
        return torch.randperm(self.n, generator=generator)

    def __iter__(self):
        return iter(self.permutation()[self.start:].tolist())

    def __len__(self):
        return self.n - self.start


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
