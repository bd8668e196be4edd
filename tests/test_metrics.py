"""What a run logs, and where users watch it: the health metrics of each row (grad_norm,
tokens_seen, data_wait_fraction, CUDA memory), TensorBoard and Weights & Biases, each
checked with the tool's own reader, resumed runs included."""

import itertools
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from training import build, config, metrics, run_data, tokenized
from conftest import FAST, FLOOR_MULTIPLE, assert_within, launch_env, run_script, script_in_process
from conftest import metrics as rows_of  # the rows of a run's metrics.jsonl (this module imports metrics.py)
from model import IGNORE_INDEX

ONE_STEP = ["--max-steps", "1"]


def training_windows(runs, out: Path, extra=()) -> tuple:
    """(the flags, the training dataset) of the run in `out`, made again here with its tokenizer."""
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST, *extra, "--out-dir", str(runs.root / "unused")])
    train_ds = run_data.Corpus(cfg).training_rows(tokenized.load_tokenizer(out / "tokenizer.json"))
    return cfg, train_ds


def first_step_gradients(runs, out: Path) -> list[torch.Tensor]:
    """The gradients of step 1, computed here without the training loop: the seeded initial
    weights, the first global batch of the sampler's permutation, the mean over its real targets."""
    cfg, train_ds = training_windows(runs, out)
    model = build.model(cfg, tokenized.load_tokenizer(out / "tokenizer.json").get_vocab_size(), torch.float32)
    sampler = data.ResumableRandomSampler(train_ds, cfg.seed)
    sampler.set_epoch(0)
    x, y = torch.utils.data.default_collate([train_ds[i] for i in itertools.islice(sampler, cfg.batch_size)])
    (model(x, y)[0].sum() / (y != IGNORE_INDEX).sum()).backward()
    return [p.grad for p in model.parameters()]


def test_grad_norm_is_the_norm_clipping_computes_under_one_process_ddp_and_fsdp(runs):
    """grad_norm is the gradient norm before clipping (the runs clip at 1.0; their first norm is
    above it), of the whole model: under FSDP the squares of every rank's shards, summed. A norm
    rounds apart from the losses: its floor here is the same gradients' norm computed in
    another order, each tensor as two halves (two shards), then combined."""
    logged = {name: next(r["grad_norm"] for r in rows_of(runs(name, script, ONE_STEP, nproc)) if "loss" in r)
              for name, script, nproc in [("dp_1step", "train_dp.py", 0), ("ddp2_1step", "train_ddp.py", 2),
                                          ("fsdp2_1step", "train_fsdp.py", 2)]}
    grads = first_step_gradients(runs, runs("dp_1step", "train_dp.py", ONE_STEP))
    plain = torch.nn.utils.get_total_norm(grads).item()  # what clip_grad_norm_ computes and returns
    halves = [half for g in grads for half in g.flatten().chunk(2)]
    floor = max(abs(torch.nn.utils.get_total_norm(halves).item() - plain) / plain, torch.finfo(torch.float32).eps)
    assert plain > 1.0  # clipping had work to do: a norm logged after it would be 1.0
    for name, norm in logged.items():
        assert_within(f"{name} grad_norm", abs(norm - plain) / plain, floor, FLOOR_MULTIPLE)


def test_tokens_seen_counts_every_real_target_since_the_run_began(runs):
    """tokens_seen at each row is the sum of the real targets of every global batch so far,
    counted here from the windows in the samplers' order. (A resumed run counts the steps
    before its checkpoint from that order too: the exact-resume tests of test_failures.py
    compare its every row, tokens_seen included, with an uninterrupted run's.)"""
    out = runs("dp", "train_dp.py")
    cfg, train_ds = training_windows(runs, out)
    sampler = data.ResumableRandomSampler(train_ds, cfg.seed)
    sampler.set_epoch(0)
    order = list(sampler)
    logged = [row for row in rows_of(out) if "loss" in row]
    assert len(logged) == 4 and logged[-1]["step"] * cfg.batch_size <= len(order)  # one epoch holds them
    for row in logged:
        windows = order[:row["step"] * cfg.batch_size]
        assert row["tokens_seen"] == sum(int((train_ds[i][1] != IGNORE_INDEX).sum()) for i in windows)
    assert train_ds.targets_before(8, cfg.batch_size, cfg.seed) == logged[-1]["tokens_seen"]


def test_a_resume_counts_the_tokens_of_the_steps_before_it_in_every_epoch(runs):
    """What a resumed run starts tokens_seen from (targets_before, counted from the samplers'
    permutations) equals what the straight run summed step by step, in both of its epochs."""
    epochs = ["--batch-size", "64", "--max-steps", "12", "--log-every", "1"]
    out = runs("dp_two_epochs", "train_dp.py", epochs)  # test_training's run over an epoch boundary
    cfg, train_ds = training_windows(runs, out, epochs)
    logged = {row["step"]: row["tokens_seen"] for row in rows_of(out) if "loss" in row}
    assert len(logged) == 12 and {row["epoch"] for row in rows_of(out) if "loss" in row} == {0, 1}
    assert {step: train_ds.targets_before(step, 64, cfg.seed) for step in logged} == logged


def test_data_wait_fraction_is_the_share_of_step_time_spent_waiting_for_a_batch(monkeypatch):
    """The Speedometer's own clock: one interval of 2 steps, 3 s, 1 s of it inside waiting()."""
    clock = iter([100.0, 100.5, 101.5, 103.0, 103.0])  # start, wait begins, wait ends, row, next start
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    cfg = config.parse_args(FAST)
    speedometer = metrics.Speedometer(cfg, flops_per_token=10, peak=None, device=torch.device("cpu"), tokens_seen=50)
    with speedometer.waiting():
        speedometer.step()
    speedometer.step()
    row = speedometer.row(step=2, epoch=0, loss=3.0, lr=0.1, grad_norm=0.5, nonpad_tokens=400)
    assert row["data_wait_fraction"] == pytest.approx(1 / 3) and row["tokens_seen"] == 450
    assert row["tokens_per_s"] == 2 * 8 * 32 / 3.0 and "max_memory_allocated_gib" not in row  # a CPU has no such peak


def test_cuda_rows_carry_the_peak_memory_since_the_last_row(monkeypatch):
    """On CUDA, the allocator's peaks in GiB, then reset, so the next row has its own
    (tests/test_cuda.py reads them from a real GPU)."""
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4.5 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    gpu = torch.device("cuda", 0)
    assert metrics.cuda_memory(gpu) == {"max_memory_allocated_gib": 3.0, "max_memory_reserved_gib": 4.5}
    assert resets == [gpu]


@pytest.mark.parametrize("flag, package", [(["--tensorboard"], "tensorboard"), (["--wandb", "p"], "wandb")])
def test_a_tracker_without_its_package_is_one_line_and_nothing_is_written(flag, package, tmp_path, capsys,
                                                                         monkeypatch, corpus):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees where the package is not installed
    out = tmp_path / "out"
    assert script_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(out), *flag]) == 2
    assert capsys.readouterr().err == f"error: --{package} needs the {package} package: pip install {package}\n"
    assert not out.exists()


def tensorboard_server(logdir: Path, load_fast: str) -> tuple[subprocess.Popen, str]:
    """`tensorboard --logdir` on a free loopback port, reloading every second; its address."""
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
                               "--port", "0", "--reload_interval", "1", "--load_fast", load_fast],
                              stderr=subprocess.PIPE, text=True, env=launch_env())
    for line in server.stderr:  # it prints its address once it serves
        if found := re.search(r"http://127\.0\.0\.1:\d+", line):
            return server, found.group(0)
    raise AssertionError(f"tensorboard exited with status {server.wait()} before serving")


def served_scalars(address: str, tag: str) -> list[tuple[int, float]] | None:
    """The (step, value) series the server has for tag; None while it has not read the tag yet."""
    try:
        with urllib.request.urlopen(f"{address}/data/plugin/scalars/scalars?run=tensorboard&tag={tag}") as reply:
            return [(step, value) for _, step, value in json.load(reply)]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def as_served(rows: list[dict], tag: str) -> list[tuple[int, float]]:
    """A metrics.jsonl column as TensorBoard serves it: float32 values, by step."""
    return [(row["step"], float(np.float32(row[tag]))) for row in rows if tag in row]


def wait_for(condition, what: str, seconds: float = 120):
    """Poll until condition() holds (the server reloads its files every second)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"tensorboard never showed {what}"
        time.sleep(0.2)


def test_both_tensorboard_loaders_serve_the_logged_scalars_and_a_resumed_run_one_value_per_step(runs, tmp_path):
    """Real tensorboard servers against a 2-rank DDP run killed at step 7 (logged to step 6,
    checkpoint at step 4); then resumed to the end under the same servers: steps 5 and 6 are
    trained again, and each step still shows one value, the one metrics.jsonl holds. Both of
    TensorBoard's loaders watch the run: its Rust data server (the default where pip installed
    it) and the Python one (--load_fast false), which drops the steps a resumed run trains again
    only because the run says where it resumed (SummaryWriter's purge_step)."""
    out = tmp_path / "run"
    args = ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), "--tensorboard"]
    killed = run_script("train_ddp.py", args, nproc=2, wrapper="tests/inject_fault.py", check=False,
                        env={"FAULT": "kill", "FAULT_STEP": "7", "FAULT_LOG_DIR": str(tmp_path),
                             "FAULT_AFTER_FILE": str(out / "checkpoint-00000004.pt")})
    assert killed.returncode != 0 and [r["step"] for r in rows_of(out) if "loss" in r] == [2, 4, 6]
    tags = sorted({key for row in rows_of(out) for key in metrics.scalars(row)})
    assert {"loss", "val_loss", "grad_norm", "tokens_seen", "data_wait_fraction", "lr"} <= set(tags)
    servers = {}
    try:
        for load_fast in ("auto", "false"):  # as the README says: tensorboard --logdir OUT
            servers[load_fast] = tensorboard_server(out, load_fast)
        for when, rows in (("killed", rows_of(out)), ("resumed", None)):
            if rows is None:
                run_script("train_ddp.py", [*args, "--resume"], nproc=2)
                rows = rows_of(out)
                assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6, 8]
            for load_fast, (_, address) in servers.items():
                # every scalar as metrics.jsonl holds it, once the server has read the whole file
                # (a reload may land between the step's row and its evaluation's)
                wait_for(lambda: all(served_scalars(address, tag) == as_served(rows, tag) for tag in tags),
                         f"the {when} run's scalars (--load_fast {load_fast})")
                for tag in tags:
                    served = served_scalars(address, tag)
                    assert len({step for step, _ in served}) == len(served)  # one value per step
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait()


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of one offline W&B run, through wandb's own reader of its .wandb log."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                          capture_output=True, text=True, check=True, env=launch_env(), timeout=120)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_wandb_offline_holds_the_run_its_config_and_its_history_and_a_resume_continues_it(runs, tmp_path):
    """--wandb under WANDB_MODE=offline: stopped at step 4, then resumed. Both sessions log to
    one W&B run (the id kept in the output folder), with the run's flags as its config, and its
    history holds every row of metrics.jsonl once, at its step."""
    out = tmp_path / "run"
    args = ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), "--wandb", "llama-tests",
            "--wandb-run", "fast"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_script("train_dp.py", [*args, "--stop-at-step", "4"], env=env)
    run_script("train_dp.py", [*args, "--resume"], env=env)
    sessions = sorted((out / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2
    records = [record for session in sessions for record in wandb_records(session)]
    runs_seen = [r["run"] for r in records if r["type"] == "run"]
    assert {(r["run_id"], r["project"], r["display_name"]) for r in runs_seen} == {
        ((out / "wandb-run.txt").read_text().split()[0], "llama-tests", "fast")}
    config = runs_seen[0]["config"]["update"]
    assert config["lr"] == 1e-3 and config["seq_len"] == 32 and config["out_dir"] == str(out)
    by_step = {}
    for item in (r["history"]["item"] for r in records if r["type"] == "history"):
        assert item["_step"] not in by_step  # one entry per step
        by_step[item["_step"]] = item
    rows = rows_of(out)
    assert sorted(by_step) == sorted({row["step"] for row in rows}) == [0, 2, 4, 6, 8]
    assert (out / "wandb-run.txt").read_text().split()[1] == "8"  # the last step sent
    for row in rows:
        assert {k: by_step[row["step"]][k] for k in metrics.scalars(row)} == metrics.scalars(row), row["step"]


def tracker_config(tmp_path, *flags):
    return config.parse_args(["--out-dir", str(tmp_path / "out"), *flags])


def test_a_wandb_run_file_claiming_steps_metrics_jsonl_never_logged_is_one_line(tmp_path):
    """`<id> 999999999`: the resumed run would send W&B nothing (each step goes to
    metrics.jsonl first, so W&B cannot hold a step metrics.jsonl never had)."""
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    out.mkdir()
    (out / "wandb-run.txt").write_text("abcd1234 999999999\n")
    with pytest.raises(metrics.UsageError, match="says W&B has the steps up to 999,999,999, but metrics.jsonl logged "
                                                 "only up to 8"):
        metrics.WandbSink(out, tracker_config(tmp_path, "--wandb", "p"), logged=8)


@pytest.mark.parametrize("fallback", ["offline", "disabled"])
def test_wandb_asked_online_that_falls_back_at_its_login_prompt_is_one_line_not_a_silent_change(tmp_path, monkeypatch,
                                                                                                fallback):
    """At a terminal with no login, W&B's own prompt lets the user choose "don't visualize"
    (it goes offline) or times out (it disables itself): --wandb P would then log nowhere
    anyone looks. The run asked for online W&B; it stops and says so."""
    import types
    wandb = pytest.importorskip("wandb")
    finished = []
    run = types.SimpleNamespace(offline=fallback == "offline", disabled=fallback == "disabled",
                                finish=lambda: finished.append(1))
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(metrics.UsageError, match=f"W&B did not log in, and would have run {fallback} instead"):
        metrics.WandbSink(tmp_path / "out", tracker_config(tmp_path, "--wandb", "p"), logged=0)
    assert finished == [1] and list((tmp_path / "out").iterdir()) == []


def test_wandb_that_cannot_start_leaves_no_tensorboard_file_behind(tmp_path, monkeypatch):
    """--tensorboard --wandb P without a W&B login: the one line comes before TensorBoard has
    written anything, so the corrected command is not refused as a run already begun."""
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")

    def no_login(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")
    monkeypatch.setattr(wandb, "init", no_login)
    cfg = tracker_config(tmp_path, "--wandb", "p", "--tensorboard")
    (tmp_path / "out").mkdir()
    with pytest.raises(metrics.UsageError, match="W&B could not start the run"):
        metrics.MetricsLog(cfg, enabled=True, facts={"documents": 1})
    assert list((tmp_path / "out").iterdir()) == []


def test_tensorboard_that_cannot_write_after_wandb_started_leaves_no_run_file_behind(tmp_path, monkeypatch):
    """--tensorboard --wandb P where OUT/tensorboard cannot be written: W&B has started its
    run, but nothing marks OUT as a run's (no wandb-run.txt, no metrics.jsonl), so the corrected
    command is not refused as a run already begun."""
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    import errno
    import torch.utils.tensorboard

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", read_only)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tracker_config(tmp_path, "--wandb", "p", "--tensorboard")
    (tmp_path / "out").mkdir()
    with pytest.raises(metrics.UsageError, match="--tensorboard: cannot write"):
        metrics.MetricsLog(cfg, enabled=True, facts={"documents": 1})
    from training import resume
    assert not resume.resuming(str(tmp_path / "out"), resume=False)  # the rerun starts: nothing refuses it
    assert not (tmp_path / "out" / "wandb-run.txt").exists()


def test_a_tensorboard_folder_that_cannot_be_written_is_found_before_tensorboards_writer_starts(tmp_path,
                                                                                               monkeypatch):
    """OUT/tensorboard a link to a folder no one may write in (here /sys/kernel): our own
    file fails first, in one line; TensorBoard's writer, whose thread would add a traceback
    after that line, is never started."""
    pytest.importorskip("tensorboard")
    import torch.utils.tensorboard
    if not os.path.isdir("/sys/kernel") or os.access("/sys/kernel", os.W_OK) and _writable("/sys/kernel"):
        pytest.skip("needs a folder nobody can write in: /sys/kernel is not one here")
    started = []
    real = torch.utils.tensorboard.SummaryWriter
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", lambda *a, **k: started.append(1) or real(*a, **k))
    (tmp_path / "tensorboard").symlink_to("/sys/kernel")
    with pytest.raises(metrics.UsageError, match="--tensorboard: cannot write .*tensorboard: "):
        metrics.TensorBoardSink(tmp_path, tracker_config(tmp_path, "--tensorboard"), kept=[])
    assert started == []


def _writable(folder: str) -> bool:
    import tempfile
    try:
        tempfile.TemporaryFile(dir=folder).close()
        return True
    except OSError:
        return False


def test_tensorboard_that_cannot_write_is_one_line(tmp_path, monkeypatch):
    """A read-only or full OUT/tensorboard (simulated: its writer raises EROFS)."""
    pytest.importorskip("tensorboard")
    import errno
    import torch.utils.tensorboard

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", read_only)
    with pytest.raises(metrics.UsageError, match="--tensorboard: cannot write .*tensorboard: .*Read-only file system"):
        metrics.TensorBoardSink(tmp_path, tracker_config(tmp_path, "--tensorboard"), kept=[])
