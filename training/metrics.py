"""What a run logs, and where. Speedometer.row defines a logged training row, the one
definition that every sink reads: metrics.jsonl always, TensorBoard (--tensorboard) and
Weights & Biases (--wandb) when asked for, and the progress bar, which shows part of it.
Only rank 0 writes. The trackers are imported only when their flag is given.
"""

import contextlib
import dataclasses
import datetime
import json
import os
import re
import secrets
import shlex
import shutil
import tempfile
import time
from pathlib import Path

import torch

from model import LlamaForPretraining
from training import corpus
from training.config import TrainConfig
from training.errors import UsageError, first_line, warn
from training.files import atomic_save, raise_if_disk_full
from training.launch import data_parallel, usable_cores
from training.run_folder import CONFIG, METRICS, MODEL, TENSORBOARD, TOKENIZER, WANDB_RUN

# Dense bf16 tensor-core peaks in TFLOP/s (with fp32 accumulation, without 2:4 sparsity, whose
# figure data sheets print first at twice this), for MFU. The first key found as whole words in
# torch.cuda.get_device_name() wins, so a variant comes before its family: "NVIDIA H100 NVL"
# and "NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3" (the SXM part). A GPU not here gets no
# MFU, and one line says so: add yours from its data sheet.
GPU_BF16_PEAK_TFLOPS = [
    ("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989),      # Hopper
    ("H200 NVL", 835), ("H200", 989), ("GH200", 989),
    ("H800 PCIe", 756), ("H800", 989),
    ("GB200", 2500), ("B200", 2250),                            # Blackwell
    ("A100", 312), ("A800", 312), ("A40", 149.7), ("A30", 165),  # Ampere
    ("L40S", 362), ("L40", 181), ("L4", 121),                   # Ada
    ("RTX 5090", 209.5), ("RTX 4090", 165.2), ("RTX 3090", 71),  # GeForce
]


def peak_tflops(device: torch.device, dtype: torch.dtype, n_devices: int = 1):
    """The bf16 peak of the n_devices GPUs that do the work, when known and the run computes
    in bf16; else None."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    # whole words: "NVIDIA L40S" is not an L4, "NVIDIA GH200 480GB" not an H200, "NVIDIA A100-SXM4-80GB" an A100
    peak = next((peak for key, peak in GPU_BF16_PEAK_TFLOPS if re.search(rf"\b{key}\b", name)), None)
    if peak is None:
        warn(f"no MFU: the bf16 peak of {name} is not known here; add it to metrics.GPU_BF16_PEAK_TFLOPS "
             "from its data sheet (dense, without sparsity)")
        return None
    return peak * n_devices


def devices_in_use(model: torch.nn.Module) -> int:
    """The devices the job computes on: all of DataParallel's GPUs, or one per rank."""
    if isinstance(model, torch.nn.DataParallel):
        return max(1, len(model.device_ids))
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def throughput(seconds: float, steps: int, cfg: TrainConfig, nonpad_tokens: float, flops_per_token: int,
               peak: float | None) -> dict:
    """Speed over `steps` optimizer steps that took `seconds` of wall time, data loading
    included. tokens_per_s counts every position, pads too, and so do TFLOP/s and MFU (achieved
    over peak FLOP/s, all devices): the work the hardware did. tokens_per_s_nonpad counts the
    real targets alone: the useful throughput, which the progress bar and the summary show."""
    tokens_per_s = steps * cfg.batch_size * cfg.seq_len / seconds
    speed = {"tokens_per_s": tokens_per_s, "tokens_per_s_nonpad": nonpad_tokens / seconds,
             "flops_per_token": flops_per_token, "tflops": flops_per_token * tokens_per_s / 1e12}
    if peak:
        speed["mfu"] = speed["tflops"] / peak
    return speed


def cuda_memory(device: torch.device) -> dict:
    """On CUDA, the peak memory since the last row, in GiB: what the tensors took
    (allocated) and what the caching allocator held (reserved, what nvidia-smi sees). Read
    from the allocator's counters on the host, without waiting for the GPU."""
    if device.type != "cuda":
        return {}
    peaks = {"max_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
             "max_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return peaks


class Speedometer:
    """Times the optimizer steps between two logged rows, and the part of that time spent
    waiting for the next batch; the time inside paused() (saving, evaluating) is left out."""

    def __init__(self, cfg: TrainConfig, flops_per_token: int, peak: float | None, device: torch.device,
                 tokens_seen: int = 0):
        self.cfg, self.flops_per_token, self.peak, self.device = cfg, flops_per_token, peak, device
        self.start, self.steps, self.waited = time.perf_counter(), 0, 0.0
        self.trained = 0  # real (non-pad) targets in the rows so far: the tokens this session trained on
        self.tokens_before = tokens_seen  # those of the steps before a resume

    def step(self):
        self.steps += 1

    @contextlib.contextmanager
    def paused(self, pausing: bool = True):
        """Leaves the time inside out, when pausing (a step that saves or evaluates). A GPU first
        finishes the steps the host has queued: their time is training's, not the pause's."""
        if not pausing:  # (no sync: the host goes on queueing steps)
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        pause = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - pause

    @contextlib.contextmanager
    def waiting(self):
        """Around the wait for the next batch: data_wait_fraction, timed on the host with no
        sync. A GPU with work still queued does not starve while the host waits, so this is
        the most the data feed can have cost, not always what it did cost."""
        wait = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - wait

    def row(self, step: int, epoch: int, loss: float, lr: float, grad_norm: float, nonpad_tokens: float) -> dict:
        """A logged training row: what it holds is defined here, once. Then the next interval starts."""
        seconds = time.perf_counter() - self.start
        self.trained += round(nonpad_tokens)
        row = {"step": step, "epoch": epoch,
               "loss": loss,  # the token-weighted mean since the last row
               "lr": lr,
               "grad_norm": grad_norm,  # this step's, before clipping, of the whole model (every rank's part)
               "tokens_seen": self.tokens_before + self.trained,  # real targets since the run began
               **throughput(seconds, self.steps, self.cfg, nonpad_tokens, self.flops_per_token, self.peak),
               "data_wait_fraction": self.waited / seconds,  # of the wall time, waiting for a batch
               **cuda_memory(self.device)}
        self.start, self.steps, self.waited = time.perf_counter(), 0, 0.0
        return row


def progress(row: dict) -> dict:
    """What the progress bar shows next to the step count, from a logged row."""
    # tok_s: the real tokens trained a second; TFLOP/s (and MFU) count every position, pads too
    shown = {"loss": f"{row['loss']:.3f}", "tok_s": f"{row['tokens_per_s_nonpad']:,.0f}",
             "tflops": f"{row['tflops']:.3g}"}
    return {**shown, "mfu": f"{row['mfu']:.1%}"} if "mfu" in row else shown


METRICS_LIMIT = 2**30  # a row a step is a few hundred bytes: millions of steps


def read_metrics(path: Path, warn_if_torn: bool = True) -> list[dict]:
    """The rows of a metrics.jsonl. A torn last line (what a crash or a full disk leaves
    mid-write) is dropped with a warning and blank lines are skipped; any other damage is
    a UsageError."""
    if not path.exists():
        return []
    text = corpus.read_text(path, "metrics file", METRICS_LIMIT)
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a row with a step")
            if bad := next((k for k, v in row.items() if not is_number(v)), None):  # every value we log is one
                raise ValueError(f"its {bad} is not a number: {str(row[bad])[:40]}")
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep to parse
            if number == len(lines):  # the last line, with no newline after it: torn
                if warn_if_torn:
                    warn(f"{path}: dropping its torn last line {line[:40]!r}")
                continue
            raise UsageError(f"{path}, line {number}: {first_line(e)}; repair or remove that line") from None
        rows.append(row)
    return rows


def is_number(value) -> bool:
    """A finite number, as JSON gives it back (not a bool; not an int past what a float holds)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -1e300 < value < 1e300


def scalars(row: dict) -> dict:
    """The numbers of a row a tracker plots against its step."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlSink:
    def __init__(self, path: Path):
        self.path = path

    def write(self, row: dict):
        line = json.dumps(row) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as e:
            raise_if_disk_full(e, self.path, len(line))
            raise

    def close(self):
        pass


class TensorBoardSink:
    """Event files in OUT/tensorboard/: `tensorboard --logdir OUT` (or a folder of runs).
    They mirror metrics.jsonl: every session starts with a restart mark at step 0
    (purge_step), for which TensorBoard hides all that earlier sessions wrote, then writes
    again the rows metrics.jsonl kept. A resumed run's steps trained again, or rows logged
    while --tensorboard was off, then show as metrics.jsonl has them: one value per step."""

    def __init__(self, out: Path, cfg: TrainConfig, kept: list[dict]):
        from torch.utils.tensorboard import SummaryWriter
        folder = out / TENSORBOARD
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"{folder} is a file, not a folder of TensorBoard event files: move it away")
        created = not os.path.lexists(folder)
        try:
            # a file of our own first: a folder that cannot be written fails here, not in the
            # writer's thread (whose traceback would follow our line)
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
            self.writer = SummaryWriter(str(folder), purge_step=0)
            flags = "\n".join(f"| {k} | {v} |" for k, v in dataclasses.asdict(cfg).items())
            self.writer.add_text("flags", "| flag | value |\n|---|---|\n" + flags, 0)
            for row in kept:
                self.add(row)
            self.writer.flush()
        except OSError as e:  # a read-only folder, a full disk
            if created:  # an empty folder left behind would mark OUT as a run's
                shutil.rmtree(folder, ignore_errors=True)
            raise UsageError(f"--tensorboard: cannot write {folder}: {first_line(e)}") from None

    def add(self, row: dict):
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def write(self, row: dict):
        self.add(row)
        self.writer.flush()  # on disk at once: the run is watched live, and a killed run loses nothing logged

    def close(self):
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (WANDB_MODE=offline keeps it on disk, under OUT/wandb/).
    OUT/wandb-run.txt holds its id, so that a resumed run continues the same W&B run, and
    the last step sent to it. W&B takes no step twice: a resumed run sends the rows that
    metrics.jsonl kept and W&B has not seen, then its own; the steps it trains again keep
    the values first sent (the same losses; other timings)."""

    def __init__(self, out: Path, cfg: TrainConfig, logged: int):
        """Starts the W&B run; nothing of ours is written until begin()."""
        import wandb
        self.state = out / WANDB_RUN
        run_id, self.sent = self.read_state()
        if self.sent > logged:  # every row goes to metrics.jsonl before W&B: it cannot have seen more
            raise UsageError(f"{self.state} says W&B has the steps up to {self.sent:,}, but metrics.jsonl logged "
                             f"only up to {logged:,}: the resumed run would send W&B nothing. Remove it to start a "
                             "new W&B run")
        asked = os.environ.get("WANDB_MODE", "online")
        try:  # at a terminal without a login, W&B asks how to go on: a minute, then it gives up
            self.run = wandb.init(project=cfg.wandb, name=cfg.wandb_run, id=run_id, resume="allow", dir=str(out),
                                  config=dataclasses.asdict(cfg), settings=wandb.Settings(login_timeout=60))
        except Exception as e:  # no login, no network, a project name W&B refuses: its own words, in one line
            raise UsageError(f"--wandb {cfg.wandb}: W&B could not start the run ({first_line(e)}); log in with "
                             "`wandb login`, or keep the run on disk with WANDB_MODE=offline") from None
        if asked == "online" and (self.run.offline or self.run.disabled):  # a choice at its prompt, or its timeout
            self.run.finish()
            raise UsageError(f"--wandb {cfg.wandb}: W&B did not log in, and would have run "
                             f"{'offline' if self.run.offline else 'disabled'} instead; log in with `wandb login`, "
                             "or ask for a run on disk with WANDB_MODE=offline")
        self.run_id, self.sent_before = run_id, self.sent  # earlier sessions sent the steps up to sent_before

    def begin(self, kept: list[dict]):
        """The rows metrics.jsonl kept, then the run file: once every tracker has started."""
        for row in kept:
            self.send(row)
        self.save_state()

    def read_state(self) -> tuple[str, int]:
        if not self.state.exists():
            return secrets.token_hex(4), -1  # a new W&B run (8 characters, as W&B's own ids), nothing sent
        text = corpus.read_text(self.state, "W&B run file", 1024)  # a FIFO or a device: its own line
        try:
            run_id, sent = text.split()
            if not (re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id) and re.fullmatch(r"-?[0-9]{1,18}", sent)):
                raise ValueError
            return run_id, int(sent)
        except ValueError:
            raise UsageError(f"{self.state} does not hold a W&B run id and a step: remove it to start a new W&B "
                             "run") from None

    def send(self, row: dict):
        if row["step"] > self.sent_before:  # (an evaluation's row shares its step with a training row)
            self.run.log(scalars(row), step=row["step"])
            self.sent = row["step"]

    def save_state(self):
        atomic_save(f"{self.run_id} {self.sent}\n", self.state)

    def write(self, row: dict):
        self.send(row)
        self.save_state()

    def close(self):
        self.run.finish()


class MetricsLog:
    """Rank 0's record of the run: each row to metrics.jsonl, and to the trackers asked for.
    A resumed (or restarted) run first drops the rows logged after its checkpoint: those
    steps are trained again. facts: a new run's first row, what an epoch trains on."""

    def __init__(self, cfg: TrainConfig, enabled: bool, resume_step: int = 0, facts: dict | None = None):
        self.sinks = []
        self.latest = {}  # "loss", "val_loss": (step, value) of the last row that held it, for the summary
        if not enabled:
            return
        out = Path(cfg.out_dir)
        path = out / METRICS
        logged = read_metrics(path, warn_if_torn=False)
        kept = [row for row in logged if row["step"] <= resume_step]
        kept = kept or ([{"step": 0, **facts}] if facts else [])  # a new run's first row
        # the trackers first: one that cannot start (W&B without a login, a read-only tensorboard/) stops
        # the run before any write of ours: W&B starts before TensorBoard writes its first event file,
        # and writes its run file (which marks the folder as a run's) only once TensorBoard has started
        wandb_sink = WandbSink(out, cfg, max((row["step"] for row in logged), default=0)) if cfg.wandb else None
        try:
            trackers = [TensorBoardSink(out, cfg, kept)] if cfg.tensorboard else []
        except UsageError:
            if wandb_sink:
                wandb_sink.close()  # the W&B run ends with nothing logged
            raise
        if wandb_sink:
            wandb_sink.begin(kept)
            trackers.append(wandb_sink)
        atomic_save("".join(json.dumps(row) + "\n" for row in kept), path)
        self.sinks = [JsonlSink(path), *trackers]

    def write(self, row: dict):
        self.latest.update((key, (row["step"], row[key])) for key in ("loss", "val_loss") if key in row)
        for sink in self.sinks:
            sink.write(row)

    def close(self):
        for sink in self.sinks:
            sink.close()


def describe(model: LlamaForPretraining, train_ds, steps_per_epoch: int, total_steps: int, micro_batch: int,
             cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The line printed as training starts (with the ranks and backend under DDP; under TP, the
    data-parallel groups, each of --tp ranks reading the same rows)."""
    ddp = torch.distributed.is_initialized()
    ranks = f" x {torch.distributed.get_world_size()} ranks" if ddp else ""
    if cfg.tp > 1:
        groups = data_parallel(cfg)[1]
        ranks = f" x {groups} data-parallel group{'s' * (groups > 1)} of {cfg.tp} tensor-parallel ranks"
    backend = f" ({torch.distributed.get_backend()})" if ddp else ""
    facts = train_ds.facts
    if cfg.stream:  # read as training goes: what an epoch holds is not known before
        source = f" from {train_ds.hub}" if train_ds.hub else ""  # a Hub dataset, at its commit
        what = (f"streamed{source}: {facts['shards']:,} shards ({facts['shard_bytes'] / 1e6:,.1f} MB) in "
                f"{facts['pieces']:,} pieces, dealt into {facts['sub_streams']} sub-streams, {facts['held_out']:,} "
                f"documents held out{', packed online' if cfg.pack else ''}")
    else:
        packed = f", packed into {facts['rows']:,} rows" if cfg.pack else ""
        what = (f"{facts['documents']:,} documents: all their {facts['tokens_per_epoch']:,} tokens an epoch, in "
                f"{facts['windows']:,} windows of {cfg.seq_len}{packed} ({facts['padding']:.1%} padding) | "
                f"{steps_per_epoch} steps per epoch")
    return (f"{model.num_parameters() / 1e6:.1f}M parameters | {what} | {total_steps} steps | "
            f"{micro_batch} {'rows' if cfg.pack else 'sequences'} x {cfg.grad_accum} micro-steps per step{ranks} "
            f"| device {device}{backend} "
            f"| {usable_cores()} usable CPU cores | {dtype}{' | compiled' if cfg.compile else ''}"
            f"{' | activation checkpointing' if cfg.activation_checkpointing else ''}")


def summary(cfg: TrainConfig, step: int, total_steps: int, first_step: int, trained: int, seconds: float,
            latest: dict, preempted: bool, checkpoint: Path) -> str:
    """The end-of-run report: how far, how fast, how well, and what to do next (trained: the
    real tokens this session trained on; latest: MetricsLog.latest, the losses this session
    logged last; checkpoint: the newest checkpoint, which --resume continues from)."""
    out = Path(cfg.out_dir)
    positions = (step - first_step) * cfg.batch_size * cfg.seq_len
    how = "done" if step == total_steps else "stopped by a signal" if preempted else "stopped"
    losses = ""
    for key, name in (("loss", "train loss"), ("val_loss", "val loss")):
        if key in latest:  # a run stopped between two logs or evaluations: the last one, and its step
            at, value = latest[key]
            losses += f" | {name} {value:.4f}" + (f" at step {at}" if at != step else "")
    report = [f"{how} after step {step} of {total_steps}: {trained:,} tokens ({positions:,} positions with "
              f"padding) in {datetime.timedelta(seconds=round(seconds))}{losses}"]
    if step < total_steps:
        return "\n".join(report + [f"checkpoint saved in {checkpoint}; continue with --resume"])
    prompt = "def " if cfg.dataset == corpus.EMBEDDED_CORPUS else "The "  # the demo corpus is Python code
    q = shlex.quote  # commands that paste into a shell whatever the folder's name
    return "\n".join(report + [
        f"weights in {out / MODEL}, with {TOKENIZER}, {CONFIG} and {METRICS} beside them",
        f"  sample:   python tools/generate.py {q(str(out))} --prompt {q(prompt)}",
        f"  export:   python tools/export_hf.py {q(str(out))} {q(str(out) + '-hf')}",
        f"  plot:     python tools/plot_metrics.py {q(str(out))} -o {q(str(out / 'metrics.png'))}"])
