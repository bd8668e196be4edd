"""Measure the data feed: train_dp.py with each step's batches read ahead, in a thread, while
the step before runs (training/read_ahead.py), against the same run reading them in turn,
with the dataset made slow on purpose (--read-ms a batch read), side by side in one run.

    python benchmarks/bench_read_ahead.py                  # the tiny demo model, 40 steps
    python benchmarks/bench_read_ahead.py --read-ms 50 -- --model article --batch-size 16

The slow read sleeps (as a read from a slow disk or network waits, without the GIL); each
row is the median of --rounds runs of each kind, taking turns: data_wait_fraction (the share
of the wall time the loop waited for a batch) and real tokens a second, from metrics.jsonl.
Read ahead, the wait falls to what a step does not cover of the read.
"""

import argparse
import contextlib
import io
import json
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root, from any folder


def parse_args(argv=None):
    from training.errors import ArgumentParser, at_least
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--read-ms", type=at_least(0.0, float), default=100.0,
                   help="milliseconds each batch read waits, on top of its work")
    p.add_argument("--max-steps", type=at_least(1), default=40, help="steps a run")
    p.add_argument("--rounds", type=at_least(1), default=3, help="runs of each kind, taking turns")
    p.add_argument("trainer_flags", nargs="*", help="more flags for train_dp.py (after --)")
    return p.parse_args(argv)


class InTurn:
    """ReadAhead's interface, reading each step only when it is asked for: the feed before it."""

    def __init__(self, loader, grad_accum, device, steps):
        from training.read_ahead import on_device
        self.batches, self.grad_accum, self.device, self.steps, self.on_device = (
            iter(loader), grad_accum, device, steps, on_device)

    def __iter__(self):
        return self

    def __next__(self):
        if self.steps == 0:
            raise StopIteration
        self.steps -= 1
        return [self.on_device(next(self.batches), self.device) for _ in range(self.grad_accum)]


def trainer_argv(args, out_dir: Path) -> list[str]:
    """train_dp.py's flags for a run: the benchmark's, then the user's after --, which win (but
    for its folder, a temporary one: check_trainer_flags refuses an --out-dir)."""
    return ["--out-dir", str(out_dir), "--max-steps", str(args.max_steps), "--log-every", "5",
            "--eval-every", str(args.max_steps), "--save-every", str(args.max_steps), *args.trainer_flags]


def check_trainer_flags(args, out_dir: Path):
    """Before the first run: the trainer's flags as train_dp.py checks them (its own line for a
    bad one), and steps enough for a median of its logged rows after the first."""
    from training import config
    from training.errors import UsageError
    try:
        cfg = config.parse_args(trainer_argv(args, out_dir))
    except UsageError as e:
        raise UsageError(f"train_dp.py {' '.join(args.trainer_flags)}: {e}") from None
    if Path(cfg.out_dir) != out_dir:  # the user's would be trained into, round after round, or else ignored
        raise UsageError(f"train_dp.py --out-dir {cfg.out_dir}: bench_read_ahead.py runs the trainer in temporary "
                         "folders of its own: leave --out-dir out")
    steps = min(cfg.max_steps, cfg.stop_at_step or cfg.max_steps)
    if steps <= cfg.log_every:
        raise UsageError(f"--max-steps {steps}: too few steps for a median: train_dp.py logs every {cfg.log_every} "
                         "steps, and the first row is left out (it waits for the first read); give --max-steps "
                         f"{cfg.log_every + 1} or more")


def one_run(args, ahead: bool, out_dir: Path) -> dict:
    """train_dp.py in this process, its reads slowed; the medians of its logged rows. A run that
    fails is one line: the trainer's own."""
    import data
    from training import read_ahead
    from training.errors import UsageError
    real_getitems, real_read_ahead = data.PaddedSequenceDataset.__getitems__, read_ahead.ReadAhead

    def slow_getitems(self, indices):
        time.sleep(args.read_ms / 1e3)
        return real_getitems(self, indices)
    data.PaddedSequenceDataset.__getitems__ = slow_getitems
    read_ahead.ReadAhead = real_read_ahead if ahead else InTurn
    sys.argv = ["train_dp.py", *trainer_argv(args, out_dir)]
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
            runpy.run_path(str(REPO / "train_dp.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):  # its exit_on_usage_error printed one line (or "interrupted")
            lines = [line for line in said.getvalue().splitlines() if line.strip()]
            line = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1] if lines else "")
            if e.code != 2:
                print(line, file=sys.stderr)
                raise
            raise UsageError(f"train_dp.py {' '.join(args.trainer_flags)}: {line.removeprefix('error: ')}") from None
    finally:
        data.PaddedSequenceDataset.__getitems__, read_ahead.ReadAhead = real_getitems, real_read_ahead
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "data_wait_fraction" in row][1:]  # the first interval holds the first read
    if not rows:  # an epoch shorter than --max-steps
        raise UsageError(f"train_dp.py {' '.join(args.trainer_flags)}: too few steps for a median: the run logged "
                         "one interval, which is left out (it waits for the first read); give it more data or epochs")
    return {key: statistics.median(row[key] for row in rows) for key in ("data_wait_fraction", "tokens_per_s_nonpad")}


def main():
    args = parse_args()
    import torch
    results = {"in turn": [], "read ahead": []}
    with tempfile.TemporaryDirectory() as tmp:
        check_trainer_flags(args, Path(tmp) / "flags")
        for r in range(args.rounds):  # the kinds take turns: the machine's drift falls on both
            for name in results:
                results[name].append(one_run(args, name == "read ahead", Path(tmp) / f"{name}-{r}"))
    print(f"train_dp.py {' '.join(args.trainer_flags)} | reads slowed by {args.read_ms:g} ms | torch "
          f"{torch.__version__} | {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}")
    print(f"  {'feed':<12}{'data_wait_fraction':>20}{'real tokens/s':>15}")
    for name, runs in results.items():
        wait = statistics.median(run["data_wait_fraction"] for run in runs)
        tokens = statistics.median(run["tokens_per_s_nonpad"] for run in runs)
        print(f"  {name:<12}{wait:20.1%}{tokens:15,.0f}")


if __name__ == "__main__":
    from training import stopping
    stopping.exit_on_usage_error(main)  # bad flags (and the trainer's): one line, exit status 2
