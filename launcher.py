"""Launcher plumbing: what a torchrun-launched script needs besides DDP itself. Who this
process is, starting the process group on torchrun's store, data preparation in turns
across ranks, DDP's options, and a clean exit. train_ddp.py keeps the lines that teach DDP;
the rest lives here.
"""

import datetime
import inspect
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from errors import RankError, UsageError, first_line


def usable_cores() -> int:
    """The cores this process may run on: its affinity, what Slurm or taskset gave it (not
    the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_rank0() -> bool:
    """Rank 0 of a job, or a plain `python` run: the process that speaks. Only processes that
    really belong to a job keep quiet: members of a process group, and torchrun's workers
    before it starts. A stray RANK variable in a plain run silences nothing."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        return os.environ.get("RANK", "0") == "0"
    return True


def warn(message: str):
    if is_rank0():
        print(f"warning: {message}", file=sys.stderr)


# What torchrun (or a job script launching by hand) tells each process, as whole numbers
LAUNCH_NUMBERS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")


def check_launch_environment(one_process: bool):
    """The launch variables must be what torchrun sets: digits (not "abc", "-1" or "1_0", which
    int() would take as 10). A script that is one process (train_dp.py) reads them only under
    torchrun, and refuses a torchrun that started several: they would train side by side into
    one folder. Each rank says what it finds: a stray value may be one rank's alone."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if one_process and not under_torchrun:
        return  # a stray RANK in a plain `python` run is nothing to a script of one process
    for name in LAUNCH_NUMBERS:
        value = os.environ.get(name)
        if value is not None and not re.fullmatch(r"[0-9]+", value):
            raise RankError(f"{name}={value} is not a whole number: {name} tells each process its place in the "
                            "job; start the ranks with torchrun, or fix the job script that sets it")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size < 1:
        raise RankError(f"WORLD_SIZE={world_size}: a job has at least one process")
    if one_process and world_size > 1:
        raise RankError(f"{Path(sys.argv[0]).name} is one process, and torchrun started {world_size}: they would "
                        "each train the whole model into one folder. Launch train_ddp.py or train_fsdp.py with "
                        f"torchrun, or {Path(sys.argv[0]).name} with plain python")


def restart_count() -> int:
    """How often torchrun (--max-restarts) has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


# Background work to finish before the process ends or its process group goes: checkpoints
# still being written (checkpointing.CheckpointWriter registers its wait). A sharded save
# talks to the other ranks until its last file is written.
_UNFINISHED = []


def finish_before_exit(wait):
    _UNFINISHED.append(wait)


def _finish_background_work():
    """On the way out after an error: let a save in flight complete (what it saves was checked
    before the save began) instead of tearing the process group down under it, which would
    leave a half-written checkpoint behind. Its own failure is a warning: the error that ended
    the run has been printed already."""
    while _UNFINISHED:
        try:
            _UNFINISHED.pop()()
        except Exception as e:
            warn(f"the checkpoint being saved was not completed: {first_line(e)}")


# A signal before training begins (StopSignal, below, takes over then) ends the process at
# once: there is nothing to save yet. Not by the default action, though: SIGTERM's would kill
# this process and leave the processes it started (datasets' tokenizing workers) running on
# without it, and a shell starts a background job with SIGINT ignored. The handler raises
# KeyboardInterrupt instead, so that what is running ends its workers on its way out.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_main_pid, _signalled = None, None  # the process exit_on_usage_error runs in; the signal ending it
_joining = False  # from job_store until side_groups returns: the ranks are meeting (exit_on_usage_error)
# A signal while InTurns waits leaves gloo's barrier queued, and tearing down the group (or the
# interpreter) waits for it to complete: for the other rank's turn. Such a process ends at once.
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


# How DDP is built, for speed:
# - gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, so there is no
#   second set of gradient-sized tensors and no copy out of the buckets after the all-reduce.
#   After zero_grad(set_to_none=True) each backward's fresh gradient is still copied into its
#   bucket once (and freed); set_to_none=False avoids that copy but zeroes the buckets and
#   adds into them instead, which measured no faster (docs/benchmarks.md);
# - no buffer sync before each forward: our only buffers are RoPE's cos/sin tables, which
#   every rank computes identically, so broadcasting them every step is wasted traffic.
#   (torch 2.13 renamed broadcast_buffers to forward_sync_buffers; torch 2.5 knows only the old name.)
_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters
_SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
NO_BUFFER_SYNC = {_SYNC_BUFFERS: False}
DDP_OPTIONS = {"gradient_as_bucket_view": True, **NO_BUFFER_SYNC}  # what train_ddp.py passes, for the benches


def agreed(stop_requested: bool, group) -> bool:
    """Whether any rank was asked to stop. A signal reaches the ranks at different moments;
    one tiny all-reduce per step (MAX of a 0 or 1) makes all of them stop after the same
    step instead of racing into collectives the others have left."""
    flag = torch.tensor([stop_requested], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def job_store(timeout_minutes: float, wait_for_workers: bool = True):
    """The store dist.init_process_group meets the other ranks through: torchrun's, with a
    prefix per restart (or, under plain `python`, one for a world of one). Launched without
    torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand), rank 0 hosts it and,
    unless told not to, waits there for the others to connect."""
    global _joining
    _joining = True  # until side_groups: see exit_on_usage_error
    timeout = datetime.timedelta(minutes=timeout_minutes)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if ("RANK" in os.environ or world_size > 1) and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        # RANK or WORLD_SIZE without a launcher (left in a shell, or a plain `python` where
        # torchrun was meant): a world of 2 would wait 30 minutes for a rank that never comes
        raise UsageError(f"RANK={os.environ.get('RANK', '(unset)')} WORLD_SIZE={os.environ.get('WORLD_SIZE', '(unset)')} "
                         "without MASTER_ADDR and MASTER_PORT: start the ranks with torchrun, or unset RANK and "
                         "WORLD_SIZE to train as one process")
    if not 0 <= rank < world_size:
        raise RankError(f"RANK={rank} is not a rank of WORLD_SIZE={world_size} (0 to {world_size - 1})")
    if "RANK" not in os.environ:
        return dist.HashStore()
    port = os.environ["MASTER_PORT"]
    if not (re.fullmatch(r"[0-9]+", port) and int(port) < 2**16):
        raise RankError(f"MASTER_PORT={port} is not a port number (0 to 65535)")
    # torchrun hosts the store itself (TORCHELASTIC_USE_AGENT_STORE) and shares it with the
    # workers, keeping it when it restarts them (--max-restarts): keys of each attempt get their
    # own prefix, or a restarted rank can read a dead peer's address and fail to connect
    # (pytorch/pytorch#135712). What dist.rendezvous("env://") does, with wait_for_workers.
    by_torchrun = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if int(port) == 0 and world_size > 1 and not by_torchrun:
        raise RankError("MASTER_PORT=0: rank 0 would listen on a port of its choosing, which the other ranks "
                        "cannot know; give every rank the same free port")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(port), world_size, is_master=rank == 0 and not by_torchrun,
                          timeout=timeout, wait_for_workers=wait_for_workers, multi_tenant=True)
    return dist.PrefixStore(f"attempt{restart_count()}/", store)


def side_groups(backend: str, timeout_minutes: float, data_timeout_minutes: float):
    """Two small gloo groups beside the main one. `prep` carries the turns of data preparation:
    on a cold cache local rank 0 may download and tokenize for hours while the others wait,
    far longer than a training collective should ever take. `control` (NCCL only) carries the
    per-step stop flag, which under NCCL would need a GPU tensor whose read-back stalls the
    host; it waits as long as the training collectives do."""
    global _joining
    # Every rank has joined first, within a training collective's timeout: making a group waits
    # for every rank as long as the group may wait (a day for `prep`), and a rank started with
    # another WORLD_SIZE, by hand, would never come.
    dist.barrier(**({"device_ids": [torch.cuda.current_device()]} if dist.get_backend() == "nccl" else {}))
    prep = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=data_timeout_minutes))
    control = (dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
               if backend == "nccl" else None)
    _joining = False  # the ranks have met
    return prep, control


class InTurns:
    """Runs the stages of data preparation across ranks (see training.prepare_data). Each
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
        global _abandoned
        barrier, pause = dist.barrier(group=self.group, async_op=True), 0.001
        _abandoned = True  # until it completes: a signal ends the process with the barrier still queued
        while not barrier.is_completed():
            time.sleep(pause)  # a signal is handled here; short waits stay short, long ones poll twice a second
            pause = min(2 * pause, 0.5)
        _abandoned = False
        barrier.wait()  # raises what the barrier met: a timeout, a rank gone


class StopSignal:
    """SIGTERM or SIGUSR1 (what Slurm and torchrun send before they kill a job), or Ctrl-C,
    only sets a flag; the training loop finishes its step, saves a checkpoint and exits 0.
    A second Ctrl-C stops at once, losing the steps since the last checkpoint."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C interrupts
            if is_rank0():
                print("\nCtrl-C: saving after this step (press it again to stop at once)", file=sys.stderr)
