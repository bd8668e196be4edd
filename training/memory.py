"""What a run will hold in memory, estimated before the model exists. A model whose weights
and optimizer state cannot fit the device is refused with one line, instead of being killed
by the kernel (or by CUDA) minutes later with nothing said. A run whose whole estimate
exceeds the memory available is warned about: activations are the rougher part of the
estimate, and the user may know better.

Per process, in bytes:
- the state: fp32 weights, gradients and AdamW's two moments, 4 + 4 + 8 = 16 bytes a
  parameter (bf16 runs keep fp32 weights too). FSDP holds 1/world of it on each rank: it
  builds the model on the meta device, shards it, and draws each whole weight in turn, each
  rank keeping its part, so the largest weight, whole, is all it holds beyond its share.
- the snapshot each save writes from, in CPU memory: weights and moments, 12 bytes a
  parameter (FSDP: of this rank's shards), held while training goes on. Every run saves at
  least once, at its end. On a GPU it is host memory, not the device's.
- what comes and goes with each step: AdamW's unfused step (on a CPU) makes two temporaries
  the size of the largest weight; under autocast every decoder matmul weight has a bf16
  copy from forward until backward (with activation checkpointing only the recomputed
  layer's; FSDP instead gathers two of its groups at a time, in bf16); the chunked loss
  holds one chunk of logits, and from forward into backward the LM head's fp32 gradient
  (a second copy where .grad already exists: gradient accumulation, DDP's buckets, and
  under FSDP the whole unsharded gradient, and a bf16 one).
- the activations: what autograd saves for backward, per token of a micro-batch. Each layer
  keeps (4 x intermediate + 10 x hidden) values in the compute dtype and its RMSNorms' fp32
  copies; with activation checkpointing only its fp32 input (hidden values), and backward
  makes one layer's worth again at a time. The final norm keeps its input and output. The
  chunked LM head keeps the hidden states' gradient (chunked_loss.py). Compiled (--compile),
  inductor fuses each layer's elementwise work and keeps less: (3 x intermediate + 5.5 x
  hidden) values in the compute dtype and one fp32 value per hidden unit (the residual
  stream); the plain formulation of the LM head keeps the logits and its input in the
  compute dtype, and backward writes the logits' gradient over them.
  Packed rows (--pack) add, once, each row's RoPE tables (fp32 cos and sin a token) and on a
  CPU the attention mask (seq_len values a token, in the compute dtype); past one block of
  queries (packed_attention.QUERY_BLOCK), each layer keeps a copy of its attention output.
  tests/test_memory.py checks this against what autograd really saves.
- under tensor parallelism (train_tp.py, tp ranks a group; sequence parallelism between the
  blocks), per rank: the matrices' state 1/tp (each rank its rows or columns), sharded by FSDP
  over the world / tp groups; the norms' gains whole on every TP rank. The residual stream and
  the norms' inputs and outputs 1/tp (sequence-parallel: (B, T/tp, C)); the inputs of
  attention and of the MLP whole (gathered along the sequence); q, k, v, attention's output
  and the MLP's hidden units 1/tp (each rank its heads, its hidden units). The loss is the
  chunked loss over each rank's V/tp rows of the vocabulary: one chunk of (tokens, V/tp) logits
  at a time. FSDP gathers 1/tp of each group. tests/test_memory.py measures these on 2 gloo ranks.
"""

import collections
import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from model import PRESETS, LlamaConfig, LlamaForPretraining
from ops import chunked_loss, packed_attention
from training import launch
from training.config import TrainConfig, model_config
from training.errors import UsageError, warn

BYTES_PER_PARAMETER = 4 + 4 + 8  # fp32 weight, its gradient, AdamW's exp_avg and exp_avg_sq


@dataclass
class Estimate:
    parameters: int
    state: int  # weights, gradients and AdamW's moments that this process holds while it trains
    snapshot: int  # a save's CPU copy of weights and moments, when that is the device's memory (else 0)
    build: int  # FSDP: the largest weight, whole in fp32, as each rank draws it and keeps its part (0 otherwise)
    optimizer_temporaries: int  # AdamW's unfused step (a CPU): two of the largest weight's size
    copies: int  # weights in the compute dtype: autocast's copies, or FSDP's two gathered groups
    logits: int  # the chunked loss's one chunk of logits, fp32 (and its compute-dtype matmul output); TP: of V/tp
    head_gradient: int  # the chunked loss's LM head gradient, made in forward
    activations: int  # saved for backward by one micro-batch

    @property
    def transient(self) -> int:
        """The most held beside the state and the activations at once."""
        return self.optimizer_temporaries + self.copies + self.logits + self.head_gradient

    @property
    def fixed(self) -> int:
        """What no smaller batch can lower."""
        return max(self.state + self.snapshot, self.build)

    @property
    def total(self) -> int:
        return max(self.state + self.snapshot + self.transient + self.activations, self.build)


def activation_bytes_per_token(config: LlamaConfig, dtype: torch.dtype, checkpointing: bool = False,
                               compiled: bool = False, packed_seq_len: int | None = None, on_gpu: bool = False,
                               tp: int = 1) -> int:
    """packed_seq_len: the rows' length, for packed rows (--pack); None for one window a row.
    tp: the ranks each layer is split over (train_tp.py), a token being one of the micro-batch
    that every rank of the TP group computes on; 1: the whole layer on each rank."""
    C, I = config.hidden_size, config.intermediate_size
    if compiled:  # measured on a CPU (tests/test_memory.py); on an H100, the article model kept 1.03x this
        # (compiled under TP: counted as a whole layer, an upper bound; not measured split)
        per_layer = (6 * I + 11 * C) * dtype.itemsize // 2 + 4 * C + 4 * config.num_attention_heads + 8
    else:
        # Whole on every TP rank: the inputs of q, k, v and of gate, up (autocast's copy of each,
        # 5 x hidden), all-gathered along the sequence before the column-parallel matmuls.
        # 1/tp: q, k, v, attention's output and its joined heads (5 x hidden: this rank's heads)
        # and the MLP's 4 x intermediate (its hidden units); the two RMSNorms' fp32 inputs and
        # outputs (16 x hidden bytes), sequence-parallel: (B, T/tp, C).
        per_layer = (5 * C + (5 * C + 4 * I) // tp) * dtype.itemsize + 16 * C // tp
    residual = 4 * C // tp  # a checkpointed layer's fp32 input: the residual stream, sequence-parallel
    layers = config.num_hidden_layers * residual + per_layer if checkpointing else config.num_hidden_layers * per_layer
    final_norm = 8 * C // tp + 4 + 8  # its fp32 input, output (sequence-parallel) and norm, the token ids (whole)
    if compiled:
        lm_head = (config.vocab_size + C) * dtype.itemsize + 8  # logits, input, target
    else:
        lm_head = 4 * C  # the chunked loss keeps the hidden states' gradient (under TP: every token's, gathered)
    packing = 0
    if packed_seq_len:
        packing = 8 * config.head_dim  # each token's fp32 cos and sin (packed_attention: rows have their own)
        if not on_gpu:  # the CPU's mask and, past one block of queries, the joined attention outputs (its heads)
            blocks = packed_seq_len > packed_attention.QUERY_BLOCK
            packing += packed_seq_len * dtype.itemsize + blocks * C // tp * dtype.itemsize * (
                1 if checkpointing else config.num_hidden_layers)
    return layers + final_norm + lm_head + packing


Sizes = collections.namedtuple("Sizes", "parameters matrices largest layer_matmuls layers_matmuls lm_head groups")


@functools.lru_cache(maxsize=None)
def _sizes(config_json: str) -> Sizes:
    """Parameter counts of the real model, built on the meta device (nothing allocated).
    groups: train_fsdp.shard's groups, each as (its matrices, its vectors): TP splits the
    first (tensor_parallel.parallelize), and leaves the RMSNorms' gains whole."""
    with torch.device("meta"):
        model = LlamaForPretraining(LlamaConfig(**json.loads(config_json)))

    def count(module, matmuls_only=False):
        return sum(p.numel() for p in module.parameters() if p.dim() == 2 or not matmuls_only)
    layers = model.base_model.layers
    groups = [model.base_model.embed_tokens, model.lm_head, *layers]  # train_fsdp.shard's groups
    return Sizes(parameters=count(model), matrices=count(model, True),
                 largest=max(p.numel() for p in model.parameters()),
                 layer_matmuls=count(layers[0], True), layers_matmuls=sum(count(layer, True) for layer in layers),
                 lm_head=count(model.lm_head), groups=tuple((count(g, True), count(g) - count(g, True))
                                                            for g in groups))


def estimate(config: LlamaConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, shards: int = 1,
             on_gpu: bool = False, checkpointing: bool = False, compiled: bool = False,
             packed: bool = False, tp: int = 1) -> Estimate:
    """What one process holds while it trains; shards: the ranks the state is spread over
    (1: one process, DataParallel, DDP; FSDP: the world; TP with FSDP: the world too, tp of
    them splitting each matrix, shards / tp sharding each share); on_gpu: the device is a GPU,
    where AdamW is fused (build.optimizer) and saves copy the state into host memory;
    checkpointing: --activation-checkpointing; compiled: --compile; packed: --pack; tp: --tp
    (train_tp.py; 1 elsewhere), micro_batch then being each TP group's."""
    n = _sizes(json.dumps(dataclasses.asdict(config), sort_keys=True))  # (a dict field: no tuple to cache by)
    # TP splits every matrix (tensor_parallel.parallelize: by rows or columns, the embedding and
    # the LM head by the vocabulary) and replicates the norms' gains; FSDP shards what each TP
    # rank holds over the shards / tp ranks of "dp". (Without TP: 1/shards of every parameter.)
    local_parameters = n.matrices // tp + (n.parameters - n.matrices)
    dp = shards // tp
    if dtype == torch.float32:
        copies = 0
    elif shards == 1:  # autocast: a copy of every matmul weight (the chunked loss's of the LM head is not kept;
        # with activation checkpointing, only those of the layer being recomputed)
        copies = dtype.itemsize * ((n.layer_matmuls if checkpointing else n.layers_matmuls)
                                   + (n.lm_head if compiled else 0))
    else:  # FSDP gathers two of its groups (train_fsdp.shard) at a time; under TP, a TP rank's share of them
        copies = 2 * dtype.itemsize * max(matrices // tp + vectors for matrices, vectors in n.groups)
    tokens = micro_batch * seq_len
    low_precision = dtype.itemsize if dtype != torch.float32 else 0  # a bf16 copy beside the fp32 one
    if compiled:  # the plain formulation: its logits are the activations' (activation_bytes_per_token)
        logits = 0
    else:  # under TP, chunks of this rank's V/tp rows of the vocabulary (tensor_parallel.vocabulary_parallel_loss)
        vocabulary = config.vocab_size // tp
        chunk = min(tokens, chunked_loss.chunk_tokens(vocabulary, torch.device("cuda" if on_gpu else "cpu")))
        logits = chunk * vocabulary * (4 + low_precision)
    return Estimate(parameters=n.parameters, state=BYTES_PER_PARAMETER * local_parameters // dp,
                    snapshot=0 if on_gpu else (4 + 8) * local_parameters // dp,
                    build=4 * n.largest if shards > 1 else 0,  # init_weights draws each weight whole, TP or not
                    optimizer_temporaries=0 if on_gpu else 2 * 4 * -(-n.largest // shards), copies=copies,
                    logits=logits,  # and the LM head's gradient, under TP of its V/tp rows
                    head_gradient=0 if compiled else n.lm_head // tp * (4 + (low_precision if shards > 1 else 0)),
                    activations=tokens * activation_bytes_per_token(config, dtype, checkpointing, compiled,
                                                                    seq_len if packed else None, on_gpu, tp))


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
    for limit, used in cgroup_limits():
        total, available = min(total, limit), min(available, max(0, limit - used))
    ranks_here = launch.ranks_on_this_node()
    return total // ranks_here, available // ranks_here


def cgroup_limits(own: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup"):
    """(limit, used) bytes of each memory cgroup this process is in, its own and every one above
    it (a Slurm job or a container sets the limit on its own group, not on the root): cgroup
    v2's memory.max and memory.current, or v1's limit_in_bytes and usage_in_bytes."""
    try:
        lines = Path(own).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, limit_name, used_name = Path(mount), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            root, limit_name, used_name = Path(mount, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = root / path.lstrip("/")
        for group in [folder, *folder.parents]:
            if not group.is_relative_to(root):
                break
            try:
                yield int((group / limit_name).read_text()), int((group / used_name).read_text())
            except (OSError, ValueError):  # not there, or "max": no limit at this level
                continue


@dataclass
class Check:
    """Called with the vocabulary size once the tokenizer is known (run_data.prepare),
    before the corpus is tokenized or anything is written: refuses a model whose state alone
    exceeds the device's memory; warns when the whole estimate exceeds what is available now.
    shards: the ranks FSDP spreads the state over (1: DataParallel, DDP); under TP (train_tp.py)
    every rank of the job, cfg.tp of them splitting each layer (estimate), and a model TP cannot
    split is refused here too."""
    cfg: TrainConfig  # its --model, --seq-len, --compile, --activation-checkpointing and --pack
    micro_batch: int
    dtype: torch.dtype
    device: torch.device
    shards: int = 1

    def __call__(self, vocab_size: int):
        cfg = self.cfg
        config = model_config(cfg, vocab_size)
        if cfg.tp > 1:  # here: the vocabulary is known now, and nothing is written yet
            from training import tensor_parallel  # train_tp.py's alone
            tensor_parallel.check_model(config, cfg.tp)
        need = estimate(config, self.micro_batch, cfg.seq_len, self.dtype, self.shards,
                        on_gpu=self.device.type == "cuda", checkpointing=cfg.activation_checkpointing,
                        compiled=cfg.compile, packed=cfg.pack, tp=cfg.tp)
        total, available = device_memory(self.device)
        where = "GPU memory" if self.device.type == "cuda" else "CPU memory"
        held = "weights, gradients and AdamW state" + (", and the copy each save writes" if need.snapshot else "")
        if need.fixed > total:
            raise UsageError(
                f"the model cannot fit: its {need.parameters:,} parameters need about {size(need.fixed)} per process "
                f"for {held}, and this process has {size(total)} of {where}; choose a "
                "smaller --model or vocabulary, or shard it over more ranks with train_fsdp.py")
        if self.device.type == "cuda":  # the host holds each save's copy, and the fp32 model before it moves
            # (FSDP: one whole weight at a time, drawn there before each rank keeps its part)
            built_on_host = need.build if self.shards > 1 else 4 * need.parameters
            host_need, host_total = max(built_on_host, 12 * need.parameters // self.shards), \
                device_memory(torch.device("cpu"))[0]
            if host_need > host_total:
                raise UsageError(f"the model cannot fit: its {need.parameters:,} parameters need about "
                                 f"{size(host_need)} of CPU memory per process (the model is built there, and each "
                                 f"save copies its state there), and this process has {size(host_total)}")
        if need.total > available:
            warn(f"this run may not fit in memory: it needs about {size(need.total)} per process "
                 f"({size(need.fixed)} for the model and its optimizer, {size(need.activations)} of activations "
                 f"for {self.micro_batch} x {cfg.seq_len} tokens a micro-step), and {size(available)} of {where} "
                 "are available; lower --batch-size or raise --grad-accum")
