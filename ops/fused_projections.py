"""Projections of one input as one matmul: attention's q, k and v, the MLP's gate and up
(LlamaForPretraining.fuse_projections; off by default, a candidate no GPU has measured yet).

The plain formulation, model.py's default, runs each projection as its own nn.Linear:
`q_proj(x), k_proj(x), v_proj(x)` and `gate_proj(x), up_proj(x)`. Each reads the same x again,
and in the article model k_proj and v_proj are 768 -> 192 matmuls, too narrow to keep a GPU
busy (on an H100 the matmuls are about half of a step). Here their weights are concatenated
at every forward and x goes through one matmul as wide as all of them: the same FLOPs in
fewer, wider kernels, x read once. The weights stay the separate parameters they are (their
names, the state_dict, checkpoints and export do not change); autograd's backward of the
concatenation hands each weight its own slice of the gradient. FSDP2 gathers a layer's
weights before its forward, and autocast casts the concatenated weight as it would each one.
tests/test_fused_projections.py proves it equal to the plain formulation to rounding.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def linear(x: torch.Tensor, *projections: nn.Linear) -> tuple[torch.Tensor, ...]:
    """What each projection (an nn.Linear without bias) makes of x, in their order, from one matmul."""
    weight = torch.cat([projection.weight for projection in projections])  # (sum of out_features, in_features)
    return F.linear(x, weight).split([projection.out_features for projection in projections], dim=-1)
