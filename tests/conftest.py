"""Shared fixtures: an offline, private `datasets` cache, a small corpus, and a runner
for the two training scripts (in a subprocess, as a user would run them)."""

import atexit
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Flags for a run that takes seconds: the tiny model on a small corpus with a tiny BPE.
# fp32 whatever the CPU: the exactness guarantees are fp32 guarantees (bf16 has its own tests).
FAST = ["--vocab-size", "300", "--seq-len", "32", "--batch-size", "8", "--max-steps", "8",
        "--warmup-steps", "2", "--log-every", "2", "--eval-every", "4", "--save-every", "4",
        "--val-docs", "8", "--dtype", "fp32"]
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


# Bitwise equality of two runs holds only at the same thread count: on some CPUs (seen on an
# Intel Xeon) kernels round differently with 1 and 2 threads. torchrun sets OMP_NUM_THREADS=1
# for its workers only when --nproc_per_node is above 1, so every launch here fixes it.
THREADS = {"OMP_NUM_THREADS": "1"}


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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def run_script(script: str, args: list[str], nproc: int = 0, wrapper: str | None = None,
               env: dict | None = None, check: bool = True, timeout: int = 600,
               torchrun_args: list[str] = ()) -> subprocess.CompletedProcess:
    """Run train_dp.py / train_ddp.py. nproc=0: plain python; nproc>0: torchrun with
    that many CPU processes (gloo). wrapper: a script that runs the trainer for us."""
    target = [str(REPO / wrapper), str(REPO / script)] if wrapper else [str(REPO / script)]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *torchrun_args, *target, *args]
    else:
        cmd = [sys.executable, *target, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=launch_env(env))
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def load_weights(out_dir: Path) -> dict:
    return torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True)


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, corpus):
    """Memoized training runs: runs(name, script, extra_args, nproc) -> out_dir.
    Several tests compare the same runs, so each is trained once per session."""
    done = {}
    root = tmp_path_factory.mktemp("runs")

    def get(name, script, extra=(), nproc=0, **kwargs):
        if name not in done:
            out = root / name
            run_script(script, ["--dataset", str(corpus), *FAST, "--out-dir", str(out), *extra],
                       nproc=nproc, **kwargs)
            done[name] = out
        return done[name]

    get.root, get.corpus = root, corpus
    return get


def ddp_two_ranks(runs):
    """The reference DDP run: torchrun with 2 gloo processes, every file write of each rank
    recorded (tests/record_writes.py; the recording changes nothing in training)."""
    return runs("ddp2", "train_ddp.py", nproc=2, wrapper="tests/record_writes.py",
                env={"WATCH_DIR": str(runs.root / "ddp2"), "WRITE_LOG_DIR": str(runs.root)})


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


SPEED = {"tokens_per_s", "tokens_per_s_nonpad", "flops_per_token", "tflops", "mfu"}


def without_speed(rows: list[dict]) -> list[dict]:
    """Metrics rows without the timing fields, the only ones that differ between equal runs."""
    return [{k: v for k, v in row.items() if k not in SPEED} for row in rows]
