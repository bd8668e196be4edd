"""A process that has imported torch, datasets, tokenizers and torch's compiler, and runs each
script a test launches in a child forked from itself: `python SCRIPT ARGS` without the 6 s of
CPU (on a 2-core machine) that a new interpreter spends importing them, which is most of what a
short test run costs. conftest.run_script starts one per test worker, on first use, and sends
it the launches that a new interpreter would run the same way (no fault injected into a process
that may aim it at its launcher; in the environment the worker started with, give or take the
variables read only once a script runs): `python train_dp.py ...`, tests/torchrun_forked.py
(torchrun forking its ranks with its own fork start method), or the real torchrun's agent
(`python -m torch.distributed.run`), whose ranks are forked from it as `python -u SCRIPT`
(fork_ranks).

What a child does is what `python SCRIPT ARGS` does: the script runs as __main__ (runpy) with
sys.argv and sys.path[0] as python sets them, in the launch's folder and environment, writing
to the launch's stdout and stderr; an uncaught exception is printed and exits 1; at its end the
interpreter joins the non-daemon threads and runs atexit, as any process ends. Each child leads
a process group of its own, which a timeout kills (the real torchrun's ranks start sessions of
their own, as they do under subprocess.run). What a child shares with the server, as the ranks of
tests/torchrun_forked.py share with their launcher: the string hash seed, numpy's global RNG, and
the warnings that importing printed once, in the server.

The protocol, over a Unix socket pair from the test worker: one JSON request (argv, cwd, env,
unbuffered) with the stdout and stderr file descriptors passed beside it (SCM_RIGHTS), answered
by the child's pid, then by its exit status when it ends (negative: the signal that ended it,
as subprocess reports). The server ends when the worker closes its end."""

import atexit
import io
import json
import locale
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings


class ForkServer:
    """The test worker's end, starting the server in env. run() returns what
    subprocess.run(capture_output=True, text=True) would, or None where the launch must start a
    new interpreter instead: the server busy with another thread's launch, or an environment
    that differs from env in more than `forkable`, the variables read only once the child runs.
    Any other may be read while importing what the server imported (HF_*, TORCH*, ATEN_*,
    OMP_NUM_THREADS, PYTHONPATH...)."""

    def __init__(self, env: dict, forkable: set):
        self.env, self.forkable = dict(env), forkable
        self.conn, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                       env=self.env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.busy = threading.Lock()
        self.broken = False  # a launch left half-answered: the replies would be out of step

    def close(self):
        self.conn.close()  # the server's recv ends: it exits
        self.server.wait()

    def run(self, argv: list[str], cwd, env: dict, timeout: float, unbuffered: bool = False):
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        if (not differ <= self.forkable or self.broken or self.server.poll() is not None
                or not self.busy.acquire(blocking=False)):
            return None
        try:
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                request = {"argv": list(argv), "cwd": str(cwd), "env": env, "unbuffered": unbuffered}
                socket.send_fds(self.conn, [json.dumps(request).encode()], [out.fileno(), err.fileno()])
                pid = self.answer()["pid"]
                try:
                    returncode = self.answer(timeout)["returncode"]
                except TimeoutError:
                    try:  # the launch and its process group, as subprocess.run kills its child
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended meanwhile
                        pass
                    self.answer()
                    raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, text(out), text(err)) from None
                return subprocess.CompletedProcess([sys.executable, *argv], returncode, text(out), text(err))
        except subprocess.TimeoutExpired:
            raise
        except BaseException:
            self.broken = True  # later launches start new interpreters
            raise
        finally:
            self.busy.release()

    def answer(self, timeout: float | None = None) -> dict:
        if not select.select([self.conn], [], [], timeout)[0]:
            raise TimeoutError
        message = self.conn.recv(1 << 16)
        if not message:
            raise RuntimeError("tests/fork_server.py ended during a launch (its stderr says why)")
        return json.loads(message)


def text(file) -> str:
    """What a child wrote, read as subprocess.run(text=True) reads a pipe: the locale's encoding,
    universal newlines (tqdm's carriage returns become line ends)."""
    file.seek(0)
    return io.TextIOWrapper(io.BytesIO(file.read()), encoding=locale.getpreferredencoding(False)).read()


def serve(conn: socket.socket) -> str | None:
    """Forks a child for each request until the worker hangs up (then exits). Returns only in a
    child, made the launch it is to run: with the module of `python -m`, else None."""
    while True:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        if not message:
            sys.exit(0)  # the worker has ended
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            conn.close()
            return become(request, fds)
        for fd in fds:
            os.close(fd)
        reply(conn, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply(conn, {"returncode": os.waitstatus_to_exitcode(status)})


def reply(conn: socket.socket, message: dict):
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the worker is gone (pytest-timeout ended it): so is our reason to be
        sys.exit(0)


def become(request: dict, fds: list[int]) -> str | None:
    """This child is now `python ARGV` as the request launches it; returns the module of
    `python -m MODULE`, else None."""
    os.setsid()  # its own process group, which a timeout kills
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(fd, target)
        os.close(fd)
    if request["unbuffered"]:  # python -u
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["argv"][0] == "-m":  # python -m MODULE ARGS: the folder first on sys.path (runpy sets argv[0])
        sys.argv = ["-m", *request["argv"][2:]]
        sys.path[0] = os.getcwd()
        return request["argv"][1]
    sys.argv = list(request["argv"])  # python SCRIPT ARGS: the script's own folder first
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    return None


def run_as_main(module: str | None) -> int:
    """Runs the script sys.argv[0] (or the module) as its own __main__ and ends as python ends:
    an uncaught exception printed (exit status 1), SystemExit's code, the non-daemon threads
    joined, atexit run, stdout and stderr flushed. Then the caller leaves with os._exit, skipping
    what is left of the interpreter's ending, the teardown of every module: 2 s of CPU once torch
    is imported, and nothing a script relies on (every file it writes is closed by then)."""
    script = sys.argv[0]
    try:
        if module:  # what `python -m` runs, in a __main__ of its own
            sys.modules["__main__"] = types.ModuleType("__main__")
            sys.modules.pop(module, None)  # imported here, not by a new interpreter (runpy would warn)
            runpy._run_module_as_main(module, alter_argv=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException as e:
        tb = e.__traceback__  # from where python's own starts: runpy's frame for -m, else the script's
        while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ if module
                                  else tb.tb_frame.f_code.co_filename != script):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # as python reports an uncaught Ctrl-C: ended by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code or 0


class ForkedRank:
    """What torchrun's agent uses of a rank's subprocess.Popen, for a rank forked from the agent."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None:
                pidfd = os.pidfd_open(self.pid)  # readable once the process has ended
                try:
                    if not select.select([pidfd], [], [], timeout)[0]:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                finally:
                    os.close(pidfd)
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def fork_ranks():
    """In a child that is torchrun's agent (`python -m torch.distributed.run`): each rank it
    starts as `python -u SCRIPT ARGS` is forked from the agent instead, which imported torch
    already, and becomes that launch as become() makes any other: in a session of its own (as
    torchrun's Popen starts it), with a new interpreter's signal handlers, not the agent's
    (torchrun's, which would turn a SIGTERM into an exception). Everything else of the agent,
    torchrun's own code, runs as it does for a user: the rendezvous, the rank's environment,
    its monitoring, restarts and signals, and the exit status it reads. (A rank runs the exit
    functions registered before it was forked, as any child here does: the agent registers none
    of its own.) A launch it starts otherwise (numactl, PYTHON_EXEC) is started as torchrun
    starts it."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import \
            SubprocessHandler
    except ImportError:  # a torch without it: every rank starts anew
        return
    popen = SubprocessHandler._popen
    fresh_signals = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}  # the server's: python's own

    def _popen(handler, args, env):
        if tuple(args[:2]) != (sys.executable, "-u"):
            return popen(handler, args, env)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or what is buffered here would be written twice
        fds = [os.dup(f.fileno() if f else target) for f, target in ((handler._stdout, 1), (handler._stderr, 2))]
        with warnings.catch_warnings():  # Python 3.12 warns that the agent has threads; the child uses none of theirs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            for fd in fds:
                os.close(fd)
            return ForkedRank(pid, list(args))
        code = 1
        try:
            for sig, disposition in fresh_signals.items():
                if disposition is not None and signal.getsignal(sig) != disposition:
                    signal.signal(sig, disposition)
            module = become({"argv": list(args[2:]), "cwd": os.getcwd(), "env": env, "unbuffered": True}, fds)
            code = run_as_main(module)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)

    SubprocessHandler._popen = _popen


if __name__ == "__main__":
    # What every launch imports, imported once, here: torchrun_forked.py's list (torch, datasets,
    # tokenizers, the compiler, DCP, FSDP, torchrun). Ours (data, model, training) is left to each
    # child, as the script's own imports: a wrapper may patch them first.
    import torchrun_forked  # noqa: F401
    module = serve(socket.socket(fileno=int(sys.argv[1])))
    if module == "torch.distributed.run":
        fork_ranks()
    os._exit(run_as_main(module))  # in the child
