"""The shards --stream reads, and how a run knows what it read: the files of a source (one
file, a folder's files at any depth, or a Hub dataset's at a pinned commit: hub.py), each
described by its pieces (a parquet file's row groups, a JSON Lines file whole) and a digest
that a resume must find again; and the documents of one piece, from any row on. Damage is one
UsageError line that names the file and the row: never a traceback, never a document silently
skipped.

A document is what load_corpus (training/corpus.py) takes for one: a text that is empty or
only whitespace is none (passed over, its row still counted), a null or a missing text is
refused, and so is text that is not UTF-8.
"""

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow
import pyarrow.parquet as pq

from training import corpus
from training.errors import UsageError, first_line
from training.stream import hub, json_lines
from training.stream.hub import HubSource

# name suffix -> kind. A piece is where a reader can start without reading what comes before
# it: a parquet row group; a JSON Lines file whole (a compressed stream has no other way in).
KINDS = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".jsonl.zst": "jsonl.zst"}
KNOWN_SHARDS = "/".join(KINDS)
# The digest reads this much of a file: a parquet file's end, where its footer holds the schema
# and each row group's place, size and statistics (a rewritten file differs there), any other's start.
DIGEST_BYTES = 64 * 1024
READ_ROWS = 1024  # a parquet row group is decoded and made Python strings this many rows at a time
Source = str | HubSource  # a local file or folder (--dataset), or a Hub dataset's files


@dataclasses.dataclass(frozen=True)
class Shard:
    """One file of the source, as a run records it. pieces: each piece's row count, from a
    parquet footer; a JSON Lines file's is None, unknown until it is read (counting would read
    every shard, gigabytes, before the first step)."""
    name: str  # the path below the source folder, "/"-separated; a lone file's name
    kind: str  # a value of KINDS
    size: int  # bytes
    digest: str  # blake2b (16 bytes, hex) of the file's last (parquet) or first DIGEST_BYTES
    pieces: tuple[int | None, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "size": self.size, "digest": self.digest,
                "pieces": list(self.pieces)}

    @classmethod
    def from_dict(cls, d) -> "Shard":
        """A shard as a run recorded it, checked: the record may be hostile or stale."""
        fields = ["name", "kind", "size", "digest", "pieces"]
        if not (isinstance(d, dict) and set(d) == set(fields)):
            raise UsageError(f"shard record {str(d)[:100]}: expected the fields {', '.join(fields)}")
        name, kind, size, digest, pieces = (d[f] for f in fields)
        checks = [(isinstance(name, str) and shard_kind(name) == kind, "its kind is not its name's"),
                  (_is_count(size), "its size is not a count of bytes"),
                  (isinstance(digest, str) and re.fullmatch("[0-9a-f]{32}", digest), "its digest is not 32 hex digits"),
                  (isinstance(pieces, list) and (all(map(_is_count, pieces)) if kind == "parquet"
                                                 else pieces == [None]), "its pieces are not row counts")]
        problem = next((problem for holds, problem in checks if not holds), None)
        if problem:
            raise UsageError(f"shard record {str(d)[:100]}: {problem}")
        return cls(name, kind, size, digest, tuple(pieces))


def _is_count(n) -> bool:
    return type(n) is int and n >= 0  # a bool is no count


def shard_kind(path) -> str | None:
    """A shard's kind, judged by its name in any case (`part-0.JSONL.GZ` is jsonl.gz), or None."""
    name = Path(path).name.lower()
    return next((kind for suffix, kind in KINDS.items() if name.endswith(suffix)), None)


def shard_path(source: Source, shard: Shard) -> Path | str:
    """Where a shard found in source is: below the folder, the lone file itself, or a Hub
    dataset's file's URL (a str: the readers open a Path as a local file, a str with fsspec)."""
    if isinstance(source, HubSource):
        return source.url(shard.name)
    root = Path(source).expanduser()
    return root / shard.name if root.is_dir() else root


def find_shards(source: Source, text_column: str) -> list[Shard]:
    """The shards of source, sorted by name (the same list on every rank): the file itself,
    every shard a folder holds at any depth, walked as load_corpus walks --dataset's folder
    (symlinked folders followed, hidden ones not, each real file once, other files named in one
    warning), or a Hub dataset's files, named by their path in its repository. Each is checked
    before any training, cheaply (a parquet file's footer, a JSON Lines file's first document):
    nothing to read, a FIFO, a device or a dangling link where a shard should be, a file that
    cannot be read, a damaged footer, no text column: one line."""
    if isinstance(source, HubSource):
        return _remote_shards(source, text_column)
    root = Path(source).expanduser()
    if root.is_dir():
        # A FIFO or a dangling link named as a shard is kept, to be refused below: skipping it
        # would train on part of the data, and a resume on another part.
        files, skipped = corpus.walk(root, lambda f: shard_kind(f) is not None)
        corpus.warn_skipped(root, skipped, KNOWN_SHARDS)
        if not files:
            raise UsageError(f"folder {source} holds no {KNOWN_SHARDS} files")
        named = sorted((f.relative_to(root).as_posix(), f) for f in files)
    elif not (root.exists() or root.is_symlink()):  # a dangling link: refused as a shard below
        raise UsageError(f"dataset file or folder not found: {source}")
    elif shard_kind(root) is None:
        raise UsageError(f"unsupported shard {source}: expected {KNOWN_SHARDS}")
    else:
        named = [(root.name, root)]
    return [_described(path, name, text_column) for name, path in named]


def _remote_shards(source: HubSource, text_column: str) -> list[Shard]:
    """A Hub dataset's files, each described as a local file is, a few at a time: each takes a
    request or two (a parquet file's end), and a corpus may have thousands."""
    other = [name for name, _ in source.files if shard_kind(name) is None]
    if other or not source.files:
        raise UsageError(f"{source} holds {len(source.files)} files, {len(other)} not {KNOWN_SHARDS} shards "
                         f"({', '.join(other[:3])}): --stream reads only those; leave it out to load the dataset whole")
    with ThreadPoolExecutor(hub.LISTING_THREADS) as pool:
        return list(pool.map(lambda file: _described(file[1], file[0], text_column), source.files))


def _size(path: Path | str) -> int:
    """A shard's size: a local file's, refused unless it is a regular file, or a URL's."""
    return corpus.regular_file(path, "shard") if isinstance(path, Path) else hub.file_size(path)


def _open(path: Path | str):
    """A shard's bytes: a local file, or a URL's (fsspec's, its failures OSErrors)."""
    return open(path, "rb") if isinstance(path, Path) else hub.open_file(path)


def _described(path: Path | str, name: str, text_column: str) -> Shard:
    kind = shard_kind(path)
    size = _size(path)  # before open(): a FIFO would block it
    try:
        with _open(path) as f:
            f.seek(max(0, size - DIGEST_BYTES) if kind == "parquet" else 0)
            digest = hashlib.blake2b(f.read(DIGEST_BYTES), digest_size=16).hexdigest()
            pieces = _row_groups(f, path, text_column) if kind == "parquet" else (None,)
    except OSError as e:
        raise UsageError(f"cannot read shard {path}: {first_line(e)}") from None
    shard = Shard(name, kind, size, digest, pieces)
    if kind != "parquet":  # its first document: the wrong --text-column, or no JSON, said before training
        with contextlib.closing(_documents(path, shard, 0, 0, text_column)) as documents:
            next(documents, None)
    return shard


def _row_groups(f, path: Path | str, text_column: str) -> tuple[int, ...]:
    """Each row group's row count, from the footer, once it has a text column."""
    try:
        footer = pq.ParquetFile(f)
    except (pyarrow.ArrowException, OSError) as e:
        raise UsageError(f"cannot read shard {path}: {first_line(e)}") from None
    _check_text_column(footer.schema_arrow, path, text_column)
    return tuple(footer.metadata.row_group(i).num_rows for i in range(footer.num_row_groups))


def _check_text_column(schema: pyarrow.Schema, path: Path | str, column: str):
    found = schema.get_all_field_indices(column)
    if len(found) != 1:
        raise UsageError(f"shard {path} has {'no' if not found else len(found)} columns named {column!r} "
                         f"(columns: {', '.join(schema.names)})")
    kind = schema.field(found[0]).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)
            or pyarrow.types.is_string_view(kind)):
        raise UsageError(f"column {column!r} of shard {path} holds {kind}, not text")


def corpus_pieces(found: list[Shard]) -> list[tuple[Shard, int]]:
    """The corpus's pieces in shard order, each as (its shard, its index there): piece i of the
    corpus, as order.py and a run's positions number pieces, is corpus_pieces(found)[i]."""
    return [(shard, piece) for shard in found for piece in range(len(shard.pieces))]


def describe(source: Source, found: list[Shard]) -> Callable[[int, int | None], str]:
    """describe(piece, row) for order.SubStreams: where row `row` of the corpus's piece `piece`
    is, as a line names it ("shard PATH, row group 3, row 57", "shard PATH, line 58"); row
    None: the piece ("shard PATH, row group 3", "shard PATH")."""
    listed = corpus_pieces(found)

    def where(piece: int, row: int | None) -> str:
        shard, index = listed[piece]
        if row is not None:
            return f"shard {shard_path(source, shard)}, {_place(shard, index, row)}"
        return f"shard {shard_path(source, shard)}" + (f", row group {index}" if shard.kind == "parquet" else "")
    return where


def _place(shard: Shard, piece: int, row: int) -> str:
    """Row `row` of the shard's piece `piece` as a line names it: a parquet row group's row,
    both counted from 0 as pyarrow counts them; a JSON Lines file's line, from 1 as editors count."""
    return f"row group {piece}, row {row:,}" if shard.kind == "parquet" else f"line {row + 1:,}"


def piece_sizes(found: list[Shard]) -> list[int]:
    """The size of each of the corpus's pieces (numbered as corpus_pieces numbers them) in one
    unit, for order.deal: rows where every piece counts its rows (parquet row groups); else
    bytes, a parquet row group's its share of its file by rows (a JSON Lines file is one piece
    of unknown rows: only its bytes say how much it holds)."""
    if all(rows is not None for shard in found for rows in shard.pieces):
        return [rows for shard in found for rows in shard.pieces]
    return [shard.size if rows is None else shard.size * rows // max(sum(shard.pieces), 1)
            for shard in found for rows in shard.pieces]


def reader(source: Source, found: list[Shard], text_column: str) -> Callable[[int, int], Iterator[tuple[int, str]]]:
    """read(piece, start_row) for order.documents: read_documents of the corpus's piece `piece`
    (numbered as corpus_pieces numbers them)."""
    listed = corpus_pieces(found)
    return lambda piece, start_row: read_documents(source, *listed[piece], start_row, text_column)


def read_documents(source: Source, shard: Shard, piece: int, start_row: int,
                   text_column: str) -> Iterator[tuple[int, str]]:
    """The documents of one piece of a shard from start_row on, in the file's order, as (its
    row within the piece, its text): the row is the position a resume starts at. A row is a
    parquet row group's row, or a JSON Lines file's line (from 0, blank lines counted).
    Only that piece is read: of a parquet file, that row group's text column; a JSON Lines
    file from its start (a compressed stream has no other way in), its first start_row lines
    only counted. A file that is not the one listed (another size), a piece or row it does not
    have, and damage on the way are one UsageError naming the file and the row."""
    return _documents(shard_path(source, shard), shard, piece, start_row, text_column)


def _documents(path: Path | str, shard: Shard, piece: int, start_row: int, text_column: str):
    if not (type(piece) is int and 0 <= piece < len(shard.pieces)):
        raise UsageError(f"shard {path}: there is no piece {piece} (it has {len(shard.pieces)})")
    rows = shard.pieces[piece]
    if not (type(start_row) is int and 0 <= start_row and (rows is None or start_row <= rows)):
        held = f" (row group {piece} holds {rows:,})" if rows is not None else ""
        raise UsageError(f"shard {path}: there is no row {start_row} to start at{held}")
    if (size := _size(path)) != shard.size:  # cut short or rewritten since listed
        raise UsageError(f"cannot read shard {path}, {_place(shard, piece, start_row)} on: it holds {size:,} bytes, "
                         f"where it held {shard.size:,} when listed: it changed during the run")
    if shard.kind == "parquet":
        return _parquet_documents(path, piece, rows, start_row, text_column)
    return json_lines.documents(path, _open, shard.kind, shard.size, start_row, text_column)


def _parquet_documents(path: Path | str, piece: int, rows: int, start_row: int, text_column: str):
    """Its row group's text column, decoded a batch of pages at a time (iter_batches): a whole
    row group read at once (read_row_group) held about 4 times its text in memory."""
    where = f"shard {path}, row group {piece}"  # rows and row groups counted from 0, as pyarrow counts them
    first = 0  # the batch's first row
    try:
        with _open(path) as f:
            footer = pq.ParquetFile(f)
            _check_text_column(footer.schema_arrow, path, text_column)  # read again: the file may have changed
            held = footer.metadata.row_group(piece).num_rows if piece < footer.num_row_groups else 0
            if held != rows:
                raise UsageError(f"{where} holds {held:,} rows, where it held {rows:,} when listed: "
                                 "the file changed during the run")
            for batch in footer.iter_batches(READ_ROWS, row_groups=[piece], columns=[text_column]):
                if first + batch.num_rows > start_row:
                    yield from _texts(batch.column(0).slice(max(0, start_row - first)), max(first, start_row),
                                      where, text_column)
                first += batch.num_rows
    except (pyarrow.ArrowException, OSError) as e:  # a damaged page: ArrowInvalid, or OSError("Corrupt snappy ...")
        raise UsageError(f"cannot read {where}, row {first:,} on: {first_line(e)}") from None


def _texts(column: pyarrow.Array, first: int, where: str, text_column: str):
    """The documents of a batch of a parquet column, as (row, text), its first row numbered first."""
    try:
        texts = column.to_pylist()
    except UnicodeDecodeError:  # parquet's strings are any bytes until decoded
        bad = corpus.first_not_utf8(pyarrow.chunked_array([column]))
        at = f"row {first + bad}" if bad is not None else f"rows {first} to {first + len(column) - 1}"
        raise UsageError(f"cannot read {where}, {at}: not UTF-8 text") from None
    for row, text in enumerate(texts, first):
        if text is None:
            raise UsageError(f"cannot read {where}, row {row}: {text_column!r} is null: "
                             "fix that row, or choose another column with --text-column")
        if text.strip():
            yield row, text


def changed(recorded: list[dict], found: list[Shard]) -> str | None:
    """What differs between the shards a run recorded and those found now, or None: a phrase
    naming the first shard by name that differs (added, removed, renamed: found by its same
    size, digest and pieces, another size, digest or pieces), for the line refusing a resume."""
    if not isinstance(recorded, list):
        raise UsageError(f"the shard record is a {type(recorded).__name__}, not a list")
    before = {}
    for shard in map(Shard.from_dict, recorded):
        if before.setdefault(shard.name, shard) is not shard:
            raise UsageError(f"the shard record lists {shard.name} twice")
    now = {shard.name: shard for shard in found}
    for name in sorted(before.keys() | now.keys()):
        old, new = before.get(name), now.get(name)
        if old is None:
            twin = _same_content(new, before, now)
            return f"shard {twin.name} is now named {name}" if twin else f"shard {name} was added"
        if new is None:
            twin = _same_content(old, now, before)
            return f"shard {name} is now named {twin.name}" if twin else f"shard {name} was removed"
        if old.size != new.size:
            return f"shard {name} holds {new.size:,} bytes, where it held {old.size:,}"
        if old.digest != new.digest:
            return (f"shard {name} changed: its {'last' if old.kind == 'parquet' else 'first'} "
                    f"{DIGEST_BYTES // 1024} KiB differ")
        if old.pieces != new.pieces:
            return f"shard {name} holds row groups of {_counts(new.pieces)} rows, where it held {_counts(old.pieces)}"
    return None


def _same_content(shard: Shard, among: dict, not_in: dict) -> Shard | None:
    """The shard of `among`, under a name that `not_in` lacks, with the content of `shard`."""
    return next((s for name, s in sorted(among.items())
                 if name not in not_in and dataclasses.replace(s, name=shard.name) == shard), None)


def _counts(pieces: tuple) -> str:
    shown = ", ".join(f"{n:,}" for n in pieces[:5])
    return f"[{shown}{f' and {len(pieces) - 5} more' if len(pieces) > 5 else ''}]"
