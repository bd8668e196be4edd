"""--profile: a trace of a few chosen steps on every rank, to see what a step does instead of
reading about it. Each rank writes OUT/profile/rank<R>.steps<A>-<B>.pt.trace.json, which
Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's profiler open; on CUDA also
rank<R>.steps<A>-<B>.memory.pickle, a snapshot of every allocation in those steps, for
pytorch.org/memory_viz. tools/trace_summary.py prints per step what a trace holds: compute,
communication, how much of it overlapped compute, and the wait for data. docs/profiling.md
shows how to read one.

The profiler starts at the first profiled step and stops after the last: nothing is recorded
outside them, and a run without --profile makes no profiler at all.
"""

import os
from pathlib import Path

import torch

STEP_MARK = "ProfilerStep#"  # what torch.profiler's own schedule names a step: TensorBoard's view reads it


class Profiler:
    """Records steps first .. first + count - 1 of this run, where first = the run's first step
    (1, or the resumed one + 1) + --profile-warmup: compiling, the allocator's first requests
    and the data feed's start are over by then. Call begin(step) before each step and end(step)
    after it (step: the number of the step, from 1), and close() when the run ends."""

    def __init__(self, cfg, rank: int, device: torch.device, first_step: int):
        self.enabled = cfg.profile
        self.first = first_step + 1 + cfg.profile_warmup
        self.last = self.first + cfg.profile_steps - 1
        self.rank, self.device, self.out = rank, device, Path(cfg.out_dir) / "profile"
        self.profiler, self.mark, self.steps = None, None, []

    def begin(self, step: int):
        if not self.enabled or not self.first <= step <= self.last:
            return
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)  # every allocation from here
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
        self.mark = torch.profiler.record_function(f"{STEP_MARK}{step}")
        self.mark.__enter__()
        self.steps.append(step)

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
        """Stop and write what was recorded (all of it, or the steps a stopped run took)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        if self.mark is not None:  # an error inside a step: that step, as far as it got
            self.mark.__exit__(None, None, None)
            self.mark = None
        profiler.stop()
        name = f"rank{self.rank}.steps{self.steps[0]}-{self.steps[-1]}"
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f"{name}.tmp"
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, self.out / f"{name}.pt.trace.json")  # whole or not at all
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(tmp))
            os.replace(tmp, self.out / f"{name}.memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
