"""Check a cluster before its first training job, in seconds. Launch it exactly like training:

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv-id=check --rdzv-backend=c10d \\
        --rdzv-endpoint=node0.example.com:29500 --rdzv-conf join_timeout=120 check_cluster.py
    SCRIPT=check_cluster.py sbatch slurm/train.sbatch
    torchrun --standalone --nproc_per_node=2 check_cluster.py      # two CPU processes, here

Rank 0 prints one row per rank (node, host, local rank, device, torch, CUDA and NCCL
versions) and calls out any difference between ranks in those versions or in GPU kind.
Then an all-reduce of known values, checked on every rank, on the training backend (NCCL
on GPUs) and on gloo, and the all-reduce bus bandwidth at a few sizes, as nccl-tests
computes it (algorithm bandwidth x 2(n-1)/n): over all ranks, and within each node when
there are several. Exit status 0 when everything agrees; else one line naming the problem
and exit status 2.

Every wait is bounded (--timeout-seconds): a collective that does not complete ends the
check with one line saying which ranks joined it and which never did, on which backend,
and the network settings in effect. torchrun's own rendezvous, before this script starts,
waits `--rdzv-conf join_timeout=SECONDS` (600 by default) for every node. What to do when
it fails: docs/multi-node.md.
"""

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, from any folder
from training import errors, launch, stopping  # noqa: E402
from training.errors import ArgumentParser, RankError, UsageError, first_line  # noqa: E402
from training.launch import usable_cores  # noqa: E402

# what decides where the ranks meet and over which network: printed when a wait fails
NETWORK_ENV = ["MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE",
               "NCCL_P2P_DISABLE", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
MUST_AGREE = ["world_size", "torch", "cuda", "nccl", "gpu"]  # a difference in any of these breaks or slows a job
STORE = None  # the job's store, once reached: the ranks agree through it on which one reports a failure


class Failed(Exception):
    """One line that ends the check with exit status 2."""


def this_rank(device: torch.device) -> dict:
    """What this rank runs on. GROUP_RANK: torchrun's node number (hosts may share a name)."""
    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {"world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "node": int(os.environ.get("GROUP_RANK", 0)), "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "device": f"{gpu.name}, {gpu.total_memory / 2**30:.0f} GiB" if gpu else f"CPU, {usable_cores()} cores",
            "gpu": gpu.name if gpu else None, "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None}


def ranks(numbers: list[int]) -> str:
    return f"rank{'s' * (len(numbers) != 1)} {', '.join(map(str, numbers)) or 'none'}"


def settings() -> str:
    return " ".join(f"{k}={os.environ[k]}" for k in NETWORK_ENV if k in os.environ) or "none set"


class Meeting:
    """Bounded waits, through the job's store, which every rank reaches over TCP even when a
    collective hangs. Each rank leaves a mark in it as it reaches a step; one deadline per step
    ends the check, whatever the step is stuck in (a collective, a connection NCCL makes, the
    store itself), with one line naming the ranks that never reached the step."""

    def __init__(self, store, rank: int, world_size: int, timeout: float):
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout

    def arrive(self):
        """Each rank number is taken once: two processes given the same RANK (by hand, or a
        launcher misconfigured) are named at once, not later as a rank that never came."""
        if self.store.add(f"check/rank {self.rank} arrived", 1) > 1:
            raise Failed(f"two processes have RANK={self.rank}: give each process of the job its own rank "
                         f"(0 to {self.world_size - 1}), or start them with torchrun")

    def mark(self, step: str, value: str = "reached"):
        self.store.set(f"check/{step}/{self.rank}", value)

    def stalled(self, step: str, backend: str, why: str | None) -> str:
        try:
            missing = [r for r in range(self.world_size) if not self.store.check([f"check/{step}/{r}"])]
        except (dist.DistError, RuntimeError):
            return (f"{step} did not complete within {self.timeout:g} s, and the job's store does not answer either "
                    f"(node 0 gone?). Network settings: {settings()}. What to try: docs/multi-node.md")
        joined = [r for r in range(self.world_size) if r not in missing]
        who = (f"{ranks(missing)} of {self.world_size} never joined it ({ranks(joined)} did)" if missing
               else why or "every rank joined it, and it never completed")
        return (f"{step} over {backend} did not complete within {self.timeout:g} s: {who}. Network settings: "
                f"{settings()}. What to try: docs/multi-node.md")

    @contextlib.contextmanager
    def deadline(self, step: str, backend: str, why: str | None = None):
        """The step must end within the timeout, or the check ends, from a timer thread."""
        timer = threading.Timer(self.timeout, lambda: end(self.stalled(step, backend, why), self.store))
        timer.daemon = True
        timer.start()
        try:
            yield
        except (dist.DistError, RuntimeError) as e:  # a failure, not a hang: the backend's own words
            raise Failed(f"{step} over {backend} failed: {first_line(e)}. Network settings: {settings()}. "
                         "What to try: docs/multi-node.md") from None
        finally:
            timer.cancel()

    def _poll(self, done) -> bool:
        """Poll the store until done() (True) or the deadline (False); once another rank has
        told the job what went wrong (end), end without a line of our own (stand_down)."""
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while not done():
            if self.store.check([ENDED]):
                stand_down(self.store)
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
        return True

    def await_end(self):
        """Wait, up to the deadline, for another rank to tell the job what went wrong (then end
        without a line of our own); past it, return: this rank says it instead."""
        try:
            self._poll(lambda: False)
        except (dist.DistError, RuntimeError):  # a store that went away with the rank that held it
            pass

    def share(self, step: str, value) -> list:
        """Every rank's JSON value for step, on every rank. Waited for here, in polls of the
        store, until the deadline (then this thread names who is missing: no timer to race it),
        or until another rank has told the job what went wrong (end): started by hand with
        another WORLD_SIZE, this rank waits for a rank that does not exist, and rank 0's line
        says why; a second line, once rank 0 and its store are gone, would only guess."""
        keys, arrived = [f"check/{step}/{r}" for r in range(self.world_size)], f"check/{step}/arrived"
        try:
            self.mark(step, json.dumps(value))
            self.store.add(arrived, 1)  # one key to poll, whatever the number of ranks
            if self._poll(lambda: self.store.add(arrived, 0) >= self.world_size):
                return [json.loads(self.store.get(key)) for key in keys]
        except (dist.DistError, RuntimeError):  # a store that went away
            pass
        raise Failed(self.stalled(step, "the store", None))


ENDED, HEARD = "check/ended", "check/heard"  # a rank has said what went wrong; ranks that saw it
_ending = threading.Event()  # this process's end() is under way (perhaps in the deadline's timer thread)


def end(message: str, store=None):
    """Say it once for the whole job (the first rank to get here), and exit 2 at once: a
    collective that never completed would hold up an orderly exit."""
    _ending.set()  # before ENDED: share() must not take this rank's own end for another's
    try:
        first = store is None or store.add(ENDED, 1) == 1
    except (dist.DistError, RuntimeError):
        first = True  # no store to agree through: better twice than never
    if first:
        print(f"error: {message}", file=sys.stderr, flush=True)
        stopping.tell_torchrun(f"error: {message}")  # torchrun's report shows it, not a link to its docs
    sys.stdout.flush()
    if store is not None:
        linger(store)
    os._exit(2)


def stand_down(store):
    """Another rank has said what went wrong, for the job: end without a line of our own."""
    if _ending.is_set():  # no: this process's own end() is saying it, and exits
        threading.Event().wait()
    try:
        store.add(HEARD, 1)
    except (dist.DistError, RuntimeError):
        pass
    linger(store)
    os._exit(2)


def linger(store):
    """Rank 0 started by hand hosts the store: it stays up to a second, until the ranks still
    waiting in share() have seen that the job ended (all but the one that said it). Without
    its store, they would each add a line guessing why it went away."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or os.environ.get("RANK", "0") != "0":
        return
    until = time.monotonic() + 1
    try:
        while store.add(HEARD, 0) < int(os.environ.get("WORLD_SIZE", 1)) - 1 and time.monotonic() < until:
            time.sleep(0.01)
    except (dist.DistError, RuntimeError):
        pass


def table(ranks: list[dict]) -> str:
    columns = ["rank", "node", "host", "local_rank", "device", "torch", "cuda", "nccl"]
    rows = [[str(i), *("-" if info[c] is None else str(info[c]) for c in columns[1:])] for i, info in enumerate(ranks)]
    widths = [max(len(x) for x in column) for column in zip(columns, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [columns, *rows])


def differences(ranks: list[dict]) -> str | None:
    """The first field in which a rank differs from rank 0, as one sentence; None if none."""
    for field in MUST_AGREE:
        for rank, info in enumerate(ranks):
            if info[field] != ranks[0][field]:
                return f"rank {rank} has {field} {info[field]}, rank 0 has {ranks[0][field]}: every rank needs the same"
    return None


def check_sum(meeting: Meeting, step: str, backend: str, device: torch.device, group=None) -> str:
    """All-reduce (rank + 1) everywhere; every rank must get 1 + 2 + ... + world_size."""
    values = torch.full((1024,), float(meeting.rank + 1), device=device)
    with meeting.deadline(step, backend):
        work = dist.all_reduce(values, group=group, async_op=True)
        meeting.mark(step)  # this rank's part is under way: a rank that never gets here is named
        work.wait()
        got = values.cpu().unique().tolist()
    expected = meeting.world_size * (meeting.world_size + 1) / 2
    wrong = [(r, v) for r, v in enumerate(meeting.share(f"{step} result", got)) if v != [expected]]
    if wrong:
        rank, value = wrong[0]
        raise Failed(f"{step} over {backend} summed wrong: rank {rank} got {value}, not {expected:g}")
    return f"{step} over {backend}: correct on every rank ({meeting.world_size})"


def bus_bandwidth(meeting: Meeting, device: torch.device, group, n: int, sizes: list[int], what: str) -> str:
    """Seconds per all-reduce of each size, as nccl-tests measures it: several issued back to
    back, timed together (the slowest rank's time); bus bandwidth = size / time x 2(n-1)/n,
    the traffic each link carries."""
    figures = []
    for size in sizes:
        data = torch.ones(size // 4, device=device)
        step = f"bandwidth {what} {size / 2**20:g} MiB"
        with meeting.deadline(step, device.type):
            meeting.mark(step)
            for timed in (False, True):  # a warm-up round, then the timed one
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                works = [dist.all_reduce(data, group=group, async_op=True) for _ in range(5)]
                for work in works:
                    work.wait()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - start) / 5
        slowest = max(meeting.share(f"{step} time", seconds))
        figures.append(f"{size / 2**20:g} MiB {size / slowest * 2 * (n - 1) / n / 1e9:.2f} GB/s")
    return f"bus bandwidth, all-reduce {what}: " + " | ".join(figures)


def main():
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-seconds", type=float, default=60.0, help="the longest any one step may wait")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where torch sees GPUs")
    args = parser.parse_args()
    if not 1 <= args.timeout_seconds <= 86400:  # inf and nan too: no deadline is no check
        raise UsageError(f"--timeout-seconds must be at least 1 and at most a day (86400), got {args.timeout_seconds:g}")
    launch.check_launch_environment(one_process=False)  # RANK, WORLD_SIZE...: whole numbers
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if cuda and local_rank >= torch.cuda.device_count():
        raise UsageError(f"local rank {local_rank} has no GPU: torch sees {torch.cuda.device_count()} here; "
                         "start at most that many processes per node (--nproc_per_node)")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    global STORE
    started = time.monotonic()
    try:  # rank 0 hosts the store when there is no torchrun, and does not wait there for the
        # others: the first shared step below names who never came. Reaching it is bounded by
        # the store's timeout, which a connection spends twice (it tries again once): half each.
        store = STORE = launch.job_store(args.timeout_seconds / 2 / 60, wait_for_workers=False)
    except (dist.DistError, RuntimeError) as e:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if rank == 0 and ("EADDRINUSE" in str(e) or "address already in use" in str(e).lower()):
            raise Failed(f"rank 0 could not host the job's store at {where}: the port is in use (another process "
                         "started with RANK=0, or another job): give each process its own RANK, or choose another "
                         "MASTER_PORT") from None
        raise Failed(f"rank {rank} could not reach the job's store at {where} in {time.monotonic() - started:.0f} s "
                     f"({first_line(e).rstrip('.')}). Network settings: {settings()}. "
                     "What to try: docs/multi-node.md") from None
    meeting = Meeting(store, rank, world_size, args.timeout_seconds)
    meeting.arrive()
    ranks = meeting.share("rank facts", this_rank(device))
    if rank == 0:
        print(table(ranks), flush=True)
    if problem := differences(ranks):
        if rank != 0 and all(info["world_size"] == world_size for info in ranks):
            # rank 0 has every rank's facts too: it prints the table, then says it (this rank's
            # exit, first, could make torchrun end rank 0 before the table)
            meeting.await_end()
        raise Failed(problem)
    # Every rank reached the store; now they connect to each other, directly. The process
    # group waits longer than the check does, so that the check's deadline speaks first.
    timeout = datetime.timedelta(seconds=2 * args.timeout_seconds + 30)
    unreachable = ("every rank reached the store, but they could not connect to each other: a firewall between "
                   "the nodes, or the wrong network interface (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)")
    with meeting.deadline("connecting the ranks", backend, unreachable):
        meeting.mark("connecting the ranks")
        # device_id: NCCL connects now, under this deadline, not at the first collective
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                **({"device_id": device} if cuda else {}))
    report = [check_sum(meeting, "all-reduce", backend, device)]
    if cuda:  # gloo beside NCCL, as the training scripts use it (data preparation, the stop flag)
        with meeting.deadline("connecting the ranks over gloo", "gloo", unreachable):
            meeting.mark("connecting the ranks over gloo")
            gloo = dist.new_group(backend="gloo", timeout=timeout)
        report.append(check_sum(meeting, "all-reduce (gloo)", "gloo", torch.device("cpu"), gloo))
    nodes = sorted({info["node"] for info in ranks})
    sizes = [2**20, 2**24, 2**27] if cuda else [2**16, 2**20, 2**22]
    if world_size == 1:
        report.append("one rank: no bandwidth to measure")
    else:
        report.append(bus_bandwidth(meeting, device, None, world_size, sizes,
                                    f"all {world_size} ranks on {len(nodes)} node{'s' * (len(nodes) > 1)}"))
    per_node = [[r for r, info in enumerate(ranks) if info["node"] == node] for node in nodes]
    if len(nodes) > 1 and len(per_node[0]) > 1 and all(len(p) == len(per_node[0]) for p in per_node):
        with meeting.deadline("grouping the ranks by node", backend):
            meeting.mark("grouping the ranks by node")
            mine, _ = dist.new_subgroups_by_enumeration(per_node)  # every rank builds every node's group
        report.append(bus_bandwidth(meeting, device, mine, len(per_node[0]), sizes,
                                    f"within a node ({len(per_node[0])} ranks)"))
    if rank == 0:
        print("\n".join(report), flush=True)
    dist.destroy_process_group()


def run():
    try:
        main()
    except Failed as e:  # before any teardown: a process group with a collective in trouble may never tear down
        end(str(e), STORE)
    except UsageError as e:  # bad flags or launch: every rank finds the same, and rank 0 says it, or one rank's own
        if isinstance(e, RankError) or errors.is_rank0():
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
