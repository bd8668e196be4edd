"""The corpus: the embedded default (Python's standard library), local files, or a Hub
dataset, loaded as documents with one column, "text"; its fingerprint, which a resumed run
must find again, and the held-out split.
"""

import codecs
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import stat
import sys
import sysconfig
from pathlib import Path

import datasets
import fsspec
import pyarrow.compute

from training.errors import UsageError, first_line, warn

EMBEDDED_CORPUS = "stdlib"
# local file suffix -> the `datasets` builder that reads it
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# A UTF-8 byte-order mark (some Windows editors write one) is not part of the first document:
# the same file with and without it is the same data. The json and csv readers drop it already.
BUILDER_OPTIONS = {"text": {"encoding": "utf-8-sig"}}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")  # `datasets` decompresses these as it reads (.zst: with zstandard)
# A compressed file of 0 bytes: gzip and zstd read it as no documents, where `gzip -t` refuses it
EMPTY_COMPRESSED = ("it is empty (0 bytes), and a compressed file holds at least its header: it is damaged or was cut "
                    "short; replace it, or remove it")
KNOWN_FILES = f"{'/'.join(FILE_BUILDERS)} (optionally {'/'.join(COMPRESSIONS)})"


# ---------------------------------------------------------------------------------------
# The embedded default corpus: the Python standard library that ships with the interpreter


def stdlib_files() -> list[str]:
    """The standard library's .py files, test suites and installed packages left out."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = []

    def unlisted(error: OSError):  # the interpreter's own files, not the user's: the run can go on without them
        warn(f"the embedded corpus ({EMBEDDED_CORPUS}) leaves out {error.filename}: it cannot be listed "
             f"({error.strerror or first_line(error)})")
    for folder, subfolders, names in os.walk(root, onerror=unlisted):
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
    if not path.is_dir():
        regular_file(path, "dataset file")  # a FIFO or a device (a link to /dev/zero) is neither file nor folder
        if file_builder(path) is None:
            raise UsageError(f"unsupported dataset file {path}: expected {KNOWN_FILES}")
        files = [path]
    else:
        files, skipped = walk(path, lambda f: file_builder(f) is not None and f.is_file())
        warn_skipped(path, skipped, KNOWN_FILES)
        if not files:
            raise UsageError(f"folder {path} holds no {KNOWN_FILES} files")
    for f in files:
        if not os.access(f, os.R_OK):
            raise UsageError(f"cannot read dataset file {f}")
        if f.name.lower().endswith(COMPRESSIONS) and f.stat().st_size == 0:  # read as no documents, where gzip -t fails
            raise UsageError(f"cannot read {f}: {EMPTY_COMPRESSED}")
        if f.name.lower().endswith(".zst") and importlib.util.find_spec("zstandard") is None:
            raise UsageError(f"reading {f} needs the zstandard package: pip install zstandard")
    return files


def _holds_text(path: Path) -> bool:
    """Whether a data file holds more than blanks, once decompressed: one that does not has no
    documents, and makes `datasets` builders fail with lines that say nothing of it (JSON's
    bare StopIteration for a compressed file of nothing, "Instruction "train" corresponds to no
    data!" for blank lines). Read up to its first other byte; a file that cannot be read is
    left to its builder, whose line names the damage."""
    if file_builder(path) == "parquet":  # binary, never blank
        return True
    try:
        with fsspec.open(str(path), "rb", compression="infer") as f:
            while chunk := f.read(2**16):
                if chunk.strip():
                    return True
        return False
    except Exception:  # a damaged compressed file: its builder says so, naming it
        return True


def warn_skipped(path: Path, skipped: list[str], known: str):
    """One warning that names what the walk of --dataset's folder left out (the first five)."""
    if skipped:
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warn(f"--dataset {path}: skipping {len(skipped)} {'entry' if len(skipped) == 1 else 'entries'}: {shown} "
             f"(data files end in {known})")


def walk(root: Path, wanted) -> tuple[list[Path], list[str]]:
    """The files under root for which wanted(path) is true, at any depth, symlinked folders
    followed and hidden ones not, sorted (the same order on every rank), each real file once;
    and what was left out, with the reason for the less obvious cases."""
    files, skipped, seen_dirs, seen_files = [], [], set(), {}

    def unlisted(error: OSError):  # os.walk's default passes over such a folder: its files never trained
        raise UsageError(f"cannot list the folder {error.filename} of --dataset {root} "
                         f"({error.strerror or first_line(error)}): its files would be left out of the run; make it "
                         "readable, or move it out of the folder")
    for folder, subfolders, names in os.walk(root, onerror=unlisted, followlinks=True):
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
            if not wanted(f):
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


def regular_file(path, what: str) -> int:
    """The size of a file we are about to read, refused in one line unless it is a regular file:
    in a folder anyone may write, a FIFO would block the read forever and a link to /dev/zero
    never end it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {first_line(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path} is not a regular file (a FIFO, a device or a folder): replace it with the "
                         "file it should be, or remove it")
    return st.st_size


def read_text(path, what: str, limit: int) -> str:
    """A file's text, read only as what it must be: a regular file of at most `limit` bytes."""
    if (size := regular_file(path, what)) > limit:
        raise UsageError(f"{what} {path} holds {size:,} bytes, more than any {what} can ({limit:,})")
    with open(path, "rb") as f:
        return f.read(limit + 1)[:limit].decode(errors="replace")  # bounded even if it grows meanwhile


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
        files = [f for f in _local_files(Path(dataset).expanduser()) if _holds_text(f)]
        if not files:
            raise UsageError(f"dataset {dataset} has no non-empty documents")
        parts = []
        for builder in sorted({file_builder(f) for f in files}):
            data_files = [str(f) for f in files if file_builder(f) == builder]
            parts.append(_text_column(_load_files(builder, data_files, dataset), text_column, dataset))
        if len({part.features["text"].dtype for part in parts}) > 1:  # .csv reads large_string, .txt string
            parts = [part.cast_column("text", datasets.Value("large_string")) for part in parts]
        ds = datasets.concatenate_datasets(parts)
    else:
        try:
            with reported_by_us():
                ds = datasets.load_dataset(dataset, dataset_config, split=split or "train")
        except Exception as e:  # offline, unknown id, bad config or split
            raise UsageError(f"cannot load Hub dataset {dataset!r}: {first_line(e)}") from None
        ds = _text_column(ds, text_column, dataset)
    try:
        ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    except UnicodeDecodeError:  # pyarrow's JSON and CSV readers take any bytes as a string
        raise UsageError(f"dataset {dataset}: {_not_utf8(ds)} is not UTF-8 text: fix or drop it") from None
    if len(ds) == 0:
        raise UsageError(f"dataset {dataset} has no non-empty documents")
    return ds


def _not_utf8(ds: datasets.Dataset) -> str:
    """Which document is not UTF-8 (read again on this path only)."""
    found = first_not_utf8(ds.with_format("arrow")[:]["text"])
    return "a document" if found is None else f"document {found + 1:,}"


def first_not_utf8(column: pyarrow.ChunkedArray) -> int | None:
    """The index of the first string in column that is not UTF-8, or None if none is found:
    pyarrow's full validation names it."""
    before = 0
    for chunk in column.chunks:
        try:
            chunk.validate(full=True)
        except pyarrow.ArrowInvalid as e:
            found = re.search(r"index (\d+)", str(e))
            return before + int(found.group(1)) if found else None
        before += len(chunk)
    return None


def _load_files(builder: str, data_files: list[str], dataset: str) -> datasets.Dataset:
    """The files, read by one `datasets` builder. Its errors do not name the file ("JSON parse
    error ... in row 30"): on that path only, the files are read again one at a time, in order,
    up to the first that fails, which the one line names, with the line of a JSON Lines file
    that does not parse (_bad_json_line)."""
    def load(files):
        with reported_by_us():
            return datasets.load_dataset(builder, data_files=files, split="train", **BUILDER_OPTIONS.get(builder, {}))
    try:
        return load(data_files)
    except Exception as e:  # datasets raises many types for unreadable files
        where = dataset
        for f in data_files if len(data_files) > 1 else []:
            try:
                load([f])
            except Exception as in_file:
                e, where = in_file, f
                break
        problem = first_line(e)
        # pyarrow's "in row N"; a line nested thousands deep fails in what `datasets` tries after
        # pyarrow: pandas' "Reached object decoding depth limit", or a RecursionError of its own
        if builder == "json" and (re.search(r" in row \d+|decoding depth limit", problem)
                                  or isinstance(e, RecursionError)):
            file = data_files[0] if len(data_files) == 1 else where
            if bad_line := _bad_json_line(file):
                where, problem = file, bad_line
        raise UsageError(f"cannot read {where}: {problem}") from None


def _bad_json_line(path: str) -> str | None:
    """Where a JSON Lines file first fails, counted as editors and `sed -n Np` count its lines
    (from 1, blank ones included), or None. pyarrow's "in row N" is no line number: it counts
    from 0, skips blank lines, and starts again at each block it parses (a few hundred kB of a
    large file). Read again from the start (a compressed file decompressed), on this path only."""
    with fsspec.open(path, "rb", compression="infer") as f:
        for number, line in enumerate(f, start=1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)  # as `datasets` reads it
            if not line.strip():
                continue
            try:
                json_object(line.rstrip(b"\r\n").decode(errors="replace"))  # its syntax, as pyarrow reads it
            except ValueError as e:
                return f"JSON parse error on line {number}: {e}"
    return None


def json_object(line: str) -> dict:
    """A line of a JSON Lines file as the object each line must be, or a ValueError that says
    why it is not (the column where its syntax fails)."""
    try:
        document = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg.removesuffix(' at')} at column {e.colno}") from None
    except RecursionError:  # its reader recurses a level at a time: "[" * 100000 is a traceback otherwise
        raise ValueError("arrays or objects nested deeper than Python's JSON reader can follow (its recursion "
                         f"limit, {sys.getrecursionlimit():,} levels)") from None
    if not isinstance(document, dict):
        raise ValueError(f"a {type(document).__name__}, where each line is an object")
    return document


def _text_column(ds: datasets.Dataset, column: str, name: str) -> datasets.Dataset:
    if column not in ds.column_names:
        raise UsageError(f"dataset {name} has no column {column!r} (columns: {', '.join(ds.column_names)})")
    feature = ds.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__.lower()
        raise UsageError(f"column {column!r} of dataset {name} holds {kind}, not text")
    missing = ds.data.column(column).null_count  # rows without the field (JSON lines), or with null
    if missing:
        raise UsageError(f"{missing:,} of {len(ds):,} documents of dataset {name} have no {column!r} (absent or null): "
                         "fix those rows, or choose the column they all have with --text-column")
    ds = ds.select_columns([column])
    return ds.rename_column(column, "text") if column != "text" else ds


@contextlib.contextmanager
def reported_by_us():
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


def text_bytes(texts: datasets.Dataset) -> int:
    """The UTF-8 bytes of every document's text, from the Arrow column (no Python strings)."""
    return pyarrow.compute.sum(pyarrow.compute.binary_length(texts.with_format("arrow")[:]["text"])).as_py() or 0
