"""Run a training script (argv[1:]) with one fault injected, for the failure tests.

FAULT picks the fault (or several, comma-separated), FAULT_STEP the optimizer step at which
it strikes (counted by calls to build.AdamW.step, once per step), FAULT_RANK the rank (default
0). It strikes in the
first attempt only: after torchrun restarts the workers, the run goes on unharmed.
    kill              SIGKILL this process (a dead GPU, the OOM killer); with FAULT_AFTER_FILE, once
                      that file exists (a checkpoint its background writer must finish first)
    kill-exporting    (with --profile) the same, while the trace is written: what kineto, the
                      profiler's exporter, leaves then, the first half of its NAME.tmp (FAULT_STEP
                      is unused)
    sigterm-launcher  what `scancel` or a preempting scheduler does: SIGTERM to torchrun,
                      which forwards it to every worker. This rank also gets it at once.
    sigusr1           SIGUSR1 to this process (Slurm's warning before the time limit)
    sigint            SIGINT to this process (Ctrl-C); sigint-twice: two of them (Ctrl-C, Ctrl-C)
    small-disk        the output folder's disk holds FAULT_BYTES: a write beyond that fails with
                      ENOSPC, as on a full disk, and shutil.disk_usage says what is left
                      (train_fsdp.py: this rank's writes of its shards and .metadata too)
    slow-disk         the first checkpoint write hangs until training reaches FAULT_STEP;
                      a trainer that saved in its training loop would never get there
                      (train_fsdp.py: this rank's first write of its shards)
    hold-checkpoint   (with --profile) this rank's checkpoint writes are held until the trainer waits
                      for one in flight, and then until every other rank has either begun to export
                      its trace or waits in a barrier after its first step (files in FAULT_LOG_DIR
                      tell the ranks): a rank that exports without waiting for the checkpoint does so
                      while it is unwritten. Each rank's export records which checkpoints were on
                      disk then, in $FAULT_LOG_DIR/exported-rank<RANK>.txt (FAULT_STEP is unused)
    slow-prepare      loading the corpus takes FAULT_SECONDS longer than it does (a cold cache:
                      a download, a tokenizer to train); FAULT_STEP is unused
    sigterm-waiting   (with slow-prepare) every other rank gets SIGTERM, to itself alone, a second
                      after it began to wait for FAULT_RANK's turn of data preparation
    slow-tokenizing   tokenizing (a corpus of 10,000 documents or more: one process per 5,000) runs in two processes
                      forked for it, whatever the cores, and takes ten minutes: each writes
                      $FAULT_LOG_DIR/tokenizing-<pid> and waits. FAULT_STEP is unused
    diverge-mid-save  (train_fsdp.py, every rank) the loss logged at FAULT_STEP is NaN, while the
                      sharded checkpoint saved before it is still being written: its write
                      waits until the divergence has been raised
    small-memory      this rank's device holds FAULT_BYTES of memory, all of it available
                      (memory.device_memory); FAULT_STEP is unused
    stall-collective  (check_cluster.py) this rank never joins an all-reduce: it blocks forever at
                      the first, as a rank whose network is cut would
    other-torch       (check_cluster.py) this rank reports torch 2.99.0, as a node with another
                      installation would; FAULT_STEP is unused
    never-start       this rank blocks forever before the script starts, as a rank whose node never
                      launched it would
    same-rank         this rank is given RANK=0 too, as a process launched by hand with a copied line
    other-world-size  this rank is given WORLD_SIZE one larger than the others'
    cut-windows       (padded runs) the windows cache the run trains on is cut to half its size in
                      place, as someone's `truncate` would, just before the loader reads its first batch
                      after FAULT_STEP (in the reading thread: no read is under way); zero-windows: cut
                      to its first KiB and grown back to its size, zeros where its windows were
    none              no fault: the run as it is, only recorded
Each process records how it ended in $FAULT_LOG_DIR/exit-rank<RANK>.txt, and in ran-rank<RANK>.txt
how many seconds the script itself ran (its start to its end: torchrun's launch, this file's
imports and a fault's wait before the script starts left out). Whatever the fault
patched is restored when the script ends, so that a test can run this in its own process.
"""

import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for training.build
from training import build  # noqa: E402 (the trainers' AdamW, a subclass of torch's)

faults, at_step = os.environ["FAULT"].split(","), int(os.environ["FAULT_STEP"])
rank = os.environ.get("RANK", "0")
armed = ((rank == os.environ.get("FAULT_RANK", "0") or "diverge-mid-save" in faults)
         and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
reached = threading.Event()
steps = 0
real_step = build.AdamW.step
patched = []  # (object, name, original): put back at the end


def patch(obj, name, value):
    patched.append((obj, name, obj.__dict__.get(name, patch)))  # patch: "had no attribute of its own"
    setattr(obj, name, value)


def kill():
    if "FAULT_AFTER_FILE" in os.environ:  # e.g. a checkpoint, written in the background: complete first
        deadline = time.monotonic() + 120
        while not Path(os.environ["FAULT_AFTER_FILE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def strike():
    if "kill" in faults:
        kill()
    if "sigterm-launcher" in faults:
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # this rank's copy arrives now
        os.kill(os.getppid(), signal.SIGTERM)  # torchrun forwards it to the others, later
    if "sigusr1" in faults:
        os.kill(os.getpid(), signal.SIGUSR1)
    if "sigint" in faults or "sigint-twice" in faults:
        os.kill(os.getpid(), signal.SIGINT)
        if "sigint-twice" in faults:
            os.kill(os.getpid(), signal.SIGINT)


def step_and_count(*args, **kwargs):
    global steps
    steps += 1
    if steps == at_step:
        reached.set()
        if armed:
            strike()
    return real_step(*args, **kwargs)


patch(build.AdamW, "step", step_and_count)
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
if "slow-disk" in faults and armed:
    from torch.distributed.checkpoint import FileSystemWriter

    from training import pt_checkpoint

    def slow(write):
        def slow_write(*args, **kwargs):
            reached.wait()  # the disk answers only once training has moved on to FAULT_STEP
            return write(*args, **kwargs)
        return slow_write

    patch(pt_checkpoint, "save_checkpoint", slow(pt_checkpoint.save_checkpoint))
    patch(FileSystemWriter, "write_data", slow(FileSystemWriter.write_data))  # train_fsdp.py's shards

if "hold-checkpoint" in faults:
    from training import checkpoint, pt_checkpoint

    logs = Path(os.environ["FAULT_LOG_DIR"])  # the ranks are processes: files tell them
    released = logs / "released"
    others = [r for r in range(int(os.environ.get("WORLD_SIZE", "1"))) if str(r) != rank]
    real_save, real_wait = pt_checkpoint.save_checkpoint, checkpoint.CheckpointWriter.wait
    real_export, real_barrier = torch.profiler.profile.export_chrome_trace, torch.distributed.barrier

    def until(done):
        deadline = time.monotonic() + 300  # (a rank gone wrong: the test fails on what it finds)
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    def held_save(state, out_dir, keep):
        until(released.exists)
        real_save(state, out_dir, keep)
        (logs / f"saved-{state['step']}").touch()

    def waited(self):
        if self.thread is not None:  # a save in flight (save() waits for the one before too)
            until(lambda: all((logs / f"exported-rank{r}.txt").exists() or (logs / f"barrier-rank{r}").exists()
                              for r in others))
            released.touch()
        real_wait(self)

    def recorded_barrier(*args, **kwargs):
        if steps:  # in training (launch.side_groups's, before it, is none of this)
            (logs / f"barrier-rank{rank}").touch()
        return real_barrier(*args, **kwargs)

    def recorded_export(self, path):
        on_disk = sorted(int(p.name.removeprefix("saved-")) for p in logs.glob("saved-*"))
        with open(logs / f"exported-rank{rank}.txt", "a") as f:
            f.write(f"{on_disk}\n")
        return real_export(self, path)

    if armed:
        patch(pt_checkpoint, "save_checkpoint", held_save)
        patch(checkpoint.CheckpointWriter, "wait", waited)
    patch(torch.profiler.profile, "export_chrome_trace", recorded_export)
    patch(torch.distributed, "barrier", recorded_barrier)

if "kill-exporting" in faults and armed:
    real_export = torch.profiler.profile.export_chrome_trace

    def killed_exporting(self, path):
        real_export(self, path)  # kineto writes path.tmp, then renames it to path
        torn = Path(path).rename(path + ".tmp")
        os.truncate(torn, torn.stat().st_size // 2)  # as it stood halfway through the write
        kill()

    patch(torch.profiler.profile, "export_chrome_trace", killed_exporting)

if "slow-prepare" in faults and armed:
    from training import run_data

    real_load_text = run_data.load_text

    def slow_load_text(*args, **kwargs):
        time.sleep(float(os.environ["FAULT_SECONDS"]))  # the work itself is slow, nothing waits on it
        return real_load_text(*args, **kwargs)

    patch(run_data, "load_text", slow_load_text)

if "sigterm-waiting" in faults and not armed and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    from training import turns

    real_wait = turns.InTurns._wait

    def signalled_wait(self, *args):
        if not getattr(signalled_wait, "armed", False):  # the first wait only
            signalled_wait.armed = True
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return real_wait(self, *args)

    patch(turns.InTurns, "_wait", signalled_wait)

if "slow-tokenizing" in faults and armed:
    import data

    def slow_encode(batch, **kwargs):
        Path(os.environ["FAULT_LOG_DIR"], f"tokenizing-{os.getpid()}").touch()
        time.sleep(600)  # the work itself is slow: nothing waits on it
        return {"input_ids": [[0]] * len(batch["text"])}

    # pickled to the workers by name, as data.batch_windows (by value, a function of this script
    # would drag its globals along), and found there patched: they are forked from this process
    slow_encode.__module__, slow_encode.__qualname__ = "data", "batch_windows"
    patch(os, "sched_getaffinity", lambda pid: {0, 1})  # tokenized.tokenize: one process per core
    patch(data, "batch_windows", slow_encode)

if "diverge-mid-save" in faults and armed:
    from torch.distributed.checkpoint import FileSystemWriter

    from training import stopping

    diverged = threading.Event()
    real_check, real_write_data = stopping.Divergence.check, FileSystemWriter.write_data

    def nan_at_step(self, step, loss, grad_norm):
        if step == at_step:
            diverged.set()  # the UsageError is on its way
            loss = float("nan")
        return real_check(self, step, loss, grad_norm)

    def write_after_divergence(self, *args, **kwargs):
        diverged.wait()
        return real_write_data(self, *args, **kwargs)

    patch(stopping.Divergence, "check", nan_at_step)
    patch(FileSystemWriter, "write_data", write_after_divergence)

if ("cut-windows" in faults or "zero-windows" in faults) and armed:
    import data

    real_getitems = data.PaddedSequenceDataset.__getitems__

    def damaging_getitems(self, indices):
        if reached.is_set() and self.corpus is not None and not getattr(damaging_getitems, "done", False):
            damaging_getitems.done = True  # the training windows, once, in the thread that reads them
            path = self.rows.cache_files[0]["filename"]
            size = os.path.getsize(path)
            os.truncate(path, 1024 if "zero-windows" in faults else size // 2)
            if "zero-windows" in faults:
                os.truncate(path, size)
        return real_getitems(self, indices)

    patch(data.PaddedSequenceDataset, "__getitems__", damaging_getitems)

if "small-memory" in faults and armed:
    from training import memory

    patch(memory, "device_memory", lambda device: (int(os.environ["FAULT_BYTES"]),) * 2)

if "small-disk" in faults and armed:
    import contextlib
    import errno
    import io
    import shutil

    from training import files

    capacity = int(os.environ["FAULT_BYTES"])
    out_dir = sys.argv[sys.argv.index("--out-dir") + 1]

    def used():  # every rank's files count: they share the disk
        return sum(f.stat().st_size for f in Path(out_dir).rglob("*") if f.is_file())

    class SmallDiskFile(io.FileIO):
        def write(self, b):
            if used() + len(b) > capacity:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)

    real_disk_usage = shutil.disk_usage

    def small_disk_usage(path):
        if os.path.realpath(path).startswith(os.path.realpath(out_dir)):
            return shutil._ntuple_diskusage(capacity, used(), max(0, capacity - used()))  # ranks race to fill it
        return real_disk_usage(path)

    patch(files, "open", lambda path, mode: SmallDiskFile(path, mode.replace("b", "")))  # atomic_save's
    from torch.distributed.checkpoint.filesystem import FileSystem
    real_create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def small_disk_stream(self, path, mode):  # what DCP's FileSystemWriter opens
        with (SmallDiskFile(path, "w") if "w" in mode else real_create_stream(self, path, mode)) as stream:
            yield stream

    patch(FileSystem, "create_stream", small_disk_stream)
    patch(shutil, "disk_usage", small_disk_usage)

if "stall-collective" in faults and armed:
    patch(torch.distributed, "all_reduce", lambda *args, **kwargs: threading.Event().wait())

if "other-torch" in faults and armed:
    patch(torch, "__version__", "2.99.0")

if "never-start" in faults and armed:
    threading.Event().wait()

if "same-rank" in faults and armed:
    os.environ["RANK"] = "0"

if "other-world-size" in faults and armed:
    os.environ["WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) + 1)



def record(status: str):
    """How this process ended, and how long its script ran, for the test to read."""
    for name, value in [("exit", status), ("ran", f"{time.monotonic() - started:.3f}")]:
        with open(os.path.join(os.environ["FAULT_LOG_DIR"], f"{name}-rank{rank}.txt"), "w") as f:
            f.write(value)


def recorded_exit(status, real_exit=os._exit, pid=os.getpid()):
    """os._exit, recorded first where the rank itself takes it (check_cluster.py's end() does), not a
    child it forked (a DataLoader worker ends with os._exit too)."""
    if os.getpid() == pid:
        record(str(status))
    real_exit(status)


patch(os, "_exit", recorded_exit)
status, started = "exception", time.monotonic()
try:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    status = "0"
except SystemExit as e:
    status = str(e.code if e.code is not None else 0)
    raise
finally:
    for obj, name, original in reversed(patched):
        if original is patch:
            delattr(obj, name)
        else:
            setattr(obj, name, original)
    record(status)
