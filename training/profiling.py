"""--profile: a trace of a few chosen steps on every rank, to see what a step does instead of
reading about it. Each rank writes OUT/profile/rank<R>.steps<A>-<B>.pt.trace.json, which
Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's profiler open; on CUDA also
rank<R>.steps<A>-<B>.memory.pickle, a snapshot of every allocation in those steps, for
pytorch.org/memory_viz. tools/trace_summary.py prints per step what a trace holds: compute,
communication, how much of it overlapped compute, and the wait for data. docs/profiling.md
shows how to read one.

The profiler starts at the first profiled step and stops after the last: nothing is recorded
outside them, and a run without --profile makes no profiler at all. Everything it will need
is checked before the run writes anything (the steps it traces are steps the run takes, the
folder can take the files, nothing of the user's sits at a name it writes); and however the run
ends (an error, a signal, a full disk), the profiler is stopped and what it recorded kept, or
nothing left behind. Each file is written under a hidden name of the project's own
(run_folder.partial_trace), renamed once whole: a session killed while writing leaves only such
names, which the run's next session deletes (run_folder.remove_temp_files).

The profiler never costs the run its checkpoints: the trace is written once the checkpoint in
flight is on disk (every rank's), and kept only if the disk still has room for the run's next
checkpoint and model.pt (checkpoint.room_to_keep); else it is deleted, with a warning.
"""

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from training import checkpoint, files, launch, stopping
from training.errors import UsageError, first_line
from training.run_folder import PROFILE, partial_trace

STEP_MARK = "ProfilerStep#"  # what torch.profiler's own schedule names a step: TensorBoard's view reads it
MICRO_STEP_MARK = "micro-step "  # each micro-step's forward and backward, numbered from 1 (micro_steps)
EVALUATION_MARK = "evaluation"  # evaluation.evaluate: its forwards are no micro-step's
DATA_WAIT_MARK = "data wait"  # read_ahead.ReadAhead: the loop waiting for its next step's batches
TRACE, MEMORY = ".pt.trace.json", ".memory.pickle"  # the suffixes of a trace and of a CUDA memory snapshot
KINETO_TMP = ".tmp"  # kineto, the profiler's exporter, writes NAME.tmp for the NAME it is given, renamed when done
# A write kineto failed tells no errno (it prints a line, leaves its NAME.tmp as far as it got, and
# returns): less free space than this then is a full disk, which the write it was flushing (kilobytes
# of its stream's buffer) met.
KINETO_ROOM = 2**20


class Profiler:
    """Records steps first .. first + count - 1 of this run, where first = the run's first step
    (1, or the resumed one + 1) + --profile-warmup: compiling, the allocator's first requests
    and the data feed's start are over by then. Call begin(step) before each step and end(step)
    after it (step: the number of the step, from 1), finish() when the loop ends (a run stopped
    within the traced steps), close() on the way out of an error. Made on
    every rank at once: what one rank finds wrong (its trace's name taken, say) ends them all.
    model: the run's, whose size says how much room its checkpoints need (room_to_keep); None
    where nothing is saved (benchmarks/step_rows.py's traced step)."""

    def __init__(self, cfg, rank: int, device: torch.device, first_step: int, total_steps: int, model):
        self.enabled = cfg.profile
        self.room = checkpoint.room_to_keep(model) if model is not None else 0  # what the trace must leave free
        self.first = first_step + 1 + cfg.profile_warmup
        self.last = self.first + cfg.profile_steps - 1
        self.rank, self.device, self.out = rank, device, Path(cfg.out_dir) / PROFILE
        self.profiler, self.mark, self.steps = None, None, []
        self.writing_seconds = 0.0  # spent writing the trace: not training time
        if self.enabled:
            last_step = min(total_steps, cfg.stop_at_step or total_steps)
            problem = self._problem(first_step, last_step)
            if dist.is_initialized():  # every rank's, so that all stop if one must
                problems = [None] * dist.get_world_size()
                dist.all_gather_object(problems, problem)
                problem = next((p for p in problems if p), None)
            if problem:
                raise UsageError(problem)

    def _problem(self, first_step: int, last_step: int) -> str | None:
        """What keeps this rank from tracing, said before anything is written (None: nothing)."""
        if self.last > last_step:
            resumed = f" (resumed after step {first_step})" if first_step else ""
            return (f"--profile would trace steps {self.first}-{self.last}, and this run ends at step {last_step}"
                    f"{resumed}: lower --profile-warmup or --profile-steps")
        if self.out.is_symlink() and not self.out.exists():
            return (f"{self.out} is a link to {os.readlink(self.out)}, which does not exist, and --profile writes "
                    "its traces there: create that folder or remove the link")
        if self.out.exists() and not self.out.is_dir():
            return f"{self.out} is not a folder, and --profile writes its traces there: move it away"
        # every name it may write: the steps planned, or fewer (a run stopped within them), and each one's
        # partial names, where a regular file is a killed session's partial trace (rank 0 deleted it on
        # taking the folder, or the write replaces it) and anything else the user's
        for last in range(self.first, self.last + 1):
            for final in self._files(last):
                if os.path.lexists(final):
                    return (f"{final} exists (a trace of an earlier session of this run): move it away to trace "
                            "these steps")
                for partial in _in_progress(final):
                    if os.path.lexists(partial) and (partial.is_symlink() or not partial.is_file()):
                        return f"{partial} is in the way of --profile, which writes its trace there first: move it away"
        folder = self.out if self.out.exists() else self.out.parent
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            return f"--profile: no permission to write in {folder}"
        return None

    def name(self, first: int | None = None, last: int | None = None) -> str:
        """The trace's file name without its suffix: the steps planned, or those recorded."""
        return f"rank{self.rank}.steps{self.first if first is None else first}-{self.last if last is None else last}"

    def _files(self, last: int) -> list[Path]:
        """The files of a trace of steps first .. last: the trace, and on CUDA the memory snapshot."""
        return [self.out / f"{self.name(self.first, last)}{suffix}"
                for suffix in ([TRACE, MEMORY] if self.device.type == "cuda" else [TRACE])]

    def begin(self, step: int):
        if not self.enabled or not self.first <= step <= self.last:
            return
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)  # every allocation from here
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            with _quiet_stderr():
                self.profiler.start()
            # an error or a signal from here on: stopped, and kept
            stopping.finish_before_exit(self.close, "the trace being recorded")
        self.mark = torch.profiler.record_function(f"{STEP_MARK}{step}")
        self.mark.__enter__()
        self.steps.append(step)

    def micro_steps(self, micro_batches: list):
        """The step's micro-batches, each one's forward and backward marked in the trace as
        micro-step i (from 1) while the profiler records; else the list itself."""
        return _marked(micro_batches) if self.mark is not None else micro_batches

    def writes_after(self, step: int) -> bool:
        """Whether end(step) writes the trace (a pause: not training time)."""
        return self.mark is not None and step == self.last

    def end(self, step: int, writer: checkpoint.CheckpointWriter | None = None):
        """After the step (its saving and evaluation included); after the last traced one, the
        trace is written, once the checkpoint the writer may still be writing is on disk: on
        every rank (a rank may share rank 0's disk), so that the trace takes only the room the
        checkpoint left, and never the room it was being written into."""
        if self.mark is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels belong to the step
        self.mark.__exit__(None, None, None)
        self.mark = None
        if step == self.last:
            if writer is not None:
                writer.wait()
            self.finish()

    def finish(self):
        """Where the run's loop ends, once this rank's checkpoint in flight is on disk (the
        trainer waited for it), and after the last traced step: what was recorded is written
        once every rank's checkpoint (DDP: rank 0's) is on disk too. Every rank calls it at the
        same step, and records or not alike (a run stops after the same step on every rank)."""
        if self.profiler is None:
            return
        if dist.is_initialized():
            launch.barrier()
        self.close()

    def close(self):
        """Stop and write what was recorded (all of it, or the steps a stopped run took). A
        trace that cannot be written (a full disk), or that leaves less free than the run's
        next checkpoint and model.pt need (self.room), is a warning: the run's own files
        matter more, and nothing of the trace is left."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        started = time.perf_counter()
        if self.mark is not None:  # an error inside a step: that step, as far as it got
            self.mark.__exit__(None, None, None)
            self.mark = None
        with _quiet_stderr():
            profiler.stop()
        trace, *memory = self._files(self.steps[-1])
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            _write_whole(lambda path: _export_trace(profiler, path), trace)
            if memory:
                _write_whole(lambda path: torch.cuda.memory._dump_snapshot(str(path)), memory[0])
            _leave_room(self.out, self.room, [trace, *memory])
        except (OSError, RuntimeError) as e:  # a full disk, a folder gone read-only: each rank says its own
            tqdm.write(f"warning: --profile: rank {self.rank}'s trace of steps {self.steps[0]}-{self.steps[-1]} was "
                       f"not written to {self.out}: {first_line(e)}", file=sys.stderr)  # (below the progress bar)
        finally:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
            self.writing_seconds += time.perf_counter() - started


def _export_trace(profiler: torch.profiler.profile, path: Path):
    """The trace, written by kineto at path, and whole: its JSON object closed (kineto writes
    NAME.tmp and renames it once done, and says nothing when a write fails; an exporter that
    wrote NAME itself would leave it torn). kineto keeps the file it wrote open as long as the
    profiler's results live, which a reference cycle keeps until the garbage collector runs: a
    partial file, deleted, would hold its space on a full disk until then. Freed at once."""
    try:
        profiler.export_chrome_trace(str(path))
    finally:
        if hasattr(profiler.profiler, "kineto_results"):  # (private: torch 2.13's name)
            profiler.profiler.kineto_results = None
    if path.is_file():
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 64))
            if not f.read().rstrip().endswith(b"}"):
                raise OSError(f"torch.profiler's exporter left {path.name} unfinished")


def _leave_room(folder: Path, room: int, written: list[Path]):
    """The trace's files, deleted unless the disk has `room` bytes free beside them: the run
    writes its checkpoint and model.pt next, and they come first (a trace that fits whole but
    leaves too little free would end the run at its next save, exit 2, with no checkpoint)."""
    free = shutil.disk_usage(folder).free
    if free < room:
        for path in written:
            path.unlink(missing_ok=True)
        raise OSError(f"it left {free / 1e6:,.1f} MB free on the disk mounted at {files.mounted_at(folder)}, and "
                      f"the run's next checkpoint and model.pt need about {room / 1e6:,.1f} MB")


def _in_progress(final: Path) -> list[Path]:
    """The names `final` is written under before it is renamed to it: its partial name, and
    for a trace kineto's own .tmp of that."""
    partial = partial_trace(final)
    return [partial, partial.with_name(partial.name + KINETO_TMP)] if final.name.endswith(TRACE) else [partial]


def _write_whole(export, final: Path):
    """export(path) writes a file at path; here it becomes `final` whole, or no file is left
    under any of the names it was written under (a full disk: the space is the run's own files'
    again). Why it failed is said in the error: a full disk says so, as kineto does not."""
    partial = partial_trace(final)
    try:
        with _quiet_stderr():  # kineto's own line on a failed write ("Failed to write to log file!")
            export(partial)
        if not partial.is_file():  # kineto raises nothing: a failed write leaves its .tmp unrenamed
            raise OSError(f"torch.profiler's exporter did not finish {partial.name}{KINETO_TMP}")
        os.replace(partial, final)
    except (OSError, RuntimeError) as e:
        full = files.out_of_space(e, final.parent, KINETO_ROOM)  # while the partial file still takes its space
        if full:
            free, mount = full
            raise OSError(f"the disk mounted at {mount} is full ({free / 1e6:,.1f} MB free)") from None
        raise
    finally:
        for path in _in_progress(final):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet_stderr():
    """Around the profiler's start and stop, which print a line each to the process's stderr
    from C++ (kineto's "USDT: ... profiler_start"), whatever its log level, and its export: a
    run's stderr is its one-line errors and warnings."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(devnull)


def _marked(micro_batches: list):
    for i, batch in enumerate(micro_batches, 1):
        with torch.profiler.record_function(f"{MICRO_STEP_MARK}{i}"):
            yield batch  # the loop's body, forward and backward, runs inside the mark
