"""The model: Llama layout, causal attention that ignores right padding, GQA, RoPE, and a
loss computed inside forward that equals a hand-written masked cross-entropy."""

import pytest
import torch
import torch.nn.functional as F

import model as model_module
from model import IGNORE_INDEX, PRESETS, LlamaAttention, LlamaConfig, LlamaForPretraining, apply_rotary_pos_emb

V, T = 97, 16


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    return LlamaForPretraining(config).eval()


def test_forward_shapes(llama):
    x = torch.randint(0, V, (3, T))
    assert llama(x).shape == (3, T, V)
    loss_sum, n_tokens = llama(x, x)
    assert loss_sum.shape == (1,) and n_tokens.shape == (1,) and n_tokens.item() == 3 * T


def test_parameter_names_follow_the_llama_layout_and_rope_is_not_saved(llama):
    keys = set(llama.state_dict())
    for name in ["base_model.embed_tokens.weight", "base_model.norm.weight", "lm_head.weight"] + [
            f"base_model.layers.1.{m}.weight" for m in (
                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]:
        assert name in keys
    assert not [k for k in keys if "rotary" in k or "cos" in k or "sin" in k]  # non-persistent buffers
    assert not [k for k in keys if k.endswith("bias")]


def test_article_preset_is_the_articles_180M_model():
    article = LlamaForPretraining(LlamaConfig(vocab_size=50000, **PRESETS["article"]))
    assert 179e6 < article.num_parameters() < 181e6
    assert article.base_model.layers[0].self_attn.k_proj.weight.shape == (3 * 64, 768)  # 3 kv heads


def test_changing_a_later_token_never_changes_earlier_logits(llama):
    x = torch.randint(0, V, (2, T))
    for t in (1, 7, T - 1):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % V
        a, b = llama(x), llama(y)
        torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
        assert (a[:, t] - b[:, t]).abs().max() > 1e-4  # and the changed position does change


def test_right_padding_never_changes_the_logits_of_real_tokens(llama):
    x = torch.randint(3, V, (1, 10))
    padded = torch.cat([x, torch.zeros(1, T - 10, dtype=torch.long)], dim=1)  # pad id 0
    torch.testing.assert_close(llama(padded)[:, :10], llama(x), rtol=0, atol=1e-5)


def test_is_causal_equals_an_explicit_causal_and_padding_mask_on_real_tokens(llama, monkeypatch):
    lengths = [T, 11, 4]
    x = torch.randint(3, V, (3, T))
    real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    x[~real] = 0
    ours = llama(x)

    sdpa = F.scaled_dot_product_attention

    def with_explicit_mask(q, k, v, is_causal=False, enable_gqa=False):
        # what the article's code builds: causal AND key-is-not-padding, as a float mask
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", with_explicit_mask)
    reference = llama(x)
    torch.testing.assert_close(ours[real], reference[real], rtol=0, atol=1e-5)


def test_attention_hands_sdpa_no_mask_tensor_only_is_causal(llama, monkeypatch):
    """`is_causal=True` instead of the article's float mask: SDPA gets no (B, 1, T, T) tensor
    to hold and may pick its flash or memory-efficient kernel. A mask passed instead gives the
    same logits (the test above), so the calls themselves are checked."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((args, kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    x = torch.randint(0, V, (2, T))
    llama(x, x)
    assert calls == [((), None, True)] * llama.config.num_hidden_layers


def test_grouped_query_attention_shares_each_kv_head_among_its_query_heads():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=128, num_hidden_layers=1, max_position_embeddings=T)
    attn = LlamaAttention(config)
    assert attn.k_proj.weight.shape == (2 * 8, 64) and attn.q_proj.weight.shape == (8 * 8, 64)
    x = torch.randn(2, T, 64)
    cos, sin = torch.ones(T, 8), torch.zeros(T, 8)  # no rotation: compare attention alone
    ours = attn(x, cos, sin)
    # reference: repeat each kv head for its 4 query heads, then plain multi-head attention
    q = attn.q_proj(x).view(2, T, 8, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, T, 2, 8).transpose(1, 2).repeat_interleave(4, dim=1)
    v = attn.v_proj(x).view(2, T, 2, 8).transpose(1, 2).repeat_interleave(4, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, attn.o_proj(y.transpose(1, 2).reshape(2, T, 64)))


def test_rope_attention_scores_depend_only_on_relative_position(llama):
    cos, sin = llama.base_model.rotary_emb(32)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i, j):
        qi, _ = apply_rotary_pos_emb(q, q, cos[i], sin[i])
        _, kj = apply_rotary_pos_emb(k, k, cos[j], sin[j])
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(20, 17))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_loss_pieces_equal_a_hand_computed_masked_cross_entropy(llama):
    x = torch.randint(0, V, (3, T))
    y = torch.randint(0, V, (3, T))
    y[0, 9:] = IGNORE_INDEX
    y[2, 3:] = IGNORE_INDEX
    loss_sum, n_tokens = llama(x, y)
    logits = llama(x)
    expected, count = 0.0, 0
    for b in range(3):
        for t in range(T):
            if y[b, t] != IGNORE_INDEX:
                expected -= torch.log_softmax(logits[b, t].double(), dim=-1)[y[b, t]].item()
                count += 1
    assert n_tokens.item() == count == 16 + 9 + 3
    assert loss_sum.item() == pytest.approx(expected, rel=1e-5)


def test_all_ignored_targets_give_zero_loss_not_nan(llama):
    x = torch.randint(0, V, (1, T))
    loss_sum, n_tokens = llama(x, torch.full((1, T), IGNORE_INDEX))
    assert loss_sum.item() == 0.0 and n_tokens.item() == 0


def test_sequence_longer_than_positions_is_refused(llama):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        llama(torch.zeros(1, 65, dtype=torch.long))


def test_kv_cache_gives_the_logits_of_a_full_forward(llama):
    """Feeding a sequence in pieces through the KV cache (a prompt, a chunk that must see the
    cached prefix through the mask, then one token at a time) gives every position the
    logits of one forward over the whole sequence."""
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = llama(x)
        caches = llama.new_kv_caches(batch_size=2, max_len=20)
        pieces = [llama(x[:, :6], kv_caches=caches), llama(x[:, 6:10], kv_caches=caches)]
        pieces += [llama(x[:, t:t + 1], kv_caches=caches) for t in range(10, 20)]
    assert caches[0].length == 20
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_kv_cache_refuses_positions_beyond_its_size_or_the_model(llama):
    caches = llama.new_kv_caches(batch_size=1, max_len=4)
    with torch.no_grad():
        llama(torch.zeros(1, 4, dtype=torch.long), kv_caches=caches)
        with pytest.raises(ValueError, match="KV cache holds 4 positions, 5 needed"):
            llama(torch.zeros(1, 1, dtype=torch.long), kv_caches=caches)
        caches = llama.new_kv_caches(batch_size=1, max_len=100)
        llama(torch.zeros(1, 64, dtype=torch.long), kv_caches=caches)
        with pytest.raises(ValueError, match="sequence length 65 exceeds max_position_embeddings 64"):
            llama(torch.zeros(1, 1, dtype=torch.long), kv_caches=caches)


def linear_output_dtypes(model, run):
    """Run run(); return the dtypes of every nn.Linear output (every matmul of the model; given
    targets, the LM head returns the loss instead, 0-dim and fp32: left out)."""
    dtypes = set()

    def record(module, args, out):  # returns None: a hook's return value would replace the output
        if out.dim() > 0:
            dtypes.add(out.dtype)
    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return dtypes


@pytest.mark.parametrize("outer_autocast", [False, True])
def test_a_replica_on_a_fresh_thread_computes_in_the_models_dtype(outer_autocast):
    """nn.DataParallel's parallel_apply runs each replica in a new thread and re-enters
    autocast there with `enabled` only. Autocast's dtype is per thread and defaults to fp16
    on CUDA, so a dtype set by the caller's autocast is lost. The model applies its own."""
    import threading
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForPretraining(config)
    model.compute_dtype = torch.bfloat16
    x = torch.randint(0, V, (2, T))
    results = {}

    def replica():  # what parallel_apply's worker does, with CUDA's per-thread default dtype
        torch.set_autocast_dtype("cpu", torch.float16)
        with torch.autocast("cpu", enabled=outer_autocast):
            results["loss"] = model(x, x)[0]

    thread = threading.Thread(target=replica)
    dtypes = linear_output_dtypes(model, lambda: (thread.start(), thread.join()))
    assert dtypes == {torch.bfloat16}
    assert results["loss"].dtype == torch.float32  # the loss is computed in fp32
    model.compute_dtype = torch.float32  # fp32 stays fp32, whatever autocast the caller set
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_output_dtypes(model, lambda: model(x, x)) == {torch.float32}


def test_under_bf16_attention_gets_q_k_v_in_one_dtype_and_only_the_key_value_heads(llama, monkeypatch):
    """RoPE's tables are fp32: multiplied into bf16 q and k they would make them fp32 while v
    stays bf16, and on CUDA the fp32 branch would repeat every key/value head for its query
    heads. What SDPA receives is checked here, on any device."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, q.shape[1], k.shape[1], v.shape[1]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(llama, "compute_dtype", torch.bfloat16)
    x = torch.randint(0, V, (2, T))
    loss_sum, _ = llama(x, x)
    loss_sum.sum().backward()  # the rotation runs in fp32 and must keep its gradient flowing
    assert all(p.grad is not None for p in llama.parameters())
    llama.zero_grad(set_to_none=True)
    H, K = llama.config.num_attention_heads, llama.config.num_key_value_heads
    assert seen == [(torch.bfloat16,) * 3 + (H, K, K)] * llama.config.num_hidden_layers
