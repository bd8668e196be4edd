"""tests/fork_server.py, which launches most of the suite's runs: a forked launch is the launch a
new interpreter runs (its output, its exit status, its threads and atexit), a timeout ends it with
what it started, and a launch that another environment would import differently is not forked."""

import os
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
