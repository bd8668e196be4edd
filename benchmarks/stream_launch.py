"""bench_stream.py --sections launch: a trainer's launch seen from outside, as a user sees it.

The launches, on generated corpora of --launch-mbs MB (bench_data.py's), or --data alone:
  stream             train_dp.py --stream --tokenizer (the --mb corpus's BPE of --vocab-size)
  stream-bpe         train_dp.py --stream, training its own BPE (--vocab-size): what a user sees
  stream-2-ranks     torchrun --nproc_per_node 2 train_ddp.py --stream --tokenizer
  map-style(-bpe)    train_dp.py without --stream, the same two ways: on --map-style-mbs alone
                     (it tokenizes the whole corpus before its first step)
Each run is started as a user starts it (`python train_dp.py ...`, or torchrun for train_ddp.py),
with folders of its own for --out-dir, HF_HOME (the `datasets` cache) and TMPDIR, and stopped by
SIGTERM once it has logged its first step (--log-every 1): it finishes the step it is in, saves a
checkpoint, and exits, as a preempted run does. Measured:
  ready         seconds from the launch to the line the trainer prints as its loop begins (the
                data prepared, the model built): before --stream's first batch is read
  first step    seconds from the launch to the first row of metrics.jsonl: the first batch
                read and one optimizer step taken
  peak RSS/PSS  the most memory of the process and every process it started (torchrun's ranks,
                DataLoader workers) together, sampled every 0.25 s from /proc/PID/smaps_rollup:
                RSS counts the pages forked workers share with their parent once each, PSS
                shares them out (the truer sum)
  --out-dir     the bytes of its files (a file's hard links once): checkpoints, and the rest
  cache, TMPDIR the bytes left under HF_HOME and TMPDIR
  written       what the process tree wrote to any file system: this process's /proc/self/io
                write_bytes less cancelled_write_bytes across the run, which Linux adds the
                reaped children's to (each process here reaps its own); nothing else here writes
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = ["stream", "stream-bpe", "stream-2-ranks", "map-style", "map-style-bpe"]
# the smallest preset, so that one step's compute weighs little beside the data's preparation
RUN_FLAGS = ["--model", "debug", "--seq-len", "512", "--batch-size", "8", "--device", "cpu", "--max-steps", "1000",
             "--log-every", "1"]


def add_arguments(p):
    """--sections launch's flags, in bench_stream.py's parser."""
    from training.errors import at_least
    p.add_argument("--launches", nargs="+", choices=LAUNCHES, default=LAUNCHES, help="--sections launch's runs")
    p.add_argument("--launch-mbs", type=at_least(1), nargs="+", default=[100, 1000],
                   help="--sections launch's generated corpora, in MB of text")
    p.add_argument("--launch-repeats", type=at_least(1), default=1,
                   help="runs of each launch: the first to reach its first step is shown")
    p.add_argument("--launch-sub-streams", type=at_least(1),
                   help="the streamed launches' --sub-streams (default: theirs, 8 fitted to the pieces)")
    p.add_argument("--map-style-mbs", type=at_least(1), nargs="*", default=[100],
                   help="of --launch-mbs, the corpora map-style runs launch on too (with --data: that one)")


def table(args, tokenizer_path: Path) -> dict:
    """Each launch on each corpus (generated where it is not yet), run to its first step
    --launch-repeats times: the row of the run that got there first (this machine is shared:
    the others ran slower, not faster), with every run's first step, and the load average."""
    from benchmarks import bench_data
    corpora = {None: Path(args.data)} if args.data else {
        mb: bench_data.prepared_corpus(argparse.Namespace(**{**vars(args), "mb": mb})) for mb in args.launch_mbs}
    streams = f", --sub-streams {args.launch_sub_streams} streamed" if args.launch_sub_streams else ""
    print(f"\nlaunch to first step: {' '.join(RUN_FLAGS)}{streams}, stopped by SIGTERM after it; --tokenizer "
          f"{tokenizer_path.name}, or a BPE of {args.vocab_size:,} tokens trained by the run (-bpe)")
    print(f"  {'corpus':<10}{'launch':<16}{'ready':>8}{'first step':>12}{'peak RSS':>11}{'peak PSS':>11}"
          f"{'checkpoints':>13}{'run files':>11}{'cache':>12}{'TMPDIR':>9}{'written':>10}  load", flush=True)
    results = {}
    for mb, path in corpora.items():
        for launch in args.launches:
            if launch.startswith("map-style") and not (mb is None or mb in args.map_style_mbs):
                continue
            runs = [measure(launch, path, tokenizer_path, args.vocab_size, args.launch_sub_streams)
                    for _ in range(args.launch_repeats)]
            row = results.setdefault(mb, {})[launch] = min(runs, key=lambda run: run["first_step_s"])
            row["first_step_runs"] = [run["first_step_s"] for run in runs]
            ready = f"{row['ready_s']:7.1f}s" if row["ready_s"] is not None else f"{'-':>8}"
            print(f"  {f'{mb} MB' if mb else path.name:<10}{launch:<16}{ready}{row['first_step_s']:11.1f}s"
                  f"{row['peak_rss_mb']:8,.0f} MB{row['peak_pss_mb']:8,.0f} MB{row['checkpoint_mb']:10,.1f} MB"
                  f"{row['run_files_mb']:8,.1f} MB{row['cache_mb']:9,.1f} MB{row['tmp_mb']:6,.1f} MB"
                  f"{row['written_mb']:7,.0f} MB {os.getloadavg()[0]:5.2f}{every_run(row['first_step_runs'])}",
                  flush=True)
    return results


def every_run(seconds: list[float]) -> str:
    return f"  first steps {', '.join(f'{s:.1f}' for s in seconds)} s" if len(seconds) > 1 else ""


def command(launch: str, corpus: Path, tokenizer: Path, vocab_size: int, out_dir: Path,
            sub_streams: int | None = None) -> list[str]:
    """The launch's command line: --stream (with --sub-streams where given) or map-style,
    --tokenizer or the run's own BPE of vocab_size tokens, train_dp.py or train_ddp.py on 2 gloo ranks."""
    script = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_ddp.py"] \
        if launch == "stream-2-ranks" else ["train_dp.py"]
    stream = ["--stream", *(["--sub-streams", str(sub_streams)] if sub_streams else [])] \
        if launch.startswith("stream") else []
    bpe = ["--vocab-size", str(vocab_size)] if launch.endswith("-bpe") else ["--tokenizer", str(tokenizer)]
    return [sys.executable, *script, *stream, "--dataset", str(corpus), *RUN_FLAGS, *bpe, "--out-dir", str(out_dir)]


def measure(launch: str, corpus: Path, tokenizer: Path, vocab_size: int, sub_streams: int | None = None,
            limit_s: float = 1800) -> dict:
    """The launch (command's) run to its first step, then stopped by SIGTERM: the module's
    docstring says what is measured. A run that fails, or stops before its first step, is an
    error with the end of its output."""
    from benchmarks.gpu_report import end_process_tree
    with tempfile.TemporaryDirectory(prefix="stream_launch_") as work:
        work = Path(work)
        out, hf_home, tmp = work / "out", work / "hf", work / "tmp"
        hf_home.mkdir()
        tmp.mkdir()
        cmd = command(launch, corpus, tokenizer, vocab_size, out, sub_streams)
        env = {**os.environ, "HF_HOME": str(hf_home), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1",
               "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc written by the first run of a fresh checkout
        env.pop("HF_DATASETS_CACHE", None)  # under HF_HOME
        written = written_bytes()
        with open(work / "stderr", "w") as stderr:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
            lines, ready = [], []
            reader = threading.Thread(target=read_lines, args=(proc.stdout, lines, ready, start))
            reader.start()
            first_step, rss, pss = None, 0, 0
            try:
                while proc.poll() is None:
                    if time.perf_counter() - start > limit_s:
                        raise RuntimeError(f"{' '.join(cmd)} ran past {limit_s:.0f} s")
                    rss, pss = (max(a, b) for a, b in zip((rss, pss), tree_memory(proc.pid)))
                    if first_step is None and logged_a_step(out):
                        first_step = time.perf_counter() - start
                        os.kill(proc.pid, signal.SIGTERM)  # torchrun sends it on to its ranks
                    time.sleep(0.25)
            finally:
                if proc.poll() is None:
                    end_process_tree(proc.pid)
                proc.wait()
                reader.join()
        written = written_bytes() - written
        if first_step is None:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode} before its first step:\n"
                               + (work / "stderr").read_text(errors="replace")[-3000:])
        if not any(out.glob("checkpoint*")):
            raise RuntimeError(f"{' '.join(cmd)} saved no checkpoint when stopped (exit status {proc.returncode}):\n"
                               + "".join(lines[-20:]))
        checkpoints = folder_bytes(*out.glob("checkpoint*"))  # checkpoint.pt: a link to the newest numbered one
        return {"ready_s": ready[0] if ready else None, "first_step_s": first_step, "peak_rss_mb": rss / 1e6,
                "peak_pss_mb": pss / 1e6, "checkpoint_mb": checkpoints / 1e6,
                "run_files_mb": (folder_bytes(out) - checkpoints) / 1e6,
                "cache_mb": folder_bytes(hf_home) / 1e6, "tmp_mb": folder_bytes(tmp) / 1e6, "written_mb": written / 1e6}


def read_lines(stdout, lines: list, ready: list, start: float):
    """The run's stdout, kept, and the time of the line its loop begins with (metrics.describe)."""
    for line in stdout:
        lines.append(line)
        if not ready and " parameters | " in line:
            ready.append(time.perf_counter() - start)


def logged_a_step(out: Path) -> bool:
    """Whether metrics.jsonl holds a training row (its last line may be half written)."""
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                if "loss" in json.loads(line):
                    return True
    return False


def tree_memory(pid: int) -> tuple[int, int]:
    """The RSS and PSS of pid and every process it started, summed, in bytes (a process that
    ends meanwhile counts nothing)."""
    from benchmarks.gpu_report import descendants
    rss = pss = 0
    for each in {pid} | descendants(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{each}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
    return rss, pss


def written_bytes() -> int:
    """What this process, and the children it reaped, wrote to file systems so far."""
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io["write_bytes"]) - int(io["cancelled_write_bytes"])


def folder_bytes(*paths: Path) -> int:
    """The bytes of the files under paths (or of paths that are files), each inode once."""
    files = [f for path in paths for f in ([path] if path.is_file() else path.rglob("*"))
             if f.is_file() and not f.is_symlink()]
    return sum({(s.st_dev, s.st_ino): s.st_size for s in map(os.stat, files)}.values())
