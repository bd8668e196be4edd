"""The LM head's loss, computed chunk by chunk of tokens so that the full logits never exist.

The plain formulation, `F.cross_entropy(lm_head(h).float(), targets)`, keeps the (tokens, V)
logits, their fp32 copy and their log-softmax alive from forward into backward, and makes
their gradient in backward. At V = 50,000 and 8 x 512 tokens on a CPU that is 3.0 GiB over
the decoder's own peak; at 64 x 512 on a GPU, 18 GiB. Here forward takes each chunk's
logits, its loss and at once its gradients (softmax minus one-hot, then times the weight and
times the hidden states: the three matmuls the plain backward does too, and no more), and
frees the logits before the next chunk. Backward only scales the stored gradients. Only
one chunk of logits is ever alive. Compiled (LlamaLMHead.compiled_loss = "chunked"), each
chunk's loss and gradient are pure operations instead, which inductor fuses.
tests/test_chunked_loss.py proves it equal to the plain formulation, which stays in
tests/perturb.py (full_logits_loss) as the reference.

Under tensor parallelism (training/tensor_parallel.py) each rank holds a shard of the
vocabulary's rows of the weight: given the TP group, each chunk's softmax takes its max, its
sum and the target's logit over every shard (three all-reduces of one number a token), and
the hidden states' gradient is this shard's part of a sum, which the caller reduces.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100  # target id that the loss skips (the data marks [PAD] targets with it)

# fp32 logits in one chunk. A CPU: 2**25 (128 MiB, 671 tokens at V = 50,000), which costs
# 0.23 GiB over the decoder's peak and runs 1.12x the plain step (docs/benchmarks.md). A GPU
# keeps its matmuls busy only with larger chunks: 2**28 (1 GiB, 5,368 tokens); on an H100
# 671 tokens ran at 0.87x the plain step, 4,096 at 0.95x, saving 17 GiB of its 39.
LOGITS_PER_CHUNK = {"cpu": 2**25, "cuda": 2**28}


def chunk_tokens(vocab_size: int, device: torch.device) -> int:
    return max(1, LOGITS_PER_CHUNK.get(device.type, 2**25) // vocab_size)


def loss_and_gradient_in_place(logits, y, ignored, group=None):
    """The summed loss of fp32 logits (n, V) against targets y (n,) where not ignored, and its
    gradient (softmax minus the one-hot target; 0 in ignored rows), made in the logits' buffer.
    group: the TP ranks holding the vocabulary's other shards (y: ids within this shard, out of
    [0, V) where the target is another shard's), whose max and sums each softmax takes too."""
    # log-softmax and softmax in place, in this one (n, V) buffer (logsumexp would make two more)
    top = logits.amax(dim=-1, keepdim=True)
    here = (y >= 0) & (y < logits.shape[1])  # the targets in this shard (all of them without TP)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    logits -= top
    y = y.clamp(0, logits.shape[1] - 1)
    target = logits.gather(1, y[:, None]).squeeze(1).masked_fill_(~here, 0)
    probs = logits.exp_()
    total = probs.sum(dim=-1)
    if group is not None:  # each shard's part of the sum, and the one shard's target logit
        total, target = both = torch.stack([total, target])
        dist.all_reduce(both, group=group)
    loss = (total.log() - target).masked_fill(ignored, 0).sum()  # -log softmax at the target
    grad = probs.div_(total[:, None])                              # softmax
    grad[torch.arange(len(y), device=y.device), y] -= here.to(grad.dtype)  # minus the one-hot target, where here
    return loss, grad.masked_fill_(ignored[:, None], 0)


def loss_and_gradient(logits, y, ignored):
    """The same in pure operations, for the compiler. Inductor fuses them into three passes over
    the logits (their max, the sum of exponentials, the gradient in the compute dtype) and no
    (n, V) tensor between; it leaves the in-place form two fp32 (n, V) buffers and a fourth pass
    (the one-hot's index_put splits its fusion). Eager, each operation here would be a tensor."""
    lse = logits.logsumexp(dim=-1)
    loss = (lse - logits.gather(1, y[:, None]).squeeze(1)).masked_fill(ignored, 0).sum()
    one_hot = torch.arange(logits.shape[1], device=y.device) == y[:, None]
    return loss, ((logits - lse[:, None]).exp() - one_hot.float()).masked_fill(ignored[:, None], 0)


def over_chunks(h, weight, targets, chunk: int, dtype: torch.dtype, group=None, vocab_start: int = 0,
                gradients: bool = True):
    """h (N, C), weight (V, C), targets (N,): the summed cross-entropy over the targets that
    are not IGNORE_INDEX, the logits computed in dtype and the loss in fp32, chunk by chunk; and
    with gradients, those of h and weight. Under TP, weight is this rank's shard of the
    vocabulary, from id vocab_start, and group the TP ranks: h's gradient is then this shard's
    part of it."""
    w = weight.to(dtype)
    losses = [h.new_zeros((), dtype=torch.float32)]  # each chunk's sum (no tokens: a loss of 0), added up
    # at the end: the loss returned is a fresh tensor, never one changed in place
    grad_h = torch.empty_like(h) if gradients else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if gradients else None
    for start in range(0, h.shape[0], chunk):
        x, y = h[start:start + chunk].to(dtype), targets[start:start + chunk]
        logits = (x @ w.t()).float()                                   # (n, V): the only big tensor
        ignored = y == IGNORE_INDEX
        y = (y - vocab_start).masked_fill(ignored, 0)
        if torch.compiler.is_compiling() and group is None:
            loss, grad = loss_and_gradient(logits, y, ignored)
        else:
            loss, grad = loss_and_gradient_in_place(logits, y, ignored, group)
        losses.append(loss)
        if gradients:
            grad = grad.to(dtype)
            grad_h[start:start + chunk] = grad @ w
            if grad.dtype == grad_weight.dtype:
                torch.addmm(grad_weight, grad.t(), x, out=grad_weight)  # in place: no (V, C) temporary
            else:
                grad_weight += grad.t() @ x  # bf16 products, summed in fp32
        del logits, grad  # freed before the next chunk's logits exist
    # A fresh tensor, not a `loss +=` total: torch 2.11's compiler, tracing a Function whose
    # forward changed the tensor it returns in place, sent backward's incoming gradient to
    # the wrong output (pytorch/pytorch#180642, fixed in 2.12): every gradient was 0
    return torch.stack(losses).sum(), grad_h, grad_weight


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, dtype: torch.dtype, group=None, vocab_start: int = 0):
        """over_chunks' loss; its gradients kept for backward."""
        loss, grad_h, grad_weight = over_chunks(h, weight, targets, chunk, dtype, group, vocab_start)
        ctx.save_for_backward(grad_h, grad_weight)
        ctx.weight_dtype = weight.dtype  # under FSDP, bf16: the gradient of a bf16 weight
        return loss

    @staticmethod
    @once_differentiable  # its gradients are computed in forward: they have no graph to differentiate again
    def backward(ctx, grad_loss):
        grad_h, grad_weight = ctx.saved_tensors
        # scaled in place: a copy would be one more head-sized tensor (a second backward
        # through this graph then fails loudly: autograd sees the saved tensors changed)
        return grad_h.mul_(grad_loss), grad_weight.mul_(grad_loss).to(ctx.weight_dtype), None, None, None, None, None


def chunked_loss(h, weight, targets, chunk: int, dtype: torch.dtype, group=None, vocab_start: int = 0):
    """The summed loss of h (N, C) against targets (N,); with gradients only where autograd
    needs them (evaluation computes the logits' matmul alone, chunk by chunk). group and
    vocab_start: under TP, as over_chunks takes them."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedCrossEntropy.apply(h, weight, targets, chunk, dtype, group, vocab_start)
    if group is not None:  # evaluation under TP: each chunk's softmax over every shard
        return over_chunks(h, weight, targets, chunk, dtype, group, vocab_start, gradients=False)[0]
    w = weight.to(dtype)
    losses = [h.new_zeros((), dtype=torch.float32)]  # (no tokens: a loss of 0)
    for start in range(0, h.shape[0], chunk):
        logits = (h[start:start + chunk].to(dtype) @ w.t()).float()
        losses.append(F.cross_entropy(logits, targets[start:start + chunk], ignore_index=IGNORE_INDEX, reduction="sum"))
    return torch.stack(losses).sum()
