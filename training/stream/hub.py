"""--stream's Hub datasets: `--dataset ORG/NAME` (with --dataset-config and --split, as the
map-style path reads them: split "train" where none is given) resolved to its data files at
one commit, each read through fsspec (huggingface_hub's HfFileSystem: hf://datasets/ORG/NAME@SHA/
path) a byte range at a time: a parquet footer, then only the row groups a rank trains on.
Nothing is downloaded whole; nothing but the dataset card (which `datasets` reads) is cached.

Pinned: the files are those of the commit the run started at, whose sha the run records
(HubSource.pin: run.py's record). A resume resolves the dataset at that commit, not at the
branch's head: a repository that moved on since (files added, rewritten, removed) does not
change what the resume reads, which is exact as a resume of local shards is. The files of a
commit never change, but a resume still lists them and checks each one's size and digest
against the record (shards.changed), as it does a folder's: the same guarantee, one code path.
What `datasets` resolves is the list of files only (load_dataset_builder: the dataset card's
configs, or its folder conventions); shards.py reads them, so each shard is one a run can read
from any row group (parquet) or whole (JSON Lines): a split of CSV or text files, or of archives,
is one line.

Failures: resolving (offline, an unknown id, config, split or revision) is one line naming the
dataset and the cause. Reading: HTTP errors reach shards.py as OSErrors (RemoteFile), which it
turns into one line naming the file and the row, as it does a local disk's; huggingface_hub
retries a dropped connection (http_backoff) before that.
"""

import dataclasses
import functools
import io
import re

import datasets
import fsspec

from training import corpus
from training.errors import UsageError, first_line

REMOTE_BUFFER = 1 << 20  # a JSON Lines shard's lines are read through this much; fsspec's own block is larger
LISTING_THREADS = 16  # a remote shard is described in a request or two: listed this many at a time
COMMIT = "[0-9a-f]{40}"  # a commit's sha: a branch or a tag names one commit today and another tomorrow


@dataclasses.dataclass(frozen=True)
class Pin:
    """What a run records of a Hub dataset: enough to read the same files again."""
    dataset: str
    config: str | None
    split: str
    revision: str  # the commit's sha, 40 hex digits

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> "Pin":
        """A pin as a run recorded it, checked: the record may be hostile or stale."""
        fields = [field.name for field in dataclasses.fields(cls)]
        if not (isinstance(d, dict) and set(d) == set(fields) and isinstance(d["dataset"], str)
                and (d["config"] is None or isinstance(d["config"], str)) and isinstance(d["split"], str)
                and isinstance(d["revision"], str) and re.fullmatch(COMMIT, d["revision"])):
            raise UsageError(f"Hub dataset record {str(d)[:120]}: expected {', '.join(fields)} (a config or null, a "
                             "revision of 40 hex digits)")
        return cls(**d)

    def __str__(self) -> str:
        config = f"config {self.config}, " if self.config is not None else ""
        return f"Hub dataset {self.dataset} ({config}split {self.split}) at revision {self.revision[:12]}"


@dataclasses.dataclass(frozen=True)
class HubSource:
    """A Hub dataset's split at a pinned commit: its data files, each by its path in the
    repository (the shard's name) and the URL fsspec reads it at, sorted by name."""
    pin: Pin
    files: tuple[tuple[str, str], ...]

    @functools.cached_property
    def _urls(self) -> dict[str, str]:
        return dict(self.files)

    def url(self, name: str) -> str:
        found = self._urls.get(name)
        if found is None:
            raise UsageError(f"{self.pin} has no file {name}")
        return found

    def __str__(self) -> str:
        return str(self.pin)


def hub_source(dataset: str, config: str | None, split: str | None, recorded: dict | None = None) -> HubSource:
    """The data files of --dataset's split: at the recorded commit where `recorded` (a run's
    Pin.to_dict()) pins the same dataset, config and split (a resume), else at the head of its
    default branch (a new run). One line where it cannot be resolved, where its files are not
    pinned to that commit, and where the split has none."""
    split = split or "train"
    pinned = Pin.from_dict(recorded) if recorded is not None else None
    same = pinned is not None and (pinned.dataset, pinned.config, pinned.split) == (dataset, config, split)
    revision = pinned.revision if same else None
    at = f" at revision {revision}" if revision else ""
    try:
        with corpus.reported_by_us():
            builder = datasets.load_dataset_builder(dataset, config, revision=revision)
    except Exception as e:  # offline, an unknown id, config or revision, a gated dataset: datasets raises many types
        if _unreachable(e):
            raise UsageError(f"cannot reach the Hub for dataset {dataset!r}{at} ({first_line(e)}): --stream reads "
                             "a Hub dataset over the network; without one, download its files and give their folder "
                             "as --dataset") from None
        raise UsageError(f"cannot open Hub dataset {dataset!r}{at}: {first_line(e)}") from None
    sha, splits = builder.hash, builder.config.data_files or {}
    if not (isinstance(sha, str) and re.fullmatch(COMMIT, sha)):
        raise UsageError(f"Hub dataset {dataset!r} resolved to no commit ({str(sha)[:40]!r}): --stream reads a "
                         "dataset at a commit it records (a copy cached for offline use names none)")
    if revision not in (None, sha):
        raise UsageError(f"Hub dataset {dataset!r} resolved to the commit {sha}, not to {revision}, which the "
                         "checkpoint read")
    pin = Pin(dataset, config, split, sha)
    if pin.split not in splits:
        raise UsageError(f"{pin} has no split {pin.split!r} (its splits: {', '.join(map(str, splits)) or 'none'}): "
                         "--split names one; --stream reads a split whole")
    files = []
    for url in splits[pin.split]:
        _, pinned_at, name = str(url).partition(f"@{sha}/")
        if not pinned_at:
            raise UsageError(f"{pin}: its file {url} is not at that commit, so a resume could not read it again")
        files.append((name, str(url)))
    return HubSource(pin, tuple(sorted(files)))


def _unreachable(e: BaseException | None) -> bool:
    """No network, or none to the Hub: `datasets` says so with a ConnectionError (huggingface_hub's
    offline mode is one too), whatever its cause (httpx's ConnectError, which is none)."""
    while e is not None and not isinstance(e, (ConnectionError, TimeoutError)):
        e = e.__cause__
    return e is not None


def file_size(url: str) -> int:
    """A remote file's size in bytes (HfFileSystem answers from the listing it made)."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        return fs.size(path)
    except Exception as e:  # huggingface_hub's HTTP errors are httpx's, not OSErrors
        raise UsageError(f"cannot read shard {url}: {first_line(e)}") from None


def open_file(url: str) -> io.BufferedReader:
    """A remote file, read as a local one is (seek, read, readline), its failures OSErrors."""
    return io.BufferedReader(RemoteFile(url), REMOTE_BUFFER)


class RemoteFile(io.RawIOBase):
    """An fsspec file whose every failure is an OSError: shards.py turns an OSError into one
    line naming the file, and huggingface_hub raises its transport's errors (httpx's), which are
    not. Only this file's own calls are translated: an error of the reader above it is its own."""

    def __init__(self, url: str):
        self.url = url
        self.file = self._translated(lambda: fsspec.open(url, "rb").open())

    def _translated(self, call):
        try:
            return call()
        except OSError:
            raise
        except Exception as e:
            raise OSError(f"{type(e).__name__}: {first_line(e)}") from None  # the one line names its kind

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._translated(lambda: self.file.read(len(buffer)))
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._translated(lambda: self.file.seek(offset, whence))

    def tell(self) -> int:
        return self.file.tell()

    def close(self):
        if not self.closed and hasattr(self, "file"):
            self.file.close()
        super().close()
