"""What logging costs a training step: train_dp.py on the demo (the tiny preset, the embedded
corpus), with --tensorboard and --wandb (offline) on, timing every call that writes a row.

    python bench_logging.py                    # 100 steps, --log-every 10
    python bench_logging.py --steps 250 --log-every 1

Prints the training time per step, the time per logged row, and the per-step cost of the
rows (each row's time over the steps it covers), as a share of the step. The trackers'
start (a W&B run, a TensorBoard file) and end are one-off costs, printed apart.
"""

import argparse
import os
import runpy
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from training import config, errors, metrics, stopping  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # the repository root: train_dp.py


def timed(cls, name: str, spent: list):
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    setattr(cls, name, wrapper)


def main():
    parser = errors.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=errors.at_least(1), default=100)
    parser.add_argument("--log-every", type=errors.at_least(1), default=10)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    writes, opened, closed = [], [], []
    timed(metrics.MetricsLog, "write", writes)
    timed(metrics.MetricsLog, "__init__", opened)
    timed(metrics.MetricsLog, "close", closed)
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["train_dp.py", "--max-steps", str(args.steps), "--log-every", str(args.log_every),
                    "--eval-every", str(args.steps), "--save-every", str(args.steps), "--out-dir", f"{tmp}/run",
                    "--tensorboard", "--wandb", "bench-logging"]
        started = time.perf_counter()
        runpy.run_path(str(HERE / "train_dp.py"), run_name="__main__")
        wall = time.perf_counter() - started
        rows = [row for row in metrics.read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "loss" in row]
        cfg = config.parse_args(sys.argv[1:] + ["--resume"])  # the run's batch and sequence length
    # seconds a step, by each row's own clock (saving and evaluation left out): the median
    per_step = sorted(cfg.batch_size * cfg.seq_len / row["tokens_per_s"] for row in rows)
    step = per_step[len(per_step) // 2]
    row_cost = sum(writes) / len(writes)
    print(f"{args.steps} steps, a row every {args.log_every} ({len(writes)} rows, evaluation rows included), "
          f"{wall:.1f} s in all")
    print(f"step (median of the rows' own timing): {step * 1e3:.1f} ms")
    print(f"writing a row to metrics.jsonl, TensorBoard and W&B: {row_cost * 1e3:.2f} ms "
          f"(slowest {max(writes) * 1e3:.2f} ms)")
    print(f"per step: {row_cost / args.log_every * 1e3:.3f} ms = {row_cost / args.log_every / step:.3%} of a step "
          f"(target: at most 1%)")
    print(f"one-off: opening the sinks {sum(opened):.2f} s, closing them {sum(closed):.2f} s")


if __name__ == "__main__":
    stopping.exit_on_usage_error(main)  # bad flags: one line, exit status 2
