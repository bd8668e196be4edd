"""--stream's JSON Lines shards (.jsonl, .jsonl.gz, .jsonl.zst): a file's documents from any
line on, read from its start (a compressed stream has no other way in), split at "\\n" only,
each line's JSON checked as training/corpus.py checks a line of a map-style corpus. Damage
(a stream cut short, a line that is not JSON, not UTF-8 or too long) is one UsageError
naming the file and the line.
"""

import codecs
import contextlib
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from training import corpus
from training.errors import UsageError, first_line

READ_ERRORS = (OSError, EOFError, zlib.error)  # a disk's, or gzip's: a stream cut short or damaged
MAX_LINE_BYTES = 256 << 20  # a longer JSON line is refused, not read into memory (a book is a few MB)


def documents(path: Path | str, open_file: Callable, kind: str, size: int, start_row: int, text_column: str):
    """The documents of a JSON Lines shard (open_file(path): its bytes, `size` of them when it
    was listed) from line start_row on, as (its line, from 0, blank lines counted; its text);
    damage is one UsageError naming the line."""
    lines = 0
    with contextlib.closing(_lines(path, open_file, kind, size)) as file_lines:
        for row, line in enumerate(file_lines):
            lines = row + 1
            if row < start_row:
                continue
            try:
                text = _json_text(line.removeprefix(codecs.BOM_UTF8) if row == 0 else line, text_column)
            except ValueError as e:
                raise UsageError(f"cannot read shard {path}: line {row + 1}: {e}") from None
            if text:
                yield row, text
    if lines < start_row:
        raise UsageError(f"shard {path} has {lines:,} lines, none numbered {start_row} (from 0): "
                         "the file changed during the run")


def _lines(path: Path | str, open_file: Callable, kind: str, size: int) -> Iterator[bytes]:
    """A JSON Lines file's lines as bytes, decompressed: split at "\\n" only, as JSON Lines
    are (a text file's reader would also split at "\\r" and at U+2028 inside a document).
    The file must end where it was listed to end, `size` bytes in: a file cut short (or grown)
    while it is read would otherwise end its piece early without a word. A compressed stream
    cut inside a frame is gzip's or zstd's EOFError; one cut between two of its frames, or a
    plain file cut anywhere, only this count sees."""
    with open_file(path) as raw:
        errors = READ_ERRORS
        if kind == "jsonl.gz":
            stream = gzip.GzipFile(fileobj=raw)  # several gzip members one after another: one stream
        elif kind == "jsonl.zst":
            zstandard = _zstandard(path)
            errors += (zstandard.ZstdError,)
            stream = io.BufferedReader(_Chunks(_zstd_frames(raw, zstandard)))
        else:
            stream = raw
        lines = 0
        try:
            # bounded: a line with no end (a few bytes of gzip make gigabytes of one line) is refused, not held
            for lines, line in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(line) > MAX_LINE_BYTES:
                    raise UsageError(f"cannot read shard {path}: line {lines} is longer than "
                                     f"{MAX_LINE_BYTES:,} bytes, more than any document")
                if not line.endswith(b"\n") or raw.tell() > size:  # the last line, or a file grown: its end checked
                    _check_end(path, raw, size, lines)
                yield line
            _check_end(path, raw, size, lines + 1)
        except errors as e:
            raise UsageError(f"cannot read shard {path}: line {lines + 1}: {first_line(e)}") from None
        if kind != "jsonl" and raw.tell() == 0:  # gzip and zstd read 0 bytes as an empty stream, without a word
            raise UsageError(f"cannot read shard {path}: {corpus.EMPTY_COMPRESSED}")


def _check_end(path: Path | str, raw, size: int, line: int) -> None:
    """At the end of the file's lines (or of its last, unfinished one, or past its listed end):
    all of its listed bytes read, and no more. A compressed stream has read its file to the
    end by then (or further than it held)."""
    if (ended := raw.tell()) != size:
        now = f"ends at byte {ended:,}" if ended < size else f"goes on past byte {size:,}"
        raise UsageError(f"cannot read shard {path}: line {line}: the file {now}, where it held {size:,} bytes when "
                         "listed: it changed during the run")


def _zstd_frames(raw, zstandard) -> Iterator[bytes]:
    """A .zst file decompressed, frame after frame. zstandard's own stream_reader ends silently
    where a file is cut short; here a frame left unfinished is an EOFError, as gzip's is."""
    decompressor = zstandard.ZstdDecompressor()
    frame, unfinished = decompressor.decompressobj(), False
    while data := raw.read(4096):  # a small read: what one call makes is at most ~30,000 times more
        while data:
            yield frame.decompress(data)
            if frame.eof:
                data, frame, unfinished = frame.unused_data, decompressor.decompressobj(), False
            else:
                data, unfinished = b"", True
    if unfinished:
        raise EOFError("the file ends in the middle of a zstd frame: it was cut short")


class _Chunks(io.RawIOBase):
    """Chunks of bytes as a file, for io.BufferedReader's readline."""
    def __init__(self, chunks: Iterator[bytes]):
        self.chunks, self.left = chunks, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.left:
            if (chunk := next(self.chunks, None)) is None:
                return 0
            self.left = memoryview(chunk)
        n = min(len(buffer), len(self.left))
        buffer[:n], self.left = self.left[:n], self.left[n:]
        return n


def _zstandard(path: Path | str):
    """The optional zstandard package, imported only when a .zst shard is read."""
    try:
        import zstandard
    except ImportError:
        raise UsageError(f"reading {path} needs the zstandard package: pip install zstandard") from None
    return zstandard


def _json_text(line: bytes, text_column: str) -> str | None:
    """The document of one line, or None for a blank line or an empty text; a ValueError that
    says what is wrong with it otherwise."""
    if not line.strip():
        return None  # pyarrow's JSON reader, behind load_corpus, passes over a blank line too
    try:
        decoded = line.decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start + 1})") from None
    try:
        document = corpus.json_object(decoded)
    except ValueError as e:
        raise ValueError(f"JSON parse error: {e}") from None
    text = document.get(text_column)
    if text is None:
        raise ValueError(f"no {text_column!r} (absent or null; its fields: {', '.join(document)}): "
                         "fix that line, or choose another field with --text-column")
    if not isinstance(text, str):
        raise ValueError(f"{text_column!r} holds {json.dumps(text)[:40]}, not text")
    try:
        text.encode()
    except UnicodeEncodeError:  # an escape such as \ud800 that JSON reads as half a surrogate pair
        raise ValueError(f"{text_column!r} holds a lone surrogate escape, not UTF-8 text") from None
    return text if text.strip() else None
