"""Attention for packed rows (--pack): several windows share a row of the batch, and each
must attend only to itself, causally, as it would alone in a row of its own.

window_mask makes that mask from the rows' positions; attention applies it. A CPU runs
scaled_dot_product_attention with the mask as a tensor, in blocks of queries (see there);
CUDA runs flex attention, compiled, with the mask as a BlockMask, which skips every block of
keys that no query of the block may see. Rows of one sequence each (no --pack)
never come here: they keep is_causal, and its flash kernels.
"""

import functools

import torch
import torch.nn.functional as F


# Flex attention on CUDA from torch 2.6; 2.5's mishandled rows shorter than its block of 128
# and lengths not a multiple of it. Before 2.6, CUDA takes the CPU's path (the same mask).
FLEX_ON_CUDA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 6)


def uses_flex(t: torch.Tensor) -> bool:
    return t.is_cuda and FLEX_ON_CUDA


def window_mask(position_ids, dtype: torch.dtype):
    """The mask for rows whose windows restart their positions at 0: query i may see key j
    when j <= i and no window starts after j up to i. position_ids (B, T) -> (B, 1, T, T) in
    `dtype`, the dtype attention computes in: 0 where attention is allowed, -inf elsewhere (a
    block-diagonal causal mask, broadcast over heads). Additive and in that dtype, every
    layer's attention keeps this one tensor for backward: given booleans, SDPA would convert
    them, and each layer keep its own copy. On CUDA a flex attention BlockMask of the same mask."""
    B, T = position_ids.shape
    window = (position_ids == 0).cumsum(dim=1)  # (B, T): which window of its row each token is in
    if uses_flex(position_ids):
        return _flex_block_mask(window)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (window[:, :, None] == window[:, None, :]) & causal
    return torch.zeros(B, 1, T, T, dtype=dtype, device=position_ids.device).masked_fill_(~allowed[:, None], -torch.inf)


@torch.compiler.disable  # built eagerly, before the compiled layers that read it (torchtitan's way too)
def _flex_block_mask(window):
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = window.shape

    def same_window_causal(b, h, q, kv):
        return (window[b, q] == window[b, kv]) & (q >= kv)
    return create_block_mask(same_window_causal, B, None, T, T, device=window.device)


# Queries a block of attention_in_query_blocks takes. On a 2-core CPU (8 rows, the tiny model's
# heads, fp32), packed rows' attention forward and backward took 0.84x the time of is_causal's
# at T = 512 and 1.07x at 1024 with blocks of 256, against 1.04x and 1.37x with the mask in one
# call (bench_packing.py; docs/benchmarks.md).
QUERY_BLOCK = 256


def attention_in_query_blocks(q, k, v, mask):
    """Attention under an explicit mask, as one scaled_dot_product_attention call computes it
    (the plain formulation, in tests/test_packing.py), without its wasted half: SDPA's kernels
    skip the keys after each query only for is_causal, and with a mask they score every key,
    though the mask allows none after the query. Queries in blocks, each block against the keys
    up to its own end, skip them too. (CUDA's flex attention skips them by itself.)"""
    T = q.shape[2]
    if T <= QUERY_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    blocks = [F.scaled_dot_product_attention(q[:, :, s:s + QUERY_BLOCK], k[:, :, :s + QUERY_BLOCK],
                                             v[:, :, :s + QUERY_BLOCK], enable_gqa=True,
                                             attn_mask=mask[:, :, s:s + QUERY_BLOCK, :s + QUERY_BLOCK])
              for s in range(0, T, QUERY_BLOCK)]
    # joined as (B, T, H, D) in memory, the layout the caller's transpose and reshape read as a view
    return torch.cat([y.transpose(1, 2) for y in blocks], dim=1).transpose(1, 2)


def flex_attention(q, k, v, block_mask):
    """Flex attention, compiled: eager, it would compute every score (torch's reference
    implementation). Compiled, it is one fused kernel that skips the blocks the mask rules out.
    Inside a compiled model the model's compile takes it in; called eagerly, it is compiled alone."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    if torch.compiler.is_compiling():
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)


@functools.cache
def _compiled_flex():
    # Made on the first eager call, never while a model is being compiled: there torch.compile
    # is a no-op, and the plain (unfused) flex it returned was kept for every eager call after.
    from torch.nn.attention.flex_attention import flex_attention as flex
    return torch.compile(flex, dynamic=False)


def attention(q, k, v, mask):
    """q (B, H, T, D), k and v (B, K, T, D), mask from window_mask -> (B, H, T, D)."""
    return flex_attention(q, k, v, mask) if uses_flex(q) else attention_in_query_blocks(q, k, v, mask)
