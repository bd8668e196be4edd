"""The LM head's loss in chunks (chunked_loss.py) is the plain cross-entropy over the whole
logits, computed with less memory and no more work: the same loss and gradients to rounding,
one chunk of logits alive at a time, the same matmul FLOPs, and the logits matmul alone
where no gradient is needed."""

import json
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import EagerAndRecordGraphs
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from conftest import FLOOR_MULTIPLE, assert_same_model, assert_within, ddp_two_ranks, spied
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining, LlamaLMHead
from perturb import full_logits_loss

V, C = 4096, 64  # a vocabulary large beside the width: the logits dominate, as at V = 50,000


def small_model(chunk_tokens=100):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, max_position_embeddings=256, hidden_size=C, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForPretraining(config)
    model.lm_head.chunk_tokens = chunk_tokens  # 512 tokens: 5 chunks, the last one short
    return model


def batch(B=4, T=128):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, V, (B, T), generator=g)
    y = x.roll(-1, 1)
    y[0, 50:] = IGNORE_INDEX  # padding: ignored targets inside a chunk,
    y[1, :] = IGNORE_INDEX  # and filling whole ones (tokens 128 to 255: chunks of 100 and 128)
    y[2, 100:] = IGNORE_INDEX
    return x, y


def plain_loss(model, x, y):
    """The formulation the chunks replace (perturb.full_logits_loss): every logit at once."""
    with torch.autocast("cpu", dtype=model.compute_dtype, enabled=model.compute_dtype != torch.float32):
        return full_logits_loss(model.lm_head, model.base_model(x), y)


def loss_and_gradients(model, loss_fn, x, y):
    """The summed loss, and the gradients of the mean (as the trainers divide by the token count)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, x, y)
    (loss / (y != IGNORE_INDEX).sum()).backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def chunked(model, x, y):
    return model(x, y)[0].sum()


def distance(a, b) -> float:
    """The largest relative difference of two (loss, gradients) pairs, over the loss and every parameter."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return max(abs(loss_a - loss_b) / abs(loss_b),
               *((grads_a[k] - grads_b[k]).abs().max().item() / grads_b[k].abs().max().item() for k in grads_b))


def test_the_chunked_loss_and_every_gradient_equal_the_plain_formulation_to_rounding():
    """The floor: the plain formulation against itself on the batch with its sequences in
    reverse order (the same tokens, summed in another order)."""
    model, (x, y) = small_model(), batch()
    plain = loss_and_gradients(model, plain_loss, x, y)
    floor = distance(loss_and_gradients(model, plain_loss, x.flip(0), y.flip(0)), plain)
    assert_within("chunked vs plain", distance(loss_and_gradients(model, chunked, x, y), plain), floor,
                  FLOOR_MULTIPLE)


def test_in_bf16_the_chunked_loss_is_as_close_to_fp32_as_the_plain_formulation():
    """bf16 is another arithmetic, not another order: the plain formulation's own distance in
    bf16 from the same step in fp32 is the floor, and the chunks may add little to it. (Their
    head gradient sums the chunks' bf16 products in fp32, where the plain one rounds the
    whole sum to bf16 once: against each other they differ by 6.6e-3 here, within 9.7e-3.)"""
    model, (x, y) = small_model(), batch()
    fp32 = loss_and_gradients(model, plain_loss, x, y)
    model.compute_dtype = torch.bfloat16
    floor = distance(loss_and_gradients(model, plain_loss, x, y), fp32)
    with MatmulDtypes() as seen:
        ours = loss_and_gradients(model, chunked, x, y)
    assert_within("bf16 chunked vs fp32", distance(ours, fp32), floor, 2)
    assert seen.dtypes == {torch.bfloat16}  # every matmul, the head's three included, in bf16


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of every matrix product's output, in forward and backward."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
            self.dtypes.add(out.dtype)
        return out


def allocated_peak(fn) -> int:
    """The most bytes of tensors alive at once while fn runs, above what was alive before:
    torch's CPU allocator, as torch.profiler records each allocation and free."""
    return allocations(fn)[0]


def allocations(fn) -> tuple[int, int]:
    """(the peak while fn runs, what is still alive when it returns), in bytes above what was
    alive before, as allocated_peak measures them."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e["args"] for e in sorted((e for e in json.load(open(f.name))["traceEvents"]
                                             if e.get("name") == "[memory]"), key=lambda e: e["ts"])]
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before, events[-1]["Total Allocated"] - before


def head_loss_and_gradients(loss_fn, order, head=None, dtype=torch.float32):
    """The LM head alone (a fresh one unless given: its weight is drawn anew), on 500 tokens
    (5 chunks), some targets ignored; rows taken in `order`, loss_fn(h, head, targets) under
    autocast to dtype. Backward gets the mean's gradient, not 1, so that a misrouted incoming
    gradient shows."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(500, C, generator=g)[order].requires_grad_()
    head = head or LlamaLMHead(C, V)
    with torch.no_grad():
        head.weight.copy_(0.02 * torch.randn(V, C, generator=g))
    head.weight.grad = None
    targets = torch.randint(0, V, (500,), generator=g)
    targets[::7] = IGNORE_INDEX
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(h, head, targets[order])
    (loss / (targets != IGNORE_INDEX).sum()).backward()
    return loss.item(), {"h": h.grad[order.argsort()], "weight": head.weight.grad}


IN_ORDER, REVERSED_ROWS = torch.arange(500), torch.arange(500).flip(0)


def test_compiled_the_chunked_loss_gives_the_loss_and_gradients_of_eager():
    """Traced by the compiler (aot_eager with fullgraph: what inductor receives, without
    generating code), the Function gives eager's loss and gradients. torch 2.11 sent the
    incoming gradient of a Function that changed its returned tensor in place to the wrong
    output, and every gradient was exactly 0 (pytorch/pytorch#180642); on this torch, tracing
    `loss += ...` the same way gives 0 gradients too (the mutant this test fails on)."""
    from ops.chunked_loss import ChunkedCrossEntropy

    def loss_fn(h, head, targets):
        return ChunkedCrossEntropy.apply(h, head.weight, targets, 100, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    eager = head_loss_and_gradients(loss_fn, IN_ORDER)
    floor = distance(head_loss_and_gradients(loss_fn, REVERSED_ROWS), eager)  # the same tokens, another order
    traced = head_loss_and_gradients(compiled, IN_ORDER)
    assert all(grad.abs().max() > 0 for grad in traced[1].values())
    assert_within("compiled vs eager", distance(traced, eager), floor, FLOOR_MULTIPLE)


def plain_head_loss(h, head, targets):
    return full_logits_loss(head, h, targets)  # eager, whether or not the head is compiled


@pytest.mark.compile
def test_compiled_with_compiled_loss_chunked_the_head_gives_the_plain_loss_and_gradients():
    """The head compiled in place (inductor, as train_ddp.py does) with compiled_loss =
    "chunked" against the eager plain formulation: in fp32 within the floor of the same tokens
    in another order; in bf16 as close to fp32 as the plain formulation's own bf16 (the bf16
    products of the weight's gradient are summed chunk by chunk, where the plain one rounds
    their whole sum once: another rounding, not a reordering). No gradient is 0 (torch 2.11)."""
    torch._dynamo.reset()
    head = LlamaLMHead(C, V)
    head.chunk_tokens, head.compiled_loss = 100, "chunked"
    head.compile()
    plain = head_loss_and_gradients(plain_head_loss, IN_ORDER, head)
    floor = distance(head_loss_and_gradients(plain_head_loss, REVERSED_ROWS, head), plain)
    ours = head_loss_and_gradients(lambda h, head, targets: head(h, targets), IN_ORDER, head)
    assert all(grad.abs().max() > 0 for grad in ours[1].values())
    assert_within("compiled chunked vs plain", distance(ours, plain), floor, FLOOR_MULTIPLE)
    bf16_floor = distance(head_loss_and_gradients(plain_head_loss, IN_ORDER, head, torch.bfloat16), plain)
    ours = head_loss_and_gradients(lambda h, head, targets: head(h, targets), IN_ORDER, head, torch.bfloat16)
    assert all(grad.abs().max() > 0 for grad in ours[1].values())
    assert_within("bf16 compiled chunked vs fp32 plain", distance(ours, plain), bf16_floor, 2)


def test_compiled_loss_chooses_the_formulation_the_compiler_traces():
    """Dynamo's graph of the compiled head (fullgraph: no graph break; called twice: one graph,
    no recompile) applies ChunkedCrossEntropy with compiled_loss = "chunked", its forward traced
    in the pure form (loss_and_gradient: the in-place form leaves inductor two fp32 (n, V)
    buffers, and its compiled chunks ran at 0.84x the plain loss on an H200), and F.cross_entropy
    over every logit with the default, "plain"."""
    g = torch.Generator().manual_seed(2)
    h, targets = torch.randn(500, C, generator=g, requires_grad=True), torch.randint(0, V, (500,), generator=g)
    traced, graphs = {}, {}
    for setting in [None, "chunked"]:  # None: the default
        torch._dynamo.reset()
        head, backend = LlamaLMHead(C, V), EagerAndRecordGraphs()
        head.compiled_loss = setting or head.compiled_loss
        head.compile(backend=backend, fullgraph=True)
        for _ in range(2):
            head(h, targets).backward()
        assert len(backend.graphs) == 1
        graphs[head.compiled_loss] = backend.graphs[0]
        traced[head.compiled_loss] = [n for n in backend.graphs[0].graph.nodes if n.op == "call_function"]
    assert F.cross_entropy in [n.target for n in traced["plain"]]
    assert not any(n.target is torch.ops.higher_order.autograd_function_apply for n in traced["plain"])
    applied = [n for n in traced["chunked"] if n.target is torch.ops.higher_order.autograd_function_apply]
    assert len(applied) == 1 and "ChunkedCrossEntropy.apply" in applied[0].meta["stack_trace"]
    assert F.cross_entropy not in [n.target for n in traced["chunked"]]
    forward = getattr(graphs["chunked"], applied[0].args[0].target)  # the Function's forward, as traced
    methods = {n.target for n in forward.graph.nodes if n.op == "call_method"}
    assert "logsumexp" in methods and not methods & {"exp_", "div_", "masked_fill_"}


def test_only_one_chunk_of_logits_is_ever_alive_in_forward_or_backward():
    """Forward and backward of the decoder alone (a loss of its outputs' sum) against the same
    with the chunked loss: the difference is one chunk of fp32 logits, the head's gradient
    (which the plain backward makes too) and the hidden states' gradient. The plain
    formulation holds all the logits, several times over."""
    model, (x, y) = small_model(), batch()
    model.lm_head.chunk_tokens = 128  # 4 chunks of 2 MiB of logits
    decoder = allocated_peak(lambda: model.base_model(x).sum().backward())
    model.zero_grad(set_to_none=True)
    ours = allocated_peak(lambda: model(x, y)[0].sum().backward())
    model.zero_grad(set_to_none=True)
    plain = allocated_peak(lambda: plain_loss(model, x, y).backward())
    one_chunk, head_gradient, hidden_gradient = 128 * V * 4, V * C * 4, x.numel() * C * 4
    assert ours - decoder <= one_chunk + head_gradient + hidden_gradient + 64 * 1024, (ours - decoder)
    assert plain - decoder > 2 * x.numel() * V * 4  # the measure sees the logits


def matmul_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_no_more_matmul_work_than_the_plain_formulation_and_evaluation_only_the_logits():
    """Forward and backward: the same three head matmuls (logits, the hidden states' gradient,
    the weight's gradient) as the plain formulation, chunk by chunk. Without gradients, only
    the logits' matmul."""
    model, (x, y) = small_model(), batch()
    assert matmul_flops(lambda: chunked(model, x, y).backward()) == \
        matmul_flops(lambda: plain_loss(model, x, y).backward())
    with torch.no_grad():
        evaluation = matmul_flops(lambda: model(x, y))
        decoder = matmul_flops(lambda: model.base_model(x))
        assert evaluation - decoder == 2 * x.numel() * C * V
        assert model(x, y)[0].item() == pytest.approx(plain_loss(model, x, y).item(), rel=1e-6)


def test_without_targets_forward_returns_the_logits():
    model, (x, _) = small_model(), batch()
    logits = model(x)
    assert logits.shape == (*x.shape, V)
    torch.testing.assert_close(logits, torch.nn.Linear.forward(model.lm_head, model.base_model(x)), rtol=0, atol=0)


RUNGS = [  # (cached run, script, flags, processes): the suite's runs of each rung
    pytest.param("dp", "train_dp.py", [], 0, id="dp"),  # one process; DataParallel in a world of one
    pytest.param("dp_accum2", "train_dp.py", ["--grad-accum", "2"], 0, id="grad-accum-2"),
    pytest.param("ddp2", "train_ddp.py", [], 2, id="ddp2"),
    pytest.param("fsdp2", "train_fsdp.py", [], 2, id="fsdp2"),
    pytest.param("ddp2_compiled", "train_ddp.py", ["--compile"], 2, id="ddp2-compiled", marks=pytest.mark.compile),
]


@pytest.mark.parametrize("name, script, flags, nproc", RUNGS)
def test_every_rung_trains_the_model_of_the_full_logits_formulation(runs, floor, name, script, flags, nproc):
    """8 steps in fp32: each rung (which computes the loss in chunks; compiled, inductor's own
    fusion of the plain formulation) ends with the weights and losses of one process that
    computes every logit at once, to the rounding floor."""
    from test_fsdp import fsdp_two_ranks
    full_logits = runs("dp_full_logits", "train_dp.py", perturb="full-logits")
    if name == "ddp2":
        run = ddp_two_ranks(runs)
    elif name == "fsdp2":
        run = fsdp_two_ranks(runs)
    elif name == "ddp2_compiled":
        run, _ = spied(runs, name, script, flags, nproc)
    else:
        run = runs(name, script, flags)
    assert_same_model(run, full_logits, floor)


def test_a_run_in_small_chunks_trains_the_model_of_the_full_logits_formulation(runs, floor):
    """FSDP on 2 ranks with chunks of 7 tokens (the suite's micro-batches of 128 tokens are
    otherwise one chunk each): the chunks, their ignored targets and the short last one."""
    full_logits = runs("dp_full_logits", "train_dp.py", perturb="full-logits")
    assert_same_model(runs("fsdp2_small_chunks", "train_fsdp.py", nproc=2, perturb="small-chunks"), full_logits, floor)
