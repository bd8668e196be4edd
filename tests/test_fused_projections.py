"""q, k, v and gate, up each as one matmul (LlamaForPretraining.fuse_projections,
ops/fused_projections.py) compute the plain formulation's loss and gradients to rounding, eager
and compiled, in fp32 and bf16, packed or not, and generate through the KV cache alike; the
parameters, their names and the state_dict stay those of the plain model."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FLOOR_MULTIPLE, assert_within
from model import IGNORE_INDEX, PRESETS, LlamaConfig, LlamaForPretraining
from ops import fused_projections
from test_chunked_loss import chunked, distance, loss_and_gradients

V = 300


def plain_and_fused() -> tuple[LlamaForPretraining, LlamaForPretraining]:
    """The debug model twice, with the same weights: as built, and with fuse_projections."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, **PRESETS["debug"])
    plain, fused = LlamaForPretraining(config), LlamaForPretraining(config)
    fused.load_state_dict(plain.state_dict())
    fused.fuse_projections()
    return plain, fused


def batch(B=4, T=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, V, (B, T), generator=g)
    y = x.roll(-1, 1)
    y[1, 20:] = IGNORE_INDEX  # padding
    return x, y


def packed(model, x, y):
    """The loss of rows packed with two windows each (position_ids restart at 0), as --pack trains."""
    T = x.shape[1]
    position_ids = torch.cat([torch.arange(20), torch.arange(T - 20)]).expand_as(x)
    return model(x, y, position_ids=position_ids)[0].sum()


@pytest.fixture
def fused_calls(monkeypatch) -> list:
    """How many projections each call of ops.fused_projections.linear took: proof the fused path ran."""
    calls, real = [], fused_projections.linear

    def spy(x, *projections):
        calls.append(len(projections))
        return real(x, *projections)
    monkeypatch.setattr(fused_projections, "linear", spy)
    return calls


class Matmuls(TorchDispatchMode):
    """How many matrix products run (each nn.Linear of a 3-dimensional input is one mm)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss_fn", [chunked, packed], ids=["rows", "packed"])
def test_the_loss_and_every_gradient_equal_the_plain_formulations_to_rounding(fused_calls, loss_fn):
    """fp32. The floor: the plain model against itself on the batch with its rows in reverse
    order (the same tokens, summed in another order). On this AMD EPYC the fused model is not
    bitwise the plain one (one wider matmul adds in another order): 0.6-0.7x the floor. Forward,
    each layer runs 4 matmuls where the plain one runs 7."""
    plain, fused = plain_and_fused()
    x, y = batch()
    ours = loss_and_gradients(fused, loss_fn, x, y)
    assert fused_calls == [3, 2] * fused.config.num_hidden_layers
    reference = loss_and_gradients(plain, loss_fn, x, y)
    floor = distance(loss_and_gradients(plain, loss_fn, x.flip(0), y.flip(0)), reference)
    assert_within("fused vs plain", distance(ours, reference), floor, FLOOR_MULTIPLE)
    counts = {}
    for name, model in (("plain", plain), ("fused", fused)):
        with torch.no_grad(), Matmuls() as matmuls:
            model.base_model(x)
        counts[name] = matmuls.count
    layers = fused.config.num_hidden_layers
    assert counts == {"plain": 7 * layers, "fused": 4 * layers}


def test_in_bf16_the_fused_model_is_as_close_to_fp32_as_the_plain_formulation(fused_calls):
    """bf16 is another arithmetic, not another order: the fused matmul rounds the gradient of
    its input to bf16 once, where the plain three round theirs and add them up. The floor is
    the plain formulation's own distance in bf16 from the same step in fp32 (1.0e-2 here, a
    relative distance: attention's gradients at the first step are small, and bf16 moves them
    most), and the fused model may be little further (1.1x the floor here)."""
    plain, fused = plain_and_fused()
    x, y = batch()
    fp32 = loss_and_gradients(plain, chunked, x, y)
    plain.compute_dtype = fused.compute_dtype = torch.bfloat16
    floor = distance(loss_and_gradients(plain, chunked, x, y), fp32)
    assert_within("bf16 fused vs fp32", distance(loss_and_gradients(fused, chunked, x, y), fp32), floor, 2)
    assert fused_calls == [3, 2] * fused.config.num_hidden_layers


@pytest.mark.compile
def test_compiled_as_train_ddp_compiles_the_fused_model_gives_the_plain_eager_loss_and_gradients(fused_calls):
    """Each decoder layer and the LM head compiled in place (train_ddp.py --compile) with the
    projections fused, against the plain model eager: within the reordering floor of fp32."""
    plain, fused = plain_and_fused()
    x, y = batch()
    torch._dynamo.reset()
    for block in [*fused.base_model.layers, fused.lm_head]:
        block.compile()
    ours = loss_and_gradients(fused, chunked, x, y)
    assert fused_calls  # traced: the compiled layers are the fused ones
    reference = loss_and_gradients(plain, chunked, x, y)
    floor = distance(loss_and_gradients(plain, chunked, x.flip(0), y.flip(0)), reference)
    assert_within("compiled fused vs eager plain", distance(ours, reference), floor, FLOOR_MULTIPLE)


def test_the_parameters_and_the_state_dict_stay_those_of_the_plain_model():
    """Names, shapes and values: a checkpoint of either loads into the other, and
    tools/export_hf.py writes the same files."""
    plain, fused = plain_and_fused()
    assert [(name, p.shape) for name, p in fused.named_parameters()] == \
        [(name, p.shape) for name, p in plain.named_parameters()]
    ours, reference = fused.state_dict(), plain.state_dict()
    assert list(ours) == list(reference)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_generation_through_the_kv_cache_gives_the_plain_models_logits(fused_calls):
    """A prompt, then one token at a time. The floor: the plain model's cached logits against
    its one forward over the whole sequence (the same arithmetic, in other shapes of matmul)."""
    plain, fused = plain_and_fused()
    x, _ = batch(B=2, T=12)

    def generated(model):
        caches = model.new_kv_caches(batch_size=2, max_len=12)
        return torch.cat([model(x[:, :8], kv_caches=caches)] + [model(x[:, t:t + 1], kv_caches=caches)
                                                                 for t in range(8, 12)], dim=1)
    with torch.no_grad():
        reference, ours = generated(plain), generated(fused)
        full = plain(x)
    assert fused_calls == [3, 2] * fused.config.num_hidden_layers * 5  # the prompt, then 4 tokens
    largest = reference.abs().max().item()
    # never below one float32 rounding step: a CPU where the shapes changed nothing still allows one
    floor = max((reference - full).abs().max().item(), torch.finfo(torch.float32).eps * largest)
    assert_within("fused vs plain logits", (ours - reference).abs().max().item(), floor, FLOOR_MULTIPLE)
