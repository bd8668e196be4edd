"""--stream through the scripts, as a user runs them: hostile input (a resume on changed shards
or flags, a checkpoint of the other mode or with a damaged stream entry, flags that cannot
stream) is one line on stderr, exit status 2, nothing in --out-dir touched; a shard that cannot
be read mid-run ends every rank with one line naming the file and the row, the last checkpoint
intact and resumable once the shard is repaired; the corpus's edge cases train every window
once an epoch; and a streamed run trains the model today's map-style run trains on the same
windows in the same order."""

import gzip
import json
import random
import re
import shutil
import time
from collections import Counter

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import data
from conftest import (FAST, FAST_WITH_TOKENIZER, REPO, assert_same_model, assert_same_weights, metrics,
                      run_in_process, run_script, script_in_process, stopped_at_step_4, without_speed)
from model import IGNORE_INDEX, LlamaForPretraining
from test_bad_inputs import refused_in_process, snapshot
from test_failures import exit_codes, fault_env
from training import build, corpus, tokenized
from training.stream import holdout, order, shards

WORDS = ("the model reads tokens and predicts the next one while gradients flow back "
         "through every layer of the network until the optimizer takes a step").split()


def documents(n: int, seed: int, words: tuple[int, int] = (3, 40)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


def write(path, texts: list[str], row_group_size: int | None = None, first_line_extra: str = ""):
    """A shard of these texts in the kind its name says, each row with a second text column,
    "alt" (the words in reverse); first_line_extra: a "meta" field of the first JSON line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    alt = [" ".join(reversed(t.split())) for t in texts]
    if path.name.endswith(".parquet"):
        pq.write_table(pa.table({"text": pa.array(texts, pa.string()), "alt": pa.array(alt, pa.string())}), path,
                       row_group_size=row_group_size)
        return
    rows = [{"text": t, "alt": a} for t, a in zip(texts, alt)]
    if first_line_extra:
        rows[0]["meta"] = first_line_extra
    raw = "".join(json.dumps(row) + "\n" for row in rows).encode()
    path.write_bytes(gzip.compress(raw, mtime=0) if path.name.endswith(".gz") else raw)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A BPE of this corpus's words, for the runs whose windows a test computes beforehand (and
    whose shards a BPE trained from the stream would read whole before step 1)."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    data.train_tokenizer(datasets.Dataset.from_dict({"text": documents(200, 99)}), vocab_size=300).save(str(path))
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Parquet (4 row groups), .jsonl and .jsonl.gz in a folder below: 6 pieces, 4 sub-streams."""
    folder = tmp_path_factory.mktemp("mixed") / "shards"
    write(folder / "a.parquet", documents(40, 1), row_group_size=10)
    write(folder / "b.jsonl", documents(20, 2))
    write(folder / "c" / "d.jsonl.gz", documents(20, 3))
    return folder


def streamed(dataset, *extra) -> list[str]:
    return ["--stream", "--dataset", str(dataset), *FAST, *extra]


@pytest.fixture(scope="module")
def half(mixed, tmp_path_factory):
    """A streamed run of FAST's 8 steps stopped at step 4, its checkpoint there, to resume: each
    test resumes its own copy."""
    out = tmp_path_factory.mktemp("half") / "run"
    run_in_process("train_dp.py", [*streamed(mixed, "--stop-at-step", "4"), "--out-dir", str(out)])
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 4 and saved["stream"]["record"]["sub_streams"] == 4
    return out


def copy(folder, to):
    shutil.copytree(folder, to)
    return to


# ---------------------------------------------------------------------------------------
# Hostile input: one line, exit status 2, nothing touched


def rewrite_same_size(folder):
    path = folder / "b.jsonl"
    raw = path.read_bytes()
    at = raw.index(b"the")
    path.write_bytes(raw[:at] + b"THE" + raw[at + 3:])


def append_a_document(folder):
    path = folder / "b.jsonl"
    path.write_bytes(path.read_bytes() + json.dumps({"text": "one more", "alt": "more one"}).encode() + b"\n")


SHARD_CHANGES = {
    "rewritten": (rewrite_same_size, "shard b.jsonl changed: its first 64 KiB differ"),
    "grown": (append_a_document, "shard b.jsonl holds "),
    "added": (lambda f: write(f / "c" / "e.jsonl", documents(5, 4)), "shard c/e.jsonl was added"),
    "removed": (lambda f: (f / "c" / "d.jsonl.gz").unlink(), "shard c/d.jsonl.gz was removed"),
    "renamed": (lambda f: (f / "b.jsonl").rename(f / "b2.jsonl"), "shard b.jsonl is now named b2.jsonl"),
}


@pytest.mark.parametrize("change", SHARD_CHANGES)
def test_a_resume_on_changed_shards_is_one_line_touching_nothing(half, mixed, tmp_path, change, capsys):
    changing, message = SHARD_CHANGES[change]
    shards_now = copy(mixed, tmp_path / "shards")
    changing(shards_now)
    out = copy(half, tmp_path / "run")
    refused_in_process("train_dp.py", streamed(shards_now, "--resume"), out,
                       f"the checkpoint was trained on other shards: {message}", capsys)


FLAG_CHANGES = {
    "seq-len": (["--seq-len", "16"], "read its rows with --seq-len 32, and this run asks for 16"),
    "pack": (["--pack"], "was trained without --pack"),
    "seed": (["--seed", "7"], "read its rows with --seed 1337, and this run asks for 7"),
    "sub-streams": (["--sub-streams", "2"], "dealt its shards into 4 sub-streams, and this run into 2"),
    "text-column": (["--text-column", "alt"], "read the column 'text' of its shards, and this run reads 'alt'"),
    "val-docs": (["--val-docs", "5"], "held out 9 validation documents, not 5"),
}


@pytest.mark.parametrize("change", FLAG_CHANGES)
def test_a_resume_with_a_changed_flag_is_one_line_touching_nothing(half, mixed, tmp_path, change, capsys):
    """Every column of every shard holds text, so --text-column alt reads the same documents'
    other column: only the record tells the change."""
    extra, message = FLAG_CHANGES[change]
    refused_in_process("train_dp.py", streamed(mixed, "--resume", *extra), copy(half, tmp_path / "run"), message,
                       capsys)


@pytest.fixture(scope="module")
def half_packed(mixed, tmp_path_factory):
    """`half`, packed: its sub-streams' states hold their packers' open rows."""
    out = tmp_path_factory.mktemp("half-packed") / "run"
    run_in_process("train_dp.py", [*streamed(mixed, "--pack", "--stop-at-step", "4"), "--out-dir", str(out)])
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 4 and saved["stream"]["record"]["pack"] is True
    return out


def test_a_packed_run_resumed_without_pack_is_the_records_line_touching_nothing(half_packed, mixed, tmp_path, capsys):
    """FLAG_CHANGES' "pack" the other way round: the record's line names --pack in both
    directions, before the sub-streams' states are loaded (whose own line, "are packed, and this
    run's are padded", would name no flag to resume with)."""
    refused_in_process("train_dp.py", streamed(mixed, "--resume"), copy(half_packed, tmp_path / "run"),
                       "the checkpoint was trained with --pack (its rows hold several windows each): resume with "
                       "--pack", capsys)


def test_the_runs_seed_decides_its_deal(mixed, tmp_path):
    """--seed reaches a streamed run's deal, not only its record: a run at --seed 7 stopped at
    step 2 holds every sub-stream's cursor in seed 7's deal of this corpus, which is not the
    default seed's (1337: every other run here), so that a seed lost on the way (the default
    dealt instead) fails here."""
    out = tmp_path / "run"
    run_in_process("train_dp.py", [*streamed(mixed, "--seed", "7", "--stop-at-step", "2"), "--out-dir", str(out)])
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["stream"]
    assert saved["record"]["seed"] == 7 and dealt(mixed, 9, 4, seed=7) != dealt(mixed, 9, 4)
    cursors = [saved["states"][stream]["cursor"] for stream in range(4)]
    assert [cursor["epoch"] for cursor in cursors] == [0] * 4
    sub_streams = order.SubStreams(training_sizes(mixed, 9), 4, 7)
    assert [cursor["dealt"] for cursor in cursors] == [sub_streams.fingerprint(stream, 0) for stream in range(4)]


def test_a_checkpoint_of_the_other_mode_is_one_line_touching_nothing(runs, half, mixed, tmp_path, capsys):
    """A map-style checkpoint resumed with --stream, and a streamed one without: their data
    positions count other things."""
    map_style = stopped_at_step_4(runs, tmp_path)
    refused_in_process("train_dp.py", streamed(mixed, "--resume"), map_style,
                       "was trained without --stream: resume without it", capsys)
    refused_in_process("train_dp.py", ["--dataset", str(mixed), *FAST, "--resume"], copy(half, tmp_path / "run"),
                       "was trained with --stream: resume with it", capsys)


def without(args: list[str], flag: str) -> list[str]:
    at = args.index(flag)
    return args[:at] + args[at + 2:]


@pytest.mark.parametrize("args, message", [
    # a preset's 50 or 250 steps (debug, tiny) were taken in silence: a stream has no length
    ([*without(streamed("{mixed}"), "--max-steps"), "--model", model], "--stream needs --max-steps")
    for model in ("debug", "tiny", "article")] + [
    (streamed("{mixed}", "--epochs", "2"), "--epochs counts passes over a corpus tokenized before the run"),
], ids=["no-max-steps-debug", "no-max-steps-tiny", "no-max-steps-article", "epochs"])
def test_flags_a_stream_cannot_take_are_one_line_touching_nothing(mixed, tmp_path, args, message, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    refused_in_process("train_dp.py", [a.replace("{mixed}", str(mixed)) for a in args], out, message, capsys)


@pytest.mark.parametrize("steps", [10**22, 2**63 - 1, 10**12 + 1])
def test_more_steps_than_a_run_can_count_is_one_line_leaving_no_folder(mixed, tmp_path, steps, capsys):
    """A stream is --max-steps x --batch-size rows long to the loop, past what len() holds: an
    OverflowError traceback once the data was prepared, and an empty --out-dir left."""
    out = tmp_path / "out"
    args = [*without(streamed(mixed), "--max-steps"), "--max-steps", str(steps)]
    refused_in_process("train_dp.py", args, out, f"--max-steps must be at most 1,000,000,000,000, got {steps:,}",
                       capsys)
    assert not out.exists()


def unlisted_folder(folder, unlistable):
    unlistable(folder / "c")


def nested_line(folder, unlistable):
    (folder / "c" / "e.jsonl").write_text("[" * 100_000 + "\n")


def empty_gz(folder, unlistable):
    (folder / "c" / "e.jsonl.gz").write_bytes(b"")


LISTING_DAMAGE = {  # the shards as found, and the line naming what is wrong ({c}: the folder c below them)
    "unlisted-folder": (unlisted_folder, "cannot list the folder {c} of --dataset {shards} (Permission denied): its "
                                         "files would be left out of the run"),
    "nested-100000-deep": (nested_line, "{c}/e.jsonl: line 1: JSON parse error: arrays or objects nested deeper than "
                                        "Python's JSON reader can follow"),
    "empty-gz": (empty_gz, "{c}/e.jsonl.gz: it is empty (0 bytes), and a compressed file holds at least its header: it "
                           "is damaged or was cut short"),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "map-style"])
@pytest.mark.parametrize("case", LISTING_DAMAGE)
def test_a_corpus_damaged_where_it_is_listed_is_one_line_leaving_no_folder(mixed, tmp_path, unlistable, case, stream,
                                                                          capsys):
    """Each was exit 0 with part of the corpus left out in silence (a folder os.walk could not
    list, a 0-byte .jsonl.gz read as no documents) or a RecursionError traceback, with --stream
    and without. Map-style names the JSON line as "on line 1"; the stream as "line 1"."""
    damage, message = LISTING_DAMAGE[case]
    folder = copy(mixed, tmp_path / "shards")
    damage(folder, unlistable)
    args = streamed(folder) if stream else ["--dataset", str(folder), *FAST]
    message = message.format(c=folder / "c", shards=folder)
    if not stream:
        message = message.replace(": line 1:", ": JSON parse error on line 1:").replace(
            "JSON parse error on line 1: JSON parse error:", "JSON parse error on line 1:")
    out = tmp_path / "out"
    refused_in_process("train_dp.py", args, out, message, capsys)
    assert not out.exists()


def set_state(stream: int, key: str, value, inner: str | None = None):
    def change(ckpt):
        state = ckpt["stream"]["states"][stream]
        (state[inner] if inner else state)[key] = value
    return change


HOSTILE_ENTRIES = {
    "entry-a-list": (lambda c: c.update(stream=[c["stream"]["record"], c["stream"]["states"]]),
                     "stream entry is not a record and its sub-streams' states"),
    "record-of-another-kind": (lambda c: c["stream"]["record"].update(seq_len="32"),
                               "stream record: seq_len is '32', not a whole number"),
    "record-missing-a-field": (lambda c: c["stream"]["record"].pop("seed"), "stream record holds ["),
    "states-a-list": (lambda c: c["stream"].update(states=list(c["stream"]["states"].values())),
                      "sub-stream states are a list, not a dict of sub-stream to state"),
    "state-missing": (lambda c: c["stream"]["states"].pop(3), "sub-stream states lack sub-streams [3], and the run "
                                                              "has 4"),
    "state-not-a-dict": (lambda c: c["stream"]["states"].update({1: "here"}),
                         "sub-stream states do not count their targets"),
    "cursor-past-its-piece": (set_state(1, "row", 999, "cursor"), "there is no row 999 to start at"),
    "window-past-its-document": (set_state(1, "window", 50), "sub-stream 1's rows in the checkpoint: window 50 of "
                                                             "the document at row"),
    "cursor-of-another-deal": (set_state(2, "dealt", "0" * 16, "cursor"), "sub-stream 2's position in the checkpoint: "
                                                                         "it counts in other pieces"),
    "state-packed": (set_state(3, "packer", {}), "sub-stream 3's rows in the checkpoint are packed, and this run's "
                                                 "are padded (--pack)"),
    "digest-not-hex": (set_state(1, "digest", "zz", "cursor"), "sub-stream 1's position in the checkpoint: digest is "
                                                               "'zz', not 16 hex digits"),
    "pieces-read-a-list": (set_state(2, "read", [[0, 1]]), "the checkpoint's sub-stream 2: the pieces it read are "
                                                          "list, not (piece, digest) rows of int64"),
    "pieces-read-another-corpus": (set_state(0, "read", torch.tensor([[99, 1]])), "the checkpoint's sub-stream 0: the "
                                                                                  "pieces it read name piece 99 of 6"),
}


@pytest.mark.parametrize("case", HOSTILE_ENTRIES)
def test_a_hostile_stream_entry_in_the_checkpoint_is_one_line_touching_nothing(half, mixed, tmp_path, case, capsys):
    """The states too are checked before anything is written: each rank's feed loads its own
    as the data is prepared, the document in progress read again (it was checked in the loop,
    after the run had rewritten its files)."""
    damage, message = HOSTILE_ENTRIES[case]
    out = copy(half, tmp_path / "run")
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    damage(ckpt)
    torch.save(ckpt, out / "checkpoint.pt")
    refused_in_process("train_dp.py", streamed(mixed, "--resume"), out, message, capsys)


def line_of_every_rank(proc, tmp_path) -> str:
    """Through the real torchrun, its workers recording how they ended (tests/inject_fault.py):
    every rank exited 2; our one line printed once (by rank 0), before torchrun's report, in
    which it is each rank's cause (the error file each rank leaves); no frame of our code (the
    traceback there is torchrun's own launcher's). Returns the line."""
    assert exit_codes(tmp_path) == {"exit-rank0": "2", "exit-rank1": "2"}, proc.stderr
    assert proc.returncode == 1  # torchrun's, once its workers failed
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, proc.stderr
    assert proc.stderr.index(ours[0]) < proc.stderr.find("Traceback"), proc.stderr
    assert proc.stderr.count(f"traceback : {ours[0]}") == 2, proc.stderr
    for module in ("train_ddp.py", "training", "data.py", "model.py"):
        assert f'File "{REPO / module}' not in proc.stderr, proc.stderr
    return ours[0]


def on_two_ranks(args, out, tmp_path, timeout=300):
    """train_ddp.py on 2 ranks started by the real torchrun, each recording how it ended."""
    return run_script("train_ddp.py", [*args, "--out-dir", str(out)], nproc=2, check=False, timeout=timeout,
                      wrapper="tests/inject_fault.py", env=fault_env(tmp_path, "none", step=0))


def test_a_world_size_that_does_not_divide_the_sub_streams_is_one_line_on_every_rank(mixed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(out)
    proc = on_two_ranks(streamed(mixed, "--batch-size", "6", "--sub-streams", "3"), out, tmp_path)
    assert line_of_every_rank(proc, tmp_path) == \
        "error: 2 ranks cannot share the run's 3 sub-streams evenly: it runs and resumes at 1, 3 ranks"
    assert snapshot(out) == before


# ---------------------------------------------------------------------------------------
# A shard that cannot be read mid-run


def training_sizes(folder, val_docs: int) -> list[int]:
    """The sizes of the corpus's pieces as a run deals them: the held-out documents left out."""
    found = shards.find_shards(str(folder), "text")
    _, held_out = holdout.validation_documents(str(folder), found, "text", val_docs)
    return held_out.training_sizes(shards.piece_sizes(found))


def dealt(folder, val_docs: int, streams: int, seed: int = 1337) -> list[list[tuple[str, int]]]:
    """Each sub-stream's pieces in epoch 0, in reading order, as (shard name, piece in it)."""
    listed = shards.corpus_pieces(shards.find_shards(str(folder), "text"))
    return [[(listed[p][0].name, listed[p][1]) for p in pieces]
            for pieces in order.deal(training_sizes(folder, val_docs), streams, seed, 0)]


def error_line(stderr: str) -> str:
    """The one line a run that met bad input printed (after its progress bar), no traceback."""
    assert "Traceback" not in stderr, stderr
    ours = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and stderr.strip().splitlines()[-1] == ours[0], stderr
    return ours[0]


MID_RUN = ["--sub-streams", "2", "--max-steps", "14", "--save-every", "3", "--eval-every", "100"]


@pytest.fixture(scope="module")
def one_parquet(tmp_path_factory, tokenizer_file):
    """One parquet shard of 6 row groups of 16 documents, and the uninterrupted run over it:
    2 sub-streams, each reading a row group in about 6 steps."""
    folder = tmp_path_factory.mktemp("one_parquet") / "shards"
    write(folder / "m.parquet", documents(96, 5), row_group_size=16)
    reference = folder.parent / "reference"
    run_in_process("train_dp.py", ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file),
                                   *FAST_WITH_TOKENIZER, *MID_RUN, "--out-dir", str(reference)])
    return folder, reference


@pytest.mark.parametrize("damage", ["truncated", "row-group-damaged"])
def test_a_parquet_damaged_during_the_run_stops_it_in_one_line_and_resumes_once_repaired(
        one_parquet, tokenizer_file, tmp_path, monkeypatch, capsys, damage):
    """After step 1 the shard is cut to half its size, or 16 bytes of a row group that sub-stream
    1 reads second are zeroed (the file's size and footer as listed). Where a core is spare
    the rows are read in a DataLoader worker (2 cores: one), else in ReadAhead's thread; either
    way the error reaches the loop as one line naming the file, row group and row, exit 2. The
    checkpoint saved before stays as it was: repaired, the shard resumes there, and the run
    ends bitwise where the uninterrupted run ends, with the same metrics."""
    source, reference = one_parquet
    folder = copy(source, tmp_path / "shards")
    path = folder / "m.parquet"
    good = path.read_bytes()
    piece = dealt(folder, 9, 2)[1][1][1]  # sub-stream 1's second row group
    chunk = pq.ParquetFile(path).metadata.row_group(piece).column(0)
    middle = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 2

    def damaged_after_step_1(*args, real_step=build.AdamW.step, **kwargs):
        damaged_after_step_1.steps += 1
        if damaged_after_step_1.steps == 1:
            path.write_bytes(good[:len(good) // 2] if damage == "truncated"
                             else good[:middle] + bytes(16) + good[middle + 16:])
        return real_step(*args, **kwargs)
    damaged_after_step_1.steps = 0
    monkeypatch.setattr(build.AdamW, "step", damaged_after_step_1)
    out = tmp_path / "run"
    args = ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file), *FAST_WITH_TOKENIZER, *MID_RUN,
            "--out-dir", str(out)]
    assert script_in_process("train_dp.py", args) == 2
    line = error_line(capsys.readouterr().err)
    where = r"row group \d+, row \d+" if damage == "truncated" else f"row group {piece}, row 0"
    assert re.fullmatch(rf"error: cannot read shard {re.escape(str(path))}, {where} on: .+", line), line
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    assert saved in (3, 6, 9, 12) and damaged_after_step_1.steps < 14
    monkeypatch.undo()
    path.write_bytes(good)  # repaired
    run_in_process("train_dp.py", [*args, "--resume"])
    assert_same_model(out, reference)  # bitwise, and the same metrics


def test_a_bad_json_line_one_rank_meets_ends_every_rank_in_one_line_promptly(tokenizer_file, tmp_path):
    """Rank 1's sub-stream reaches a line that is no JSON after some steps; rank 0 reads on.
    The ranks agree before each step whether a feed failed (loader.next_step): every rank exits
    2 with the line, which rank 0 prints, at once, where rank 0 used to wait in the step's
    all-reduce for a rank that had left (gloo's traceback, or NCCL's timeout). Each file's first
    line carries 64 KiB of metadata, so that the repair (a line of the same length) leaves the
    shard's size and digest as listed: the run resumes from its last checkpoint and completes."""
    folder = tmp_path / "shards"
    for i in range(4):
        write(folder / f"j{i}.jsonl", documents(16, 10 + i), first_line_extra="x" * 65536)
    name, _ = dealt(folder, 9, 2)[1][1]  # sub-stream 1's second file: read after about 6 steps
    path = folder / name
    lines = path.read_bytes().split(b"\n")
    good_line = lines[12]  # after the 9 held out, were it the first file
    lines[12] = b'{"text": "cut' + b" " * (len(good_line) - 13)
    path.write_bytes(b"\n".join(lines))
    out = tmp_path / "run"
    args = ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file), *FAST_WITH_TOKENIZER, *MID_RUN,
            "--timeout-minutes", "10"]
    started = time.monotonic()
    proc = on_two_ranks(args, out, tmp_path)
    assert time.monotonic() - started < 120  # not --timeout-minutes 10
    line = line_of_every_rank(proc, tmp_path)
    assert line.startswith(f"error: cannot read shard {path}: line 13: JSON parse error"), line
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] in (3, 6, 9, 12)
    lines[12] = good_line
    path.write_bytes(b"\n".join(lines))  # repaired
    run_script("train_ddp.py", [*args, "--out-dir", str(out), "--resume"], nproc=2)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 14


def test_a_shard_rewritten_where_the_resume_reads_it_again_is_one_line_touching_nothing(tokenizer_file, tmp_path,
                                                                                        capsys):
    """A document a sub-stream read before its checkpoint, in the piece it is in, rewritten at
    the same size past the shard's first 64 KiB (each file's first line carries 64 KiB of
    metadata): the shards' size and digest pass, and the resume reads that document again to
    reach its cursor, where its digest no longer chains (training/stream/integrity.py): one
    line naming the shard and the cursor's line, exit 2, nothing written."""
    folder = tmp_path / "shards"
    for i in range(4):
        write(folder / f"j{i}.jsonl", documents(16, 10 + i), first_line_extra="x" * 65536)
    out = tmp_path / "run"
    args = ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file), *FAST_WITH_TOKENIZER, *MID_RUN]
    run_in_process("train_dp.py", [*args, "--stop-at-step", "3", "--out-dir", str(out)])
    capsys.readouterr()  # its progress
    states = torch.load(out / "checkpoint.pt", weights_only=True)["stream"]["states"]
    pieces = dealt(folder, 9, 2)
    first_trained = {name: 9 if name == "j0.jsonl" else 0 for name in ("j0.jsonl", "j1.jsonl", "j2.jsonl", "j3.jsonl")}
    stream, cursor = next((s, state["cursor"]) for s, state in states.items()
                          if state["cursor"]["row"] > first_trained[pieces[s][state["cursor"]["piece"]][0]] + 1)
    path = folder / pieces[stream][cursor["piece"]][0]
    lines = path.read_bytes().split(b"\n")
    read_line = cursor["row"] - 1  # read whole before the checkpoint (and past the file's first 64 KiB)
    at = lines[read_line].index(b'"text": "') + 9
    lines[read_line] = lines[read_line][:at] + lines[read_line][at:at + 1].upper() + lines[read_line][at + 1:]
    path.write_bytes(b"\n".join(lines))
    refused_in_process("train_dp.py", [*args, "--resume"], out,
                       f"error: shard {path}, line {cursor['row'] + 1}: the documents before it differ from those the "
                       "run read there: the shard was rewritten since the run read it", capsys)


def test_a_piece_another_sub_stream_read_before_a_resume_is_checked_when_read_again(tokenizer_file, tmp_path,
                                                                                    capsys):
    """Eight shards of 4 documents (an epoch of about 5 steps), stopped at step 6: a shard one
    sub-stream read whole, which the other reads after the resume in the next epoch, is
    rewritten at the same size past its first 64 KiB. The resume starts (nothing it reads
    there holds the change), and the other sub-stream, given every sub-stream's digests by the
    checkpoint, stops the run in one line as it reaches the shard, exit 2, before any of its
    new text is trained on."""
    folder = tmp_path / "shards"
    for i in range(8):
        write(folder / f"j{i}.jsonl", documents(4, 10 + i), first_line_extra="x" * 65536)
    out = tmp_path / "run"
    args = ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file), *FAST_WITH_TOKENIZER, *MID_RUN,
            "--out-dir", str(out)]
    run_in_process("train_dp.py", [*args, "--stop-at-step", "6"])
    capsys.readouterr()
    states = torch.load(out / "checkpoint.pt", weights_only=True)["stream"]["states"]
    found = shards.find_shards(str(folder), "text")  # one piece a file, in name order
    _, held_out = holdout.validation_documents(str(folder), found, "text", 9)
    sizes = held_out.training_sizes(shards.piece_sizes(found))
    cursors = {s: (state["cursor"]["epoch"], state["cursor"]["piece"]) for s, state in states.items()}
    ahead = {s: order.deal(sizes, 2, 1337, epoch)[s][at + 1:] + order.deal(sizes, 2, 1337, epoch + 1)[s]
             for s, (epoch, at) in cursors.items()}  # what each reads after its piece in progress
    in_progress = {(order.deal(sizes, 2, 1337, epoch)[s] + [None])[at] for s, (epoch, at) in cursors.items()}
    read_by = {piece: s for s, state in states.items() for piece in state["read"][:, 0].tolist()}
    piece = next(p for s in (0, 1) for p in ahead[s]  # read again neither at the resume nor by 1 - s itself
                 if read_by.get(p) == 1 - s and p > held_out.piece and p not in ahead[1 - s] + list(in_progress))
    path = folder / found[piece].name
    lines = path.read_bytes().split(b"\n")
    at = lines[2].index(b'"text": "') + 9
    lines[2] = lines[2][:at] + lines[2][at:at + 1].upper() + lines[2][at + 1:]
    path.write_bytes(b"\n".join(lines))
    assert script_in_process("train_dp.py", [*args, "--resume"]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: shard {path}: its documents differ from those the run read there: the shard was rewritten since the "
        "run read it. Restore it as the run read it, or start a new run")
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] in (6, 9, 12)  # stopped before step 14


def test_a_json_lines_shard_cut_short_while_it_is_read_stops_the_run_in_one_line(tokenizer_file, tmp_path,
                                                                                monkeypatch, capsys):
    """After step 1 both shards are cut to their first 40 lines, under the sub-streams reading
    them (one each, a few lines in): where the pieces used to end there without a word and the
    run trained on, it ends in one line naming the file and the line after the cut, exit 2."""
    folder = tmp_path / "shards"
    for i in range(2):
        write(folder / f"j{i}.jsonl", documents(400, 20 + i, words=(30, 60)))

    def cut_after_step_1(*args, real_step=build.AdamW.step, **kwargs):
        cut_after_step_1.steps += 1
        if cut_after_step_1.steps == 1:
            for path in folder.iterdir():
                path.write_bytes(b"".join(line + b"\n" for line in path.read_bytes().split(b"\n")[:40]))
        return real_step(*args, **kwargs)
    cut_after_step_1.steps = 0
    monkeypatch.setattr(build.AdamW, "step", cut_after_step_1)
    args = ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file), *FAST_WITH_TOKENIZER, *MID_RUN,
            "--max-steps", "400", "--save-every", "1000", "--out-dir", str(tmp_path / "run")]
    assert script_in_process("train_dp.py", args) == 2
    line = error_line(capsys.readouterr().err)
    assert re.fullmatch(rf"error: cannot read shard {re.escape(str(folder))}/j[01]\.jsonl: line 41: the file ends at "
                        r"byte [\d,]+, where it held [\d,]+ bytes when listed: it changed during the run", line), line


# ---------------------------------------------------------------------------------------
# The corpus's edge cases


@pytest.fixture
def trained_rows(monkeypatch):
    """Every row the model trains on (its forwards with gradients: not evaluation's), as the
    window it holds: its tokens, [BOT] to the last, without padding."""
    rows, real_forward = [], LlamaForPretraining.forward

    def recording(self, input_ids, targets=None, *args, **kwargs):
        if torch.is_grad_enabled():
            for x, y in zip(input_ids, targets):
                n = int((y != IGNORE_INDEX).sum())
                rows.append((*x[:n].tolist(), int(y[n - 1])))
        return real_forward(self, input_ids, targets, *args, **kwargs)
    monkeypatch.setattr(LlamaForPretraining, "forward", recording)
    return rows


def windows_of(texts: list[str], tokenizer_file) -> list[tuple]:
    """Each document's windows as the map-style path cuts them (data.document_windows)."""
    tokenizer = data.text_only(tokenized.load_tokenizer(str(tokenizer_file)))
    exact = data.clip_is_exact(tokenizer)
    specials = data.special_ids(tokenizer)
    return [tuple(w.tolist()) for text in texts
            for w in data.document_windows(text, tokenizer, 32, exact, specials=specials)]


def test_the_corpus_edge_cases_train_every_window_once_an_epoch(tmp_path, tokenizer_file, trained_rows):
    """One sub-stream over shards of every kind and edge: a parquet shard whose last row group
    ends in a document, then the next shard; an empty .jsonl (no row) and an empty parquet
    (one row group of none); a parquet with an empty row group between two; a shard of one
    document; a document of about 20 windows in a row group of 2 rows; a .jsonl.gz in a folder
    below. The first 2 documents are held out; the rest hold a multiple of --batch-size windows,
    and the run is two epochs long: each epoch's steps train each window of the training
    documents exactly once (the epochs deal the pieces in other orders)."""
    folder = tmp_path / "shards"
    texts = {"a.parquet": documents(8, 20), "b.jsonl": [], "c.parquet": [], "e.jsonl": documents(1, 21),
             "f.parquet": [*documents(1, 25, words=(300, 300)), *documents(3, 22)], "g/h.jsonl.gz": documents(5, 23)}
    write(folder / "a.parquet", texts["a.parquet"], row_group_size=4)
    (folder / "b.jsonl").write_bytes(b"")
    write(folder / "c.parquet", [])
    texts["d.parquet"] = documents(4, 24)
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(folder / "d.parquet", schema) as writer:
        for part in (texts["d.parquet"][:2], [], texts["d.parquet"][2:]):
            writer.write_table(pa.table({"text": pa.array(part, pa.string())}))
    write(folder / "e.jsonl", texts["e.jsonl"])
    write(folder / "f.parquet", texts["f.parquet"], row_group_size=2)
    in_shard_order = [text for name in sorted(texts) for text in texts[name]]
    held_out = 2
    while len(windows_of(in_shard_order[held_out:], tokenizer_file)) % 8:  # one-window documents to round it off
        texts["g/h.jsonl.gz"].append(documents(1, len(in_shard_order), words=(3, 5))[0])
        in_shard_order.append(texts["g/h.jsonl.gz"][-1])
    write(folder / "g" / "h.jsonl.gz", texts["g/h.jsonl.gz"])
    found = shards.find_shards(str(folder), "text")
    assert [(s.name, s.pieces) for s in found if s.kind == "parquet"] == \
        [("a.parquet", (4, 4)), ("c.parquet", (0,)), ("d.parquet", (2, 0, 2)), ("f.parquet", (2, 2))]
    expected = Counter(windows_of(in_shard_order[held_out:], tokenizer_file))
    assert len(windows_of(texts["f.parquet"][:1], tokenizer_file)) >= 15  # the long document
    assert max(expected.values()) == 1  # a window trained twice, another never, would show
    steps = sum(expected.values()) // 8
    run_in_process("train_dp.py", ["--stream", "--dataset", str(folder), "--tokenizer", str(tokenizer_file),
                                   *FAST_WITH_TOKENIZER, "--sub-streams", "1", "--val-docs", str(held_out),
                                   "--max-steps", str(2 * steps), "--out-dir", str(tmp_path / "run")])
    assert len(trained_rows) == 2 * steps * 8
    first, second = trained_rows[:steps * 8], trained_rows[steps * 8:]
    assert Counter(first) == expected and Counter(second) == expected
    assert first != second  # epoch 1 reads the pieces in another order


# ---------------------------------------------------------------------------------------
# The map-style run's model


def test_a_streamed_run_trains_the_map_style_runs_model_on_the_same_windows_in_the_same_order(tmp_path, monkeypatch):
    """The Done-when's "same windows in the same order": the map-style run shuffles its windows
    each epoch (ResumableRandomSampler) and a stream reads documents in the order of its
    pieces, so their orders differ by design; the test makes them agree, and changes nothing
    else of either path. The map-style side: today's train_dp.py on a .jsonl corpus, its
    sampler's permutation replaced by the identity (its windows in document order), its BPE
    trained and its documents held out as always (split_train_val's seeded shuffle). The
    streamed side: one sub-stream (--sub-streams 1), padded, over one parquet shard of one row
    group that holds the same documents, the map-style run's held-out ones first (the stream
    holds out the first --val-docs) and then its training ones in its order. Both then train
    the same windows, padded alike, in the same batches: the same BPE, the same logged losses,
    gradient norms, token counts and val losses, and the same weights, bitwise. (Per-window
    losses of a shuffled run would say less: the same loss of a window under the same weights,
    not the same training.)"""
    texts = documents(120, 30)
    map_corpus = tmp_path / "corpus.jsonl"
    map_corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train, val = corpus.split_train_val(corpus.load_corpus(str(map_corpus), None, None, "text"), 9, 1337)
    stream_folder = tmp_path / "shards"
    write(stream_folder / "s.parquet", [*val["text"], *train["text"]])
    with monkeypatch.context() as patched:
        patched.setattr(data.ResumableRandomSampler, "permutation", lambda self: torch.arange(self.n))
        run_in_process("train_dp.py", ["--dataset", str(map_corpus), *FAST, "--out-dir", str(tmp_path / "map")])
    run_in_process("train_dp.py", ["--stream", "--dataset", str(stream_folder), *FAST, "--sub-streams", "1",
                                   "--out-dir", str(tmp_path / "stream")])
    assert (tmp_path / "stream" / "tokenizer.json").read_text() == (tmp_path / "map" / "tokenizer.json").read_text()
    steps = [row for row in metrics(tmp_path / "stream") if row["step"] > 0]
    assert without_speed(steps) == without_speed([row for row in metrics(tmp_path / "map") if row["step"] > 0])
    assert_same_weights(tmp_path / "stream", tmp_path / "map")  # bitwise
