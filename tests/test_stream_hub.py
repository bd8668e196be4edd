"""--stream from a Hub dataset (training/stream/hub.py): `--dataset ORG/NAME` resolved to its
split's files at a commit, listed in name order, read through fsspec as the same files on disk
are read, streamed and resumed at the recorded commit though the repository moved on; a changed
file, another dataset, config or split, an unreachable Hub, a failing read: each one line.

No test reaches the network: FakeHub stands in for it, a repository of commits in fsspec's
memory filesystem that datasets.load_dataset_builder (the one call hub.py makes to the Hub)
answers from. What only the real Hub can show (HfFileSystem's byte ranges, its errors, the
dataset card's configs) is left to a run with a network."""

import copy
import gc
import shutil
import types
import uuid
from pathlib import Path

import datasets
import fsspec
import huggingface_hub
import pytest
import torch
from fsspec.implementations.memory import MemoryFile

from conftest import FAST, assert_same_weights, run_in_process, script_in_process
from test_stream_loader import feed_of, same_steps
from test_stream_rows import corpus, small_pieces, texts, through_a_checkpoint, tokenizer  # noqa: F401
from test_stream_run import one_line
from test_stream_shards import write
from training import config
from training.stream import holdout, run
from training.stream.hub import HubSource, Pin, hub_source
from training.stream.shards import find_shards, read_documents

SHA_A, SHA_B = "a" * 40, "b" * 40  # two commits, one after the other
DATASET = "org/name"


class FakeHub:
    """The Hub's one repository, DATASET: commits of files in fsspec's memory filesystem, at
    {root}/datasets/{DATASET}@{sha}/{path}; load_dataset_builder answers as `datasets` does from
    the Hub: each split's files as URLs pinned to the commit asked for (the head where none is),
    listed out of name order. A file is in split "test" below a folder test/, else in "train"."""

    def __init__(self):
        self.root = f"memory://hub-{uuid.uuid4().hex}"
        self.commits, self.head, self.asked = {}, None, []

    def url(self, sha: str, name: str) -> str:
        return f"{self.root}/datasets/{DATASET}@{sha}/{name}"

    def push(self, sha: str, folder: Path):
        """A commit of the files below folder, which becomes the head."""
        names = sorted(f.relative_to(folder).as_posix() for f in folder.rglob("*") if f.is_file())
        for name in names:
            fsspec.filesystem("memory").pipe(self.url(sha, name), (folder / name).read_bytes())
        self.commits[sha] = {split: [n for n in names if n.startswith("test/") == (split == "test")]
                             for split in ("train", "test")}
        self.head = sha

    def rewrite(self, sha: str, name: str, data: bytes):
        """What a commit cannot do on the Hub, here to prove the check: a file of it changed."""
        fsspec.filesystem("memory").pipe(self.url(sha, name), data)

    def load_dataset_builder(self, path, name=None, revision=None, **kwargs):
        self.asked.append((path, name, revision))
        if path != DATASET:
            raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")
        sha = self.head if revision is None else revision
        if sha not in self.commits:
            raise datasets.exceptions.DatasetNotFoundError(f"Revision '{revision}' doesn't exist for dataset "
                                                           f"'{path}' on the Hub.")
        data_files = {split: [self.url(sha, n) for n in reversed(names)] for split, names in self.commits[sha].items()}
        return types.SimpleNamespace(hash=sha, config=types.SimpleNamespace(data_files=data_files))


@pytest.fixture
def fake_hub(monkeypatch):
    fake = FakeHub()
    monkeypatch.setattr(datasets, "load_dataset_builder", fake.load_dataset_builder)
    yield fake
    fsspec.filesystem("memory").rm(fake.root, recursive=True)


def folder_of(path: Path, shards: dict) -> Path:
    """A folder of shards: name -> (texts, row group size)."""
    for name, (documents, row_group_size) in shards.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        write(path / name, documents, row_group_size)
    return path


SMALL = {"data/b.parquet": (texts(9, 1), 4), "data/a.jsonl": (texts(5, 2), None), "test/c.jsonl": (texts(3, 3), None)}


# ---------------------------------------------------------------------------------------
# Resolving: the split's files, at a commit, in name order


def test_a_split_is_its_files_at_the_head_commit_named_by_their_path_in_name_order(fake_hub, tmp_path):
    fake_hub.push(SHA_A, folder_of(tmp_path / "a", SMALL))
    source = hub_source(DATASET, "sample", None)
    assert source.pin == Pin(DATASET, "sample", "train", SHA_A)  # "train" where --split is not given
    assert source.files == (("data/a.jsonl", fake_hub.url(SHA_A, "data/a.jsonl")),
                            ("data/b.parquet", fake_hub.url(SHA_A, "data/b.parquet")))
    assert fake_hub.asked == [(DATASET, "sample", None)]  # --dataset-config passed on; the head asked for
    assert [n for n, _ in hub_source(DATASET, None, "test").files] == ["test/c.jsonl"]
    assert str(source) == f"Hub dataset {DATASET} (config sample, split train) at revision aaaaaaaaaaaa"
    fake_hub.push(SHA_B, folder_of(tmp_path / "b", {**SMALL, "data/0.jsonl": (["new"], None)}))
    assert hub_source(DATASET, "sample", None).pin.revision == SHA_B  # a new run reads the head
    # --stream accepts a Hub id and its flags; hub_source resolves it when the run starts
    cfg = config.parse_args(["--stream", "--dataset", DATASET, "--dataset-config", "sample", "--split", "test",
                             "--max-steps", "50", "--out-dir", str(tmp_path / "out")])
    assert (cfg.dataset, cfg.dataset_config, cfg.split) == (DATASET, "sample", "test")


def test_its_shards_and_documents_are_those_of_the_same_files_on_disk(fake_hub, corpus):
    """Every kind (parquet of row groups, empty shards, JSON Lines plain and gzipped), each
    shard's size, digest and pieces, each piece read from every row: as read from disk."""
    fake_hub.push(SHA_A, Path(corpus.source))
    source = hub_source(DATASET, None, None)
    local = find_shards(corpus.source, "text")
    assert find_shards(source, "text") == local
    for shard in local:
        for piece, rows in enumerate(shard.pieces):
            whole = list(read_documents(corpus.source, shard, piece, 0, "text"))
            for start in range(len(whole) + 1 if rows is None else rows + 1):
                expected = [(row, text) for row, text in whole if row >= start]
                assert list(read_documents(source, shard, piece, start, "text")) == expected


# ---------------------------------------------------------------------------------------
# A run: streamed, resumed at its commit, refused on a changed file


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_run_resumes_at_its_recorded_commit_though_the_repo_moved_on(fake_hub, corpus, tokenizer, pack,
                                                                     tmp_path_factory):
    """Its steps are those of the same files on disk; from the states after every step, a feed
    over the dataset resolved again (the head now another commit: a shard rewritten, one added)
    gives the rest, bitwise."""
    fake_hub.push(SHA_A, Path(corpus.source))
    first = hub_source(DATASET, None, None)
    remote = copy.copy(corpus)
    remote.source = first
    everything = list(feed_of(remote, tokenizer, pack))
    assert len(everything) > 5 and same_steps(everything, list(feed_of(corpus, tokenizer, pack)))
    moved = tmp_path_factory.mktemp("moved")
    shutil.copytree(corpus.source, moved, dirs_exist_ok=True)
    write(moved / "a.parquet", texts(13, 7), row_group_size=4)
    write(moved / "h.jsonl", ["a document pushed later"])
    fake_hub.push(SHA_B, moved)
    again = copy.copy(corpus)
    again.source = hub_source(DATASET, None, None, first.pin.to_dict())
    assert again.source == first and fake_hub.asked[-1] == (DATASET, None, SHA_A)
    assert find_shards(again.source, "text") == find_shards(first, "text")
    saving = feed_of(remote, tokenizer, pack)
    for cut in range(len(everything) + 1):
        resumed = feed_of(again, tokenizer, pack)
        resumed.load_state_dict(through_a_checkpoint(saving.state_dict()))
        assert same_steps(list(resumed), everything[cut:]), cut
        next(saving, None)


def record_of(cfg, source: HubSource, tokenizer) -> dict:
    found = find_shards(source, "text")
    _, held_out = holdout.validation_documents(source, found, "text", 2)
    return run.record(cfg, found, held_out, 2, tokenizer, source.pin)


def test_the_record_holds_the_pin_and_a_changed_remote_file_is_one_line_naming_it(fake_hub, tmp_path, tokenizer):
    fake_hub.push(SHA_A, folder_of(tmp_path, SMALL))
    cfg = config.parse_args(["--stream", "--dataset", DATASET, "--out-dir", str(tmp_path / "out"), "--seq-len", "8",
                             "--max-steps", "50"])
    source = hub_source(DATASET, None, None)
    recorded = through_a_checkpoint({"record": record_of(cfg, source, tokenizer)})["record"]
    assert recorded["hub"] == {"dataset": DATASET, "config": None, "split": "train", "revision": SHA_A}
    run.check_resume(recorded, record_of(cfg, hub_source(DATASET, None, None, recorded["hub"]), tokenizer))
    listed = find_shards(source, "text")
    was = (tmp_path / "data/a.jsonl").read_bytes()
    fake_hub.rewrite(SHA_A, "data/a.jsonl", was + b'{"text": "one more"}\n')
    url = fake_hub.url(SHA_A, "data/a.jsonl")
    assert one_line(read_documents, source, listed[0], 0, 0, "text") == (
        f"cannot read shard {url}, line 1 on: it holds {len(was) + 21:,} bytes, where it held {len(was):,} when listed: "
        "it changed during the run")
    assert one_line(run.check_resume, recorded, record_of(cfg, source, tokenizer)) == (
        f"the checkpoint was trained on other shards: shard data/a.jsonl holds {len(was) + 21:,} bytes, where it held "
        f"{len(was):,}. Resume with the shards it read, or start a new run")
    fake_hub.rewrite(SHA_A, "data/a.jsonl", was.replace(b"a", b"b", 1))  # its size as it was
    assert "trained on other shards: shard data/a.jsonl changed: its first 64 KiB differ" in one_line(
        run.check_resume, recorded, record_of(cfg, source, tokenizer))


def test_a_resume_of_another_dataset_config_or_split_is_one_line(fake_hub, tmp_path, tokenizer):
    """The pins compared where both runs read a Hub dataset; another split is resolved at the
    head (the recorded commit is the recorded split's)."""
    fake_hub.push(SHA_A, folder_of(tmp_path, SMALL))
    cfg = config.parse_args(["--stream", "--dataset", DATASET, "--out-dir", str(tmp_path / "out"), "--seq-len", "8",
                             "--max-steps", "50"])
    recorded = record_of(cfg, hub_source(DATASET, "sample", None), tokenizer)
    fake_hub.push(SHA_B, tmp_path)
    for config_name, split, now in [("sample", "test", f"Hub dataset {DATASET} (config sample, split test) at "
                                                       "revision bbbbbbbbbbbb"),
                                    (None, None, f"Hub dataset {DATASET} (split train) at revision bbbbbbbbbbbb")]:
        source = hub_source(DATASET, config_name, split, recorded["hub"])
        assert fake_hub.asked[-1] == (DATASET, config_name, None)
        assert one_line(run.check_resume, recorded, {**recorded, "hub": source.pin.to_dict()}) == (
            f"the checkpoint read Hub dataset {DATASET} (config sample, split train) at revision aaaaaaaaaaaa, and "
            f"this run reads {now}: resume with --dataset {DATASET} --dataset-config sample --split train")
    local = {**recorded, "hub": None}  # the same files on disk: their shards decide, and are the same
    run.check_resume(recorded, local)
    run.check_resume(local, recorded)


@pytest.mark.parametrize("pin, said", [
    ({"dataset": DATASET, "config": None, "split": "train", "revision": "main"}, "a revision of 40 hex digits"),
    ({"dataset": DATASET, "config": 3, "split": "train", "revision": SHA_A}, "a config or null"),
    ({"dataset": DATASET, "split": "train", "revision": SHA_A}, "expected dataset, config, split, revision"),
    ("org/name@" + SHA_A, "ckpt.pt's stream record: hub is 'org/name@aaaa"),
])
def test_a_hostile_pin_is_one_line(fake_hub, tmp_path, tokenizer, pin, said):
    fake_hub.push(SHA_A, folder_of(tmp_path, SMALL))
    cfg = config.parse_args(["--stream", "--dataset", DATASET, "--out-dir", str(tmp_path / "out"), "--seq-len", "8",
                             "--max-steps", "50"])
    good = record_of(cfg, hub_source(DATASET, None, None), tokenizer)
    assert said in one_line(run.check_resume, {**good, "hub": pin}, good, "ckpt.pt")
    if isinstance(pin, dict):  # a resume resolves nothing from it
        assert said in one_line(hub_source, DATASET, None, None, pin)


# ---------------------------------------------------------------------------------------
# What cannot be read: one line


def unreachable(*args, **kwargs):
    """datasets.load_dataset_builder where the Hub's name does not resolve: after huggingface_hub's
    retries, its LocalEntryNotFoundError, which datasets raises again as a ConnectionError."""
    error = ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)")
    error.__cause__ = huggingface_hub.errors.LocalEntryNotFoundError("[Errno -2] Name or service not known")
    raise error


def test_an_unreachable_hub_is_one_line(monkeypatch):
    """Offline (conftest sets HF_HUB_OFFLINE: datasets' own resolution refuses at once), and as
    datasets says a Hub it cannot reach."""
    advice = ": --stream reads a Hub dataset over the network; without one, download its files and give their folder"
    said = one_line(hub_source, DATASET, None, None)
    assert said.startswith("cannot reach the Hub for dataset 'org/name' (") and advice in said, said
    monkeypatch.setattr(datasets, "load_dataset_builder", unreachable)
    assert one_line(hub_source, DATASET, None, None, Pin(DATASET, None, "train", SHA_A).to_dict()) == (
        f"cannot reach the Hub for dataset 'org/name' at revision {SHA_A} ([Errno -2] Name or service not known)"
        f"{advice} as --dataset")


def test_an_unknown_revision_split_or_kind_of_file_is_one_line(fake_hub, monkeypatch, tmp_path):
    fake_hub.push(SHA_A, folder_of(tmp_path / "a", SMALL))
    gone = Pin(DATASET, None, "train", "c" * 40).to_dict()  # a commit squashed away since
    assert one_line(hub_source, DATASET, None, None, gone) == (
        f"cannot open Hub dataset 'org/name' at revision {'c' * 40}: Revision '{'c' * 40}' doesn't exist for "
        "dataset 'org/name' on the Hub.")
    assert one_line(hub_source, DATASET, None, "validation") == (
        "Hub dataset org/name (split validation) at revision aaaaaaaaaaaa has no split 'validation' (its splits: "
        "train, test): --split names one; --stream reads a split whole")
    (tmp_path / "b" / "data").mkdir(parents=True)
    (tmp_path / "b" / "data" / "x.csv").write_text("text\nhello\n")
    write(tmp_path / "b" / "data" / "y.parquet", ["a document"])
    fake_hub.push(SHA_B, tmp_path / "b")
    assert one_line(find_shards, hub_source(DATASET, None, None), "text") == (
        "Hub dataset org/name (split train) at revision bbbbbbbbbbbb holds 2 files, 1 not "
        ".parquet/.jsonl/.jsonl.gz/.jsonl.zst shards (data/x.csv): --stream reads only those; leave it out to load "
        "the dataset whole")
    unpinned = types.SimpleNamespace(hash=SHA_A, config=types.SimpleNamespace(data_files={"train": ["hf://x/y.jsonl"]}))
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda *args, **kwargs: unpinned)
    assert "its file hf://x/y.jsonl is not at that commit, so a resume could not read it again" in one_line(
        hub_source, DATASET, None, None)
    assert "resolved to the commit aaaa" in one_line(hub_source, DATASET, None, None, {**gone, "revision": SHA_B})


def test_a_remote_read_that_fails_is_one_line_naming_the_file_and_the_row(fake_hub, tmp_path, monkeypatch):
    """A transport's error that is no OSError (httpx's timeout: huggingface_hub's), met while a
    parquet row group or a JSON Lines file is read, is the one line a disk's error is."""
    fake_hub.push(SHA_A, folder_of(tmp_path, SMALL))
    source = hub_source(DATASET, None, None)
    jsonl, parquet = find_shards(source, "text")

    class ReadTimeout(Exception):
        pass

    def timed_out(self, *args):
        raise ReadTimeout("The read operation timed out")
    monkeypatch.setattr(MemoryFile, "read", timed_out)
    assert one_line(lambda: list(read_documents(source, parquet, 1, 0, "text"))) == (
        f"cannot read shard {fake_hub.url(SHA_A, 'data/b.parquet')}, row group 1, row 0 on: ReadTimeout: The read "
        "operation timed out")
    assert one_line(lambda: list(read_documents(source, jsonl, 0, 0, "text"))) == (
        f"cannot read shard {fake_hub.url(SHA_A, 'data/a.jsonl')}: line 1: ReadTimeout: The read operation timed out")


# ---------------------------------------------------------------------------------------
# train_dp.py --stream --dataset ORG/NAME


def checkpoint_pins(out: Path) -> list:
    paths = sorted(out.glob("checkpoint*.pt"))
    return [torch.load(path, weights_only=True)["stream"]["record"]["hub"] for path in paths]


def test_train_dp_streams_a_hub_dataset_and_resumes_at_its_commit_bitwise(fake_hub, tmp_path, capsys, monkeypatch):
    """Stopped at step 4 and resumed after the repository moved on, it ends with the weights of
    the uninterrupted run; a resume whose recorded file changed is one line, exit 2, nothing
    written; an unreachable Hub too."""
    documents = {f"data/{i}.parquet": ([f"document {i} {j} " * (3 + j % 5) for j in range(40)], 16) for i in range(3)}
    fake_hub.push(SHA_A, folder_of(tmp_path / "a", {**documents, "data/z.jsonl": (texts(30, 5), None)}))
    args = ["--stream", "--dataset", DATASET, *FAST]
    said = run_in_process("train_dp.py", [*args, "--out-dir", str(tmp_path / "whole")])
    assert f"streamed from Hub dataset {DATASET} (split train) at revision aaaaaaaaaaaa: 4 shards" in said
    run_in_process("train_dp.py", [*args, "--out-dir", str(tmp_path / "cut"), "--stop-at-step", "4"])
    gc.collect()  # the stopped run's read-ahead, in a reference cycle, holds its worker, which holds --out-dir's lock
    pin = {"dataset": DATASET, "config": None, "split": "train", "revision": SHA_A}
    assert checkpoint_pins(tmp_path / "cut") and all(saved == pin for saved in checkpoint_pins(tmp_path / "cut"))
    fake_hub.push(SHA_B, folder_of(tmp_path / "b", {"data/0.parquet": (texts(50, 9), 8)}))  # the repository moved on
    name, was = "data/z.jsonl", (tmp_path / "a" / "data/z.jsonl").read_bytes()
    fake_hub.rewrite(SHA_A, name, was + b"\n")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "cut").iterdir())
    capsys.readouterr()
    assert script_in_process("train_dp.py", [*args, "--out-dir", str(tmp_path / "cut"), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"was trained on other shards: shard {name} holds {len(was) + 1:,} bytes" in err[0], err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "cut").iterdir()) == before
    fake_hub.rewrite(SHA_A, name, was)
    run_in_process("train_dp.py", [*args, "--out-dir", str(tmp_path / "cut"), "--resume"])
    assert_same_weights(tmp_path / "whole", tmp_path / "cut")
    assert all(saved == pin for saved in checkpoint_pins(tmp_path / "cut"))
    monkeypatch.setattr(datasets, "load_dataset_builder", unreachable)
    capsys.readouterr()
    assert script_in_process("train_dp.py", [*args, "--out-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: cannot reach the Hub for dataset 'org/name' ([Errno -2]" in err[0], err
    assert not (tmp_path / "none").exists()
