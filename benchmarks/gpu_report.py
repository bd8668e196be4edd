"""One command that measures the trainer on one GPU and writes one report: GPU time is rare and short.

    python benchmarks/gpu_report.py --out DIR                                 # one CUDA GPU: about 8 minutes
    python benchmarks/gpu_report.py --out DIR --device cpu --model debug      # the same rows on a CPU, in a minute

DIR/report.md (and DIR/report.json) hold, in this order:
  the machine   GPU, its memory and driver, torch, CUDA, cuDNN, CPU cores, the commit
  the step      --model at --batch-size x --seq-len in --dtype auto's dtype, compiled as the trainers compile it
                (on a GPU; --compile on a CPU), on rows of a FineWeb-shaped corpus made here in seconds: packed
                (--pack) under DDP at world size 1 (the baseline), padded, FSDP, train_dp.py's whole-model
                compile, and each candidate of the step beside the baseline (benchmarks/step_rows.py). Every
                row starts from the same initial weights and trains the same batches, so its loss after the
                same steps shows that it trains the same model; the baseline runs again last: the drift
  the profiles  one traced step of the baseline and one of FSDP (training/profiling.py's --profile), their
                kernel time by kind side by side (tools/trace_summary.py): where the step's time goes
  past one GPU  on a machine of 2+ GPUs (--ranks): train_fsdp.py and train_tp.py --tp N over N GPUs, launched by
                torchrun as a user launches them, on the same corpus: their speed, memory and loss from their own
                metrics.jsonl (one GPU shows nothing of tensor parallelism, so no such row is made there)
  the CUDA tests  tests/test_cuda.py, run while the corpus is made (each skips without a GPU)
The report is rewritten after each row, so a run cut short keeps what it measured; a row that fails says why in
one line and the rest go on; rows past --time-limit say so. docs/benchmarks.md says how to run it on a lent GPU.
"""

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # before `datasets` is imported (by data.py)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, from any folder
from benchmarks import step_rows  # noqa: E402
from benchmarks.bench import free_port  # noqa: E402
from benchmarks.step_rows import BASELINE, FSDP  # noqa: E402
from model import PRESETS, LlamaConfig  # noqa: E402
from training import build, config, files, launch, metrics, run_folder, stopping  # noqa: E402
from training.errors import ArgumentParser, UsageError, at_least, first_line, path_argument  # noqa: E402


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=path_argument, required=True, help="a new (or empty) folder for the report")
    cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--model", choices=sorted(PRESETS), help="default: article on a GPU, debug on a CPU")
    p.add_argument("--batch-size", type=at_least(1), help="rows a step (default: 64 on a GPU, 8 on a CPU)")
    p.add_argument("--seq-len", type=at_least(2), help="tokens a row (default: the --model preset's)")
    p.add_argument("--steps", type=at_least(1), help="timed steps a row (default: 15 on a GPU, 3 on a CPU)")
    p.add_argument("--warmup", type=at_least(1), help="untimed steps a row first, compiling (default: 3 GPU, 1 CPU)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, help="default: on a GPU, not on a CPU")
    p.add_argument("--mb", type=at_least(1), help="MB of corpus to generate (default: 10 on a GPU, 1 on a CPU)")
    p.add_argument("--peak-tflops", type=at_least(0.001, float),
                   help="the device's bf16 peak for MFU, where metrics.GPU_BF16_PEAK_TFLOPS has none (default: that "
                        "table's; no MFU on a CPU)")
    p.add_argument("--time-limit", type=at_least(1), default=480,
                   help="seconds for the whole report; rows not started by then are left out (default 480)")
    p.add_argument("--tests", action=argparse.BooleanOptionalAction, default=True, help="run tests/test_cuda.py")
    p.add_argument("--ranks", type=at_least(0), help="GPUs (CPU processes with --device cpu) for the rows past one "
                   "GPU; 0: none (default: every GPU where there are 2 or more, else 0)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU here (use --device cpu --model debug)")
    args.model = args.model or ("article" if cuda else "debug")
    preset = config.TRAINING_PRESETS[args.model]
    args.batch_size = args.batch_size or (64 if cuda else 8)
    args.seq_len = args.seq_len or preset["seq_len"]
    args.steps = args.steps or (15 if cuda else 3)
    args.warmup = args.warmup or (3 if cuda else 1)
    args.compile = cuda if args.compile is None else args.compile
    args.mb = args.mb or (10 if cuda else 1)
    args.vocab_size = preset["vocab_size"]
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if cuda and torch.cuda.device_count() >= 2 else 0
    if args.ranks == 1:
        raise UsageError("--ranks 1: the rows past one GPU need 2 or more (0 leaves them out)")
    if cuda and args.ranks > torch.cuda.device_count():
        raise UsageError(f"--ranks {args.ranks}: torch sees {torch.cuda.device_count()} GPUs here")
    if args.seq_len > PRESETS[args.model]["max_position_embeddings"]:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the {args.model} model's "
                         f"{PRESETS[args.model]['max_position_embeddings']} positions")
    run_folder.check_writable(args.out, "--out")  # a file on its path, a dangling link, no permission: one line
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise UsageError(f"--out {args.out}: not an empty folder; the report takes a folder of its own")
    return args


# ---- the machine ------------------------------------------------------------------------------

def machine(device: torch.device) -> dict:
    changed = run_quietly(["git", "status", "--porcelain"]) not in ("", "?")  # files differ from the commit's
    facts = {"torch": torch.__version__, "Python": platform.python_version(), "CPU cores": os.cpu_count(),
             "commit": run_quietly(["git", "rev-parse", "--short", "HEAD"]) + (" (with changes)" if changed else "")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts = {"GPU": props.name, "GPU memory": f"{props.total_memory / 2**30:.1f} GiB",
                 "driver": run_quietly(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                 "CUDA": torch.version.cuda, "cuDNN": torch.backends.cudnn.version(), **facts}
    return {**facts, "CPU": cpu_name()}


def cpu_name() -> str:
    """The processor's model name, as Linux gives it (else the architecture's)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def run_quietly(command: list[str]) -> str:
    """The command's first line of output ('' for none), run in the repository; '?' where it cannot run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (done.stdout.strip().splitlines() or [""])[0] if done.returncode == 0 else "?"


def start_cuda_tests(out: Path, cuda: bool) -> subprocess.Popen:
    """tests/test_cuda.py in a process of its own, its output in cuda_tests.log (on a GPU 8 workers: on an H100
    with 16 cores they passed so, docs/benchmarks.md)."""
    command = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider",
               "-n", "8" if cuda else "0"]
    with open(out / "cuda_tests.log", "w") as log:  # the child writes to its own copy of the file
        return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


def cuda_tests_result(tests: subprocess.Popen, out: Path, seconds: float) -> str:
    try:
        tests.wait(timeout=max(60.0, seconds))
    except subprocess.TimeoutExpired:
        end_process_tree(tests.pid)  # not tests.kill(): its workers and their runs would go on using the GPU
        tests.wait()
        return f"stopped after {seconds:.0f} s (the report's time limit): see cuda_tests.log"
    lines = (out / "cuda_tests.log").read_text(errors="replace").strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)),
                   f"pytest ended with status {tests.returncode}")
    return f"{summary} (exit status {tests.returncode}; cuda_tests.log)"


def end_process_tree(pid: int):
    """pid and every process it started, and theirs, killed: each stopped first (SIGSTOP, until no new
    one appears), so that none starts another meanwhile. Killing pid alone leaves pytest-xdist's workers
    running for 15 s, and the torchrun launches of the tests for as long as they train: their workers
    start sessions of their own (no process group holds them), and compute on the GPU under the rows."""
    stopped = set()
    while found := ({pid} | descendants(pid)) - stopped:
        for each in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGSTOP)
        stopped |= found
    for each in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def descendants(pid: int) -> set[int]:
    """The processes pid started, and theirs, from Linux's /proc (none found elsewhere)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name: state, parent, ...
        except OSError:  # it ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


# ---- the corpus ----------------------------------------------------------------------------------

def make_layouts(args, out: Path, device) -> dict:
    """A FineWeb-shaped corpus (bench_data.py's generator) of --mb MB and its BPE, made in the report's
    folder, and warm-up + timed batches of each layout: padded (one window a row) and packed (--pack)."""
    import datasets
    from benchmarks import bench_data, bench_packing
    from training import tokenized
    datasets.logging.set_verbosity_error()
    path = out / "corpus" / f"fineweb_like_{args.mb}mb.parquet"
    path.parent.mkdir(parents=True)
    bench_data.generate(path, args.mb)
    tokenizer_path = bench_data.bpe(path, args.vocab_size)
    layouts = {"vocab_size": tokenized.load_tokenizer(tokenizer_path).get_vocab_size(), "corpus": path,
               "tokenizer": tokenizer_path}
    for name in ("padded", "packed"):
        train = bench_packing.prepare(path, tokenizer_path, args.seq_len, name == "packed")[2]
        n = args.warmup + args.steps
        if len(train) < n * args.batch_size:
            raise UsageError(f"--mb {args.mb}: its {len(train):,} {name} rows are fewer than {n} steps of "
                             f"{args.batch_size}: raise --mb")
        layouts[name] = bench_packing.batches(train, args.batch_size, n, device)
        layouts[f"{name} padding"] = train.facts["padding"]
    return layouts


# ---- the report --------------------------------------------------------------------------------

def past_one_gpu(args, out: Path, layouts: dict, started: float):
    """(name, result) for train_fsdp.py and train_tp.py --tp N over N = --ranks devices, each launched
    by torchrun on the report's corpus and tokenizer, packed, compiled as the step's rows are; its
    speed on real tokens over the timed steps (after --warmup), its peak memory and its last loss,
    read from its own metrics.jsonl. Both train the same batches from the same initial weights."""
    steps = args.warmup + args.steps
    common = ["--dataset", str(layouts["corpus"]), "--tokenizer", str(layouts["tokenizer"]), "--model", args.model,
              "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--pack", "--max-steps",
              str(steps), "--warmup-steps", "1", "--log-every", "1", "--eval-every", str(steps), "--save-every",
              str(steps), "--device", args.device, *(["--compile"] if args.compile else [])]
    tp = largest_tp(args, layouts["vocab_size"])
    for name, script, extra in ((f"FSDP over {args.ranks}", "train_fsdp.py", []),
                                (f"TP {tp} + FSDP", "train_tp.py", ["--tp", str(tp)])):
        if tp == 1 and script == "train_tp.py":
            yield name, {"error": f"not run: the {args.model} model's heads split over no TP degree that divides "
                                  f"{args.ranks} GPUs (take a --model whose heads do)"}
            continue
        if time.perf_counter() - started > args.time_limit:
            yield name, {"error": f"not run: the report's --time-limit of {args.time_limit} s was spent"}
            continue
        run = out / "past-one-gpu" / script.removesuffix(".py")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={args.ranks}", str(ROOT / script), *common, *extra,
                               "--out-dir", str(run)], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            files.atomic_save(proc.stderr, run.with_suffix(".log"))
            said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
            yield name, {"error": said[0] if said else f"exit status {proc.returncode} (its stderr: {run}.log)"}
            continue
        rows = [row for row in metrics.read_metrics(run / run_folder.METRICS) if "loss" in row]
        timed = rows[args.warmup:]
        yield name, {"tokens_per_s": sum(r["tokens_per_s_nonpad"] for r in timed) / len(timed),
                     "mfu": sum(r["mfu"] for r in timed) / len(timed) if "mfu" in timed[0] else None,
                     "peak_gib": max(r.get("max_memory_allocated_gib", 0.0) for r in timed), "loss": rows[-1]["loss"],
                     "steps": len(rows)}


def largest_tp(args, vocab_size: int) -> int:
    """The largest TP degree that --ranks and the model allow, by train_tp.py's own checks (the
    article model's 3 key/value heads: none, 1)."""
    from training import tensor_parallel  # (torch's TP modules: imported where a report goes past one GPU)
    config = LlamaConfig(vocab_size=vocab_size, **PRESETS[args.model])

    def splits(tp: int) -> bool:
        try:
            tensor_parallel.check_layout(tp, args.seq_len, args.ranks)
            tensor_parallel.check_model(config, tp)
        except UsageError:
            return False
        return True
    return max(tp for tp in range(1, args.ranks + 1) if splits(tp))


def write_report(out: Path, report: dict):
    """report.md and report.json, each written whole (rewritten after every row)."""
    files.atomic_save(json.dumps(report, indent=2, default=str), out / "report.json")
    files.atomic_save("\n".join(markdown(report)) + "\n", out / "report.md")


def markdown(report: dict) -> list[str]:
    a = report["args"]
    lines = [f"# GPU report, {report['date']}", "", "`" + report["command"] + "`", "", "## The machine", "",
             "| " + " | ".join(report["machine"]) + " |", "|" + "---|" * len(report["machine"]),
             "| " + " | ".join(str(v) for v in report["machine"].values()) + " |", "",
             f"## The step: `{a['model']}`, {a['batch_size']} x {a['seq_len']} tokens, {report['dtype']}, "
             f"{'compiled' if a['compile'] else 'eager'}", "",
             f"{a['warmup']} warm-up and {a['steps']} timed steps a row, each row from the same initial weights on the "
             f"same batches (padding: {report.get('padding', '?')}). MFU counts real tokens (those with a target) at "
             f"{report['peak_tflops'] or 'no known'} TFLOP/s; memory is "
             f"{'the peak allocated' if a['device'] == 'cuda' else 'the process peak RSS so far'}.", "",
             "| row | real tokens/s | positions/s | MFU | peak memory (GiB) | loss after the steps | vs the baseline |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = report["rows"].get(BASELINE, {}).get("tokens_per_s")
    for name, r in report["rows"].items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | {r.get('error', 'not run')} | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['positions_per_s']:,.0f} | {mfu} | "
                     f"{r['peak_gib']:.2f} | {r['loss']:.4f} | {ratio} |")
    lines += ["", *ratios(report), "", "## One profiled step each: kernel time by kind", ""]
    lines += profile_lines(report["profiles"]) if report.get("profiles") else ["not run"]
    if report.get("past_one_gpu"):
        lines += ["", f"## Past one GPU: {a['ranks']} of them, train_fsdp.py and train_tp.py", "",
                  "Each launched by torchrun on the same corpus and batches, from the same initial weights "
                  "(docs/tp.md says what to expect).", "",
                  "| run | real tokens/s | MFU | peak memory a GPU (GiB) | loss after the steps |", "|---|---:|---:|---:|---:|"]
        for name, r in report["past_one_gpu"].items():
            if "tokens_per_s" not in r:
                lines.append(f"| {name} | {r['error']} | | | |")
                continue
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
            lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {r['loss']:.4f} |")
    lines += ["", "## The CUDA tests", "", f"`python -m pytest tests/test_cuda.py`: {report.get('cuda_tests', 'not run')}"]
    return lines


def ratios(report: dict) -> list[str]:
    """The figures the step is judged by, each beside its target, and the run's own drift."""
    speed = {name: r.get("tokens_per_s") for name, r in report["rows"].items()}
    base, lines = speed[BASELINE], []
    if base and report["rows"][BASELINE].get("mfu") is not None:
        lines.append(f"- MFU of the baseline, on real tokens: {report['rows'][BASELINE]['mfu']:.1%} (the target: 45%)")
    for name, what in ((FSDP, "FSDP / DDP at world size 1 (the target: 0.95x)"),
                       (f"{BASELINE}, again (the machine's drift)", "the baseline again, at the end / at the start")):
        if base and speed[name]:
            lines.append(f"- {what}: {speed[name] / base:.2f}x")
    return lines


def profile(trace: str) -> dict:
    """A traced step's figures: its span, its kernels' time by kind, the rest's largest, trace_summary's lines."""
    from tools import kernel_kinds, trace_summary
    summary = trace_summary.summarize(trace)[-1]  # read once: an article step's trace takes seconds
    by_kind = kernel_kinds.step_by_kind(summary)
    return {"trace": str(Path(trace).relative_to(Path(trace).parents[2])), "lines": trace_summary.describe(summary),
            "step_ms": by_kind.pop("ms"), **by_kind}


def profile_lines(profiles: dict) -> list[str]:
    """The profiled rows side by side: ms a step by kind, then each one's largest kernels of the rest and lines."""
    done = {name: p for name, p in profiles.items() if "kinds" in p}
    lines = [f"- {name}: {p['error']}" for name, p in profiles.items() if "error" in p]
    if done:
        kinds = next(iter(done.values()))["kinds"]
        lines += ["| ms a step | " + " | ".join(done) + " |", "|---|" + "---:|" * len(done)]
        lines += [f"| {kind} | " + " | ".join(f"{p['kinds'][kind]:.1f}" for p in done.values()) + " |" for kind in kinds]
        lines += ["| all kernels | " + " | ".join(f"{p['total_ms']:.1f}" for p in done.values()) + " |",
                  "| the step (on a GPU, its span on the GPU) | " + " | ".join(f"{p['step_ms']:.1f}" for p in done.values())
                  + " |"]
    for name, p in done.items():
        largest = ", ".join(f"`{kernel[:80]}` {ms:.2f}" for kernel, ms in p["rest_top"][:5])
        lines += ["", f"{name} (`{p['trace']}`), the rest's largest (ms): {largest}", "", "```", *p["lines"], "```"]
    return lines


def failed(error: Exception) -> str:
    """A row's (or a profile's) failure, in its one line of the report."""
    return f"failed: {type(error).__name__}: {first_line(error)}"[:300]


def main(argv=None, leave_at_once=False):
    args = parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = launch.compute_dtype("auto", device)  # sets TF32 for fp32 matmuls on a GPU, as the trainers do
    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(args),
              "command": " ".join(["python", "benchmarks/gpu_report.py", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(device), "dtype": str(dtype).removeprefix("torch."),
              "peak_tflops": args.peak_tflops or metrics.peak_tflops(device, dtype),
              "rows": {r["name"]: {} for r in step_rows.rows()}}
    write_report(out, report)
    tests = start_cuda_tests(out, device.type == "cuda") if args.tests else None
    layouts = make_layouts(args, out, device)  # while the tests run: the CPU's work
    report["padding"] = ", ".join(f"{name} {layouts[f'{name} padding']:.1%}" for name in ("padded", "packed"))
    if tests:  # before any timing: the tests use the GPU too
        report["cuda_tests"] = cuda_tests_result(tests, out, args.time_limit / 3)
    write_report(out, report)

    cfg = config.parse_args(["--model", args.model, "--seq-len", str(args.seq_len), "--batch-size",
                             str(args.batch_size), "--pack", "--out-dir", str(out), "--profile", "--profile-warmup",
                             "0", "--profile-steps", "1", *(["--compile"] if args.compile else [])])
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)  # DDP and FSDP in a world of one
    mesh = init_device_mesh(device.type, (1,))
    flops = build.model(cfg, layouts["vocab_size"], dtype, "meta").flops_per_token(args.seq_len)  # shapes only
    report["flops_per_token"], peak = flops, report["peak_tflops"]
    for spec in step_rows.rows():
        result = report["rows"][spec["name"]]
        if time.perf_counter() - started > args.time_limit:
            result["error"] = f"not run: the report's --time-limit of {args.time_limit} s was spent"
        else:
            try:
                result.update(step_rows.measure(spec, cfg, layouts[spec["layout"]], args.warmup, layouts["vocab_size"],
                                                device, dtype, mesh))
                # on real tokens: a padded row's pads are work the GPU did for nothing (docs/benchmarks.md)
                result["mfu"] = result["tokens_per_s"] * flops / 1e12 / peak if peak else None
            except Exception as e:  # one row's failure (out of memory, a compile error) is its row's line
                result["error"] = failed(e)
            step_rows.free(device)
        if "trace" in result:
            try:
                report.setdefault("profiles", {})[spec["name"]] = profile(result["trace"])
            except Exception as e:
                report.setdefault("profiles", {})[spec["name"]] = {"error": failed(e)}
        write_report(out, report)
        print(f"{spec['name']}: {result}", flush=True)
    if args.ranks:
        report["past_one_gpu"] = {}
        for name, result in past_one_gpu(args, out, layouts, started):
            report["past_one_gpu"][name] = result
            write_report(out, report)
            print(f"{name}: {result}", flush=True)
    report["seconds"] = time.perf_counter() - started
    write_report(out, report)
    print(f"report in {out / 'report.md'} after {report['seconds']:.0f} s", flush=True)
    if leave_at_once:  # as bench.py's workers leave: gloo's teardown can deadlock right after the last collective
        from benchmarks import bench_data
        bench_data.remove_caches()  # what an exit handler would have removed
        os._exit(0)


if __name__ == "__main__":
    stopping.exit_on_usage_error(lambda: main(leave_at_once=True))  # bad flags: one line, exit status 2
