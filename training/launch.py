"""Where this process runs: what torchrun tells it (its rank, the machine's cores, restarts),
its device and the dtype its matmuls run in, and how it meets the other ranks (the store,
the side groups, DDP's options). train_ddp.py keeps the lines that teach DDP; the
plumbing around them lives here.
"""

import datetime
import glob
import inspect
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training import stopping
from training.errors import RankError, UsageError


def usable_cores() -> int:
    """The cores this process may run on: its affinity, what Slurm or taskset gave it (not
    the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ranks_on_this_node() -> int:
    """The processes of the job on this machine, which share its cores and memory: torchrun's
    LOCAL_WORLD_SIZE, in torchrun's workers only (a stray one in a plain `python` run is not ranks)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "TORCHELASTIC_RUN_ID" in os.environ else 1


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


def data_parallel(cfg) -> tuple[int, int]:
    """(this rank's data-parallel rank, their number): the ranks that read rows of their own.
    Under tensor parallelism (train_tp.py, --tp) each group of --tp consecutive ranks (its mesh's
    "tp" dimension, the inner one) reads the same rows; otherwise every rank is its own."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank // cfg.tp, world_size // cfg.tp


def data_parallel_units(tp: int) -> str:
    """What a refusal calls the ranks that read rows of their own: under tensor parallelism the
    data-parallel groups, which a user who launched world size ranks would not count otherwise."""
    return "ranks" if tp == 1 else f"data-parallel groups (ranks / --tp {tp})"


def nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs this machine has, whether or not torch can use them: the device files
    the driver makes, one per GPU (/dev/nvidia0, /dev/nvidia1, ...)."""
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def use_cuda(cfg) -> bool:
    """Whether to train on CUDA: where torch sees a GPU, unless --device cpu. Where torch sees
    none on a machine that has NVIDIA GPUs (a CPU build of torch, or a CUDA build newer than
    the driver), a job meant for 8 GPUs would otherwise train on the CPU without a word."""
    if cfg.device == "cpu":
        return False
    if torch.cuda.is_available():
        return True
    gpus = nvidia_gpus()
    if gpus or cfg.device == "cuda":
        built = (f"a CUDA {torch.version.cuda} build, which this driver may be too old for" if torch.version.cuda
                 else "a CPU-only build")
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f"; CUDA_VISIBLE_DEVICES={hidden!r} hides GPUs" if hidden is not None else ""
        has = f"this machine has NVIDIA GPUs ({', '.join(gpus[:2])}{', ...' if len(gpus) > 2 else ''})" if gpus \
            else "--device cuda"
        raise UsageError(f"{has} but torch {torch.__version__} sees none: it is {built}{hidden}. Install the "
                         "torch build for your driver (https://pytorch.org/get-started/locally/), or pass "
                         "--device cpu to train on the CPU")
    return False


def compute_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in. bf16 pays where the hardware has bf16 matrix units: GPUs
    from Ampere on (compute capability 8.0), and CPUs with AMX (Xeon Sapphire Rapids and
    later: the demo's bf16 steps 1.3x as fast as fp32 on one, docs/benchmarks.md). Elsewhere
    auto keeps fp32. Older GPUs (V100, T4) only emulate bf16, slowly: there --dtype bf16 is
    refused."""
    if device.type == "cuda":
        # fp32 matmuls (all of --dtype fp32's, and the few a bf16 step keeps in fp32) on TF32
        # tensor cores: inputs rounded to 10 mantissa bits, products summed in fp32, several
        # times faster than full fp32. Weights and optimizer state stay fp32 all the same.
        torch.set_float32_matmul_precision("high")
    if choice == "fp32":
        return torch.float32
    if device.type == "cuda":
        # not torch.cuda.is_bf16_supported(): by default it counts emulation as support
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return torch.bfloat16
        if choice == "bf16":
            name = torch.cuda.get_device_name(device)
            raise UsageError(f"--dtype bf16: {name} has no native bf16 (compute capability 8.0 or newer "
                             "needed); use --dtype fp32")
        return torch.float32
    if choice == "bf16" or torch.cpu._is_amx_tile_supported():
        return torch.bfloat16
    return torch.float32


def job_store(timeout_minutes: float, wait_for_workers: bool = True):
    """The store dist.init_process_group meets the other ranks through: torchrun's, with a
    prefix per restart (or, under plain `python`, one for a world of one). Launched without
    torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand), rank 0 hosts it and,
    unless told not to, waits there for the others to connect."""
    stopping.ranks_meeting(True)  # until side_groups: see there
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


def barrier():
    """Every rank of the default group waits for the others. Under NCCL it names this rank's GPU:
    without device_ids, NCCL guesses the GPU from the rank and may open a context on another."""
    dist.barrier(**({"device_ids": [torch.cuda.current_device()]} if dist.get_backend() == "nccl" else {}))


def side_groups(backend: str, timeout_minutes: float, data_timeout_minutes: float):
    """Two small gloo groups beside the main one. `prep` carries the turns of data preparation:
    on a cold cache local rank 0 may download and tokenize for hours while the others wait,
    far longer than a training collective should ever take. `control` (NCCL only) carries the
    per-step stop flag, which under NCCL would need a GPU tensor whose read-back stalls the
    host; it waits as long as the training collectives do."""
    # Every rank has joined first, within a training collective's timeout: making a group waits
    # for every rank as long as the group may wait (a day for `prep`), and a rank started with
    # another WORLD_SIZE, by hand, would never come.
    barrier()
    prep = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=data_timeout_minutes))
    control = (dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
               if backend == "nccl" else None)
    stopping.ranks_meeting(False)  # the ranks have met
    return prep, control


# How DDP is built, for speed:
# - gradient_as_bucket_view: gradients live inside DDP's all-reduce buckets, so there is no
#   second set of gradient-sized tensors and no copy out of the buckets after the all-reduce.
#   After zero_grad(set_to_none=True) each backward's fresh gradient is still copied into its
#   bucket once (and freed); set_to_none=False avoids that copy but zeroes the buckets and
#   adds into them instead, which measured no faster (docs/benchmarks.md);
# - no buffer sync before each forward: our only buffers are RoPE's cos/sin tables, which
#   every rank computes identically, so broadcasting them every step is wasted traffic.
#   (torch 2.13 renamed broadcast_buffers to forward_sync_buffers; older torch knows only the old name.)
_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters
_SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
NO_BUFFER_SYNC = {_SYNC_BUFFERS: False}
DDP_OPTIONS = {"gradient_as_bucket_view": True, **NO_BUFFER_SYNC}  # what train_ddp.py passes, for the benches
