"""Bad input ends with one clear line on stderr and exit status 2, before anything in the
output folder is created or overwritten. Most cases run a script's main() in this process
(refused_in_process), as `python SCRIPT` would; a few run it as a subprocess, as a user does."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (FAST, FAST_WITH_TOKENIZER, MODEL, REPO, assert_same_weights, launch_env, run_script, script_in_process,
                      train)
from training import config
from training.config import TrainConfig
from training.errors import UsageError


def snapshot(folder):
    """Every file under folder with its modification time and a hash of its bytes, and every
    folder: equal snapshots mean nothing was created (not even an empty folder), rewritten
    or changed."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            if p.is_file() else "folder" for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(runs):
    return runs("dp", "train_dp.py")


@pytest.fixture
def plain_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["some text to learn from"] * 10,
                                  trainers.BpeTrainer(vocab_size=280, show_progress=False))
    tokenizer.save(str(tmp_path / "plain.json"))
    return tmp_path / "plain.json"


def refused_in_process(script, args, out_dir, message, capsys):
    """check_refused, faster: `python SCRIPT` in this process (a world of one for the torchrun
    scripts), through the same entry point."""
    before = snapshot(out_dir)
    status = script_in_process(script, [*args, "--out-dir", str(out_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert snapshot(out_dir) == before  # nothing created, nothing overwritten


def check_refused(script, args, out_dir, message, nproc=0, timeout=600):
    before = snapshot(out_dir) if out_dir.exists() else None
    proc = run_script(script, [*args, "--out-dir", str(out_dir)], nproc=nproc, check=False, timeout=timeout)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    after = snapshot(out_dir) if out_dir.exists() else None
    assert after == before  # nothing created, nothing overwritten


# (case id, script, extra args; "{corpus}" etc. are filled in below, expected message)
FRESH_RUN_CASES = [
    ("batch-not-divisible", "train_ddp.py", ["--grad-accum", "3"], "not divisible by world size 1 x --grad-accum 3"),
    ("batch-not-divisible-dp", "train_dp.py", ["--batch-size", "10", "--grad-accum", "4"], "not divisible"),
    ("seq-len-above-positions", "train_dp.py", ["--seq-len", "4096"], "exceeds the debug model's 1024 positions"),
    ("missing-dataset", "train_dp.py", ["--dataset", "no/such/file.txt"], "not found: no/such/file.txt"),
    ("empty-dataset", "train_dp.py", ["--dataset", "{empty}"], "has no non-empty documents"),
    ("unknown-text-column", "train_ddp.py", ["--dataset", "{jsonl}", "--text-column", "body"],
     "has no column 'body' (columns: text)"),
    ("tokenizer-without-special-tokens", "train_dp.py", ["--tokenizer", "{plain_tokenizer}"],
     "lacks the special tokens [PAD], [BOT], [EOT]"),
    ("vocab-size-with-tokenizer", "train_dp.py", ["--tokenizer", "{plain_tokenizer}", "--vocab-size", "500"],
     "--tokenizer brings its own"),
    ("unknown-preset", "train_dp.py", ["--model", "huge"], "invalid choice: 'huge'"),
    ("zero-lr", "train_dp.py", ["--lr", "0"], "--lr must be a positive number"),
    ("zero-steps", "train_ddp.py", ["--max-steps", "0"], "--max-steps must be at least 1"),
    ("too-few-windows", "train_dp.py", ["--batch-size", "4096"], "fewer than one --batch-size of 4096"),
    ("resume-without-checkpoint", "train_dp.py", ["--resume"], "nothing to resume"),
    ("text-column-of-numbers", "train_dp.py", ["--dataset", "{numbers}"], "column 'text' of dataset"),
    ("text-column-of-lists", "train_ddp.py", ["--dataset", "{lists}"], "not text"),
    ("text-column-of-objects", "train_dp.py", ["--dataset", "{nested}", "--text-column", "meta"],
     "column 'meta' of dataset"),
    ("wordlevel-tokenizer-without-unk", "train_dp.py", ["--tokenizer", "{wordlevel}"],
     "is a WordLevel tokenizer without its unknown token ('[UNK]' is not in its vocabulary)"),
    ("tokenizer-with-a-gap-in-its-ids", "train_dp.py", ["--tokenizer", "{gap}"],  # was an IndexError at step 1
     "has 5 tokens but ids up to 450: a tokenizer whose ids have gaps is not supported"),
    ("tokenizer-with-a-huge-id", "train_fsdp.py", ["--tokenizer", "{huge_id}"],  # was minutes and gigabytes
     "has 5 tokens but ids up to 10,000,000"),
]


def bad_file(name: str, folder) -> str:
    """One of the bad inputs FRESH_RUN_CASES names, written into folder (only the one a case
    uses: a tokenizer with an id of 10**9 took 1.7 s to save)."""
    documents = {"empty": "", "jsonl": json.dumps({"text": "a document"}) + "\n",
                 "numbers": json.dumps({"text": 5}) + "\n", "lists": json.dumps({"text": ["a", "b"]}) + "\n",
                 "nested": json.dumps({"text": "x", "meta": {"lang": "en"}}) + "\n"}
    if name in documents:
        path = folder / f"{name}.{'txt' if name == 'empty' else 'jsonl'}"
        path.write_text(documents[name])
        return str(path)
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[PAD]": 0, "[BOT]": 1, "[EOT]": 2, "the": 3} if name == "wordlevel" else \
        {"[PAD]": 0, "[BOT]": 1, "[EOT]": 2, "[UNK]": 3, "the": {"gap": 450, "huge_id": 10**7}[name]}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / f"{name}.json"))
    return str(folder / f"{name}.json")


@pytest.mark.parametrize("case, script, extra, message", FRESH_RUN_CASES, ids=[c[0] for c in FRESH_RUN_CASES])
def test_bad_invocation_of_a_new_run(tmp_path, corpus, plain_tokenizer, case, script, extra, message, monkeypatch,
                                     capsys):
    fill = {a: str(plain_tokenizer) if a == "{plain_tokenizer}" else bad_file(a[1:-1], tmp_path)
            for a in extra if a.startswith("{")}
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")  # must survive untouched
    fast = FAST_WITH_TOKENIZER if "--tokenizer" in extra else FAST
    args = ["--dataset", str(corpus), *fast, *[fill.get(a, a) for a in extra]]
    refused_in_process(script, args, out, message, capsys)  # the subprocess smoke tests are below


RESUME_CASES = [
    ("different-model", ["--resume", "--model", "article", "--seq-len", "32"],
     "--model was 'debug' in the checkpoint's run, now 'article'"),
    ("different-seq-len", ["--resume", "--seq-len", "64"], "--seq-len was 32 in the checkpoint's run, now 64"),
    ("different-batch", ["--resume", "--batch-size", "16"], "--batch-size was 8 in the checkpoint's run, now 16"),
    ("different-lr", ["--resume", "--lr", "0.002"], "--lr was 0.001"),
    ("new-run-over-old-one", [], "already holds a run"),
    ("corrupt-checkpoint", ["--resume"], "cannot load checkpoint"),
    ("not-a-checkpoint", ["--resume"], "is not a checkpoint of this trainer"),
]


@pytest.mark.parametrize("case, extra, message", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_bad_invocation_against_an_existing_run(tmp_path, corpus, finished_run, case, extra, message, monkeypatch,
                                                capsys):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    if case == "corrupt-checkpoint":  # every checkpoint torn: nothing to fall back to
        for ckpt in out.glob("checkpoint*.pt"):
            ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    if case == "not-a-checkpoint":  # some other program's file, and no other checkpoint
        import torch
        for ckpt in out.glob("checkpoint-*.pt"):
            ckpt.unlink()
        torch.save({"weights": torch.zeros(2)}, out / "checkpoint.pt")
    script = "train_ddp.py" if case in ("corrupt-checkpoint", "different-batch") else "train_dp.py"
    refused_in_process(script, ["--dataset", str(corpus), *FAST, *extra], out, message, capsys)


@pytest.mark.parametrize("change, message", [
    ("append a line", "(241 documents, was 240)"),
    ("swap two lines", "(the same number of documents (240), but their text or order differs)"),
])
def test_a_resume_refuses_data_that_changed(tmp_path, corpus, finished_run, change, message, capsys):
    """A changed corpus redraws the held-out split: former validation documents would be
    trained on. The fingerprint of what was read, not the path, decides."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    lines = corpus.read_text().splitlines()
    lines = lines + ["one more document"] if change == "append a line" else [lines[1], lines[0], *lines[2:]]
    changed = tmp_path / corpus.name
    changed.write_text("\n".join(lines) + "\n")
    refused_in_process("train_dp.py", ["--dataset", str(changed), *FAST, "--resume"], out,
                       f"--dataset {changed} is not the data this run trained on {message}: resume with that data",
                       capsys)


def test_leftovers_of_a_run_that_never_saved_a_checkpoint_are_not_overwritten(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 10}\n')
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *FAST], out,
                       "holds files of a run that never saved a checkpoint (tokenizer.json, metrics.jsonl)", capsys)


def test_an_impossible_out_dir_is_refused_before_any_data_is_loaded(tmp_path, capsys):
    """--out-dir under a regular file: refused first, before the (empty, so failing) dataset is read."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "README.md").write_text("a file")
    out = tmp_path / "README.md" / "sub"
    assert script_in_process("train_dp.py", ["--dataset", str(tmp_path / "empty.txt"), *FAST, "--out-dir", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --out-dir {out}: {tmp_path / 'README.md'} is a file, not a folder\n"


def test_an_out_dir_that_is_a_dangling_link_is_refused_before_any_data_is_loaded(tmp_path, corpus, capsys):
    """A link to a folder that does not exist (a scratch disk not mounted): one line that says
    so, not a FileExistsError traceback after the data was prepared; the link stays as it was."""
    (tmp_path / "out").symlink_to(tmp_path / "missing")
    for out in (tmp_path / "out", tmp_path / "out" / "run"):
        assert script_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(out)]) == 2
        assert capsys.readouterr().err == (f"error: --out-dir {out}: {tmp_path / 'out'} is a link to "
                                           f"{tmp_path / 'missing'}, which does not exist; create that folder "
                                           "or choose another\n")
    assert (tmp_path / "out").is_symlink() and not (tmp_path / "missing").exists()


def test_an_out_dir_inside_the_dataset_folder_is_refused(tmp_path, corpus):
    """The run's own .json/.jsonl files would be read back as data, and no resume could work.
    (A subprocess, as a user runs it: one of the smoke tests of the whole path.)"""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "corpus.txt").write_text(corpus.read_text())
    check_refused("train_dp.py", ["--dataset", str(data_dir), *FAST], data_dir / "run1",
                  "is inside the --dataset folder")
    assert sorted(p.name for p in data_dir.iterdir()) == ["corpus.txt"]  # no run1/ either


def test_out_dir_that_is_a_file_is_refused(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    out.write_text("I am a file")
    assert script_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --out-dir {out} exists and is not a folder\n"
    assert out.read_text() == "I am a file"


def test_an_error_under_torchrun_is_printed_once_and_ends_every_rank(tmp_path, corpus):
    """Local rank 0 meets the error while loading; rank 1 is waiting for it. Both must exit
    with the message (rank 0 prints it) instead of rank 1 waiting forever."""
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    from test_failures import exit_codes, fault_env
    out = tmp_path / "out"
    proc = run_script("train_ddp.py", ["--dataset", str(tmp_path / "c.jsonl"), *FAST, "--text-column", "body",
                                       "--out-dir", str(out)], nproc=2, check=False, timeout=120,
                      wrapper="tests/inject_fault.py", env=fault_env(tmp_path, "none", step=0))
    assert exit_codes(tmp_path) == {"exit-rank0": "2", "exit-rank1": "2"}  # every worker: exit 2
    assert proc.returncode == 1  # torchrun's own status when its workers failed
    # our line comes first, before torchrun's report; and only once
    assert proc.stderr.splitlines()[0] == f"error: dataset {tmp_path / 'c.jsonl'} has no column 'body' (columns: text)"
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == proc.stderr.splitlines()[:1]
    # torchrun then reports the failed workers with a traceback of its own launcher, but no
    # worker raised: no frame of our code appears, and its report gives our line as the cause
    # (from the error file each worker leaves), not a link to its docs
    assert f"traceback : error: dataset {tmp_path / 'c.jsonl'} has no column 'body'" in proc.stderr
    assert "To enable traceback see" not in proc.stderr
    for ours in ("train_ddp.py", "training", "data.py", "model.py"):  # training: any module of the package
        assert f'File "{REPO / ours}' not in proc.stderr
    assert not out.exists()


# Every flag that takes a value, given a bad one. These run in-process through the same
# entry point as `python train_ddp.py` (stopping.exit_on_usage_error(main)), so there are many and they are fast.
BAD_FLAGS = [
    ("--max-steps", "0", "--max-steps must be at least 1"),
    ("--max-steps", "-5", "--max-steps must be at least 1"),
    ("--max-steps", "ten", "argument --max-steps: invalid int value: 'ten'"),
    ("--batch-size", "0", "--batch-size must be at least 1"),
    ("--batch-size", "-8", "--batch-size must be at least 1"),
    ("--grad-accum", "0", "--grad-accum must be at least 1"),
    ("--epochs", "0", "--epochs must be at least 1"),
    ("--seq-len", "0", "--seq-len must be at least 1"),
    ("--lr", "0", "--lr must be a positive number"),
    ("--lr", "-0.001", "--lr must be a positive number"),
    ("--lr", "nan", "--lr must be a positive number"),
    ("--lr", "fast", "argument --lr: invalid float value: 'fast'"),
    ("--warmup-steps", "-1", "--warmup-steps must be at least 0"),
    ("--weight-decay", "-0.1", "--weight-decay must be a non-negative number"),
    ("--grad-clip", "-1", "--grad-clip must be a non-negative number"),
    ("--grad-clip", "inf", "--grad-clip must be a non-negative number"),
    ("--seed", "abc", "argument --seed: invalid int value: 'abc'"),
    ("--save-every", "0", "--save-every must be at least 1"),
    ("--eval-every", "0", "--eval-every must be at least 1"),
    ("--log-every", "-2", "--log-every must be at least 1"),
    ("--stop-at-step", "0", "--stop-at-step must be at least 1"),
    ("--keep-checkpoints", "0", "--keep-checkpoints must be at least 1"),
    ("--val-docs", "0", "--val-docs must be at least 1"),
    ("--val-docs", "100000", "cannot hold out 100000 validation documents"),
    ("--vocab-size", "100", "--vocab-size must be at least 259"),
    ("--model", "huge", "argument --model: invalid choice: 'huge'"),
    ("--dtype", "fp16", "argument --dtype: invalid choice: 'fp16'"),
    ("--seq-len", "2048", "exceeds the debug model's 1024 positions"),
    ("--dataset", "{missing}", "dataset file or folder not found"),
    ("--dataset", "{garbage_parquet}", "Parquet magic bytes not found"),
    ("--dataset", "{bad_jsonl}", "JSON parse error"),
    ("--dataset-config", "sample-10BT", "apply to Hub datasets only"),
    ("--split", "train", "apply to Hub datasets only"),
    ("--text-column", "content", "has no column 'content'"),
    ("--tokenizer", "{missing}", "cannot read tokenizer"),
    ("--out-dir", "{a_file}", "exists and is not a folder"),
    ("--out-dir", "", "--out-dir is empty (an unset variable in a job script?)"),
    ("--dataset", "{half_without_text}", "2 of 4 documents of dataset"),
    ("--backend", "mpi", "argument --backend: invalid choice: 'mpi'"),
    ("--timeout-minutes", "0", "--timeout-minutes must be a positive number"),
    ("--data-timeout-minutes", "-1", "--data-timeout-minutes must be a positive number"),
    ("--seed", "-5", "--seed must be at least 0, got -5"),
    ("--seed", "99999999999999999999", "--seed must be at most 9,223,372,036,854,775,807, got 99,999,999,999,999,999,999"),
    ("--max-steps", str(10**22), "--max-steps must be at most 1,000,000,000,000, got 10,000,000,000,000,000,000,000"),
    ("--max-steps", str(2**63 - 1), "--max-steps must be at most 1,000,000,000,000, got 9,223,372,036,854,775,807"),
    ("--timeout-minutes", "1e308", "--timeout-minutes must be at most 1e+06, got 1e+308"),
    pytest.param("--backend", "nccl", "--backend nccl needs CUDA GPUs",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL works on this machine")),
]


@pytest.mark.parametrize("flag, value, message", BAD_FLAGS,
                         ids=[f"{f}={v}" for f, v, _ in (getattr(c, "values", c) for c in BAD_FLAGS)])
def test_every_flag_rejects_a_bad_value(tmp_path, corpus, capsys, flag, value, message):
    (tmp_path / "garbage.parquet").write_bytes(b"this is not parquet")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    (tmp_path / "half.jsonl").write_text("".join(json.dumps({key: f"document {i}"}) + "\n"
                                                 for i, key in enumerate(["text", "content"] * 2)))
    (tmp_path / "a_file").write_text("precious")
    fill = {"{missing}": str(tmp_path / "missing.txt"), "{garbage_parquet}": str(tmp_path / "garbage.parquet"),
            "{bad_jsonl}": str(tmp_path / "bad.jsonl"), "{a_file}": str(tmp_path / "a_file"),
            "{half_without_text}": str(tmp_path / "half.jsonl")}
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    before = snapshot(tmp_path)
    fast = FAST_WITH_TOKENIZER if flag == "--tokenizer" else FAST
    # a world of one; every flag of train_dp.py is here too
    status = script_in_process("train_ddp.py", ["--dataset", str(corpus), *fast, "--out-dir", str(out), flag,
                                              fill.get(value, value)])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("script, args, message", [
    ("train_dp.py", ["--dataset", "missing.txt"], "dataset file or folder not found: missing.txt"),
    ("tools/generate.py", ["nowhere"], "nowhere is not the output folder of a training run"),
])
def test_a_stray_rank_variable_outside_torchrun_hides_no_error(tmp_path, script, args, message, monkeypatch, capsys):
    """RANK=1 left in a shell (or set by another tool) is not a job: the error still shows."""
    monkeypatch.setenv("RANK", "1")
    assert script_in_process(script, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("script, variables", [("train_ddp.py", {"WORLD_SIZE": "2"}),
                                               ("train_fsdp.py", {"RANK": "0"}),
                                               ("train_fsdp.py", {"RANK": "0", "WORLD_SIZE": "2"})])
def test_rank_variables_without_torchrun_are_one_line_not_a_hang(tmp_path, corpus, script, variables):
    """`WORLD_SIZE=2 python train_ddp.py` would wait 30 minutes for a second rank that nothing
    starts; RANK without MASTER_ADDR was a traceback. Both are one line, within seconds
    (a subprocess: the hang, were it back, ends at its timeout), before anything is written."""
    out = tmp_path / "out"
    proc = run_script(script, ["--dataset", str(corpus), *FAST, "--out-dir", str(out)], env=variables, check=False,
                      timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: RANK={variables.get('RANK', '(unset)')} WORLD_SIZE={variables.get('WORLD_SIZE', '(unset)')} without "
        "MASTER_ADDR and MASTER_PORT: start "
        "the ranks with torchrun, or unset RANK and WORLD_SIZE to train as one process"]
    assert not out.exists()


@pytest.mark.parametrize("script, variables, message", [
    ("train_ddp.py", {"RANK": "abc", "WORLD_SIZE": "2"}, "RANK=abc is not a whole number"),
    ("train_fsdp.py", {"RANK": "0", "WORLD_SIZE": "1_0"}, "WORLD_SIZE=1_0 is not a whole number"),  # int() says 10
    ("train_ddp.py", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "junk"}, "LOCAL_RANK=junk is not a whole number"),
    ("train_ddp.py", {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "\u00b2"},
     "MASTER_PORT=\u00b2 is not a whole number"),  # a digit to str.isdigit, not to int()
    ("train_ddp.py", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"},
     "MASTER_PORT=0: rank 0 would listen on a port of its choosing"),
    ("train_ddp.py", {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                      "TORCHELASTIC_RUN_ID": "x"}, "RANK=3 is not a rank of WORLD_SIZE=2"),  # said by rank 3 itself
    # train_dp.py is one process: started several times by torchrun, they would train into one folder
    ("train_dp.py", {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     "train_dp.py is one process, and torchrun started 2"),
    ("train_dp.py", {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "junk", "TORCHELASTIC_RUN_ID": "x"},
     "LOCAL_WORLD_SIZE=junk is not a whole number"),
])
def test_launch_variables_that_are_not_torchruns_are_one_line_from_the_rank_that_has_them(
        tmp_path, corpus, monkeypatch, capsys, script, variables, message):
    """Set by hand in a job script, RANK, WORLD_SIZE and the rest were int()'s traceback, or
    an error nobody printed (a rank other than 0 keeps quiet under torchrun). Each rank checks
    its own, before anything is written, and says what it found."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert script_in_process(script, ["--dataset", str(corpus), *FAST, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()


def test_ranks_started_by_hand_with_different_world_sizes_both_end_with_one_line_within_the_timeout(tmp_path, corpus):
    """RANK=0 WORLD_SIZE=2 and RANK=1 WORLD_SIZE=3: the second waits for a rank 2 that never
    comes, and the first, which met rank 1, went on to make the data-preparation group, which
    waited for it a day (--data-timeout-minutes), deaf to SIGTERM. Every rank now meets all the
    others within --timeout-minutes first, and each ends with one line, having written nothing."""
    import socket
    with socket.socket() as s:  # a free port, once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    args = ["--dataset", str(corpus), *FAST, "--batch-size", "12", "--out-dir", str(out), "--timeout-minutes", "0.1"]
    procs = [subprocess.Popen([sys.executable, str(REPO / "train_ddp.py"), *args], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=launch_env({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": world_size,
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
             for rank, world_size in ((0, "2"), (1, "3"))]
    try:
        ended = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, (_, stderr)) in enumerate(zip(procs, ended)):
        ours = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and "Traceback" not in stderr, stderr
        assert len(ours) == 1 and ours[0].startswith(f"error: rank {rank} of WORLD_SIZE={2 + rank} could not meet "
                                                     "the others (MASTER_ADDR=127.0.0.1"), stderr
    assert not out.exists()


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_that_saved_into_the_folder_while_this_one_prepared_its_data_stops_it(runs, tmp_path, monkeypatch,
                                                                                 capsys, resume):
    """Two runs started into one folder at once both find it free (or holding the same
    checkpoint) and prepare their data before either takes the lock. The one that comes second
    looks again once it holds the lock, sees what the other saved meanwhile, and stops without
    writing: a new run finds a run there, a resumed one finds its checkpoint replaced."""
    from training import run_data
    finished = runs("dp", "train_dp.py")
    out = runs.copy(finished, tmp_path / "run") if resume else tmp_path / "run"
    real_make_dataset, tokenized = run_data.make_dataset, []

    def the_other_run_saves(*args, **kwargs):  # while this run tokenizes its training documents (the first call)
        if not tokenized and resume:  # the other run saved a newer checkpoint.pt (here: the same bytes, a new file)
            shutil.copy(out / "checkpoint.pt", out / "newer.tmp")
            os.replace(out / "newer.tmp", out / "checkpoint.pt")
        elif not tokenized:
            shutil.copytree(finished, out)
        tokenized.append(1)
        return real_make_dataset(*args, **kwargs)

    monkeypatch.setattr(run_data, "make_dataset", the_other_run_saves)
    args = ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), *(["--resume"] if resume else [])]
    assert script_in_process("train_dp.py", args) == 2
    message = (f"{out}/checkpoint.pt changed while this run prepared its data (another run saved into the folder): "
               "start again" if resume else f"{out} already holds a run")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert (out / "metrics.jsonl").read_bytes() == (finished / "metrics.jsonl").read_bytes()  # nothing written
    assert (out / "model.pt").read_bytes() == (finished / "model.pt").read_bytes()


def test_resuming_with_another_tokenizer_is_refused(runs, tmp_path, capsys):
    from training import corpus
    import data
    out = runs.copy(runs("dp", "train_dp.py"), tmp_path / "run")
    other = data.train_tokenizer(corpus.load_corpus(str(runs.corpus)), vocab_size=280)
    other.save(str(tmp_path / "other.json"))
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST_WITH_TOKENIZER, "--resume",
                                       "--tokenizer", str(tmp_path / "other.json")], out,
                       f"--tokenizer {tmp_path / 'other.json'} differs from the run's tokenizer.json", capsys)


def swap_special_token_ids(path):
    """tokenizer.json edited in place: two special tokens trade ids. The same size, the same
    tokens: every check but the fingerprint passes it."""
    import data
    spec = json.loads(path.read_text())
    first, second = (next(t for t in spec["added_tokens"] if t["content"] == name) for name in data.SPECIAL_TOKENS[:2])
    first["id"], second["id"] = second["id"], first["id"]
    vocab = spec["model"]["vocab"]
    vocab[first["content"]], vocab[second["content"]] = first["id"], second["id"]
    path.write_text(json.dumps(spec))


def test_resuming_with_the_runs_tokenizer_edited_is_refused(runs, tmp_path, capsys):
    """The run's own tokenizer.json, its special tokens' ids swapped: resumed, the model would
    go on training on other ids for the same text. config.json's fingerprint refuses it."""
    import data
    from training import tokenized
    out = runs.copy(runs("dp", "train_dp.py"), tmp_path / "run")
    before = tokenized.load_tokenizer(out / "tokenizer.json")
    swap_special_token_ids(out / "tokenizer.json")
    edited = tokenized.load_tokenizer(out / "tokenizer.json")
    assert edited.get_vocab_size() == before.get_vocab_size()
    assert edited.token_to_id(data.SPECIAL_TOKENS[0]) == before.token_to_id(data.SPECIAL_TOKENS[1])
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST_WITH_TOKENIZER, "--resume"], out,
                       f"{out / 'tokenizer.json'} is not the tokenizer its run was trained with", capsys)


def test_val_docs_is_compared_as_the_documents_it_holds_out(runs, tmp_path, capsys):
    """Without --val-docs a run holds out 1% of the corpus (240 documents: 2). Its checkpoint
    records 2, so a resume that says --val-docs 2 resumes it, and --val-docs 3 is refused. A
    checkpoint of an older run that recorded the default as None is read the same way."""
    val = FAST.index("--val-docs")
    default = ["--dataset", str(runs.corpus), *FAST[:val], *FAST[val + 2:], "--out-dir", str(tmp_path / "run")]
    out = tmp_path / "run"
    train("train_dp.py", [*default, "--stop-at-step", "2"])
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["train_config"]["val_docs"] == 2
    ckpt["train_config"]["val_docs"] = None  # as runs saved it before
    torch.save(ckpt, out / "checkpoint.pt")
    capsys.readouterr()
    refused_in_process("train_dp.py", [*default[:-2], "--val-docs", "3", "--resume"], out,
                       "--val-docs was 2 in the checkpoint's run, now 3: resume with the same value", capsys)
    train("train_dp.py", [*default, "--val-docs", "2", "--resume", "--stop-at-step", "4"])
    assert torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["step"] == 4


def test_a_checkpoint_of_clipped_documents_is_refused(finished_run, corpus, tmp_path, capsys):
    """Before documents were cut into windows, each was clipped to one row: a checkpoint of
    that version (no "framing" recorded) would resume at a position in other rows."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    for path in out.glob("checkpoint*.pt"):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        del ckpt["framing"]
        torch.save(ckpt, path)
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--resume"], out,
                       "was trained on documents clipped to one row each", capsys)


@pytest.mark.parametrize("extra, message", [
    (["--model", "article"], "its weights do not fit --model article with its 300-token vocabulary: "
                             "base_model.embed_tokens.weight is (300, 64) there, (300, 768) here"),
    (["--vocab-size", "512"], "--vocab-size 512: the weights of --init-from were trained with 300 tokens"),
    (["--tokenizer", "{tokenizer}"], "--init-from brings its own tokenizer"),
])
def test_init_from_refuses_weights_that_do_not_fit_and_flags_that_contradict_it(finished_run, corpus, tmp_path,
                                                                                 extra, message, capsys):
    fast = FAST_WITH_TOKENIZER
    extra = [str(finished_run / "tokenizer.json") if a == "{tokenizer}" else a for a in extra]
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *fast, "--init-from", str(finished_run), *extra],
                       tmp_path / "new", message, capsys)


def test_init_from_takes_a_vocab_size_that_is_the_weights_own(finished_run, corpus):
    """A job script that always passes --vocab-size, reused with --init-from a run of that vocabulary."""
    from training import config
    fast = FAST_WITH_TOKENIZER
    cfg = config.parse_args(["--dataset", str(corpus), *fast, "--init-from", str(finished_run), "--vocab-size",
                               "300"])
    assert cfg.tokenizer == str(finished_run / "tokenizer.json") and cfg.vocab_size is None


@pytest.mark.parametrize("again", [[], ["--init-from", "{source}"]], ids=["resume", "init-from-and-resume"])
def test_a_run_started_from_weights_resumes_as_its_stop_message_says(runs, finished_run, corpus, tmp_path, again):
    """Started with --init-from and stopped, it continues with --resume (its own tokenizer.json,
    whose vocabulary no --vocab-size gave), with or without the --init-from of its job script,
    and ends where the same run never stopped ends."""
    from test_training import warm_started
    fast = FAST_WITH_TOKENIZER
    args = ["--dataset", str(corpus), *fast]
    straight, half = warm_started(runs), runs.copy(warm_started(runs, "--stop-at-step", "4"), tmp_path / "half")
    again = [str(finished_run) if a == "{source}" else a for a in again]
    train("train_dp.py", [*args, *again, "--resume", "--out-dir", str(half)])
    assert_same_weights(half, straight)
    assert torch.load(half / "checkpoint.pt", weights_only=True)["train_config"]["vocab_size"] is None


TEXT_FLAGS = [f.name for f in dataclasses.fields(TrainConfig)
              if f.type in (str, "str", str | None, "str | None") and not f.metadata["argparse"].get("choices")]


@pytest.mark.parametrize("name", TEXT_FLAGS)
@pytest.mark.parametrize("value", ["", "  "])
def test_a_text_flag_given_empty_is_refused_not_taken_as_absent(name, value):
    """`--init-from "$UNSET"` in a job script: no flag that names a file, folder, column, project
    or run takes an empty value as "not given" (which would train from random weights, train
    a new tokenizer, or log nowhere)."""
    from training import config
    flag = "--" + name.replace("_", "-")
    with pytest.raises(UsageError, match=f"^{flag} is empty"):
        config.parse_args([flag, value], distributed=True)


def test_init_from_a_folder_without_weights_is_refused(corpus, tmp_path, capsys):
    fast = FAST_WITH_TOKENIZER
    (tmp_path / "empty").mkdir()
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *fast, "--init-from", str(tmp_path / "empty")],
                       tmp_path / "new", "not an output folder, a .pt file of one, a train_fsdp.py checkpoint "
                       "folder, or a Hugging Face model's folder", capsys)


def test_init_from_a_folder_whose_tokenizer_was_edited_is_refused(finished_run, corpus, tmp_path, capsys):
    """Its weights learned other ids for the same text: the new run would start from a model
    that reads its data wrong."""
    source = shutil.copytree(finished_run, tmp_path / "source")
    swap_special_token_ids(source / "tokenizer.json")
    fast = FAST_WITH_TOKENIZER
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *fast, "--init-from", str(source)], tmp_path / "new",
                       f"{source / 'tokenizer.json'} is not the tokenizer its run was trained with", capsys)


def test_init_from_is_ignored_with_a_warning_when_a_job_resumes(finished_run, corpus, capsys):
    """A job resubmitted with its arguments plus --resume: the checkpoint's weights win."""
    from training import config
    fast = FAST_WITH_TOKENIZER
    cfg = config.parse_args(["--dataset", str(corpus), *fast, "--init-from", str(finished_run), "--resume"])
    assert cfg.init_from is None and cfg.tokenizer is None
    assert capsys.readouterr().err == (f"warning: --init-from {finished_run} is ignored: --resume continues the run "
                                       "in --out-dir from its checkpoint\n")


def weights_folder(finished_run, folder, change=None, **save_options):
    """A copy of the run's config.json, tokenizer.json and model.pt, its weights changed by `change`."""
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(finished_run / name, folder / name)
    state = torch.load(finished_run / "model.pt", weights_only=True)
    if change:
        change(state)
    torch.save(state, folder / "model.pt", **save_options)
    return folder


@pytest.mark.parametrize("change", [
    lambda state: state["base_model.norm.weight"].fill_(float("nan")),
    lambda state: state["lm_head.weight"].__setitem__(0, float("inf")),
    lambda state: state.update({"base_model.norm.weight": state["base_model.norm.weight"].long()}),
], ids=["nan", "inf", "integers"])
def test_init_from_weights_that_no_run_can_start_from_is_refused_before_anything_is_written(
        finished_run, corpus, tmp_path, capsys, change):
    source = weights_folder(finished_run, tmp_path / "source", change)
    fast = FAST_WITH_TOKENIZER
    out = tmp_path / "new"
    out.mkdir()
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *fast, "--init-from", str(source)], out,
                       "is not finite floating point (NaN, inf or integers): no run can start from these weights",
                       capsys)


def test_init_from_a_sharded_checkpoint_whose_weights_are_not_finite_is_refused_before_anything_is_written(
        runs, tmp_path, capsys):
    """The same for a train_fsdp.py checkpoint folder, read by DCP into the model itself (its
    values are known only then, before the run writes its first file)."""
    import torch.distributed.checkpoint as dcp
    from training import build, config, sharded_checkpoint
    from test_fsdp import fsdp_two_ranks
    source = shutil.copytree(fsdp_two_ranks(runs), tmp_path / "source") / "checkpoint-00000008"
    model = build.model(config.parse_args(["--model", MODEL, "--vocab-size", "300", "--seq-len", "32"]), 300,
                        torch.float32)
    sharded_checkpoint.load_model(source, model)
    with torch.no_grad():
        model.base_model.norm.weight[3] = float("nan")
    for f in [*source.glob("*.distcp"), source / ".metadata"]:
        f.unlink()
    dcp.save({"model": model.state_dict()}, checkpoint_id=source, no_dist=True)
    out = tmp_path / "new"
    out.mkdir()
    refused_in_process("train_dp.py", ["--dataset", str(runs.corpus), *FAST_WITH_TOKENIZER, "--init-from", str(source)], out,
                       f"--init-from {source}: its weights are not all finite (NaN or inf)", capsys)


def test_init_from_weights_in_torchs_legacy_format_starts_there(finished_run, tmp_path):
    """torch.save(..., _use_new_zipfile_serialization=False) cannot be memory-mapped: it is read whole."""
    from training import weights
    source = weights_folder(finished_run, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    loaded = weights.weights_in(source / "model.pt")
    expected = torch.load(finished_run / "model.pt", weights_only=True)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_init_from_safetensors_beside_a_config_not_hugging_faces_is_one_line(corpus, tmp_path, capsys):
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"")
    fast = FAST_WITH_TOKENIZER
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *fast, "--init-from", str(export)], tmp_path / "new",
                       "holds safetensors, but its config.json is not a Hugging Face model's (it names no "
                       "model_type)", capsys)


def made_hostile(path, kind: str):
    """The file at path replaced by what someone with write access to the folder could put there."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # reading it would wait forever for a writer
    elif kind == "folder":
        path.mkdir()  # where the run writes its file, after training
    else:
        path.symlink_to("/dev/zero")  # reading it would never end


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
@pytest.mark.parametrize("name", ["metrics.jsonl", "tokenizer.json", "config.json", "checkpoint.pt"])
def test_a_run_file_that_is_a_fifo_a_device_or_a_folder_is_one_line_not_a_hang(finished_run, corpus, tmp_path, capsys,
                                                                               name, kind):
    """Read, a FIFO would block and a device never end; written (config.json, checkpoint.pt), a
    folder would fail the write after training: one line first, nothing touched."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    made_hostile(out / name, kind)
    refused_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--max-steps", "10", "--resume"], out,
                       f"{out / name} is not a regular file", capsys)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_tools_and_trackers_read_no_fifo_or_device(finished_run, tmp_path, capsys, kind):
    """generate.py's config.json; --wandb's run file; --dataset itself."""
    from training import metrics
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    made_hostile(out / "config.json", kind)
    assert script_in_process("tools/generate.py", [str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: model config {out / 'config.json'} is not a regular file")
    (out / "wandb-run.txt").write_text("abc 4\n")
    made_hostile(out / "wandb-run.txt", kind)
    sink = metrics.WandbSink.__new__(metrics.WandbSink)
    sink.state = out / "wandb-run.txt"
    with pytest.raises(UsageError, match="W&B run file .*wandb-run.txt is not a regular file"):  # said as what it is
        sink.read_state()
    data = tmp_path / "data.txt"
    data.write_text("x")
    made_hostile(data, kind)
    from training import corpus
    with pytest.raises(UsageError, match=f"dataset file {data} is not a regular file"):
        corpus.load_corpus(str(data))


def test_compile_where_dataparallel_drives_several_gpus_is_refused_before_anything_runs(tmp_path, monkeypatch,
                                                                                      capsys):
    """Compiled modules do not run under nn.DataParallel's replicas: train_dp.py on several GPUs
    with --compile is one line, exit 2, nothing written (two GPUs faked: only their count is
    asked, no CUDA context opened). On the CPU, and under torchrun, --compile stays allowed."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    refused_in_process("train_dp.py", ["--compile", *FAST, "--max-steps", "1"], tmp_path / "run",
                       "--compile does not work under nn.DataParallel (train_dp.py on several GPUs)", capsys)
    assert config.parse_args(["--compile", "--device", "cpu", "--out-dir", str(tmp_path / "cpu")]).compile
    assert config.parse_args(["--compile", "--out-dir", str(tmp_path / "ddp")], distributed=True).compile
