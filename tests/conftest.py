"""Shared fixtures: an offline, private `datasets` cache, a small corpus, and a runner
for the two training scripts (in a subprocess, as a user would run them)."""

import atexit
import contextlib
import errno
import fcntl
import functools
import gzip
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from training.launch import usable_cores  # noqa: E402

# Flags for a run that takes seconds: the debug model on a small corpus with a tiny BPE (the
# model's arithmetic is most of what a test run costs: `tiny`'s took 4 times as long).
# fp32 whatever the CPU: the exactness guarantees are fp32 guarantees (bf16 has its own tests).
MODEL = "debug"
FAST = ["--model", MODEL, "--vocab-size", "300", "--seq-len", "32", "--batch-size", "8", "--max-steps", "8",
        "--warmup-steps", "2", "--log-every", "2", "--eval-every", "4", "--save-every", "4",
        "--val-docs", "9", "--dtype", "fp32"]
# 9 held-out documents: ranks of a world of 2 (or 4) evaluate different numbers of them, so
# DDP's unpadded sharding and FSDP's padding sequence run wherever a val loss is compared.
# The same, for runs given --tokenizer: the tokenizer brings its vocabulary, and --vocab-size
# next to --tokenizer is an error.
_VOCAB = FAST.index("--vocab-size")
FAST_WITH_TOKENIZER = FAST[:_VOCAB] + FAST[_VOCAB + 2:]


# No test touches the network or the user's ~/.cache, and no progress bar clutters stderr.
# Set at import, before any test module imports `datasets` (which reads these once, on
# import); subprocesses inherit them.
_HF_HOME = tempfile.mkdtemp(prefix="hf_home_")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ.update(HF_HOME=_HF_HOME, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                  TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
# torch.compile keeps its generated kernels in an on-disk cache that ATEN_CPU_CAPABILITY does
# not key: on one machine, a suite run as another CPU (ATEN_CPU_CAPABILITY=avx2) after a run
# as itself reused the other's kernels and trained NaNs (and the reverse corrupted the heap).
# Each capability gets a cache of its own.
if "ATEN_CPU_CAPABILITY" in os.environ:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


# The environment every test starts from (a test's changes are undone: PROCESS_STATE)
WORKER_ENVIRONMENT = dict(os.environ)


# Bitwise equality of two runs holds only at the same thread count: on some CPUs (seen on an
# Intel Xeon) kernels round differently with 1 and 2 threads. torchrun sets OMP_NUM_THREADS=1
# for its workers only when --nproc_per_node is above 1, so every launch here fixes it.
THREADS = {"OMP_NUM_THREADS": "1"}

# pytest-xdist's workers (pytest.ini) share the cores, so each computes in-process on its share,
# as torchrun gives its workers theirs: two workers of two threads each on two cores made
# OpenMP's threads wait on each other, and bench.py's in-process rows ran 3x slower.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, usable_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def launch_env(extra: dict | None = None) -> dict:
    """The environment of every training process a test starts: ours, one thread each."""
    return {**os.environ, **THREADS, **(extra or {})}


def write_corpus(path: Path, n_docs: int = 240, seed: int = 0) -> Path:
    """One document per line, 3 to 40 words: many shorter than --seq-len 32 (padded,
    by different amounts) and some longer (clipped)."""
    rng = random.Random(seed)
    words = ("the model reads tokens and predicts the next one while gradients flow back "
             "through every layer of the network until the optimizer takes a step").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(n_docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def shared_dir(tmp_path_factory) -> Path:
    """The session's folder for what is made once per test run. Under pytest-xdist each worker
    is a session of its own: then the folder all workers share, so that each run is still
    trained once, by whichever worker needs it first."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def exclusive(lock: Path):
    """Holds an flock on `lock`: the other workers wait here until we are done (each wait is
    bounded by pytest-timeout, like the work it waits for)."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # unlocked, not only closed: a process forked while we held it (a streamed run's loader
            # worker, trained in this process, that outlives the run) shares the lock until it
            # exits, and the next test to ask for it here would wait forever (seen under xdist)
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def h100_trace(tmp_path_factory) -> Path:
    """tests/fixtures/'s trace of an H100's two steps (its README), unpacked as the trainer writes it."""
    path = tmp_path_factory.mktemp("h100") / "run" / "profile" / "rank0.steps25-26.pt.trace.json"
    path.parent.mkdir(parents=True)
    with gzip.open(REPO / "tests/fixtures/h100-ddp-packed-compiled.rank0.steps25-26.pt.trace.json.gz") as f:
        path.write_bytes(f.read())
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = shared_dir(tmp_path_factory) / "corpus.txt"
    with exclusive(path.with_suffix(".lock")):
        if not path.exists():
            write_corpus(path.with_suffix(".tmp")).rename(path)
    return path


def run_script(script: str, args: list[str], nproc: int = 0, wrapper: str | None = None,
               env: dict | None = None, check: bool = True, timeout: int = 600,
               torchrun_args: list[str] = (), real_torchrun: bool = False) -> subprocess.CompletedProcess:
    """Runs a script as a user would: nproc=0, `python SCRIPT ARGS`; nproc>0, torchrun with that
    many CPU processes (gloo). wrapper: a script that runs the trainer for us. Cheapest first,
    where the test allows:
    - The ranks of a run that must succeed (check) and injects no fault are forked after the
      imports, by tests/torchrun_forked.py. Any other's, whose subject may be the launch itself,
      are started by the real torchrun, as a user's are; so are real_torchrun's: a rank that ends
      with os._exit, which a forked rank's torchrun would wait on until the timeout, and a GPU
      run. (A forked rank keeps torchrun's signal handlers: a run sent a signal uses the real one.)
    - The process itself (the script, tests/torchrun_forked.py, or the real torchrun's agent) is
      forked from this worker's tests/fork_server.py, which imported torch once: 6 s of CPU less
      a launch. The real torchrun's agent forks its ranks in turn (fork_server.fork_ranks), each
      as a rank it starts anew. Not with real_torchrun, nor a fault injected into one process (it
      may aim at the process that launched it), nor in an environment the server's imports would
      read otherwise."""
    target = [str(REPO / wrapper), str(REPO / script)] if wrapper else [str(REPO / script)]
    env = launch_env(env)
    if nproc:
        forked_ranks = check and not torchrun_args and wrapper != "tests/inject_fault.py" and not real_torchrun
        launcher = ["-u", str(REPO / "tests/torchrun_forked.py")] if forked_ranks else ["-m", "torch.distributed.run"]
        cmd = [sys.executable, *launcher, "--standalone", f"--nproc_per_node={nproc}", *torchrun_args, *target, *args]
    else:
        cmd = [sys.executable, *target, *args]
    forked = not real_torchrun and (nproc or wrapper != "tests/inject_fault.py")
    unbuffered = cmd[1] == "-u"  # python's flag, before the script
    proc = fork_server().run(cmd[1 + unbuffered:], REPO, env, timeout, unbuffered=unbuffered) if forked else None
    if proc is None:  # not forked, or not forkable: another environment, the server busy with another thread
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@functools.cache
def fork_server():
    """This worker's tests/fork_server.py, started on first use, in the environment the worker
    started with (a test's own changes to it start new interpreters); ended with the worker."""
    from fork_server import ForkServer
    server = ForkServer({**WORKER_ENVIRONMENT, **THREADS}, FORKABLE_VARIABLES)
    atexit.register(server.close)
    return server


def load_weights(out_dir: Path) -> dict:
    return torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True)


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# What a training run may change in the process that runs it: StopSignal's handlers, the lock
# on --out-dir (held until the process exits), the thread count and the RNG.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextlib.contextmanager
def isolated(argv: list[str]):
    """Run a script's code in this process with sys.argv = argv and one thread, as run_script's
    processes have, and leave nothing behind: the signal handlers, the --out-dir lock, the
    thread count, the float32 matmul precision (a run on CUDA sets TF32), the RNG state and
    sys.argv are restored afterwards."""
    from training import run_folder
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    threads, rng, locks, saved_argv = torch.get_num_threads(), torch.get_rng_state(), len(run_folder._LOCKS), sys.argv
    precision = torch.get_float32_matmul_precision()
    sys.argv = argv
    torch.set_num_threads(1)
    try:
        yield
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        torch.set_rng_state(rng)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for fd in run_folder._LOCKS[locks:]:
            os.close(fd)  # releases the flock, as the end of a process would
        del run_folder._LOCKS[locks:]


def script_in_process(script: str, args: list[str]) -> int:
    """`python SCRIPT ARGS` (a world of one for the torchrun scripts) in this process, through
    the script's own `if __name__ == "__main__"` lines (runpy), isolated: the whole path a
    user's command takes, seconds faster than a new process, which imports torch and datasets
    first. Returns its exit status; what it prints is left to capsys."""
    import runpy
    with isolated([script, *args]):
        try:
            runpy.run_path(str(REPO / script), run_name="__main__")
        except SystemExit as e:
            return e.code
    return 0


def run_in_process(script: str, args: list[str]) -> str:
    """script_in_process for a run that must succeed; returns what it printed."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = script_in_process(script, args)
    assert status == 0, f"{script} {' '.join(args)} exited with {status}:\n{stdout.getvalue()}"
    return stdout.getvalue()


def train(script: str, args: list[str], nproc: int = 0, perturb: str | None = None, spy_dir: Path | None = None,
          **kwargs) -> str:
    """A run that must succeed; returns what it printed. perturb: a change of tests/perturb.py;
    spy_dir: record its arithmetic there (tests/spy.py). One process without --compile (whose
    generated code would stay behind) and without a wrapper runs in this process; any other
    run in its own, with perturb.py or spy.py as its wrapper."""
    from perturb import perturbed
    from spy import recording
    if nproc == 0 and not kwargs and "--compile" not in args:
        with contextlib.ExitStack() as changes:
            if perturb:
                changes.enter_context(perturbed(perturb))
            if spy_dir:
                changes.enter_context(recording(spy_dir))
            return run_in_process(script, args)
    assert not (perturb and spy_dir), "one wrapper at a time"
    if perturb:
        kwargs.update(wrapper="tests/perturb.py", env={"PERTURB": perturb})
    if spy_dir:
        kwargs.update(wrapper="tests/spy.py", env={"SPY_DIR": str(spy_dir)})
    return run_script(script, args, nproc=nproc, **kwargs).stdout


# What one test could change for the tests after it in the same worker: each read here, and
# set back with its setter. (TF32 on, a test comparing fp32 kernels later reads 1e-3 of rounding.)
PROCESS_STATE = {
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "thread count": (torch.get_num_threads, torch.set_num_threads),
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "working directory": (os.getcwd, os.chdir),
    "environment": (lambda: {k: v for k, v in os.environ.items() if k not in NOT_THE_TESTS},
                    lambda env: os.environ.update(env) or [os.environ.pop(k) for k in set(os.environ) - set(env)
                                                           if k not in NOT_THE_TESTS]),
}
# Variables libraries set for themselves, once: pytest's name of the test running; inductor's cache
# folder and its own pointer (set on its first use), and on CUDA Triton's cache folder and ptxas (set
# by the first kernel inductor compiles for a GPU); W&B's service, started by the first wandb.init
NOT_THE_TESTS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                 "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "WANDB_SERVICE"}
# What a launch forked from tests/fork_server.py may set beside the worker's environment: those,
# and the variables of our wrappers (perturb.py, spy.py, record_writes.py, inject_fault.py), all
# read once the script runs, never while importing what the server imported.
FORKABLE_VARIABLES = NOT_THE_TESTS | {"PERTURB", "SPY_DIR", "WATCH_DIR", "WRITE_LOG_DIR", "FAULT", "FAULT_STEP",
                                      "FAULT_RANK", "FAULT_AFTER_FILE", "FAULT_BYTES", "FAULT_SECONDS", "FAULT_LOG_DIR"}


@pytest.fixture
def unlistable(monkeypatch):
    """unlistable(folder): os.scandir (what os.walk lists a folder with) fails on that folder as it
    fails for a user on a folder of mode 000. chmod itself cannot show it here: the tests run as
    root, whose override lists any folder."""
    def make(folder: Path):
        listing = os.scandir

        def scandir(path="."):
            if os.path.realpath(path) == os.path.realpath(folder):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return listing(path)
        monkeypatch.setattr(os, "scandir", scandir)
    return make


@pytest.fixture
def matmul_precision():
    """For a test that sets the float32 matmul precision (launch.compute_dtype does, for CUDA):
    set back after it, as every test must leave it (PROCESS_STATE)."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(autouse=True)
def leaves_the_test_process_as_it_found_it():
    """Every test starts from the same RNG state, so unseeded inputs do not depend on which
    tests ran before; and no test may leave a signal handler, an --out-dir lock or any of
    PROCESS_STATE changed behind (a leftover SIGTERM handler would make pytest ignore CI's
    SIGTERM): what it changed is set back, and the test fails, naming it."""
    from training import run_folder
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    locks = list(run_folder._LOCKS)
    rng, py_rng = torch.get_rng_state(), random.getstate()
    state = {name: get() for name, (get, _) in PROCESS_STATE.items()}
    torch.manual_seed(0)
    random.seed(0)
    yield
    torch.set_rng_state(rng)
    random.setstate(py_rng)
    now = {name: get() for name, (get, _) in PROCESS_STATE.items()}
    changed = {name: now[name] for name in now if now[name] != state[name]}
    if "environment" in changed:  # which variables
        was = state["environment"]
        changed["environment"] = {k: (was.get(k), v) for k, v in {**was, **now["environment"]}.items()
                                  if was.get(k) != now["environment"].get(k)}
    for name in changed:
        PROCESS_STATE[name][1](state[name])
    assert not changed, f"the test left the process changed: {changed}"
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == handlers, "the test left signal handlers behind"
    assert run_folder._LOCKS == locks, "the test left an --out-dir locked"


@pytest.fixture(scope="session")
def runs(tmp_path_factory, corpus):
    """Memoized training runs: runs(name, script, extra_args, nproc) -> out_dir.
    Several tests compare the same runs, so each is trained once per test run (once across
    pytest-xdist's workers: the first to ask trains it, the others wait and reuse it). A
    cached run is never changed: a test that resumes one resumes its own copy (runs.copy). A
    plain one-process run (no wrapper) runs in the asking process; runs.output[name] is what
    it printed."""
    get = memoized_runs(shared_dir(tmp_path_factory) / "runs", ["--dataset", str(corpus), *FAST])
    get.corpus = corpus
    return get


def memoized_runs(root: Path, base: list[str]):
    """The `runs` fixture's runner for runs of `base` args (the data and the flags), each run's
    folder in `root`: runs(name, script, extra_args, nproc, **run_script's) -> out_dir."""
    root.mkdir(exist_ok=True)
    done, output = {}, {}

    def get(name, script, extra=(), nproc=0, **kwargs):
        how = json.loads(json.dumps([script, list(extra), nproc, kwargs], default=str))
        out, record = root / name, root / f"{name}.json"
        if name not in done:
            with exclusive(root / f"{name}.lock"):
                if not record.exists():
                    args = [*base, "--out-dir", str(out), *extra]
                    # a cached run trained in this process prints nothing into the asking test's
                    # capsys: what that test reads is its own (the progress bar goes to stderr)
                    with contextlib.redirect_stderr(io.StringIO()):
                        printed = train(script, args, nproc, **kwargs)
                    record.write_text(json.dumps({"how": how, "output": printed}))
            done[name] = json.loads(record.read_text())
            output[name] = done[name]["output"]
        assert done[name]["how"] == how, f"run {name!r} was cached with other arguments: {done[name]['how']}"
        return out

    def copy(run: Path, to: Path) -> Path:
        shutil.copytree(run, to)
        return to

    get.root, get.output, get.copy = root, output, copy
    return get


def stopped_at_step_4(runs, tmp_path: Path, script: str = "train_dp.py") -> Path:
    """A copy of a run stopped at step 4 (--stop-at-step), to resume: the cached run stays as it was."""
    half = runs(f"{script.removesuffix('.py')}_stop4", script, ["--stop-at-step", "4"])
    return runs.copy(half, tmp_path / "half")


def spied(runs, name: str, script: str, extra=(), nproc: int = 0) -> tuple[Path, list[dict]]:
    """runs(...) under tests/spy.py: the run, and what each rank's arithmetic really was."""
    spy_dir = runs.root / f"{name}-spy"
    spy_dir.mkdir(exist_ok=True)
    out = runs(name, script, extra, nproc, spy_dir=spy_dir)
    return out, [json.loads(p.read_text()) for p in sorted(spy_dir.glob("rank*.json"))]


def ddp_two_ranks(runs):
    """The reference DDP run: torchrun with 2 gloo processes, every file write of each rank
    recorded (tests/record_writes.py; the recording changes nothing in training)."""
    return runs("ddp2", "train_ddp.py", nproc=2, wrapper="tests/record_writes.py",
                env={"WATCH_DIR": str(runs.root / "ddp2"), "WRITE_LOG_DIR": str(runs.root)})


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


SPEED = {"tokens_per_s", "tokens_per_s_nonpad", "flops_per_token", "tflops", "mfu", "data_wait_fraction"}


def without_speed(rows: list[dict], leave_out=()) -> list[dict]:
    """Metrics rows without the timing fields, the only ones that differ between equal runs,
    and without the fields in leave_out (those a comparison makes apart)."""
    return [{k: v for k, v in row.items() if k not in SPEED and k not in leave_out} for row in rows]


# ---- Comparing two runs ----------------------------------------------------------------
# Two runs that train the same model on the same tokens end bitwise equal only if they also
# add in the same order. Another world size, gradient accumulation, FSDP's clipping (each
# gradient's norm from its shards' norms) and compiled kernels add in another order: their
# weights then differ by rounding, which AdamW amplifies where gradients are near zero, and
# by how much depends on the CPU's kernels (AVX-512, AVX2, ATEN_CPU_CAPABILITY=default). So
# no bound here is a number seen on one machine. Each is FLOOR_MULTIPLE times a rounding
# floor measured in the same session: the distance between the plain one-process run and
# the same run with the sequences of every micro-batch in reverse order (tests/perturb.py):
# the same tokens and weights, only added up in another order.
#
# Measured by `python tests/calibrate_tolerances.py DIR` (these settings: the debug model, 8
# steps, fp32), as multiples of the floor, on an AMD EPYC with AVX2 / the same under
# ATEN_CPU_CAPABILITY=default:
#   floor: weights 1.2e-7 / 1.2e-7, logged losses 1.2e-7 / 1.2e-7 (relative: one float32 ulp)
#   DDP(2) vs one process         1.0x / 0.5x      grad-accum 2 vs none             1.0x / 0.5x
#   DDP(2) with grad-accum 2      1.0x / 0.5x      FSDP(2) vs DDP(2), clipping on   0.1x / 0.5x
#   FSDP(2), grad-accum 2 vs none 1.0x / 0.5x      compiled vs eager                1.0x / (no compile)
#   the logged losses of every pair: at most 0.8x their floor
# The mutants such a bound must catch (tests/perturb.py), weights / logged losses, both kinds:
#   one micro-batch of 16 dropped    31,000x / 26,000x
#   the LR schedule one step ahead   49,000x / 160,000x
#   each rank's own mean (DDP)       17,600x / 9,600,000x
# 20x leaves 20x of room above the largest honest distance (a CPU that rounds otherwise, as
# `tiny` did here, reached 4.5x) and 880x below the nearest bug.
FLOOR_MULTIPLE = 20

# bf16 against fp32 is no reordering: it is another arithmetic, and its weights differ as
# much as a bug's do (2e-3 after 8 steps). bf16 runs are compared by their logged losses,
# within BF16_MULTIPLE times the bf16 floor: what one rounding to bf16 does to the losses, the
# fp32 run against the fp32 run from its initial weights rounded to bf16 (tests/perturb.py), a
# stand-in of the size and kind of the roundings autocast makes at every matmul.
# A floor of reordered bf16 runs measured the summation order of the CPU's bf16 kernels, not
# bf16: under an Intel Xeon's AMX kernels it fell 16x while bf16's distance from fp32 did not
# move (23x the floor), yet under AVX2 it was 2.8x.
# Every kernel rounds the inputs of a bf16 matmul to bf16 alike (8 bits of mantissa), whatever
# order it then adds them in, so bf16's distance from fp32 is set by that rounding on every
# CPU; and the floor's own arithmetic is fp32, whose rounding is 100x below the 2^-9 of one bf16
# rounding: it is nearly the same number on every CPU (3.03e-5 here under every ISA tried).
# Measured by tests/calibrate_tolerances.py, as multiples of that floor, on an AMD EPYC with
# AVX-512 and avx512_bf16 (oneDNN's AVX512_CORE_BF16 kernels) / ONEDNN_MAX_CPU_ISA=AVX2 /
# ATEN_CPU_CAPABILITY=default: train_dp.py bf16 vs fp32 0.7x / 1.0x / 0.8x; DDP(2) bf16 +
# compile vs fp32 1.2x / 0.7x; FSDP(2) bf16 vs FSDP(1) bf16 0.8x / 1.0x / 0.5x. On an
# Intel Xeon with AMX (the same runs measured against the old floor): bf16 vs fp32 2.40e-5 =
# 0.8x, FSDP(2) bf16 vs FSDP(1) 3.86e-5 = 1.3x. Mutants: one micro-batch dropped 56-57x, the LR
# schedule one step ahead 700x. 8x: 6x above the largest honest distance, 7x below the
# nearest mutant.
# FSDP's bf16 is compared with FSDP's own: it gathers every weight in bf16, so its residual
# stream is bf16 too where autocast keeps it fp32, which puts it 7x the floor from fp32
# after 8 steps, by design.
BF16_MULTIPLE = 8


@dataclass(frozen=True)
class Floor:
    weights: float  # max |w_plain - w_reordered| over every weight
    loss: float     # max relative difference of a logged loss or val loss


LOSSES = ("loss", "val_loss", "val_bpb")  # val_bpb: the held-out loss in bits per byte, a loss too


def logged_losses(run: Path) -> list:
    """Every loss and val loss run logged, row by row (None where a row has none)."""
    return [row.get(k) for row in metrics(run) for k in LOSSES]


def loss_distance(a: Path, b: Path) -> float:
    """The largest relative difference between the losses a and b logged."""
    return max(abs(x - y) / abs(y) for x, y in zip(logged_losses(a), logged_losses(b)) if y is not None)


def max_loss_diff(a: Path, b: Path) -> float:
    """loss_distance, after checking that a and b logged the same rows (steps, epochs,
    learning rates) and the same kinds of loss."""
    def rest(run):  # grad_norm: a norm rounds apart from the losses (test_metrics.py compares it)
        return without_speed(metrics(run), leave_out=LOSSES + ("grad_norm",))
    assert rest(a) == rest(b)
    assert [x is None for x in logged_losses(a)] == [y is None for y in logged_losses(b)]
    return loss_distance(a, b)


def measure_floor(plain: Path, reordered: Path) -> Floor:
    weights = load_weights(plain)
    # never below one rounding step of float32: a machine where reversing changed nothing
    # still allows the smallest difference another order can make
    ulp = torch.finfo(torch.float32).eps
    largest = max(w.abs().max().item() for w in weights.values())
    return Floor(weights=max(max_weight_diff(weights, load_weights(reordered)), ulp * largest),
                 loss=max(max_loss_diff(reordered, plain), ulp))


REVERSED = {"perturb": "reverse-batches"}


@pytest.fixture(scope="session")
def floor(runs) -> Floor:
    """The rounding floor of the fp32 runs (see FLOOR_MULTIPLE), measured on this machine."""
    return measure_floor(runs("dp", "train_dp.py"), runs("dp_reversed", "train_dp.py", **REVERSED))


# The bf16 runs train FAST's 8 steps and log every one: their floor is the largest distance over
# 8 losses and 4 val losses. The fp32 reference logs as they do.
BF16 = ["--dtype", "bf16", "--log-every", "1", "--eval-every", "2", "--save-every", "2"]
FP32_LIKE_BF16 = ["--dtype", "fp32", *BF16[2:]]


@pytest.fixture(scope="session")
def bf16_floor(runs) -> Floor:
    """What rounding to bf16 does to the logged losses (see BF16_MULTIPLE), in fp32 arithmetic."""
    rounded = runs("dp_short_bf16_weights", "train_dp.py", FP32_LIKE_BF16, perturb="bf16-weights")
    return measure_floor(runs("dp_short", "train_dp.py", FP32_LIKE_BF16), rounded)


def assert_within(what: str, distance: float, floor: float, multiple: int):
    """distance <= multiple x floor; the distance is printed as a multiple of the floor, for the record."""
    print(f"{what} {distance:.2e} = {distance / floor:.1f}x the floor {floor:.2e}")
    assert distance <= multiple * floor, f"{what} {distance:.3e}, floor {floor:.3e}"


def assert_same_weights(a: Path, b: Path, floor: Floor | None = None):
    """Runs a and b ended with the same weights: bitwise with floor=None, else within
    FLOOR_MULTIPLE times the floor."""
    distance = max_weight_diff(load_weights(a), load_weights(b))
    if floor is None:
        assert distance == 0.0
        return
    assert_within("weights", distance, floor.weights, FLOOR_MULTIPLE)


def assert_same_metrics(a: Path, b: Path, floor: Floor | None = None):
    """Runs a and b logged the same rows (timings aside): bitwise, or their losses within
    FLOOR_MULTIPLE times the floor and everything else equal."""
    if floor is None:
        assert without_speed(metrics(a)) == without_speed(metrics(b))
        return
    assert_within("losses", max_loss_diff(a, b), floor.loss, FLOOR_MULTIPLE)


def assert_same_model(a: Path, b: Path, floor: Floor | None = None):
    """Runs a and b trained the same model: the same weights and the same logged rows."""
    assert_same_weights(a, b, floor)
    assert_same_metrics(a, b, floor)


# An untrained model's loss is ln(300) = 5.70 on every batch of the corpus, within a few
# hundredths; the debug model takes 0.2 to 0.45 off it in the few updates of a test's run.
LEARNS = 0.15


def assert_learns(rows: list[dict]):
    """The run learns: its last logged loss is LEARNS below its first (rows: metrics.jsonl's)."""
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses[-1] < losses[0] - LEARNS, losses


def assert_follows_in_bf16(run: Path, reference: Path, bf16_floor: Floor):
    """A bf16 run trained the model its reference (the fp32 run, or for FSDP its own bf16 in
    a world of one) trained: it learns, and every loss it logs is within BF16_MULTIPLE times
    the bf16 floor of the reference's."""
    assert_learns(metrics(run))
    assert_within("losses (bf16)", max_loss_diff(run, reference), bf16_floor.loss, BF16_MULTIPLE)
