"""Tensor parallelism (training/tensor_parallel.py): the model split over 2 gloo ranks computes
the loss and the gradients of the model whole, within the rounding floor measured in the same
run; what it cannot split is one line naming the flag."""

import os
import time

import pytest
import torch

from model import LlamaConfig
from training import tensor_parallel
from training.errors import UsageError

CONFIG = dict(vocab_size=96, max_position_embeddings=64, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _distances(model, reference, tp_loss, ref_loss) -> tuple[float, float]:
    """(|loss difference| relative, max |gradient difference|) of the split model from the whole one."""
    grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, q.grad)
             for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
    return abs(tp_loss - ref_loss) / abs(ref_loss), max((a - b).abs().max().item() for a, b in grads)


def plain_vocabulary_parallel_loss(head, h, targets):
    """The plain formulation tensor_parallel.vocabulary_parallel_loss replaces: the logits of this
    rank's V/tp rows of the vocabulary, all at once, and torch's loss_parallel over their shards."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import loss_parallel
    from model import IGNORE_INDEX
    logits = F.linear(h.redistribute(placements=[Replicate()]).flatten(0, -2), head.weight)  # Shard(-1)
    with loss_parallel():  # the targets a DTensor too: backward runs outside this context
        targets = DTensor.from_local(targets.flatten(), logits.device_mesh, [Replicate()])
        loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.full_tensor()


def _worker(rank, store_path, results, case):
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from model import IGNORE_INDEX, LlamaForPretraining
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        whole = LlamaForPretraining(LlamaConfig(**CONFIG))
        reordered, split = copy.deepcopy(whole), copy.deepcopy(whole)
        tensor_parallel.parallelize(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        if case == "chunked":  # 64 tokens in 13 chunks, each chunk's softmax over both shards
            split.lm_head.chunk_tokens = 5
        if case == "plain-loss":
            split.lm_head.parallel_loss = plain_vocabulary_parallel_loss
        packed = case == "packed"
        x = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
        y = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
        y[1, 9:] = IGNORE_INDEX  # a padded row: its pads have no target
        # packed rows (--pack): windows of 5, 7 and 4 positions, each attending to itself alone
        position_ids = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]).expand(4, 16) if packed else None
        losses, evaluated = {}, {}
        for name, model in (("whole", whole), ("split", split)):
            with torch.no_grad():  # evaluation: the loss alone (the chunked loss's other path)
                evaluated[name] = model(x, y, position_ids)[0].sum().item()
            loss_sum, n = model(x, y, position_ids)
            (loss_sum.sum() / n.sum()).backward()
            losses[name] = (loss_sum.sum() / n.sum()).item()
        # the floor: the whole model again, its batch as two micro-batches (another summation order)
        halves = [reordered(x[rows], y[rows], None if position_ids is None else position_ids[rows])
                  for rows in (slice(2, 4), slice(0, 2))]
        total = sum(n.sum() for _, n in halves)
        sum(loss_sum.sum() for loss_sum, _ in halves).div(total).backward()
        reordered_loss = sum(loss_sum.sum() for loss_sum, _ in halves).div(total).item()
        largest = max(p.grad.abs().max().item() for p in whole.parameters())
        eps = torch.finfo(torch.float32).eps
        floor_loss, floor_grad = _distances(reordered, whole, reordered_loss, losses["whole"])
        floor = (max(floor_loss, eps), max(floor_grad, eps * largest))
        loss, grad = _distances(split, whole, losses["split"], losses["whole"])
        loss = max(loss, abs(evaluated["split"] - evaluated["whole"]) / evaluated["whole"])
        results.put((rank, (loss, grad), floor))
    except BaseException as e:  # reported, so that the test fails instead of waiting for a result
        results.put((rank, repr(e), None))
    results.close()
    results.join_thread()  # the result is in the pipe before os._exit, which would drop it
    os._exit(0)  # (no teardown of gloo: see test_speed.py's DDP worker)


@pytest.mark.parametrize("case", ["padded", "packed", "chunked", "plain-loss"])
def test_the_model_split_over_two_ranks_computes_the_whole_models_loss_and_gradients(tmp_path, case):
    """q, k, v, gate, up split by columns, o, down by rows, the norms along the sequence, the LM
    head by the vocabulary with the loss over its shards: on every rank the loss and every
    gradient (gathered whole) equal the unsplit model's within 20 times the floor (the same
    model on the same batch as two micro-batches), a padded row's pads ignored, packed rows'
    windows apart (each rank's heads under the windows' mask), in training and evaluation; with
    the loss in many chunks, and in its plain formulation (loss_parallel). A plan that
    passed the LM head its input alone (a module plan's hooks do) would drop the targets."""
    import torch.multiprocessing as mp
    results = mp.get_context("spawn").Queue()
    workers = mp.start_processes(_worker, args=(str(tmp_path / "store"), results, case), nprocs=2, join=False,
                                 start_method="spawn")
    got = dict((rank, (distances, floor)) for rank, distances, floor in (results.get(timeout=300),
                                                                           results.get(timeout=300)))
    deadline = time.monotonic() + 60
    while not workers.join(timeout=1):  # True once both exited; raises if one failed
        assert time.monotonic() < deadline, "a worker did not exit"
    for rank, (distances, floor) in got.items():
        assert floor is not None, distances  # the worker's error
        (loss, grad), (floor_loss, floor_grad) = distances, floor
        print(f"rank {rank}: loss {loss:.1e} (floor {floor_loss:.1e}), gradients {grad:.1e} (floor {floor_grad:.1e})")
        assert loss <= 20 * floor_loss and grad <= 20 * floor_grad


@pytest.mark.parametrize("change, tp, said", [
    ({}, 3, "--tp 3: the model's 4 attention heads do not split into 3 equal shares; choose a --tp that divides 4, "
            "or another --model"),
    ({"num_attention_heads": 8}, 4, "--tp 4: the model's 2 key/value heads do not split into 4 equal shares; "
                                     "choose a --tp that divides 2, or another --model"),
    ({"intermediate_size": 129}, 2, "--tp 2: the model's 129 MLP hidden units (intermediate_size) do not split "
                                    "into 2 equal shares; choose a --tp that divides 129, or another --model"),
    ({"vocab_size": 97}, 2, "--tp 2: the model's 97 vocabulary entries do not split into 2 equal "
                            "shares; choose a --tp that divides 97, or a --vocab-size that 2 divides"),
])
def test_a_model_tp_cannot_split_is_one_line_naming_what(change, tp, said):
    """torch's own words for n_kv_heads 2 at TP 4: "shape '[2, 16, -1, 16]' is invalid"."""
    with pytest.raises(UsageError) as refused:
        tensor_parallel.check_model(LlamaConfig(**{**CONFIG, **change}), tp)
    assert str(refused.value) == said


def test_a_layout_tp_cannot_split_is_one_line_naming_the_flag():
    tensor_parallel.check_layout(2, seq_len=32, world_size=4)  # (dp 2, tp 2)
    for kwargs, said in (
            ({"tp": 2, "seq_len": 33, "world_size": 4}, "--tp 2: --seq-len 33 does not split into 2 equal parts, as "
             "sequence parallelism splits each row's positions; choose a --seq-len that --tp divides"),
            ({"tp": 2, "seq_len": 32, "world_size": 3}, "--tp 2 does not divide the 3 ranks: each tensor-parallel "
             "group is --tp ranks, and the ranks are whole groups")):
        with pytest.raises(UsageError) as refused:
            tensor_parallel.check_layout(**kwargs)
        assert str(refused.value) == said


def test_a_torch_that_cannot_compile_tp_is_one_line_with_compile_alone(monkeypatch):
    """torch 2.12 and 2.13 fail in their compiled DTensor wrapper: refused there, and there alone."""
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    with pytest.raises(UsageError):
        tensor_parallel.check_layout(2, seq_len=32, world_size=2, compile=True)
    monkeypatch.setattr(torch, "__version__", "2.12.0+cu130")
    tensor_parallel.check_layout(2, seq_len=32, world_size=2)  # eager: fine
    tensor_parallel.check_layout(1, seq_len=32, world_size=2, compile=True)  # no TP: fine
    with pytest.raises(UsageError) as refused:
        tensor_parallel.check_layout(2, seq_len=32, world_size=2, compile=True)
    assert str(refused.value) == ("--compile with --tp 2: torch 2.12.0+cu130 cannot compile tensor-parallel layers "
                                  "(docs/tp.md); leave --compile out, or use another torch")
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    tensor_parallel.check_layout(2, seq_len=32, world_size=2, compile=True)
