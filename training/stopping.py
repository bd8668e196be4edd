"""How a run ends, on every way out: at its last step; on a signal (finish the step, save,
exit 0, every rank after the same step); on bad input (one line on stderr, exit status 2);
on divergence (nothing non-finite is logged or saved). A checkpoint being written is
completed first, and the process group destroyed.
"""

import contextlib
import json
import math
import os
import select
import signal
import stat
import sys
import threading
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from training.errors import RankError, UsageError, first_line, is_rank0, warn


# Background work to finish before the process ends or its process group goes: checkpoints
# still being written (checkpoint.CheckpointWriter registers its wait; a sharded save talks to
# the other ranks until its last file is written), a trace being recorded, a batch being read
# ahead. Each as (wait, what it is), for the warning if waiting fails.
_UNFINISHED = []


def finish_before_exit(wait, what: str):
    _UNFINISHED.append((wait, what))


def _finish_background_work():
    """On the way out after an error: let a save in flight complete (what it saves was checked
    before the save began) instead of tearing the process group down under it, which would
    leave a half-written checkpoint behind. Its own failure is a warning: the error that ended
    the run has been printed already."""
    while _UNFINISHED:
        wait, what = _UNFINISHED.pop()
        try:
            wait()
        except Exception as e:
            warn(f"{what} was not completed: {first_line(e)}")


# A signal before training begins (StopSignal, below, takes over then) ends the process at
# once: there is nothing to save yet. Not by the default action, though: SIGTERM's would kill
# this process and leave the processes it started (datasets' tokenizing workers) running on
# without it, and a shell starts a background job with SIGINT ignored. The handler raises
# KeyboardInterrupt instead, so that what is running ends its workers on its way out.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_main_pid, _signalled = None, None  # the process exit_on_usage_error runs in; the signal ending it
_joining = False  # from launch.job_store until launch.side_groups returns (ranks_meeting)
# A signal while InTurns waits leaves gloo's barrier queued, and tearing down the group (or the
# interpreter) waits for it to complete: for the other rank's turn. Such a process ends at once.
_abandoned = False


def ranks_meeting(meeting: bool):
    """launch.job_store to launch.side_groups: the ranks are meeting, and what fails there is
    one line (exit_on_usage_error), not torch's page of C++ frames."""
    global _joining
    _joining = meeting


@contextlib.contextmanager
def ended_at_once_by_a_signal():
    """Around a wait whose collective cannot be left queued (turns.InTurns): a signal within
    it ends the process at once (os._exit) instead of by the usual way out."""
    global _abandoned
    _abandoned = True
    yield  # no `finally`: a signal raised inside leaves the flag set, for exit_on_usage_error
    _abandoned = False


def _end_at_once(signum, frame):
    global _signalled, _deferred
    if os.getpid() != _main_pid:  # a process forked from this one, to prepare data: ours ends it
        if signum != signal.SIGINT:  # (Ctrl-C reaches it too: our process deals with it)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # the default action: how Pool.terminate() ends a worker
        return
    if _forking:
        _deferred = _deferred or signum  # raised once the fork is over (_fork_ends)
        return
    if _signalled is None:  # a second signal would interrupt the clean-up the first one began
        _signalled = signum
        raise KeyboardInterrupt


# A signal that lands while os.fork runs its hooks (datasets starting its tokenizing workers)
# must wait until the fork is over: raised inside a hook, the exception is printed and dropped
# ("Exception ignored in ... _releaseLock"), and the signal with it; and logging's lock, taken
# before the fork, may never be released. Ours are registered after logging's (torch imports
# logging), so they run first before the fork and last after it: they bracket the others.
_forking, _deferred = False, None


def _fork_begins():
    global _forking
    _forking = True


def _fork_ends():
    global _forking, _deferred
    _forking, signum, _deferred = False, _deferred, None
    if signum is not None and os.getpid() == _main_pid:
        # again, a moment later, from another thread: sent from here, its handler would run
        # inside this hook. This hook is the fork's last: os.fork returns right after it.
        resend = threading.Timer(0.05, os.kill, args=(os.getpid(), signum))
        resend.daemon = True
        resend.start()


os.register_at_fork(before=_fork_begins, after_in_parent=_fork_ends, after_in_child=_fork_ends)


def exit_on_usage_error(main):
    """Call main(). A UsageError becomes one line on stderr (printed once, by rank 0) and
    exit status 2; a signal before training begins, one line and 128 + its number. A
    checkpoint still being written is completed first, and the process group, if any, is
    destroyed on every way out."""
    global _main_pid, _signalled, _joining, _abandoned
    _main_pid, _signalled, _joining, _abandoned = os.getpid(), None, False, False
    previous = {sig: signal.signal(sig, _end_at_once) for sig in _STOP_SIGNALS}
    try:
        with reader_may_leave():  # `tool | head -1`
            main()
    except (dist.DistError, RuntimeError) as e:
        if not _joining:  # anything else: torch's own report, whole
            raise
        # Meeting the other ranks failed (job_store to side_groups): a store that cannot be
        # reached, a port in use, ranks started by hand that disagree (another WORLD_SIZE, two
        # with one RANK). Each rank says what it met: one line, not a page of C++ frames.
        close_progress_bars()
        where = f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} MASTER_PORT={os.environ.get('MASTER_PORT')}"
        message = (f"rank {os.environ.get('RANK', 0)} of WORLD_SIZE={os.environ.get('WORLD_SIZE', 1)} could not meet "
                   f"the others ({where}): {first_line(e)}. Every rank needs the same WORLD_SIZE and MASTER_ADDR/"
                   "MASTER_PORT and a RANK of its own (torchrun sets them): see docs/multi-node.md")
        print(f"error: {message}", file=sys.stderr)
        tell_torchrun(f"error: {message}")
        sys.exit(2)
    except UsageError as e:
        close_progress_bars()
        if isinstance(e, RankError) or is_rank0():  # every rank sees a UsageError: print it once
            print(f"error: {e}", file=sys.stderr)
        tell_torchrun(f"error: {e}")
        sys.exit(2)
    except BaseException as e:
        # Ctrl-C before training began, or a second one during it; or another signal before
        # training. (A library may turn the KeyboardInterrupt into another error on its way out:
        # datasets' map does, into a TimeoutError.)
        signum = _signalled or (signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
        if signum is None or isinstance(e, SystemExit):
            raise
        close_progress_bars()
        if is_rank0():
            print("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}",
                  file=sys.stderr)
        if _abandoned:  # during data preparation: nothing to save or finish, and the group cannot be torn down
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(128 + signum)
        sys.exit(128 + signum)  # what a shell reports for a process a signal ended: 130 for Ctrl-C
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        _finish_background_work()
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def reader_may_leave():
    """Around main(): a reader of stdout that stops reading (`trace_summary.py TRACE | head -1`)
    ends the script quietly with 141, what a shell reports for a Unix tool SIGPIPE ended, not
    with BrokenPipeError's traceback (Python ignores SIGPIPE: a write to a closed pipe raises).
    Any other broken pipe (a socket, a child's pipe) is an error like any other."""
    try:
        yield
        sys.stdout.flush()  # what is still buffered meets the closed pipe here, not in the interpreter's exit
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # the interpreter flushes stdout again on its way out ("Exception ignored"): into /dev/null it cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe that nobody reads any more (Linux and macOS poll it as an error)."""
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), no poll
        return False


def close_progress_bars():
    """An open progress bar ends its line first: the message gets a line of its own."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def tell_torchrun(message: str):
    """Under torchrun, leave the reason for this worker's exit in the error file torchrun
    reads: its failure report then shows our line instead of a link to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


class StopSignal:
    """SIGTERM or SIGUSR1 (what Slurm and torchrun send before they kill a job), or Ctrl-C,
    only sets a flag; the training loop finishes its step, saves a checkpoint and exits 0.
    A second Ctrl-C stops at once, losing the steps since the last checkpoint."""

    def __init__(self):
        self.requested = False
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C interrupts
            if is_rank0():
                print("\nCtrl-C: saving after this step (press it again to stop at once)", file=sys.stderr)


def agreed(stop_requested: bool, group) -> bool:
    """Whether any rank was asked to stop. A signal reaches the ranks at different moments;
    one tiny all-reduce per step (MAX of a 0 or 1) makes all of them stop after the same
    step instead of racing into collectives the others have left."""
    flag = torch.tensor([stop_requested], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def weights_finite(model: torch.nn.Module, optimizer=None) -> bool:
    """Whether every weight is finite (and, given the optimizer, every number of its state:
    AdamW's moments). One reduction and one host sync for all, not one per tensor; under FSDP
    each rank checks its own shards (to_local) and the ranks agree on the answer (so every
    rank must call it)."""
    tensors = list(model.parameters())
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
    sharded = any(hasattr(t, "to_local") for t in tensors)  # FSDP's DTensors
    finite = torch.stack([torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all() for t in tensors]).all()
    if sharded:
        finite = finite.to(torch.int32)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return bool(finite.item())


class Divergence:
    """Stops a run whose training went bad before it logs or saves anything of it: a loss or
    gradient norm that is not finite, or weights about to be saved that are not. And a run
    whose gradient norm is exactly 0, where AdamW would do nothing. Every gradient is exactly 0
    where the network saturated (each logit so far from the rest that every softmax is exactly
    one-hot, or the hidden states so large that the norms pass no gradient): a diverging run's
    does, its loss blown up past twice a uniform guess's, ln(vocab_size) (an untrained model's is
    just above it), or every target then certain, its loss 0, or back at ln(V) after it blew up
    (docs/failures.md). Only the losses logged before tell that last one from a model whose
    gradients never reached its weights: the highest is kept, and a checkpoint keeps it for the
    run's next session (`ckpt`, before resume.from_checkpoint empties it). Every rank makes the
    same calls with the same (all-reduced) values and reaches the same verdict."""

    def __init__(self, cfg, vocab_size: int, ckpt: dict | None = None):
        self.cfg = cfg
        self.uniform = math.log(vocab_size)  # the loss of a uniform guess over the vocabulary
        # the highest loss logged in this run, and its step (checkpoint.run_state saves it)
        self.highest = tuple(ckpt["highest_loss"]) if ckpt and "highest_loss" in ckpt else (-math.inf, 0)

    def _lower(self) -> str:
        return (f"Start again with a lower --lr (was {self.cfg.lr}) or a longer --warmup-steps (was "
                f"{self.cfg.warmup_steps})")

    def check(self, step: int, loss: float, grad_norm: float):
        """At a logged step: the loss since the last log, and this step's gradient norm."""
        bad = [f"{name} is {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
               if not math.isfinite(value)]
        if bad:
            raise UsageError(f"training diverged: the {bad[0]} at step {step}. {self._lower()}")
        highest, highest_step = self.highest = max(self.highest, (loss, step))
        if grad_norm != 0.0:
            return
        if not 1e-3 < loss <= 2 * self.uniform:
            raise UsageError(f"training diverged: the gradients are all exactly 0 at step {step}, the loss at "
                             f"{loss:.4g} (a uniform guess's: {self.uniform:.3g}): the network saturated. "
                             f"{self._lower()}")
        if highest > 2 * self.uniform:
            raise UsageError(f"training diverged: the loss rose to {highest:.4g} at step {highest_step} (a uniform "
                             f"guess's: {self.uniform:.3g}), and at step {step} the gradients are all exactly 0, the "
                             f"loss back at {loss:.4g}: the network saturated. {self._lower()}")
        if self.cfg.compile:
            raise UsageError(f"every gradient is exactly 0 at step {step}: the model does not train. A compiler "
                             f"bug does this (torch 2.11 with --compile, pytorch/pytorch#180642): run without "
                             f"--compile, or with another torch (this is {torch.__version__})")
        raise UsageError(f"every gradient is exactly 0 at step {step}, with the loss at {loss:.4g}, not rising: the "
                         "model does not train. The gradients do not reach the weights: a change to the model or "
                         "its loss (a backward that returns zeros, a detached tensor) does this")

    def check_weights(self, step: int, model: torch.nn.Module):
        """Before a save, on every rank: nothing non-finite reaches a checkpoint, and the older
        checkpoints stay good."""
        if not weights_finite(model):
            raise UsageError(f"training diverged: the weights are not finite at step {step}. {self._lower()}")
