"""Attention for packed rows (--pack): several windows share a row of the batch, and each
must attend only to itself, causally, as it would alone in a row of its own.

window_mask makes that mask from the rows' positions (and their windows' bounds); attention
applies it, in one of three ways, by what the mask is:
- a tensor (a CPU): scaled_dot_product_attention under it, in blocks of queries (see there);
- a BlockMask (CUDA): flex attention, compiled, which skips every block of keys that no query
  of the block may see. The BlockMask is made by a compiled function too: eagerly, making it
  took 7.62 ms a forward at 64 x 512 on an H100, compiled 0.21 ms;
- Windows (CUDA, --packed-attention varlen, torch 2.12 on): varlen_attn, flash attention over
  the windows laid end to end, each its own causal sequence.
Rows of one sequence each (no --pack) never come here: they keep is_causal, and its flash kernels.
"""

import functools
import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F


@functools.cache
def varlen_with_gqa() -> bool:
    """Whether this torch's varlen_attn serves grouped-query attention (torch 2.12 on): before,
    it needed every key/value head repeated for its query heads, and ran slower than flex.
    (Asked when needed: importing it imports torch's compiler, 2 s of every process's start.)"""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    parameters = inspect.signature(varlen_attn).parameters
    return "enable_gqa" in parameters and "window_size" in parameters


def uses_flex(t: torch.Tensor) -> bool:
    return t.is_cuda


class Windows(NamedTuple):
    """The windows of a batch of packed rows laid end to end, as varlen_attn reads them:
    cu_seqlens (N + 1,) int32, where each window starts in the flattened (B x T) batch, then
    the total; max_len, the longest a window can be (T, a constant: no host sync)."""
    cu_seqlens: torch.Tensor
    max_len: int


def window_mask(position_ids, dtype: torch.dtype, cu_seqlens=None):
    """The mask for rows whose windows restart their positions at 0: query i may see key j
    when j <= i and no window starts after j up to i. position_ids (B, T) -> (B, 1, T, T) in
    `dtype`, the dtype attention computes in: 0 where attention is allowed, -inf elsewhere (a
    block-diagonal causal mask, broadcast over heads). Additive and in that dtype, every
    layer's attention keeps this one tensor for backward: given booleans, SDPA would convert
    them, and each layer keep its own copy. On CUDA a flex attention BlockMask of the same mask;
    given each row's cu_seqlens (for varlen_attn), the same windows as Windows."""
    B, T = position_ids.shape
    if cu_seqlens is not None:
        return windows_end_to_end(cu_seqlens, T)
    if uses_flex(position_ids):
        return compiled_block_mask(position_ids)
    window = (position_ids == 0).cumsum(dim=1)  # (B, T): which window of its row each token is in
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (window[:, :, None] == window[:, None, :]) & causal
    return torch.zeros(B, 1, T, T, dtype=dtype, device=position_ids.device).masked_fill_(~allowed[:, None], -torch.inf)


def block_mask(position_ids):
    """Flex attention's BlockMask of window_mask's mask. A function of position_ids alone, so
    that compiled (compiled_block_mask) it runs one graph for every batch of the same shape,
    wherever its windows fall: the document ids are made inside, not captured by a closure
    made outside, which would be a new input, and a recompile, every batch."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = position_ids.shape
    window = (position_ids == 0).cumsum(dim=1)  # (B, T): which window of its row each token is in

    def same_window_causal(b, h, q, kv):
        return (window[b, q] == window[b, kv]) & (q >= kv)
    return create_block_mask(same_window_causal, B, None, T, T, device=position_ids.device)


# Fixed shapes: one graph for each (B, T), never one generalized over sizes
MASK_COMPILE_OPTIONS = {"dynamic": False, "fullgraph": True}


def compiled_block_mask(position_ids):
    return _compiled_block_mask()(position_ids)


@functools.cache
def _compiled_block_mask():
    # Made on the first call (torch.compile, and torch.compiler.disable, import the compiler: 2 s
    # at a process's start otherwise). Run outside any compiled region that calls it: made
    # before the compiled layers that read it, in a graph of its own (torchtitan's way). A function
    # that calls the compiled one is disabled, not the compiled one itself: torch.compiler.disable
    # unwraps a compiled function to the plain one it compiles, which then ran eagerly.
    compiled = torch.compile(block_mask, **MASK_COMPILE_OPTIONS)

    @torch.compiler.disable
    def made_outside_compiled_regions(position_ids):
        return compiled(position_ids)
    return made_outside_compiled_regions


def windows_end_to_end(cu_seqlens, T: int) -> Windows:
    """cu_seqlens of each row (B, W + 1), int32, from the loader: [0, where each of its windows
    ends, ..., T, T, ...], at a length fixed for the whole dataset (PackedSequenceDataset) ->
    the batch's windows laid end to end. Every row's bounds move by the rows before it; a row's
    repeated T are empty windows, which varlen_attn skips. Tensor operations on fixed shapes
    alone: no host sync, no recompile."""
    B = cu_seqlens.shape[0]
    starts = cu_seqlens[:, :-1] + T * torch.arange(B, device=cu_seqlens.device, dtype=cu_seqlens.dtype)[:, None]
    total = torch.full((1,), B * T, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return Windows(torch.cat([starts.flatten(), total]), T)


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


def varlen_attention(q, k, v, windows: Windows):
    """Each window attends to itself, causally, with the windows laid end to end: (B x T, heads,
    D) for q, k and v, one sequence a window. varlen_attn is CUDA's flash kernel (torch 2.12 on,
    where it serves key/value heads shared by several query heads)."""
    B, H, T, D = q.shape

    def end_to_end(t):  # (B, heads, T, D) -> (B x T, heads, D): a view of RoPE's (B, T, heads, D) output
        return t.transpose(1, 2).reshape(B * T, t.shape[1], D)
    y = _varlen_attn(end_to_end(q), end_to_end(k), end_to_end(v), windows.cu_seqlens, windows.cu_seqlens,
                     windows.max_len, windows.max_len, window_size=(-1, 0), enable_gqa=True)  # (-1, 0): causal
    return y.view(B, T, H, D).transpose(1, 2)


def _varlen_attn(*args, **kwargs):
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(*args, **kwargs)


def attention(q, k, v, mask):
    """q (B, H, T, D), k and v (B, K, T, D), mask from window_mask -> (B, H, T, D)."""
    if isinstance(mask, Windows):
        return varlen_attention(q, k, v, mask)
    if isinstance(mask, torch.Tensor):
        return attention_in_query_blocks(q, k, v, mask)
    return flex_attention(q, k, v, mask)
