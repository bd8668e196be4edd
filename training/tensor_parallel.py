"""Tensor parallelism (TP) for the Llama model: each layer's matrices split over the ranks of a
mesh dimension, Megatron's way, with sequence parallelism between them.

Inside a block, q, k, v and gate, up are split by their output features (ColwiseParallel: each
rank computes its share of the heads, of the MLP's hidden units), o and down by their input
features (RowwiseParallel: each rank's partial sum of the whole output, summed over the TP
ranks). Attention needs nothing from the other ranks: a head is whole on one rank. So a block
costs two collectives forward, and two backward, of its activations, never of its weights.

Between the blocks (the norms, the residual stream) every rank would otherwise hold and compute
the same (B, T, C) activations: sequence parallelism splits them along the sequence (Shard(1)),
so that each rank keeps 1/tp of them. The sum after o and down then becomes a reduce-scatter
along the sequence, and the input of attention and of the MLP an all-gather: the same bytes as
the all-reduce it replaces, activations divided by tp.

The plan is torchtitan's and pytorch/examples' (../shared/TP.md): the embedding split by rows
(its output sequence-sharded), the norms SequenceParallel, the LM head split by the vocabulary.
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from model import LlamaConfig, LlamaForPretraining, compute_dtype
from ops import chunked_loss
from training.errors import UsageError


def check_layout(tp: int, seq_len: int, world_size: int, compile: bool = False) -> None:
    """What --tp cannot split in the job, one line naming the flag to change, before the mesh
    is made: whole TP groups in the world, a sequence that splits evenly (sequence parallelism),
    and a torch that can compile them where --compile asks it to."""
    if tp > 1 and compile and torch.__version__.startswith(("2.12.", "2.13.")):
        # The compiled DTensor wrapper of torch 2.12.0 fails in the first forward, 2.13.0's in the
        # first evaluation ("'Tensor' object has no attribute 'elem'"); 2.11.0 and 2.14.1 train the
        # eager model (tests/test_train_tp.py)
        raise UsageError(f"--compile with --tp {tp}: torch {torch.__version__} cannot compile tensor-parallel "
                         "layers (docs/tp.md); leave --compile out, or use another torch")
    if world_size % tp:
        raise UsageError(f"--tp {tp} does not divide the {world_size} ranks: each tensor-parallel group is --tp "
                         "ranks, and the ranks are whole groups")
    if seq_len % tp:
        raise UsageError(f"--tp {tp}: --seq-len {seq_len} does not split into {tp} equal parts, as sequence "
                         f"parallelism splits each row's positions; choose a --seq-len that --tp divides")


def check_model(config: LlamaConfig, tp: int) -> None:
    """What --tp cannot split in the model, one line, once the vocabulary is known (memory.Check)
    and before anything is written: whole heads on each rank (query and key/value), and
    matrices whose split dimension divides."""
    if tp > 1 and config.tie_word_embeddings:  # the embedding's rows and the head's would each need the one matrix
        raise UsageError(f"--tp {tp}: the model ties its input and output embeddings, which this plan splits "
                         "differently; train it with train_fsdp.py")
    for count, name, other in ((config.num_attention_heads, "attention heads", "another --model"),
                               (config.num_key_value_heads, "key/value heads", "another --model"),
                               (config.intermediate_size, "MLP hidden units (intermediate_size)", "another --model"),
                               (config.vocab_size, "vocabulary entries", f"a --vocab-size that {tp} divides")):
        if count % tp:
            raise UsageError(f"--tp {tp}: the model's {count} {name} do not split into {tp} equal shares; "
                             f"choose a --tp that divides {count}, or {other}")


def parallelize(model: LlamaForPretraining, tp_mesh: DeviceMesh) -> LlamaForPretraining:
    """Split the model's weights over tp_mesh (a 1-D mesh: the TP dimension of the run's mesh),
    in place. Before activation checkpointing is switched on, compile and FSDP (torchtitan's
    order). Given targets, the model returns on every TP rank the loss of the whole model;
    without them, logits sharded by the vocabulary (a DTensor)."""
    base = model.base_model
    # The residual stream stays a DTensor sharded along the sequence (use_local_output=False), never
    # a plain tensor viewed out of one: FSDP warns of such views (an in-place op on one skips its
    # hooks), and torch 2.12 to 2.14 compile them to wrong gradients in silence (measured: 4.1e-3
    # from the eager weights after 8 steps; 2e-7 with the stream a DTensor, tests/test_train_tp.py)
    parallelize_module(base.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                                   use_local_output=False))
    for layer in base.layers:
        parallelize_module(layer, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            # attention's input gathered along the sequence; cos, sin, the mask, the cache pass as they are
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None, None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),  # a reduce-scatter
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    parallelize_module(base.norm, tp_mesh, SequenceParallel())
    # The LM head split by the vocabulary, by hand: a module plan's hooks pass its forward only
    # its first input, and the targets would be dropped without a word. Each rank holds the
    # logits of its V/tp entries only, and the loss is computed over them (vocabulary_parallel_loss).
    head = model.lm_head
    head.weight = nn.Parameter(distribute_tensor(head.weight, tp_mesh, [Shard(0)]))
    head.parallel_loss = vocabulary_parallel_loss
    return model


# Eager even in a compiled LM head: compiled, loss_parallel's cross-entropy (the plain formulation,
# in tests/test_tensor_parallel.py) trained packed rows to weights 8.0e-3 from eager after 8 steps
# on torch 2.14.1 (padded rows: right), in silence; and the chunks' collectives are no graph's
@torch.compiler.disable
def vocabulary_parallel_loss(head: nn.Linear, h: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the targets, no rank holding the whole vocabulary's logits,
    nor all of its own shard's at once: the chunked loss (ops/chunked_loss.py) over this rank's
    V/tp rows of the weight, each chunk's softmax taking its max and sums over every shard (three
    all-reduces of one number a token). h: the final norm's output, sharded along the sequence."""
    # every position's hidden state on every TP rank; its gradient here is this shard's part of a
    # sum (Partial), which the gather's backward sums and scatters back along the sequence
    h = h.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    weight, mesh = head.weight.to_local(), head.weight.device_mesh  # this rank's V/tp rows
    chunk = head.chunk_tokens or chunked_loss.chunk_tokens(weight.shape[0], h.device)
    return chunked_loss.chunked_loss(h.flatten(0, -2), weight, targets.flatten(), chunk, compute_dtype(h),
                                     mesh.get_group(), vocab_start=mesh.get_local_rank() * weight.shape[0])
