"""tests/fork_server.py, which launches most of the suite's runs: a forked launch is the launch a
new interpreter runs (its output, its exit status, its threads and atexit), and so is each rank
that a forked torchrun forks in turn; a timeout ends a launch with what it started, and a launch
that another environment would import differently is not forked."""

import os
import re
import select
import subprocess
import sys

import pytest

from conftest import WORKER_ENVIRONMENT, fork_server, launch_env

SCRIPT = '''
import atexit, os, sys, threading
print("argv", sys.argv, "folder", os.getcwd(), "path", sys.path[0], "PERTURB", os.environ.get("PERTURB"), __name__)
print("progress\\r50%\\r100%\\r\\n", end="", file=sys.stderr)
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: threading.Event().wait(0.3) or print("the thread joined")).start()
how = sys.argv[1]
if how == "status 3":
    sys.exit(3)
if how == "a message":
    sys.exit("error: a message")
if how == "an exception":
    raise ValueError("boom")
'''


@pytest.mark.parametrize("how", ["status 0", "status 3", "a message", "an exception"])
@pytest.mark.parametrize("as_module", [False, True], ids=["python SCRIPT", "python -m MODULE"])
def test_a_forked_launch_prints_and_ends_as_a_new_interpreter(tmp_path, how, as_module):
    (tmp_path / "script.py").write_text(SCRIPT)
    argv = ["-m", "script", how] if as_module else [str(tmp_path / "script.py"), how]
    env = {**launch_env(), "PERTURB": "a wrapper's variable"}
    forked = fork_server().run(argv, tmp_path, env, timeout=60)
    anew = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert forked is not None, "the launch was not forked"
    assert (forked.returncode, forked.stdout, forked.stderr) == (anew.returncode, anew.stdout, anew.stderr)
    assert "atexit ran" in forked.stdout and "the thread joined" in forked.stdout


def test_a_module_the_server_imported_runs_as_a_new_interpreter_runs_it(tmp_path):
    """`python -m torch.distributed.run` (the real torchrun's agent), which the server imported:
    run as __main__ without runpy's warning that it was imported already."""
    argv = ["-m", "torch.distributed.run", "--help"]
    forked = fork_server().run(argv, tmp_path, launch_env(), timeout=60)
    anew = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=launch_env(), capture_output=True, text=True,
                          timeout=60)
    assert forked is not None and forked.stdout.startswith("usage: ")
    assert (forked.returncode, forked.stdout, forked.stderr) == (anew.returncode, anew.stdout, anew.stderr)


def test_a_forked_launch_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      f"open({str(tmp_path / 'pid')!r}, 'w').write(str(child.pid))\n"
                      "print('started', flush=True)\n"
                      "time.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        fork_server().run([str(script)], tmp_path, launch_env(), timeout=3)
    assert timeout.value.stdout == "started\n"
    grandchild = int((tmp_path / "pid").read_text())
    try:  # SIGKILL to the launch's process group: the sleeper it started ends too
        with os.fdopen(os.pidfd_open(grandchild)) as ended:  # readable once it has exited
            assert select.select([ended], [], [], 60)[0], f"process {grandchild}, started by the launch, still runs"
    except ProcessLookupError:
        pass  # ended and reaped already


def test_a_launch_whose_environment_the_imports_may_read_starts_a_new_interpreter(tmp_path):
    """HF_HOME is read when `datasets` is imported, which the server did in its own environment."""
    env = {**WORKER_ENVIRONMENT, "OMP_NUM_THREADS": "1"}
    assert fork_server().run([str(tmp_path / "script.py")], tmp_path, {**env, "HF_HOME": str(tmp_path)}, 60) is None


RANK_SCRIPT = '''
import atexit, os, signal, sys, threading
rank, how = os.environ["RANK"], sys.argv[2]
with open(os.path.join(sys.argv[1], "rank" + rank), "w") as f:
    f.write(str("torch" in sys.modules))  # imported already: forked from the agent, which has it
say = lambda line: sys.stdout.write(line + "\\n")  # one write: the ranks share the pipe
say(f"rank {rank} of {os.environ['WORLD_SIZE']} argv {sys.argv[2:]} path {sys.path[0]} leads its session "
    f"{os.getsid(0) == os.getpid()} SIGTERM {signal.getsignal(signal.SIGTERM)} "
    f"SIGINT {signal.getsignal(signal.SIGINT)}")
atexit.register(say, f"rank {rank}: atexit ran")
if how == "SIGTERM":  # rank 1 ends by the signal; torchrun then ends rank 0, which waits, with its own
    if rank == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait()
'''


@pytest.mark.parametrize("how", ["status 0", "SIGTERM"])
def test_the_ranks_of_a_forked_torchrun_are_forked_and_run_and_end_as_the_ranks_it_starts_anew(tmp_path, how):
    """The real torchrun's agent, forked, forks its ranks too (fork_server.fork_ranks): each runs as
    `python -u SCRIPT` would, in a session of its own, with a new interpreter's signal handlers (not
    the agent's), and torchrun sees it end as it sees a rank it started: the same exit statuses,
    the same failure report."""
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    ends = {}
    for launch in ("forked", "anew"):
        (tmp_path / launch).mkdir()
        argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(tmp_path / "script.py"),
                str(tmp_path / launch), how]
        proc = (fork_server().run(argv, tmp_path, launch_env(), timeout=120) if launch == "forked" else
                subprocess.run([sys.executable, *argv], cwd=tmp_path, env=launch_env(), capture_output=True,
                               text=True, timeout=120))
        assert proc is not None, "the launch was not forked"
        ends[launch] = (proc.returncode, sorted(proc.stdout.splitlines()),
                        set(re.findall(r"exitcode *: (-?\d+)", proc.stderr)))
        imported = {(tmp_path / launch / f"rank{rank}").read_text() for rank in (0, 1)}
        assert imported == {"True" if launch == "forked" else "False"}, f"{launch}: {imported}"
    assert ends["forked"] == ends["anew"]
    assert ends["anew"][2] == (set() if how == "status 0" else {"-15"})  # both ranks: SIGTERM's
