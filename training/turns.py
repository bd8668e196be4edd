"""Data preparation in turns. prepare() in run_data.py runs in stages, each given to one of
these: in one process (OneProcess) each stage runs once, here; under torchrun (InTurns) each
node's local rank 0 downloads and tokenizes first while the others wait, then they read what
`datasets` cached instead of racing to write the same files.
"""

import time

import torch.distributed as dist

from training import stopping
from training.errors import RankError, UsageError, first_line


class OneProcess:
    """How a single process runs the stages of run_data.prepare: each one, once, here.
    (train_ddp.py and train_fsdp.py pass InTurns, which runs them across ranks.)"""

    def everywhere(self, fn):
        return fn()

    local_rank0_first = from_rank0 = everywhere


class InTurns:
    """Runs the stages of data preparation across ranks (see run_data.prepare). Each
    node's local rank 0 downloads and tokenizes first while the others wait, then they read
    what `datasets` cached instead of racing to write the same files. A UsageError on any rank
    is raised on every rank: all exit with its message, none hangs. The waits go over `group`,
    bounded by --data-timeout-minutes."""

    def __init__(self, group, local_rank: int):
        self.group, self.local_rank = group, local_rank

    def everywhere(self, fn):
        return self._in_turns(fn, first=True)

    def local_rank0_first(self, fn):
        return self._in_turns(fn, first=self.local_rank == 0)

    def _in_turns(self, fn, first: bool):
        result = None
        for my_turn in (first, not first):
            error = None
            if my_turn:
                try:
                    result = fn()
                except UsageError as e:
                    error = str(e)
            errors = [None] * dist.get_world_size()
            self._wait(dist.all_gather_object, errors, error)  # also the barrier after each turn
            if any(errors):
                raise UsageError(next(e for e in errors if e))
        return result

    def from_rank0(self, fn):
        """Run fn on rank 0 only and give every rank its (picklable) result, or its UsageError."""
        box = [None]
        if dist.get_rank() == 0:
            try:
                box = [(fn(), None)]
            except UsageError as e:
                box = [(None, str(e))]
        self._wait(dist.broadcast_object_list, box)
        result, error = box[0]
        if error:
            raise UsageError(error)
        return result

    def _wait(self, collective, *args):
        """Waiting longer than --data-timeout-minutes, or for a rank that died, ends this rank
        with one line instead of gloo's traceback."""
        try:
            self._all_arrived()
            collective(*args, group=self.group)  # every rank is here: it does not wait
        except RuntimeError as e:
            raise RankError(f"rank {dist.get_rank()} stopped waiting for data preparation "
                            f"(--data-timeout-minutes): {first_line(e)}") from None

    def _all_arrived(self):
        """Returns once every rank has come to this collective. The wait for a turn to end may
        last hours: it is gloo's barrier, but waited for here, in Python, so that a signal to
        this rank alone (not to the whole job) stops it now; inside gloo's wait it would be
        handled only once the turn ended. Gloo still notices a rank that died."""
        barrier, pause = dist.barrier(group=self.group, async_op=True), 0.001
        with stopping.ended_at_once_by_a_signal():  # until it completes: the barrier would stay queued
            while not barrier.is_completed():
                time.sleep(pause)  # a signal is handled here; short waits stay short, long ones poll twice a second
                pause = min(2 * pause, 0.5)
        barrier.wait()  # raises what the barrier met: a timeout, a rank gone
