"""check_cluster.py: launched like training, it tells in seconds whether the ranks agree and
communicate, and when they do not, which rank is the problem, in one line."""

import datetime
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, launch_env, script_in_process
from test_failures import fault_env
from tools import check_cluster


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def no_traceback_of_ours(stderr: str) -> bool:
    """torchrun prints a report of its own when a worker fails; no frame of our code is in it."""
    return not any(f"{name}\", line" in stderr for name in ["check_cluster.py", "launch.py", "stopping.py"])


def test_two_nodes_on_loopback_print_one_row_per_rank_a_correct_all_reduce_and_exit_0():
    """Two torchrun launchers, one rank each, meeting through a c10d rendezvous on loopback,
    as two machines would (test_failures.py trains the same way)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(minutes=2))
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
         "--rdzv-id=check", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}",
         "--rdzv-conf=is_host=false", str(REPO / "tools" / "check_cluster.py"), "--timeout-seconds", "30"],
        cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        outputs = [launcher.communicate(timeout=120) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    printed = "".join(stdout for stdout, _ in outputs).splitlines()  # rank 0 prints, on whichever node it is
    header = next(i for i, line in enumerate(printed) if line.startswith("rank "))
    assert printed[header].split() == ["rank", "node", "host", "local_rank", "device", "torch", "cuda", "nccl"]
    rows = [line.split() for line in printed[header + 1:header + 3]]
    assert [row[:2] for row in rows] in ([["0", "0"], ["1", "1"]], [["0", "1"], ["1", "0"]])  # a rank on each node
    # torch's build names its CUDA (a CUDA build of torch on a machine without GPUs too); NCCL only with a GPU
    assert all(row[-3:] == [torch.__version__, torch.version.cuda or "-", "-"] and "CPU," in " ".join(row)
               for row in rows)
    assert "all-reduce over gloo: correct on every rank (2)" in printed
    bandwidth = next(line for line in printed if line.startswith("bus bandwidth, all-reduce all 2 ranks on 2 nodes: "))
    assert len(bandwidth.split(" | ")) == 3 and all(part.endswith(" GB/s") for part in bandwidth.split(" | "))


def test_a_rank_that_never_joins_ends_the_others_within_the_timeout_with_one_line_naming_it(tmp_path):
    """Rank 1 blocks before the first all-reduce, as a rank cut off from the network would.
    Rank 0 stops waiting after --timeout-seconds, names rank 1 and the settings in effect, and
    the job ends; it does not hang until torch's 30-minute default."""
    timeout = 5
    env = launch_env({**fault_env(tmp_path, "stall-collective", step=0), "FAULT_RANK": "1",
                      "NCCL_SOCKET_IFNAME": "lo"})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "tests" / "inject_fault.py"), str(REPO / "tools" / "check_cluster.py"),
                             "--timeout-seconds", str(timeout)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    table_printed = None
    for line in proc.stdout:  # the table comes just before the all-reduce that rank 1 never joins
        if line.startswith("1 "):
            table_printed = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    ended = time.monotonic()
    assert proc.returncode != 0 and table_printed is not None
    assert ended - table_printed < timeout + 15, f"{ended - table_printed:.1f} s after the table"
    [line] = error_lines(stderr)
    assert line.startswith(f"error: all-reduce over gloo did not complete within {timeout} s: rank 1 of 2 never "
                           "joined it (rank 0 did). Network settings: MASTER_ADDR="), stderr
    assert " MASTER_PORT=" in line and " NCCL_SOCKET_IFNAME=lo" in line  # what was in effect
    assert line.endswith(". What to try: docs/multi-node.md")
    assert no_traceback_of_ours(stderr), stderr
    print(f"ended {ended - table_printed:.1f} s after the table, {ended - started:.1f} s after the launch")


@pytest.mark.parametrize("fault, message", [
    ("never-start", "error: rank facts over the store did not complete within 3 s: rank 1 of 2 never joined it "
                    "(rank 0 did). Network settings: "),
    ("same-rank", "error: two processes have RANK=0: give each process of the job its own rank (0 to 1), or start "
                  "them with torchrun"),
    ("other-world-size", "error: rank 1 has world_size 3, rank 0 has 2: every rank needs the same"),
])
def test_a_launch_gone_wrong_is_one_line_naming_the_rank_within_the_timeout(tmp_path, fault, message):
    """Rank 1 never starts, or starts as a second rank 0, or with another WORLD_SIZE. Each is
    named by one line, and the check that names it ends within its one deadline (--timeout-seconds 3;
    torchrun then ends the rank left waiting, before it records anything), whatever the timing of
    the ranks. The deadline is timed from that rank's start, as inject_fault.py records it:
    torchrun's launch of two interpreters before it takes 5 to 40 s on a busy 2-core machine, and
    says nothing of the check."""
    env = launch_env({**fault_env(tmp_path, fault, step=0), "FAULT_RANK": "1"})
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "inject_fault.py"), str(REPO / "tools" / "check_cluster.py"),
                           "--timeout-seconds", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    [line] = error_lines(proc.stderr)
    assert line.startswith(message), proc.stderr
    assert "exitcode  : 2" in proc.stderr and no_traceback_of_ours(proc.stderr)
    logs = tmp_path / "fault-logs"  # the rank that named the fault: either, when both say RANK=0
    named = [f.stem[len("exit-"):] for f in logs.glob("exit-rank*.txt") if f.read_text() == "2"]
    ran = {rank: float((logs / f"ran-{rank}.txt").read_text()) for rank in named}
    assert ran and max(ran.values()) < 3 + 12, ran  # the deadline, and the check's own imports and store
    print(f"{fault}: {ran} s, the launch {took:.1f} s in all")


def test_by_hand_without_torchrun_a_missing_rank_is_named_and_an_unreachable_store_is_one_line():
    """Launched by hand (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), rank 0 hosts the store
    and does not wait there for the others: rank 1, which never comes, is named after the
    deadline. Rank 1 alone, with no rank 0 to host the store, says so."""
    with socket.socket() as s:  # a port nobody listens on, once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    by_hand = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ended = {}
    for rank in (0, 1):
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_cluster.py"), "--timeout-seconds", "3"], cwd=REPO,
                              env=launch_env({**by_hand, "RANK": str(rank)}), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and no_traceback_of_ours(proc.stderr), proc.stderr
        [ended[rank]] = error_lines(proc.stderr)
    assert ended[0].startswith("error: rank facts over the store did not complete within 3 s: rank 1 of 2 never "
                               f"joined it (rank 0 did). Network settings: MASTER_ADDR=127.0.0.1 MASTER_PORT={port}")
    assert ended[1].startswith(f"error: rank 1 could not reach the job's store at 127.0.0.1:{port} in ")


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)], ids=["rank-1-larger", "rank-0-larger"])
def test_by_hand_two_processes_with_different_world_sizes_end_with_one_line_for_the_job(sizes):
    """Started by hand (no torchrun to end the other process), one process finds the
    difference and says it; the other, which waits for a rank that does not exist, sees
    that the job has ended and ends without a line of its own ("the store does not answer",
    once rank 0 had gone, was a guess)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(REPO / "tools" / "check_cluster.py"), "--timeout-seconds", "20"], cwd=REPO,
                              env=launch_env({"LOCAL_RANK": "0", "RANK": str(rank), "WORLD_SIZE": str(size),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, size in enumerate(sizes)]
    ended = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2]
    lines = [line for _, err in ended for line in error_lines(err)]
    assert lines == [f"error: rank 1 has world_size {sizes[1]}, rank 0 has {sizes[0]}: every rank needs the same"], ended


def test_a_rank_with_another_torch_makes_the_check_exit_2_naming_the_rank_and_both_versions(tmp_path):
    env = launch_env({**fault_env(tmp_path, "other-torch", step=0), "FAULT_RANK": "1"})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "inject_fault.py"), str(REPO / "tools" / "check_cluster.py"),
                           "--timeout-seconds", "30"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert error_lines(proc.stderr) == [f"error: rank 1 has torch 2.99.0, rank 0 has {torch.__version__}: every rank "
                                        "needs the same"], proc.stderr
    assert "exitcode: 2" in proc.stderr and no_traceback_of_ours(proc.stderr)
    assert "2.99.0" in proc.stdout  # the table shows it too


def test_any_difference_in_gpu_kind_or_nccl_is_called_out():
    a100 = {"world_size": 2, "node": 0, "host": "a", "local_rank": 0, "device": "A100", "gpu": "NVIDIA A100-SXM4-80GB",
            "torch": "2.13.0", "cuda": "13.0", "nccl": "2.27.3"}
    assert check_cluster.differences([a100, dict(a100, local_rank=1)]) is None
    assert check_cluster.differences([a100, dict(a100, gpu="NVIDIA H100 80GB HBM3")]) == (
        "rank 1 has gpu NVIDIA H100 80GB HBM3, rank 0 has NVIDIA A100-SXM4-80GB: every rank needs the same")
    assert check_cluster.differences([a100, a100, dict(a100, nccl="2.21.5")]).startswith("rank 2 has nccl 2.21.5")
    assert check_cluster.differences([a100, dict(a100, world_size=3)]) == (
        "rank 1 has world_size 3, rank 0 has 2: every rank needs the same")


@pytest.mark.parametrize("flags, message", [
    (["--timeout-seconds", "0"], "--timeout-seconds must be at least 1 and at most a day (86400), got 0"),
    (["--timeout-seconds", "1e-300"], "--timeout-seconds must be at least 1 and at most a day (86400), got 1e-300"),
    (["--timeout-seconds", "inf"], "--timeout-seconds must be at least 1 and at most a day (86400), got inf"),
    (["--timeout-seconds", "nan"], "--timeout-seconds must be at least 1 and at most a day (86400), got nan"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_are_one_line_and_exit_2(flags, message, capsys):
    if flags == ["--bogus"]:  # one as a user runs it, in a process of its own
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_cluster.py"), *flags], cwd=REPO,
                              env=launch_env(), capture_output=True, text=True, timeout=120)
        assert (proc.returncode, proc.stderr) == (2, f"error: {message}\n")
    else:  # the same entry point, in this process: seconds faster
        assert script_in_process("tools/check_cluster.py", flags) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
