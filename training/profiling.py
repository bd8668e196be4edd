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
folder can take the files); and however the run ends (an error, a signal, a full disk), the
profiler is stopped and what it recorded kept, or nothing left behind.
"""

import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from training import stopping
from training.errors import UsageError, first_line
from training.run_folder import PROFILE

STEP_MARK = "ProfilerStep#"  # what torch.profiler's own schedule names a step: TensorBoard's view reads it
MICRO_STEP_MARK = "micro-step "  # each micro-step's forward and backward, numbered from 1 (micro_steps)
EVALUATION_MARK = "evaluation"  # evaluation.evaluate: its forwards are no micro-step's
DATA_WAIT_MARK = "data wait"  # read_ahead.ReadAhead: the loop waiting for its next step's batches


class Profiler:
    """Records steps first .. first + count - 1 of this run, where first = the run's first step
    (1, or the resumed one + 1) + --profile-warmup: compiling, the allocator's first requests
    and the data feed's start are over by then. Call begin(step) before each step and end(step)
    after it (step: the number of the step, from 1), and close() when the run ends. Made on
    every rank at once: what one rank finds wrong (its trace's name taken, say) ends them all."""

    def __init__(self, cfg, rank: int, device: torch.device, first_step: int, total_steps: int):
        self.enabled = cfg.profile
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
        if self.out.exists() and not self.out.is_dir():
            return f"{self.out} is not a folder, and --profile writes its traces there: move it away"
        trace = self.out / f"{self.name()}.pt.trace.json"
        if os.path.lexists(trace):
            return f"{trace} exists (a trace of an earlier session of this run): move it away to trace these steps"
        folder = self.out if self.out.exists() else self.out.parent
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            return f"--profile: no permission to write in {folder}"
        return None

    def name(self, first: int | None = None, last: int | None = None) -> str:
        """The trace's file name without its suffix: the steps planned, or those recorded."""
        return f"rank{self.rank}.steps{self.first if first is None else first}-{self.last if last is None else last}"

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

    def end(self, step: int):
        if self.mark is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels belong to the step
        self.mark.__exit__(None, None, None)
        self.mark = None
        if step == self.last:
            self.close()

    def close(self):
        """Stop and write what was recorded (all of it, or the steps a stopped run took). A
        trace that cannot be written (a full disk) is a warning: the run's own files matter
        more, and nothing half-written is left."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        started = time.perf_counter()
        if self.mark is not None:  # an error inside a step: that step, as far as it got
            self.mark.__exit__(None, None, None)
            self.mark = None
        with _quiet_stderr():
            profiler.stop()
        name = self.name(self.steps[0], self.steps[-1])
        tmp = self.out / f"{name}.tmp"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(tmp))
            os.replace(tmp, self.out / f"{name}.pt.trace.json")  # whole or not at all
            if self.device.type == "cuda":
                torch.cuda.memory._dump_snapshot(str(tmp))
                os.replace(tmp, self.out / f"{name}.memory.pickle")
        except (OSError, RuntimeError) as e:  # a full disk, a folder gone read-only: each rank says its own
            tmp.unlink(missing_ok=True)
            tqdm.write(f"warning: --profile: rank {self.rank}'s trace of steps {self.steps[0]}-{self.steps[-1]} was "
                       f"not written to {self.out}: {first_line(e)}", file=sys.stderr)  # (below the progress bar)
        finally:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
            self.writing_seconds += time.perf_counter() - started


@contextlib.contextmanager
def _quiet_stderr():
    """Around the profiler's start and stop, which print a line each to the process's stderr
    from C++ (kineto's "USDT: ... profiler_start"), whatever its log level: a run's stderr is
    its one-line errors and warnings."""
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
