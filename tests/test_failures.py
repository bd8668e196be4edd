"""What real clusters do: killed workers, preemption, torn checkpoints, slow disks, two
nodes, Slurm, and checkpoint files crafted to run code. Each test ends by comparing final
weights or file contents with an uninterrupted run."""

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (FAST, FAST_WITH_TOKENIZER, REPO, ddp_two_ranks, launch_env, load_weights, max_weight_diff,
                      metrics, run_script, script_in_process, stopped_at_step_4, train, without_speed, write_corpus)
from benchmarks.gpu_report import descendants
from training import build, pt_checkpoint, stopping, weights
from training.config import TrainConfig
from training.errors import UsageError


def fault_env(tmp_path, fault, step, rank=0):
    logs = tmp_path / "fault-logs"
    logs.mkdir(exist_ok=True)
    return {"FAULT": fault, "FAULT_STEP": str(step), "FAULT_RANK": str(rank), "FAULT_LOG_DIR": str(logs)}


def exit_codes(tmp_path):
    """How each rank's process ended, as recorded by tests/inject_fault.py."""
    return {p.stem: p.read_text() for p in sorted((tmp_path / "fault-logs").glob("exit-rank*.txt"))}


def fault_in_this_process(script, args, env, monkeypatch, capsys):
    """tests/inject_fault.py around a one-process script, run in this process (its patches and
    the script's signal handlers are undone afterwards): (exit status, stdout, stderr)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status = script_in_process("tests/inject_fault.py", [str(REPO / script), *args])
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def checkpoint_step(out):
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["step"]


def train_args(runs, out, *extra):
    return ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), *extra]


def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(runs, tmp_path):
    """kill -9 of rank 1 in step 7 (checkpoints at 4 and 8, step 6 already logged): torchrun
    restarts both workers, they resume from step 4 by themselves, and end bitwise where an
    uninterrupted run ends, with the same metrics.jsonl (steps 5-6 are not logged twice)."""
    reference = ddp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_ddp.py", train_args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "kill", step=7, rank=1), torchrun_args=["--max-restarts=1"])
    assert f"resumed from {out}/checkpoint.pt at step 4 (restart 1)" in proc.stdout
    assert exit_codes(tmp_path) == {"exit-rank0": "0", "exit-rank1": "0"}  # the restarted attempt
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0
    assert without_speed(metrics(out)) == without_speed(metrics(reference))


def test_preempted_ddp_ranks_agree_on_a_step_save_and_exit_0_even_with_a_save_hanging_on_a_slow_disk(runs, tmp_path):
    """SIGTERM to torchrun (what `scancel` does) in step 6: rank 0 sees it at once, rank 1 only
    when torchrun forwards it, yet both stop after step 6; rank 0 saves; both exit 0. Rank 0's
    write of the step-4 checkpoint cannot finish until training reaches step 6: a trainer that
    wrote checkpoints in its loop would deadlock, and with a 0.25-minute collective timeout
    rank 1 would fail within seconds. Ours writes in the background and goes on."""
    reference = ddp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_ddp.py", train_args(runs, out, "--timeout-minutes", "0.25"), nproc=2,
                      wrapper="tests/inject_fault.py", env=fault_env(tmp_path, "slow-disk,sigterm-launcher", step=6),
                      check=False, timeout=120)
    summary = proc.stdout[proc.stdout.index("stopped by a signal"):].splitlines()
    rows = metrics(out)
    loss, val_loss = [r["loss"] for r in rows if "loss" in r][-1], [r["val_loss"] for r in rows if "val_loss" in r][-1]
    assert re.fullmatch(rf"stopped by a signal after step 6 of 8: [\d,]+ tokens \(1,536 positions with padding\) "
                        rf"in \d+:\d\d:\d\d \| train loss "
                        rf"{loss:.4f} \| val loss {val_loss:.4f} at step 4", summary[0]), summary  # evaluated at 4
    assert summary[1:] == [f"checkpoint saved in {out}/checkpoint.pt; continue with --resume"]
    assert exit_codes(tmp_path) == {"exit-rank0": "0", "exit-rank1": "0"}
    assert checkpoint_step(out) == 6 and not (out / "model.pt").exists()
    run_script("train_ddp.py", train_args(runs, out, "--resume"), nproc=2)
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0
    # three checkpoints were saved (steps 4, 6 and 8): --keep-checkpoints 2 pruned the oldest
    assert sorted(p.name for p in out.glob("checkpoint*.pt")) == [
        "checkpoint-00000006.pt", "checkpoint-00000008.pt", "checkpoint.pt"]


@pytest.mark.parametrize("signal_name", ["sigusr1", "sigint"])
def test_sigusr1_or_ctrl_c_stops_the_dataparallel_script_which_resumes_exactly(runs, tmp_path, signal_name,
                                                                                monkeypatch, capsys):
    reference = runs("dp", "train_dp.py")
    out = tmp_path / "run"
    status, stdout, stderr = fault_in_this_process("train_dp.py", train_args(runs, out),
                                                   fault_env(tmp_path, signal_name, step=3), monkeypatch, capsys)
    assert status == 0 and "stopped by a signal after step 3 of 8" in stdout
    assert "Traceback" not in stderr
    assert checkpoint_step(out) == 3
    if signal_name == "sigusr1":  # the same stop either way: one resume shows it is exact
        train("train_dp.py", train_args(runs, out, "--resume"))
        assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    status, _, stderr = fault_in_this_process("train_dp.py", train_args(runs, out),
                                              fault_env(tmp_path, "sigint-twice", step=3), monkeypatch, capsys)
    assert status == 130 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "interrupted"
    assert not list(out.glob("checkpoint*.pt"))  # at once: no save at step 3


def test_a_full_disk_is_one_line_leaves_no_temp_file_and_the_run_resumes(runs, tmp_path, monkeypatch, capsys):
    """The disk has room for one checkpoint, not two: the save at step 8 fails. One line names
    the file, the disk and the space; checkpoint.pt still holds step 4; no temp file is left.
    With space again, --resume clears stale temp files and ends where a straight run ends."""
    reference = runs("dp", "train_dp.py")
    out = tmp_path / "run"
    one_checkpoint = (reference / "checkpoint.pt").stat().st_size
    env = {**fault_env(tmp_path, "small-disk", step=0), "FAULT_BYTES": str(int(1.5 * one_checkpoint))}
    status, _, stderr = fault_in_this_process("train_dp.py", train_args(runs, out), env, monkeypatch, capsys)
    ours = [line for line in stderr.splitlines() if "Traceback" in line or line.startswith("error: ")]
    assert status == 2 and len(ours) == 1, stderr
    assert ours[0].startswith(f"error: no space left to write {out}/checkpoint-00000008.pt (on the disk mounted "
                              "at /") and " MB are free. Free some space, then run again" in ours[0]
    assert checkpoint_step(out) == 4 and not list(out.glob("*.tmp"))
    # what a crash mid-write leaves behind is cleared by the resume; the user's files are not
    (out / "checkpoint-00000008.pt.tmp").write_bytes(b"torn")
    (out / "tokenizer.json.tmp").write_bytes(b"")
    (out / "notes.tmp").write_text("the user's own file")
    train("train_dp.py", train_args(runs, out, "--resume"))
    assert sorted(p.name for p in out.glob("*.tmp")) == ["notes.tmp"]
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0


def running(pid: int) -> bool:
    """Whether pid is a live process (an orphan that ended but was not reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("script", ["train_dp.py", "train_fsdp.py"])
@pytest.mark.parametrize("signal_name, status, line", [("SIGINT", 130, "interrupted"),
                                                       ("SIGTERM", 143, "stopped by SIGTERM")])
def test_a_signal_while_tokenizing_ends_the_run_at_once_with_one_line_and_no_process_left(
        runs, tmp_path, script, signal_name, status, line):
    """Ctrl-C or SIGTERM while two forked processes tokenize (for ten minutes): there is nothing
    to save yet, so the run ends at once (not after training to the end, and not after ten
    minutes), with one line and the shell's status for that signal, and ends those processes
    (SIGTERM's default action would leave them running under PID 1). A shell's background job
    starts with SIGINT ignored: Ctrl-C sent to it by `kill` still counts."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}, one of many\n" for i in range(11_000)))  # 2 x 5,000 after the val split
    out, logs = tmp_path / "run", tmp_path / "fault-logs"
    args = ["--dataset", str(corpus), "--tokenizer", str(runs("dp", "train_dp.py") / "tokenizer.json"),
            *FAST_WITH_TOKENIZER, "--out-dir", str(out)]
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/inject_fault.py"), str(REPO / script), *args],
                            cwd=REPO, env=launch_env(fault_env(tmp_path, "slow-tokenizing", step=0)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` does
    started = []
    try:
        while len(list(logs.glob("tokenizing-*"))) < 2 and proc.poll() is None:  # both are tokenizing
            time.sleep(0.05)
        started = descendants(proc.pid)
        assert len(started) >= 2, proc.communicate()
        proc.send_signal(getattr(signal, signal_name))
        _, stderr = proc.communicate(timeout=60)  # not ten minutes
        assert proc.returncode == status and stderr == f"{line}\n", stderr  # one line, nothing else
        assert exit_codes(tmp_path) == {"exit-rank0": str(status)}
        assert [pid for pid in started if running(pid)] == []
    finally:
        for pid in [proc.pid, *started]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_data_preparation_may_outlast_the_training_timeout(runs, tmp_path):
    """Local rank 0 prepares the data (here: 7 s longer) while rank 1 waits. The wait is bounded
    by --data-timeout-minutes, not by the 6-second --timeout-minutes of training collectives,
    so a cold cache does not kill the job; training then runs under the short timeout. (Rank
    1 cannot stop waiting before rank 0 has slept: the wait outlasts 6 s on any machine.)"""
    reference = ddp_two_ranks(runs)
    out = tmp_path / "run"
    env = {**fault_env(tmp_path, "slow-prepare", step=0), "FAULT_SECONDS": "7"}
    proc = run_script("train_ddp.py", train_args(runs, out, "--timeout-minutes", "0.1"), nproc=2,
                      wrapper="tests/inject_fault.py", env=env, timeout=120)
    assert "Traceback" not in proc.stderr
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0


def test_a_signal_to_a_rank_waiting_for_another_ranks_data_turn_stops_it_at_once(runs, tmp_path):
    """Rank 0 prepares the data for two minutes (a cold cache) while rank 1 waits its turn;
    SIGTERM to rank 1 alone (a user's kill, not the job's) a second into that wait ends it
    there, and torchrun ends the job. The wait is Python's: inside gloo's, the signal would
    wait for rank 0's two minutes."""
    out = tmp_path / "run"
    env = {**fault_env(tmp_path, "slow-prepare,sigterm-waiting", step=0), "FAULT_SECONDS": "120"}
    start = time.monotonic()
    proc = run_script("train_ddp.py", train_args(runs, out), nproc=2, wrapper="tests/inject_fault.py", env=env,
                      check=False, timeout=300)
    took = time.monotonic() - start
    # (torchrun's report of its first failed worker: the process ends without our wrapper's record)
    assert f"exitcode  : {128 + signal.SIGTERM}" in proc.stderr and "local_rank: 1" in proc.stderr, proc.stderr
    assert took < 60, f"rank 1 waited for rank 0's turn: {took:.0f} s"  # rank 0's turn alone is 120 s
    assert proc.returncode != 0 and not (out / "model.pt").exists()
    for ours in ("train_ddp.py", "training"):  # torchrun reports its failed child; we add none
        assert f'File "{REPO / ours}' not in proc.stderr  # (training: any module of the package)


def test_data_preparation_has_its_own_bound(runs, tmp_path):
    """...and --data-timeout-minutes does bound it: the rank that waits longer ends the job
    with one line saying so."""
    out = tmp_path / "run"
    env = {**fault_env(tmp_path, "slow-prepare", step=0), "FAULT_SECONDS": "20"}
    proc = run_script("train_ddp.py", train_args(runs, out, "--data-timeout-minutes", "0.05"), nproc=2,
                      wrapper="tests/inject_fault.py", env=env, check=False, timeout=120)
    assert proc.returncode == 1 and not (out / "model.pt").exists()  # torchrun's status when a worker failed
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith(
        "error: rank 1 stopped waiting for data preparation (--data-timeout-minutes): "), proc.stderr
    assert exit_codes(tmp_path)["exit-rank1"] == "2"
    for ours in ("train_ddp.py", "training", "data.py"):  # no traceback through our code
        assert f'File "{REPO / ours}' not in proc.stderr


def _wait_alone(rank, store_path, results, done):
    """Rank 1 of 2 waits in a collective of each side group that rank 0 never joins (rank 0
    stays connected until rank 1 is done), and reports how long each wait lasted."""
    import time

    import torch.distributed as dist
    from training.launch import side_groups
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    prep, control = side_groups("nccl", timeout_minutes=0.02, data_timeout_minutes=0.06)  # 1.2 s, 3.6 s
    if rank == 1:
        waited = []
        for group in (control, prep):
            start = time.monotonic()
            try:
                dist.barrier(group=group)
            except RuntimeError:  # gloo's timeout
                waited.append(time.monotonic() - start)
        results.put(waited)
        results.close()
        results.join_thread()
        done.set()
    done.wait(timeout=120)
    os._exit(0)  # nothing more to tear down


def test_the_side_groups_wait_as_long_as_they_should(tmp_path):
    """Under NCCL the per-step stop flag travels over a gloo group: it must time out with the
    training collectives (--timeout-minutes), not after gloo's 30-minute default. Data
    preparation's group waits --data-timeout-minutes. Seen from a rank left waiting alone."""
    import torch.multiprocessing as mp
    spawn = mp.get_context("spawn")
    results, done = spawn.Queue(), spawn.Event()
    mp.start_processes(_wait_alone, args=(str(tmp_path / "store"), results, done), nprocs=2, join=False,
                       start_method="spawn")
    control, prep = results.get(timeout=120)
    assert 1.2 <= control < 3.6 <= prep < 60  # each gave up after its own timeout, not gloo's 30 minutes


def test_two_runs_cannot_share_an_out_dir(runs, tmp_path, capsys):
    """While a run holds --out-dir (here this test process, as if it were a run in progress),
    another run into it stops with one line and writes nothing; once the holder dies, the
    folder is free again, with no stale lock to clean up."""
    import select
    import signal

    from test_bad_inputs import refused_in_process
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from training import run_folder; "
                               f"run_folder.lock_out_dir({str(out)!r}); print('locked', flush=True); sys.stdin.read()"],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)  # a bounded wait for the holder
        assert ready and holder.stdout.readline() == "locked\n"  # the holder has the lock from here on
        refused_in_process("train_dp.py", train_args(runs, out)[:-2], out,
                           f"another run is using {out}: wait for it to end, or choose another --out-dir",
                           capsys)
        assert list(out.iterdir()) == []
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without any cleanup
        holder.wait(timeout=60)
    train("train_dp.py", train_args(runs, out))
    assert max_weight_diff(load_weights(runs("dp", "train_dp.py")), load_weights(out)) == 0.0


def test_a_child_of_a_killed_run_does_not_keep_its_out_dir_locked(tmp_path):
    """A run's forked children (--stream's DataLoader workers) may outlive it by seconds when it
    is killed with kill -9: they must not hold --out-dir's lock, or the restarted run would be
    refused as "another run". Here the run forks a child that lives on, and is killed."""
    import select
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; from training import run_folder; "
                               f"run_folder.lock_out_dir({str(out)!r}); child = os.fork()\n"
                               "if child == 0: time.sleep(600); os._exit(0)\n"
                               "print(child, flush=True); sys.stdin.read()"],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)  # a bounded wait for the holder
        assert ready
        child = int(holder.stdout.readline())
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        os.kill(child, 0)  # the child lives on
        lock = f"from training import run_folder; run_folder.lock_out_dir({str(out)!r})"
        again = subprocess.run([sys.executable, "-c", lock], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr  # and the folder is free: not "another run is using"
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        holder.kill()


# ---- torn writes ------------------------------------------------------------------------

class Crash(Exception):
    pass


def state_at(step):
    return {"step": step, "model": {"w": torch.full((1000,), float(step))}, "optimizer": {}, "scheduler": {},
            "model_config": {}, "train_config": {}, "rng": {}, "steps_per_epoch": 10}


def test_a_crash_at_any_moment_of_saving_leaves_a_complete_checkpoint_pt(tmp_path, monkeypatch):
    """Crash the save of step 8 at each of its file operations in turn (a torch.save that
    dies half-way included). Afterwards checkpoint.pt always loads, and holds step 4 or 8."""
    real = {"save": torch.save, "fsync": os.fsync, "replace": os.replace, "link": os.link, "unlink": os.unlink}
    outcomes = []
    for crash_at in range(1, 50):
        out = tmp_path / f"crash{crash_at}"
        out.mkdir()
        pt_checkpoint.save_checkpoint(state_at(4), out, keep=2)
        calls = []

        def op(name):
            def wrapped(*args, **kwargs):
                calls.append(name)
                if len(calls) == crash_at:
                    if name == "save":  # die half-way through writing the bytes
                        args[1].write(b"\x80\x02 half a pickle")
                    raise Crash(name)
                return real[name](*args, **kwargs)
            return wrapped

        with monkeypatch.context() as m:
            m.setattr(torch, "save", op("save"))
            for name in ("fsync", "replace", "link", "unlink"):
                m.setattr(os, name, op(name))
            try:
                pt_checkpoint.save_checkpoint(state_at(8), out, keep=2)
                crashed = None
            except Crash as e:
                crashed = str(e)
        step = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["step"]
        assert step in (4, 8)
        assert pt_checkpoint.load_latest_checkpoint(out)["step"] == step
        outcomes.append((crashed, step))
        if crashed is None:
            break
    assert outcomes[-1] == (None, 8) and len(outcomes) > 5  # every operation was crashed once
    assert {step for _, step in outcomes[:-1]} == {4, 8}  # before and after the atomic swap


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in (4, 8, 12):
        pt_checkpoint.save_checkpoint(state_at(step), tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000008.pt", "checkpoint-00000012.pt", "checkpoint.pt"]
    assert (tmp_path / "checkpoint.pt").samefile(tmp_path / "checkpoint-00000012.pt")


def test_only_the_checkpoints_the_trainer_names_are_pruned_or_resumed_from(tmp_path):
    """A user's copies (checkpoint-best.pt, checkpoint-00000004-keep.pt) are neither deleted
    by --keep-checkpoints nor taken for a newer checkpoint; nor do they take a kept slot."""
    for step in (4, 8):
        pt_checkpoint.save_checkpoint(state_at(step), tmp_path, keep=2)
    shutil.copy(tmp_path / "checkpoint-00000004.pt", tmp_path / "checkpoint-00000004-keep.pt")
    torch.save(state_at(99), tmp_path / "checkpoint-best.pt")
    pt_checkpoint.save_checkpoint(state_at(12), tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000004-keep.pt", "checkpoint-00000012.pt", "checkpoint-best.pt", "checkpoint.pt"]
    (tmp_path / "checkpoint.pt").write_bytes(b"torn")  # the newest is unreadable under both names
    (tmp_path / "checkpoint-00000012.pt").write_bytes(b"torn")
    with pytest.raises(UsageError, match="cannot load checkpoint"):
        pt_checkpoint.load_latest_checkpoint(tmp_path)  # never checkpoint-best.pt's step 99


@pytest.mark.parametrize("damage", ['{"step": 5, "epo', "\n\n  \n"])
def test_a_torn_last_metrics_line_or_blank_lines_do_not_block_a_resume(runs, tmp_path, damage, capsys):
    """A crash or a full disk can leave half a row at the end of metrics.jsonl. Resume drops
    it (with a warning if it was a torn row) and ends like an uninterrupted run."""
    reference = runs("dp", "train_dp.py")
    out = stopped_at_step_4(runs, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(damage)
    capsys.readouterr()
    train("train_dp.py", train_args(runs, out, "--resume"))
    assert ("dropping its torn last line" in capsys.readouterr().err) == ("{" in damage)
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0
    assert without_speed(metrics(out)) == without_speed(metrics(reference))


def test_a_damaged_metrics_line_is_one_line_before_anything_is_written(runs, tmp_path, capsys):
    from test_bad_inputs import refused_in_process
    out = stopped_at_step_4(runs, tmp_path)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([rows[0], "not json", *rows[1:]]) + "\n")
    refused_in_process("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--resume"], out,
                       f"error: {out}/metrics.jsonl, line 2: Expecting value: line 1 column 1 (char 0); "
                       "repair or remove that line", capsys)


def test_an_unreadable_newest_checkpoint_falls_back_to_the_older_one(runs, tmp_path, capsys):
    reference = runs("dp", "train_dp.py")
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for torn in ("checkpoint.pt", "checkpoint-00000008.pt"):  # the newest, under both its names
        (out / torn).write_bytes((out / torn).read_bytes()[:1000])
    capsys.readouterr()
    printed = train("train_dp.py", train_args(runs, out, "--resume"))
    err = capsys.readouterr().err
    assert f"warning: cannot load checkpoint {out}/checkpoint.pt" in err
    assert "falling back to checkpoint-00000004.pt" in err
    assert f"resumed from {out}/checkpoint-00000004.pt at step 4" in printed
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0


# ---- several nodes ----------------------------------------------------------------------

def test_two_nodes_train_the_same_model_as_one_node_and_only_rank_0_writes(runs, tmp_path):
    """Two torchrun launchers on this machine play two nodes with one process each,
    rendezvous over c10d, each with its own datasets cache and its own disk, as separate
    machines have: node 1's --out-dir is a folder of its own. Whatever rank 1 wrote, by any
    means, would be there; it stays empty."""
    import datetime
    import torch.distributed as dist
    reference = ddp_two_ranks(runs)
    out = {0: tmp_path / "node0" / "run", 1: tmp_path / "node1" / "run"}
    # the rendezvous store, held by this test: its port is bound from the start (no free port
    # picked, closed and reused later); both launchers connect to it as clients
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(minutes=5))
    launchers = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={node}", "--rdzv-id=two-nodes", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-conf=is_host=false", str(REPO / "train_ddp.py"),
               *train_args(runs, out[node])]
        env = launch_env({"HF_HOME": str(tmp_path / f"hf-node{node}")})  # one thread, as the reference
        launchers.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    try:
        for launcher in launchers:
            output, _ = launcher.communicate(timeout=300)
            assert launcher.returncode == 0, output
    finally:
        for launcher in launchers:
            launcher.kill()
    assert max_weight_diff(load_weights(reference), load_weights(out[0])) == 0.0
    assert not (tmp_path / "node1").exists()  # not even the folder


@pytest.mark.parametrize("script_env, script_name, restarts", [
    ({}, "train_ddp.py", 3), ({"SCRIPT": "train_fsdp.py"}, "train_fsdp.py", 3),
    ({"SCRIPT": "tools/check_cluster.py"}, "tools/check_cluster.py", 0)])
def test_the_slurm_script_builds_the_torchrun_command_from_slurm_variables(tmp_path, script_env, script_name,
                                                                          restarts):
    """Stand-ins for srun and scontrol record what they are given. Since Slurm 22.05, srun no
    longer inherits --cpus-per-task from sbatch: the script passes it, or every launcher and
    its workers would share one core. The cluster check runs once: a failed check is an
    answer, not a fault to restart from."""
    script = REPO / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)  # it parses
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
    (stubs / "srun").write_text('#!/bin/sh\necho "signals=$TORCHELASTIC_SIGNALS_TO_HANDLE"\nfor a in "$@"; do echo "$a"; done\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "32", **script_env}
    proc = subprocess.run(["bash", str(script), "--model", "article", "--out-dir", "/shared/run"],
                          env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines() == [
        "signals=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--cpus-per-task=32", "torchrun", "--nnodes=2",
        "--nproc_per_node=8",
        f"--max-restarts={restarts}", "--rdzv-id=4242", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:29500",
        script_name, "--model", "article", "--out-dir", "/shared/run"]
    directives = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in directives and "#SBATCH --signal=USR1@120" in directives


# ---- hostile files ----------------------------------------------------------------------

class RunsCode:
    """Unpickling this object runs a shell command: what a crafted checkpoint can do
    to torch.load(weights_only=False)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_crafted_to_run_code_is_refused_and_runs_nothing(runs, tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(runs("dp", "train_dp.py"), out)
    for ckpt in out.glob("checkpoint*.pt"):
        ckpt.unlink()
    torch.save({"model": RunsCode(marker), "step": 4}, out / "checkpoint.pt")
    torch.save(RunsCode(marker), out / "model.pt")
    capsys.readouterr()
    assert script_in_process("train_dp.py", train_args(runs, out, "--resume")) == 2
    # one line, without torch's advice to load it again with weights_only=False
    assert capsys.readouterr().err == (f"error: cannot load checkpoint {out}/checkpoint.pt: refused: it holds more than "
                                       "tensors and plain values (Trying to load unsupported GLOBAL posix.system "
                                       "whose module posix is blocked.)\n")
    with pytest.raises(UsageError, match=f"cannot load weights {out}/model.pt: refused: it holds more than tensors"):
        weights.load_trained(out)  # what generate.py and export_hf.py read
    assert not marker.exists()
    torch.load(out / "model.pt", weights_only=False)  # the file really is hostile:
    assert marker.exists()  # without weights_only it runs its command


def _nan_moment(c):
    next(iter(c["optimizer"]["state"].values()))["exp_avg"][0] = float("nan")


@pytest.mark.parametrize("damage, says", [
    (lambda c: c["model"]["base_model.norm.weight"].__setitem__(0, float("nan")),
     "base_model.norm.weight is not finite floating point (NaN, inf or integers): the checkpoint is damaged"),
    (lambda c: c["model"].update({"lm_head.weight": c["model"]["lm_head.weight"].long()}),
     "lm_head.weight is not finite floating point (NaN, inf or integers): the checkpoint is damaged"),
    (_nan_moment, "holds weights or optimizer state that are not finite: the checkpoint is damaged"),
    (lambda c: c["optimizer"]["param_groups"][0].update(lr=float("nan")),
     "holds weights or optimizer state that are not finite: the checkpoint is damaged"),
    (lambda c: c["model"].update({"base_model.norm.weight": torch.ones(7)}),
     "cannot be restored (Error(s) in loading state_dict for LlamaForPretraining: size mismatch for "
     "base_model.norm.weight"),
    (lambda c: c.update(rng={"torch": torch.zeros(3, dtype=torch.uint8), "cuda": None}), "cannot be restored ("),
    (lambda c: c.update(step=10**12), "is at step 1000000000000, past this run's last step (8)"),  # was a hang
    (lambda c: c.update(step=-5), "is damaged: step -5"),
    (lambda c: c.update(train_config=None), "is damaged: its train_config is not a dict"),
    (lambda c: c.update(step="4"), "is damaged: its step is not a int"),
    (lambda c: c.update(highest_loss=["5.7", 4]), "is damaged: its highest_loss is not a loss and a step"),
    (lambda c: c.update(highest_loss=[float("nan"), 4]), "is damaged: its highest_loss is not a loss and a step"),
], ids=["nan-weight", "integer-weight", "nan-moment", "nan-lr", "weight-shape", "rng", "huge-step", "negative-step",
        "train-config", "step-string", "highest-loss-string", "highest-loss-nan"])
def test_a_damaged_checkpoint_is_one_line_naming_it_and_nothing_is_written(runs, tmp_path, capsys, damage, says):
    """Runs save only what they can resume from: a checkpoint that holds anything else was
    damaged after it was written. Every copy damaged alike (else the run falls back to the
    older one), the resume says so in one line, writes nothing, and never trains on to a
    "lower --lr" advice, a traceback, or (a step of 10**12) a count of tokens that never ends."""
    from test_bad_inputs import snapshot
    out = stopped_at_step_4(runs, tmp_path)
    for path in (out / "checkpoint.pt", out / "checkpoint-00000004.pt"):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        damage(ckpt)
        path.unlink()
        torch.save(ckpt, path)
    before = snapshot(out)
    capsys.readouterr()
    assert script_in_process("train_dp.py", train_args(runs, out, "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}/checkpoint") and says in err[0], err
    assert snapshot(out) == before


SIGNAL_DURING_A_FORK = """
import os, signal, sys, time
os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGTERM))  # runs inside stopping.py's bracket
sys.path.insert(0, sys.argv[1])
from training import stopping

def main():
    child = os.fork()  # as datasets does, starting its tokenizing workers
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    ends = time.monotonic() + 60
    while time.monotonic() < ends:  # more work: the signal must end it
        pass
    print("went on to the end")

stopping.exit_on_usage_error(main)
"""


def test_a_signal_that_lands_while_a_worker_is_forked_still_stops_the_run():
    """SIGTERM delivered while os.fork runs its hooks (the moment datasets starts its
    tokenizing workers) raised KeyboardInterrupt inside a hook, where Python drops it: the
    run trained on to the end, exit 0, and logging's lock could stay held. The signal now
    waits for the fork to end, then stops the run as any other."""
    proc = subprocess.run([sys.executable, "-c", SIGNAL_DURING_A_FORK, str(REPO)], capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (128 + signal.SIGTERM, "", "stopped by SIGTERM\n")


def test_a_run_whose_gradients_are_all_exactly_zero_stops_with_one_line(runs, tmp_path, capsys, monkeypatch):
    """What torch 2.11's compiler did to the chunked loss (pytorch/pytorch#180642): backward's
    incoming gradient became 0, so every gradient was 0 and the run trained on, learning
    nothing. Simulated here, in a run that did not compile: the first log step stops it, in
    one line that says the gradients never reached the weights, and names no compiler."""
    from ops import chunked_loss
    backward = chunked_loss.ChunkedCrossEntropy.backward
    monkeypatch.setattr(chunked_loss.ChunkedCrossEntropy, "backward",
                        staticmethod(lambda ctx, grad_loss: backward(ctx, grad_loss * 0)))
    out = tmp_path / "run"
    assert script_in_process("train_dp.py", train_args(runs, out)) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: every gradient is exactly 0 at step 2, with the loss at ")
    assert "not rising: the model does not train. The gradients do not reach the weights" in line
    assert "compile" not in line
    assert not (out / "model.pt").exists()


LR_100 = TrainConfig(lr=100.0, warmup_steps=0)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("loss", [57.3, 0.0])
def test_gradients_that_vanish_after_the_loss_blew_up_are_a_divergence_compiled_or_not(compiled, loss):
    """A network whose weights blew up saturates: every softmax exactly one-hot, every gradient
    exactly 0 (on an AVX-512 CPU, --lr 100 got there before any weight was inf). Its loss says
    so, past twice a uniform guess's ln(V) (the steps before, blowing up), or 0 (every target
    then certain); and the run is told to lower its learning rate, not to suspect a compiler."""
    with pytest.raises(UsageError) as refused:
        stopping.Divergence(dataclasses.replace(LR_100, compile=compiled), vocab_size=300).check(4, loss, 0.0)
    assert str(refused.value).startswith(f"training diverged: the gradients are all exactly 0 at step 4, the loss at "
                                         f"{loss:.4g} (a uniform guess's: 5.7): the network saturated")
    assert "Start again with a lower --lr (was 100.0)" in str(refused.value) and "compile" not in str(refused.value)


@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_that_vanish_with_the_loss_back_at_a_uniform_guess_after_it_blew_up_are_a_divergence(compiled):
    """--lr 100 took the loss to millions, then the network settled into a uniform guess: the
    loss back at ln(V) = 5.704, every gradient exactly 0 (../shared/fixtures/saturate_corpus.txt,
    on an Intel Xeon; the run below, here). The loss alone looks like a model whose gradients
    never reached its weights; the losses logged before it say the run diverged."""
    divergence = stopping.Divergence(dataclasses.replace(LR_100, compile=compiled), vocab_size=300)
    for step, loss, norm in [(1, 5.714, 3.2), (2, 1695.9, 40.0), (3, 6.836e6, 9e5)]:
        divergence.check(step, loss, norm)  # finite, and the gradients move the weights: training goes on
    with pytest.raises(UsageError) as refused:
        divergence.check(4, 5.704, 0.0)
    assert str(refused.value) == ("training diverged: the loss rose to 6.836e+06 at step 3 (a uniform guess's: 5.7), "
                                  "and at step 4 the gradients are all exactly 0, the loss back at 5.704: the network "
                                  "saturated. Start again with a lower --lr (was 100.0) or a longer --warmup-steps "
                                  "(was 0)")


SATURATES = ["--lr", "100", "--warmup-steps", "1", "--log-every", "1"]  # the tests' corpus: 6 steps, on CPUs seen


def assert_told_to_lower_the_learning_rate(err: str):
    """The one line of a run that blew up: where its gradients then vanished, the line names the
    loss it rose to (not a model whose gradients never reach its weights). A CPU whose rounding
    takes the run to inf or NaN first is told of that divergence instead."""
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Start again with a lower --lr (was 100.0)" in line, line
    if "exactly 0" in line:
        assert re.match(r"error: training diverged: the loss rose to [\d.e+]+ at step \d+ \(a uniform guess's: 5\.7\), "
                        r"and at step \d+ the gradients are all exactly 0, the loss back at ", line), line
    else:
        assert re.match(r"error: training diverged: the (loss is|gradient norm is|weights are not finite)", line), line


def test_a_run_that_blows_up_then_saturates_is_told_to_lower_its_learning_rate(runs, tmp_path, capsys):
    """The same end to end: the tests' corpus with --lr 100 blows up to millions by step 5 and
    saturates at step 6 (here, and on an Intel Xeon with AMX)."""
    assert script_in_process("train_dp.py", train_args(runs, tmp_path / "run", *SATURATES)) == 2
    assert_told_to_lower_the_learning_rate(capsys.readouterr().err)


def test_a_resumed_run_remembers_how_high_its_loss_rose_before_its_checkpoint(runs, tmp_path, capsys):
    """The same run stopped at step 5, in the middle of blowing up, then resumed: the losses
    that rose were logged by the session before, and the checkpoint carries the highest to the
    next, whose gradients vanish at step 6."""
    out = tmp_path / "run"
    assert script_in_process("train_dp.py", train_args(runs, out, *SATURATES, "--stop-at-step", "5")) == 0
    capsys.readouterr()
    assert script_in_process("train_dp.py", train_args(runs, out, *SATURATES, "--resume")) == 2
    assert_told_to_lower_the_learning_rate(capsys.readouterr().err)


def test_a_checkpoint_carries_the_highest_loss_to_the_divergence_check_of_the_next_session():
    divergence = stopping.Divergence(LR_100, vocab_size=300, ckpt={"highest_loss": [6.836e6, 5]})
    with pytest.raises(UsageError, match=r"the loss rose to 6\.836e\+06 at step 5 .* at step 6 the gradients"):
        divergence.check(6, 5.704, 0.0)


def test_gradients_that_vanish_with_the_loss_where_it_began_name_the_compiler_only_in_a_compiled_run():
    for compiled in (False, True):
        with pytest.raises(UsageError) as refused:
            stopping.Divergence(dataclasses.replace(LR_100, compile=compiled), vocab_size=300).check(10, 5.8, 0.0)
        assert ("pytorch/pytorch#180642" in str(refused.value)) == compiled
        assert str(refused.value).startswith("every gradient is exactly 0 at step 10")
    stopping.Divergence(LR_100, vocab_size=300).check(10, 5.8, 1e-30)  # tiny, not 0: it trains


@pytest.mark.parametrize("script", ["train_dp.py", "train_ddp.py", "train_fsdp.py"])
def test_weights_made_non_finite_by_a_step_that_logs_no_loss_are_never_saved(runs, tmp_path, script, monkeypatch,
                                                                            capsys):
    """A step's logged loss was computed before its update, and the update itself can leave a
    weight non-finite (AdamW overflowing, a bad gradient) while every loss logged is finite:
    each script checks the weights themselves before every save, on every rank. A weight made
    NaN by the update of step 3, which logs nothing (--log-every 2), ends the run with one line
    at step 3, before checkpoint 3 is written; those of steps 1 and 2 stay. (The --lr 100 run
    below never needs this check: its loss turns non-finite first.)"""
    real_step, steps = build.AdamW.step, []

    def step_then_spoil_a_weight(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        steps.append(1)
        if len(steps) == 3:
            weight = self.param_groups[0]["params"][0]
            with torch.no_grad():  # under FSDP, this rank's shard
                (weight.to_local() if hasattr(weight, "to_local") else weight).view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(build.AdamW, "step", step_then_spoil_a_weight)
    out = tmp_path / "run"
    assert script_in_process(script, train_args(runs, out, "--save-every", "1")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: training diverged: the weights are not finite at step 3. Start again with a lower "
                      "--lr (was 0.001) or a longer --warmup-steps (was 2)"]
    saved = sorted(p.name.removesuffix(".pt") for p in out.glob("checkpoint-*"))
    assert saved == ["checkpoint-00000001", "checkpoint-00000002"] and not (out / "model.pt").exists()


@pytest.mark.parametrize("script, nproc", [("train_dp.py", 0), ("train_ddp.py", 2)])
def test_a_diverging_run_stops_with_one_line_and_saves_nothing_non_finite(runs, tmp_path, script, nproc, capsys):
    """--lr 100 blows up within a few steps. The run stops at the first non-finite loss or
    weights, names the step, exits non-zero, and leaves only finite checkpoints and valid JSON."""
    import json
    import math
    out = tmp_path / "run"
    args = train_args(runs, out, "--lr", "100", "--warmup-steps", "0", "--max-steps", "20", "--save-every", "1")
    if nproc:
        proc = run_script(script, args, nproc=nproc, check=False, wrapper="tests/inject_fault.py",
                          env=fault_env(tmp_path, "none", step=0))
        stderr = proc.stderr
        assert exit_codes(tmp_path) == {"exit-rank0": "2", "exit-rank1": "2"}
        assert proc.returncode == 1  # torchrun's status when a worker failed
    else:
        assert script_in_process(script, args) == 2
        stderr = capsys.readouterr().err
    ours = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, stderr
    assert ours[0].startswith("error: training diverged: the ") and "Start again with a lower --lr (was 100.0)" in ours[0]
    assert not (out / "model.pt").exists()
    saved = sorted(out.glob("checkpoint-*.pt"))
    assert saved  # the steps before the divergence were saved...
    for ckpt in saved:  # ...and every one of them holds finite weights
        state = torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
        assert all(torch.isfinite(w).all() for w in state.values()), ckpt.name

    def no_nan(text):
        raise ValueError(f"{text} is not JSON")
    rows = [json.loads(line, parse_constant=no_nan) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row.get("loss", 0.0)) for row in rows)


@pytest.mark.parametrize("damage", ["zero-windows", "cut-windows"])
def test_windows_damaged_while_a_run_trains_are_one_line_naming_their_cache_not_a_divergence(tmp_path, capsys,
                                                                                                  monkeypatch, damage):
    """The windows cache a run reads is memory-mapped: cut short in place, the next read of a
    page it lost killed the run (SIGBUS, no word said); cut and grown back, its zeros trained as
    windows without targets (this run to its end; a longer one stopped with "training diverged
    ... lower --lr"). Each is damaged data, said in one line that names the cache, before a
    batch of it is trained on."""
    corpus = write_corpus(tmp_path / "corpus.txt")  # a cache of its own: the other tests' stays whole
    out = tmp_path / "run"
    args = ["--dataset", str(corpus), *FAST, "--out-dir", str(out)]
    if damage == "cut-windows":  # a process of its own: without the check, SIGBUS kills it
        proc = run_script("train_dp.py", args, check=False, wrapper="tests/inject_fault.py",
                          env=fault_env(tmp_path, damage, step=5))
        status, stderr = proc.returncode, proc.stderr
    else:
        status, _, stderr = fault_in_this_process("train_dp.py", args, fault_env(tmp_path, damage, step=5),
                                                  monkeypatch, capsys)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert status == 2 and "Traceback" not in stderr, stderr
    how = "written in place" if damage == "zero-windows" else r"[\d,]+ bytes, now [\d,]+"
    assert len(errors) == 1 and re.fullmatch(
        rf"error: damaged data in the cached windows \S+/cache-\w+\.arrow: it changed while this run read it "
        rf"\({how}\)\. Remove that cache \(`datasets` makes it again\) and run again with --resume", errors[0]), errors
    assert checkpoint_step(out) == 4 and not (out / "model.pt").exists()  # nothing saved after the damage
