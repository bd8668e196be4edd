"""Under torchrun: train_fsdp.shard with layers_kept_gathered 0 (the default), 1 and 2 (the debug
model's every layer), from the same
initial weights and batches (with argv[2] "compile", each layer and the LM head compiled before
sharding, as train_fsdp.py --compile does). Records which units' registered parameters are
gathered (plain tensors, not their DTensor shards) after forward and after backward, then
trains on as train_fsdp.py does (clipping acting, an evaluation forward after each step): the
losses, the gradients' norms, and every weight at the end, gathered whole. Writes what it found
to argv[1] (rank 0) as JSON."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's modules
from train_fsdp import shard  # noqa: E402
from training import build, config, sharded_checkpoint  # noqa: E402

STEPS = 3
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
cfg = config.parse_args(["--model", "debug", "--vocab-size", "300", "--seq-len", "32", "--grad-clip", "0.05"],
                        distributed=True)
generator = torch.Generator().manual_seed(rank)  # this rank's share of each step, the same for both runs
batches = [torch.randint(0, 300, (2, cfg.seq_len + 1), generator=generator) for _ in range(STEPS + 1)]


def units(model) -> dict:
    """Each unit's parameters now: "gathered" or "sharded" (or "mixed"). FSDP registers on the
    module the gathered tensors while it keeps them, and its DTensor shards otherwise."""
    names = {"base_model.embed_tokens", "base_model.norm", "lm_head",
             *(f"base_model.layers.{i}" for i in range(len(model.base_model.layers)))}
    found = {}
    for name, module in model.named_modules():
        if name in names:
            shards = [isinstance(p, DTensor) for p in module.parameters()]
            found[name] = "sharded" if all(shards) else "mixed" if any(shards) else "gathered"
    return found


def trained(layers_kept_gathered: int) -> dict:
    model = build.model(cfg, 300, torch.float32, device="meta")
    if sys.argv[2:] == ["compile"]:
        for block in [*model.base_model.layers, model.lm_head]:
            block.compile()
    shard(model, init_device_mesh("cpu", (world_size,)), torch.float32, layers_kept_gathered)
    model.to_empty(device="cpu")
    build.init_weights(model, cfg)
    optimizer, scheduler = build.optimizer(model, cfg, STEPS)
    found = {"losses": [], "grad norms": []}
    for batch in batches[:STEPS]:
        loss_sum, n_tokens = model(batch[:, :-1], batch[:, 1:])
        found["losses"].append(loss_sum.item())
        found.setdefault("after forward", units(model))
        (loss_sum.sum() / n_tokens.sum()).backward()
        found.setdefault("after backward", units(model))
        grads = [p.grad for p in model.parameters() if p.grad is not None]  # as train_fsdp.py clips
        grad_norm = torch.nn.utils.get_total_norm(grads).full_tensor()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.grad_clip, grad_norm)
        found["grad norms"].append(grad_norm.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # as evaluation: a forward whose gathered units no backward reshards
            model(batches[STEPS][:, :-1], batches[STEPS][:, 1:])
    found["weights"] = sharded_checkpoint.full_model_state(model)  # as model.pt: rank 0's; every rank gathers
    return found


runs = {"plain": trained(0), "kept": trained(1), "all kept": trained(2)}
if rank == 0:
    plain = runs["plain"]["weights"]
    differ = {run: [name for name in plain if not torch.equal(plain[name], found["weights"][name])]
              for run, found in runs.items()}
    found = {run: {key: value for key, value in found.items() if key != "weights"} for run, found in runs.items()}
    Path(sys.argv[1]).write_text(json.dumps({**found, "differ": differ, "weights": len(plain)}))
dist.destroy_process_group()
# Ends here, without the interpreter's shutdown (see tests/fsdp_initial_weights.py: a rank that
# reached it while gloo's threads still freed full_tensor's temporaries could abort).
sys.stdout.flush()
os._exit(0)
