"""--stream's validation documents and its BPE, both taken from the stream's start in shard order.

Held out: the corpus's first V documents in shard order (the shards sorted by name, each one's
pieces in order, each piece's rows in order), not in the order a run reads them: the same set
whatever --seed and the sub-stream count, found by reading the first pieces only, never the
whole corpus (a seeded sample, as the map-style path draws, would have to). V is --val-docs, or
its rule (1%, at least 1, at most 1000). Training reads the corpus through skip_held_out(read),
which yields no held-out row from any piece and any start row: training and validation are
disjoint by construction, not by a check. What defines the set is its count and the shards
(which the run records: shards.py); HeldOut also says where training starts, for a resume to
check that the same documents are held out.

The BPE, when no --tokenizer is given: data.train_tokenizer over the training documents from
the stream's start in shard order, up to its character budget, read lazily: the same documents
on every run over the same shards, and the rest of the corpus never opened.
"""

import contextlib
import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import datasets
from tokenizers import Tokenizer

import data
from training import corpus
from training.errors import UsageError
from training.stream import shards
from training.stream.order import LIMIT, Read

# corpus.default_val_docs gives its most (1000) from this many documents on: the default count
# reads at most this far, where the map-style path counts the whole corpus
ENOUGH_TO_COUNT = 100_000
MOST_HELD_OUT = corpus.default_val_docs(ENOUGH_TO_COUNT)


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The corpus's first `count` documents in shard order, held out: every document before row
    `row` of the corpus's piece `piece` (numbered as shards.corpus_pieces numbers them), where
    the first training document is. Pieces before `piece` hold no training document."""
    count: int
    piece: int
    row: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> "HeldOut":
        """A held-out set as a run recorded it, checked: the record may be hostile or stale."""
        fields = [field.name for field in dataclasses.fields(cls)]
        if not (isinstance(d, dict) and set(d) == set(fields)
                and all(type(d[f]) is int and 0 <= d[f] < LIMIT for f in fields) and d["count"] > 0):
            raise UsageError(f"held-out record {str(d)[:100]}: expected {', '.join(fields)}, whole numbers "
                             "(a count of at least 1)")
        return cls(**d)

    def check(self, recorded) -> None:
        """A resume holds out what the run held out: the same count (the same shards are
        shards.changed's to check) must end where it ended, else the documents differ."""
        was = HeldOut.from_dict(recorded)
        if was.count != self.count:
            raise UsageError(f"this run held out {was.count} validation documents, not {self.count}: resume with "
                             f"--val-docs {was.count}, or start a new run")
        if was != self:
            raise UsageError(f"the {was.count} validation documents this run held out end at row {was.row} of the "
                             f"corpus's piece {was.piece}, and now at row {self.row} of piece {self.piece}: the same "
                             "shards read as other documents (another version of this code?). Start a new run")

    def training_sizes(self, piece_sizes: list[int]) -> list[int]:
        """The pieces' sizes as order.deal should see them: a piece wholly held out holds no
        training data (dealt as it is, a sub-stream of only such pieces would read nothing). The
        piece where they end keeps its size: at most V documents more than it trains on."""
        return [0 if piece < self.piece else size for piece, size in enumerate(piece_sizes)]


def in_shard_order(read: Read, pieces: int, first_piece: int = 0) -> Iterator[tuple[int, int, str]]:
    """The documents of pieces first_piece .. pieces - 1, in order, as (piece, row, text)."""
    for piece in range(first_piece, pieces):
        for row, text in read(piece, 0):
            yield piece, row, text


def validation_documents(source: shards.Source, found: list[shards.Shard], text_column: str,
                         count: int | None = None) -> tuple[list[str], HeldOut]:
    """The corpus's first `count` documents in shard order (None: --val-docs' rule, the corpus
    counted up to ENOUGH_TO_COUNT documents), and the HeldOut that says where training starts.
    A corpus with no document after them is one line: there would be nothing to train on."""
    if count is not None and not (type(count) is int and 0 < count < LIMIT):
        raise ValueError(f"hold out {count!r} documents")
    keep = (count or MOST_HELD_OUT) + 1  # the held-out texts, and where the first training document is
    span = count + 1 if count else ENOUGH_TO_COUNT  # documents read: without a count, as many as its rule needs
    first, read, read_count = [], shards.reader(source, found, text_column), 0
    with contextlib.closing(in_shard_order(read, len(shards.corpus_pieces(found)))) as documents:
        for read_count, document in enumerate(itertools.islice(documents, span), 1):
            if read_count <= keep:
                first.append(document)
    count = count or corpus.default_val_docs(read_count)
    if len(first) <= count:
        raise UsageError(f"cannot hold out {count} validation documents from {source}: it holds {len(first)}, "
                         "and training would have none (--val-docs sets how many are held out)")
    piece, row, _ = first[count]
    return [text for _, _, text in first[:count]], HeldOut(count, piece, row)


def skip_held_out(read: Read, held_out: HeldOut) -> Read:
    """read (order.documents') without the held-out documents: a piece's training documents
    from start_row on. A start row inside the held-out range (row 0 of the piece where they
    end, as every epoch starts it) reads from the first training row on; a piece wholly held
    out is not read at all, whatever the start row (it holds nothing to train on)."""
    def training_read(piece: int, start_row: int) -> Iterable[tuple[int, str]]:
        if piece < held_out.piece:
            return ()
        return read(piece, max(start_row, held_out.row) if piece == held_out.piece else start_row)
    return training_read


def training_documents(source: shards.Source, found: list[shards.Shard], text_column: str,
                       held_out: HeldOut) -> Iterator[str]:
    """The training documents in shard order (not a run's order): the corpus less the held out."""
    read = skip_held_out(shards.reader(source, found, text_column), held_out)
    for _, _, text in in_shard_order(read, len(shards.corpus_pieces(found)), held_out.piece):
        yield text


def train_stream_tokenizer(source: shards.Source, found: list[shards.Shard], text_column: str, vocab_size: int,
                           held_out: HeldOut, chars: int = data.TOKENIZER_TRAIN_CHARS) -> Tokenizer:
    """The BPE of a run without --tokenizer: data.train_tokenizer on the training documents in
    shard order, read lazily (an IterableDataset: no Arrow copy on disk) until its `chars`
    budget, so that the same shards give the same tokenizer and no held-out document is seen."""
    def texts():
        for text in training_documents(source, found, text_column, held_out):
            yield {"text": text}
    features = datasets.Features({"text": datasets.Value("string")})
    return data.train_tokenizer(datasets.IterableDataset.from_generator(texts, features=features), vocab_size, chars)
