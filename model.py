"""A Llama-style decoder: RoPE, grouped-query attention, SwiGLU, RMSNorm.

Parameter names follow the usual Llama layout (`base_model.layers.0.self_attn.q_proj.weight`, ...)
so a checkpoint maps one to one onto other Llama tooling.

Shapes used in the comments: B batch, T sequence length, C hidden size, H query heads,
K key/value heads, D head dim (C // H unless the config says), V vocabulary.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ops import chunked_loss, fused_projections, packed_attention
from ops.kv_cache import KVCache
from ops.chunked_loss import IGNORE_INDEX


@dataclass
class LlamaConfig:
    vocab_size: int = 50000
    max_position_embeddings: int = 2048
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3's RoPE frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} (llama3_inv_freq); None: plain RoPE
    rope_scaling: dict | None = None
    head_dim: int | None = None  # None: hidden_size // num_attention_heads; a config may set another
    tie_word_embeddings: bool = False  # the LM head reads out with the input embedding's matrix
    # An imported model's own tokens that frame documents, bos + text + eos, and pad rows
    # (training/hf_import.py). None: our tokenizer's [BOT], [EOT], [PAD] (data.py).
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # The sequence length it was trained at (the run's --seq-len): positions past it were never
    # seen, though RoPE reaches to max_position_embeddings. Not architecture; None: unknown.
    trained_seq_len: int | None = None

    def __post_init__(self):
        # (A config read back from a file is checked before it gets here: training/model_config.py)
        if self.head_dim is None:  # the usual Llama: the query heads split the hidden size
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be divisible by num_attention_heads")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    @property
    def own_special_tokens(self) -> bool:  # an imported model's names them; ours leaves them to the tokenizer
        return self.bos_token_id is not None

    @property
    def trained_context(self) -> int:
        """The longest input the model handles as trained: trained_seq_len where it is known."""
        return self.trained_seq_len or self.max_position_embeddings


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's RoPE frequency scaling (Llama 3.1 and later): the frequencies whose wavelength
    exceeds the original context (its positions' low frequencies) slowed by `factor`, the short
    wavelengths kept, the ones between blended smoothly, so the model reads a context `factor`
    times longer than it was pretrained at with its high frequencies unchanged. Meta's formula."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(between, blended, scaled)


# `article`: the article's full-size model (README.md names it) (about 180M parameters with a 50K vocabulary).
# `tiny`: the CPU demo, small enough to train visibly in a few minutes on two cores.
# `debug`: the smallest model with every part of the others (grouped-query attention, more than one
# layer), as torchtitan's debug model: to try a setup or a change in seconds (the tests train it).
PRESETS = {
    "debug": dict(max_position_embeddings=1024, hidden_size=64, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny": dict(max_position_embeddings=1024, hidden_size=256, intermediate_size=1024,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2),
    "article": dict(max_position_embeddings=2048, hidden_size=768, intermediate_size=3072,
                    num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=3),
    # `1b`: Llama-3.2-1B's dimensions (untied, with our 50K vocabulary: 1.18B parameters),
    # 17.6 GiB of weights, gradients and AdamW state: the size where FSDP (train_fsdp.py) pays.
    "1b": dict(max_position_embeddings=2048, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
}


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on h run in: autocast's where it is on, else h's own (under FSDP's
    MixedPrecisionPolicy, the dtype the weights were gathered in)."""
    return torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        # normalize in fp32 for stability under bf16, then cast back
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables for rotary position encoding, "rotate half" convention."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        # Non-persistent: derived from the config, so they stay out of the state_dict and
        # DataParallel/DDP have nothing to keep in sync.
        self.register_buffer("cos", torch.empty(config.max_position_embeddings, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(config.max_position_embeddings, config.head_dim), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self):
        """Compute the tables into the buffers: at construction, and again after a model built
        on the meta device (shapes only) is given real, uninitialized memory."""
        d = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if self.config.rope_scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, self.config.rope_scaling)
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)           # (max_pos, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)    # (max_pos, D): same table over both halves
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, T: int, start: int = 0, position_ids=None):
        if position_ids is not None:  # packed rows: each token's position in its own window
            return self.cos[position_ids][:, None], self.sin[position_ids][:, None]  # (B, 1, T, D)
        return self.cos[start:start + T], self.sin[start:start + T]  # positions start .. start+T-1


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    # q: (B, H, T, D), k: (B, K, T, D), cos/sin: (T, D) broadcast over batch and heads, or
    # (B, 1, T, D) over heads (packed rows: every row has its own positions).
    # Rotated in fp32, returned in the dtype q and k came in: under bf16, fp32 tables would
    # otherwise promote q and k to fp32 while v stays bf16, and attention would take its
    # fp32 path (on CUDA: every key/value head repeated, and fp32 copies kept for backward).
    def rotate(x):
        x32 = x.float()
        return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)
    return rotate(q), rotate(k)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        C, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(C, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(C, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(C, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, C, bias=False)
        self.fused = False  # LlamaForPretraining.fuse_projections

    def forward(self, x, cos, sin, mask=None, kv_cache=None):
        B, T, _ = x.shape
        q, k, v = (fused_projections.linear(x, self.q_proj, self.k_proj, self.v_proj) if self.fused
                   else (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        # -1: the heads this module holds, all of them, or its share under tensor parallelism
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # No padding mask, on purpose. Sequences are right-padded, so every real token sits
        # before every [PAD]: the causal mask alone already hides all pads from real tokens.
        # Pad positions do attend to garbage, but their targets are ignored by the loss.
        # Without a materialized mask SDPA can use its flash/efficient kernels and stores
        # no (B, 1, T, T) tensor. enable_gqa lets K key/value heads serve H query heads.
        if kv_cache is not None:  # generation: the T new queries also see every cached position before them
            start = kv_cache.length
            k, v = kv_cache.append(k, v)  # (B, K, start + T, D)
            seen = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)
        elif mask is not None:  # packed rows (--pack): each window attends only to itself (window_mask)
            y = packed_attention.attention(q, k, v, mask)
        elif q.is_cuda and q.dtype == torch.float32:
            # On CUDA only the flash kernel takes enable_gqa, and only in bf16/fp16: in fp32 SDPA
            # would fall back to the math kernel, which stores the (B, H, T, T) scores. With each
            # key/value head repeated for its query heads, the memory-efficient kernel runs.
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * D)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused = False  # LlamaForPretraining.fuse_projections

    def forward(self, x):
        gate, up = (fused_projections.linear(x, self.gate_proj, self.up_proj) if self.fused
                    else (self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.activation_checkpointing = False  # LlamaForPretraining.enable_activation_checkpointing

    def forward(self, h, cos, sin, mask=None, kv_cache=None):
        if self.activation_checkpointing and torch.is_grad_enabled() and kv_cache is None:
            # Activation checkpointing: autograd keeps only this layer's inputs, and backward
            # runs the layer's forward again to get the rest. Non-reentrant, and inside this
            # module's forward: FSDP's hooks around it gather the weights once for both, and
            # compiling the layer compiles the recomputation too (torchtitan's order).
            return checkpoint(self.layer, h, cos, sin, mask, use_reentrant=False)
        return self.layer(h, cos, sin, mask, kv_cache)

    def layer(self, h, cos, sin, mask=None, kv_cache=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, kv_cache)  # pre-norm residual blocks
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, kv_caches=None):
        h = self.embed_tokens(input_ids)  # (B, T, C)
        start = kv_caches[0].length if kv_caches else 0  # position of input_ids[:, 0]
        cos, sin = self.rotary_emb(input_ids.shape[1], start, position_ids)
        # None: one sequence a row, and attention is causal over the whole row (is_causal)
        mask = None if position_ids is None else packed_attention.window_mask(position_ids, compute_dtype(h),
                                                                               cu_seqlens)
        for layer, cache in zip(self.layers, kv_caches or [None] * len(self.layers)):
            h = layer(h, cos, sin, mask, cache)
        return self.norm(h)


class LlamaLMHead(nn.Linear):
    """The LM head: a plain nn.Linear (`lm_head.weight`, or the embedding's, tied). Given targets
    it returns their summed loss instead of the logits, computed inside its own forward, so
    that FSDP gathers its weight for it and DDP and DataParallel see one ordinary forward."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.chunk_tokens = None  # tokens a chunk (None: chunked_loss.chunk_tokens for the device)
        self.compiled_loss = "plain"  # or "chunked", a candidate: benchmarks/gpu_report.py measures both
        self.parallel_loss = None  # under tensor parallelism, the loss over the vocabulary's shards

    def forward(self, h, targets=None):
        if targets is None:
            return super().forward(h)  # the logits
        if self.parallel_loss is not None:
            return self.parallel_loss(self, h, targets)
        h, targets = h.flatten(0, -2), targets.flatten()
        if torch.compiler.is_compiling() and self.compiled_loss == "plain":
            # Compiled, the plain formulation: inductor fuses the loss so that only the
            # compute-dtype logits stay alive, and it is the faster one. On an H200 the
            # compiled chunks ran at 0.84x its speed, saving 0.6-1.5 GiB of its 3.2 (with
            # their in-place form; docs/benchmarks.md). "chunked" traces ChunkedCrossEntropy.
            return F.cross_entropy(super().forward(h).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        dtype = compute_dtype(h)
        chunk = self.chunk_tokens or chunked_loss.chunk_tokens(self.out_features, h.device)
        return chunked_loss.chunked_loss(h, self.weight, targets, chunk, dtype)  # never all the logits at once


INIT_STD = 0.02  # every matrix and embedding starts from N(0, INIT_STD); the RMSNorm gains from ones


class LlamaForPretraining(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.base_model = LlamaModel(config)
        self.lm_head = LlamaLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()
        # The dtype matmuls run in (autocast); weights stay fp32. The model applies it itself,
        # not the caller: nn.DataParallel runs each replica in a thread of its own, and
        # autocast settings are per thread (a replica thread's default on CUDA is fp16).
        self.compute_dtype = torch.float32
        # The CUDA kernel for packed rows (--packed-attention): "flex", or "varlen" over the
        # windows' cu_seqlens (ops/packed_attention.py). A CPU computes either under a mask.
        self.packed_attention = "flex"
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def initial_weights(self, seed: int):
        """(parameter, its initial value) for every parameter, one whole tensor at a time, drawn
        from a generator of its own: N(0, 0.02) for every matrix and embedding, ones for the
        RMSNorm gains. The same values wherever the model lives and however it is split: a
        model built on the meta device and sharded (FSDP) takes each rank's part of each."""
        generator = torch.Generator().manual_seed(seed)
        seen = set()  # a tied weight once: it is the embedding's
        for module in self.modules():  # a fixed order: the module tree's
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                yield module.weight, torch.empty(module.weight.shape).normal_(0.0, INIT_STD, generator=generator)
            elif isinstance(module, LlamaRMSNorm):
                yield module.weight, torch.ones(module.weight.shape)

    def forward(self, input_ids, targets=None, position_ids=None, cu_seqlens=None, kv_caches=None):
        """input_ids: (B, T) token ids. Without targets: returns logits (B, T, V).
        With targets (B, T), IGNORE_INDEX where there is nothing to predict: returns
        (loss_sum, n_tokens), each of shape (1,): the summed cross-entropy over real targets
        and their count. Computed here, not by the caller, so that nn.DataParallel gathers two
        numbers per replica onto GPU 0 instead of the (B, T, V) logits; callers divide by the
        global token count, which keeps the loss exact however the batch is split.
        position_ids (B, T), packed rows only (--pack): each token's position in its own
        window, from 0 where a window starts; each window attends only to itself
        (window_mask). cu_seqlens (B, W + 1), with them: where each row's windows end, the
        kernel's input where packed_attention is "varlen". A row's structure travels with its
        row, so nn.DataParallel's split along the batch keeps it. None: one sequence a row.
        kv_caches (generation only, new_kv_caches): input_ids continue the cached tokens,
        whose keys and values grow by theirs."""
        end = input_ids.shape[1] + (kv_caches[0].length if kv_caches else 0)
        if end > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {end} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        device = input_ids.device.type
        with torch.autocast(device, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            varlen = position_ids is not None and self.packed_attention == "varlen"
            if varlen and cu_seqlens is None:
                raise ValueError('packed_attention "varlen" needs the rows\' cu_seqlens with their position_ids')
            h = self.base_model(input_ids, position_ids, cu_seqlens if varlen else None, kv_caches)
            if targets is None:
                return self.lm_head(h)  # the logits (B, T, V)
            loss_sum = self.lm_head(h, targets)
        n_tokens = (targets != IGNORE_INDEX).sum()
        # 1-element tensors, not 0-dim: DataParallel gathers them without a warning; and new
        # tensors, not views of others: FSDP warns about views returned by a sharded module
        return torch.stack([loss_sum]), torch.stack([n_tokens])

    def tie_weights(self):
        """Tied embeddings (SmolLM2, Llama 3.2 1B/3B): one (V, C) parameter embeds the ids and reads
        out the logits. Again after to_empty(), which gives each module a parameter of its own."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.base_model.embed_tokens.weight

    def enable_activation_checkpointing(self):
        """Each decoder layer recomputes its activations in backward instead of storing them."""
        for layer in self.base_model.layers:
            layer.activation_checkpointing = True

    def fuse_projections(self):
        """q, k, v and gate, up each as one matmul (ops/fused_projections.py); before compile and FSDP."""
        for layer in self.base_model.layers:
            layer.self_attn.fused = layer.mlp.fused = True

    def new_kv_caches(self, batch_size: int, max_len: int) -> list[KVCache]:
        """Empty caches, one per layer, for generating up to max_len positions in all."""
        w = self.lm_head.weight
        return [KVCache(self.config, batch_size, max_len, w.device, w.dtype) for _ in self.base_model.layers]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight of every matmul (the
        embedding lookup is no matmul; the LM head is one), plus 6 * 2 * hidden * seq_len per
        layer for the attention scores and their weighted sum (PaLM's estimate, which does
        not halve for the causal mask)."""
        c = self.config
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))  # tied too
        return 6 * matmul_weights + 12 * c.num_hidden_layers * c.hidden_size * seq_len
