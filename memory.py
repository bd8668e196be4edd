"""What a run will hold in memory, estimated before the model exists. A model whose weights
and optimizer state cannot fit the device is refused with one line, instead of being killed
by the kernel (or by CUDA) minutes later with nothing said. A run whose whole estimate
exceeds the memory available is warned about: activations are the rougher part of the
estimate, and the user may know better.

Per process, in bytes:
- the state: fp32 weights, gradients and AdamW's two moments, 4 + 4 + 8 = 16 bytes a
  parameter (bf16 runs keep fp32 weights too). FSDP holds 1/world of it on each rank, but
  builds the whole model on every rank before sharding it: 4 bytes a parameter, for a moment.
- the snapshot each save writes from, in CPU memory: weights and moments, 12 bytes a
  parameter (FSDP: of this rank's shards), held while training goes on. Every run saves at
  least once, at its end. On a GPU it is host memory, not the device's.
- what comes and goes with each step: AdamW's unfused step (on a CPU) makes two temporaries
  the size of the largest weight; under autocast every matmul weight has a bf16 copy from
  forward until backward (FSDP instead gathers two of its groups at a time, in bf16).
- the activations: what autograd saves for backward, per token of a micro-batch, for each
  layer (4 x intermediate + 10 x hidden) values in the compute dtype plus the RMSNorms' fp32
  copies, and for the LM head 3 x vocabulary fp32 values (the logits' log-softmax, and in
  backward two gradients of its size). tests/test_memory.py checks it against what autograd
  really saves.
"""

import os
from dataclasses import dataclass

import torch

from errors import UsageError
from launcher import warn
from model import PRESETS, LlamaConfig, LlamaForPretraining

BYTES_PER_PARAMETER = 4 + 4 + 8  # fp32 weight, its gradient, AdamW's exp_avg and exp_avg_sq


@dataclass
class Estimate:
    parameters: int
    state: int  # weights, gradients and AdamW's moments that this process holds while it trains
    snapshot: int  # a save's CPU copy of weights and moments, when that is the device's memory (else 0)
    build: int  # FSDP: the whole fp32 model, built on every rank before it is sharded (0 otherwise)
    transient: int  # the most held beside the state and activations at once (see above)
    activations: int  # saved for backward by one micro-batch

    @property
    def fixed(self) -> int:
        """What no smaller batch can lower."""
        return max(self.state + self.snapshot, self.build)

    @property
    def total(self) -> int:
        return max(self.state + self.snapshot + self.transient + self.activations, self.build)


def activation_bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    C, I = config.hidden_size, config.intermediate_size
    per_layer = (4 * I + 10 * C) * dtype.itemsize + 16 * C
    lm_head = 3 * config.vocab_size * 4  # fp32 whatever the compute dtype: the loss upcasts the logits
    return config.num_hidden_layers * per_layer + lm_head


def estimate(config: LlamaConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, shards: int = 1,
             on_gpu: bool = False) -> Estimate:
    """What one process holds while it trains; shards: the ranks FSDP spreads the state over
    (1: one process, DataParallel, DDP); on_gpu: the device is a GPU, where AdamW is fused
    (training.make_optimizer) and saves copy the state into host memory."""
    with torch.device("meta"):  # the real model, counted without allocating it
        model = LlamaForPretraining(config)
    parameters = model.num_parameters()
    largest = max(p.numel() for p in model.parameters())
    temporaries = 0 if on_gpu else 2 * 4 * -(-largest // shards)
    if dtype == torch.float32:
        copies = 0
    elif shards == 1:  # autocast: a copy of every matmul weight
        copies = dtype.itemsize * sum(p.numel() for name, p in model.named_parameters()
                                      if p.dim() == 2 and "embed_tokens" not in name)
    else:  # FSDP's groups (train_fsdp.shard): each decoder layer, the embedding, the norm with the LM head
        groups = [model.base_model.embed_tokens, model.lm_head, *model.base_model.layers]
        copies = 2 * dtype.itemsize * max(sum(p.numel() for p in g.parameters()) for g in groups)
    return Estimate(parameters=parameters, state=BYTES_PER_PARAMETER * parameters // shards,
                    snapshot=0 if on_gpu else (4 + 8) * parameters // shards,
                    build=4 * parameters if shards > 1 else 0, transient=temporaries + copies,
                    activations=micro_batch * seq_len * activation_bytes_per_token(config, dtype))


def size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:,.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:,.1f} MB"


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, available) bytes for this process: its GPU's, or on a CPU its share of the
    machine's (or of its cgroup's limit), split among the ranks torchrun started on it."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass  # not Linux: the whole memory counts as available
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                limit = int(f.read())  # "max" (no limit) is not a number
        except (OSError, ValueError):
            continue
        total, available = min(total, limit), min(available, limit)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return total // ranks_here, available // ranks_here


@dataclass
class Check:
    """Called with the vocabulary size once the tokenizer is known (training.prepare_data),
    before the corpus is tokenized or anything is written: refuses a model whose state alone
    exceeds the device's memory; warns when the whole estimate exceeds what is available now.
    shards: the ranks FSDP spreads the state over (1: DataParallel, DDP)."""
    model: str  # the --model preset
    micro_batch: int
    seq_len: int
    dtype: torch.dtype
    device: torch.device
    shards: int = 1

    def __call__(self, vocab_size: int):
        config = LlamaConfig(vocab_size=vocab_size, **PRESETS[self.model])
        need = estimate(config, self.micro_batch, self.seq_len, self.dtype, self.shards,
                        on_gpu=self.device.type == "cuda")
        total, available = device_memory(self.device)
        where = "GPU memory" if self.device.type == "cuda" else "CPU memory"
        held = "weights, gradients and AdamW state" + (", and the copy each save writes" if need.snapshot else "")
        if need.fixed > total:
            raise UsageError(
                f"the model cannot fit: its {need.parameters:,} parameters need about {size(need.fixed)} per process "
                f"for {held}, and this process has {size(total)} of {where}; choose a "
                "smaller --model or vocabulary, or shard it over more ranks with train_fsdp.py")
        if need.total > available:
            warn(f"this run may not fit in memory: it needs about {size(need.total)} per process "
                 f"({size(need.fixed)} for the model and its optimizer, {size(need.activations)} of activations "
                 f"for {self.micro_batch} x {self.seq_len} tokens a micro-step), and {size(available)} of {where} "
                 "are available; lower --batch-size or raise --grad-accum")
