"""Record what a training run's arithmetic really was, so that a test can tell a flag took
effect and was not silently ignored (every loss would still fall):
    matmul_dtypes    the dtypes the Linear layers' outputs came out in, seen by a forward hook
                     on every module, and the one the chunked loss computes the LM head's
                     matmuls in (left out under --compile, whose graphs would trace it)
    compiled_graphs  how many graphs torch.compile built (torch._dynamo's own count)
    all_reduces      how many all-reduces this rank joined, by the size of their group (FSDP's
                     own among them: HSDP all-reduces gradient shards over a group of replicas),
                     and all_reduce_bytes, the bytes of the tensors it handed them
    all_reduce_groups  the ranks of every group of 2 or more that it all-reduced over, each once
    weights_held     the elements of the weights this rank holds (under FSDP, its shards), counted
                     when the optimizer is built over them
    memory_shards    the share of the state the memory check counted this rank holding (memory.Check's
                     shards: 1 for the whole model)
    evaluation_batches  the batches (forwards) of each evaluation this rank ran
    weights_read     the elements this rank read from safetensors files (--init-from a Hugging Face
                     model), whatever it read them with: get_tensor, or a slice of get_slice
written to SPY_DIR/rank<RANK>.json when the run ends. `recording(spy_dir)` does it for a run
in this process; as a script, it runs a training script (argv[1:]) with $SPY_DIR."""

import contextlib
import json
import os
import runpy
import sys

import torch


def _graphs_built() -> int:
    if "torch._dynamo" not in sys.modules:  # imported by torch.compile; a run that never compiled has none
        return 0
    return sys.modules["torch._dynamo"].utils.counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def recording(spy_dir, compiled: bool = False):
    dtypes = set()

    def record_dtype(module, args, output):
        if isinstance(module, torch.nn.Linear) and output.dim() > 0:  # 0-dim: the LM head's loss, not its matmul
            dtypes.add(str(output.dtype).removeprefix("torch."))

    from ops import chunked_loss
    real_chunked_loss = chunked_loss.chunked_loss

    def record_loss_dtype(h, weight, targets, chunk, dtype):  # the LM head's three matmuls run in dtype
        dtypes.add(str(dtype).removeprefix("torch."))
        return real_chunked_loss(h, weight, targets, chunk, dtype)

    all_reduces, all_reduce_bytes, all_reduce_groups = {}, {}, []
    real_all_reduce = torch.distributed.all_reduce

    def count_all_reduce(tensor, *args, group=None, **kwargs):  # FSDP's calls pass their group by name
        size = str(torch.distributed.get_world_size(group))
        all_reduces[size] = all_reduces.get(size, 0) + 1
        all_reduce_bytes[size] = all_reduce_bytes.get(size, 0) + tensor.numel() * tensor.element_size()
        ranks = torch.distributed.get_process_group_ranks(group or torch.distributed.group.WORLD)
        if len(ranks) > 1 and ranks not in all_reduce_groups:
            all_reduce_groups.append(ranks)
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    from training import build, evaluation, memory
    real_optimizer, real_check, real_evaluate = build.optimizer, memory.Check.__call__, evaluation.evaluate
    held, evaluation_batches = {}, []

    def count_weights_held(model, *args, **kwargs):
        held["weights"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        return real_optimizer(model, *args, **kwargs)

    def record_memory_shards(check, *args, **kwargs):
        held["memory_shards"] = check.shards
        return real_check(check, *args, **kwargs)

    def count_evaluation_batches(model, loader, device):
        evaluation_batches.append(len(loader))
        return real_evaluate(model, loader, device)

    import safetensors
    real_safe_open, weights_read = safetensors.safe_open, []

    class Counted:  # a safe_open, or one of its slices, whose reads are counted
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc) if hasattr(self.inner, "__exit__") else None

        def get_slice(self, name):
            return Counted(self.inner.get_slice(name))

        def get_tensor(self, name):
            return self.counted(self.inner.get_tensor(name))

        def __getitem__(self, index):
            return self.counted(self.inner[index])

        def counted(self, tensor):
            weights_read.append(tensor.numel())
            return tensor

    graphs_before = _graphs_built()
    safetensors.safe_open = lambda *args, **kwargs: Counted(real_safe_open(*args, **kwargs))
    hook = None if compiled else torch.nn.modules.module.register_module_forward_hook(record_dtype)
    chunked_loss.chunked_loss = record_loss_dtype
    torch.distributed.all_reduce = count_all_reduce
    build.optimizer, memory.Check.__call__, evaluation.evaluate = count_weights_held, record_memory_shards, \
        count_evaluation_batches
    try:
        yield
    finally:
        chunked_loss.chunked_loss, torch.distributed.all_reduce = real_chunked_loss, real_all_reduce
        safetensors.safe_open = real_safe_open
        build.optimizer, memory.Check.__call__, evaluation.evaluate = real_optimizer, real_check, real_evaluate
        if hook is not None:
            hook.remove()
        with open(os.path.join(spy_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"matmul_dtypes": sorted(dtypes), "compiled_graphs": _graphs_built() - graphs_before,
                       "all_reduces": all_reduces, "all_reduce_bytes": all_reduce_bytes,
                       "all_reduce_groups": sorted(all_reduce_groups), "weights_held": held.get("weights"),
                       "memory_shards": held.get("memory_shards"), "evaluation_batches": evaluation_batches,
                       "weights_read": sum(weights_read)}, f)


if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    with recording(os.environ["SPY_DIR"], compiled="--compile" in sys.argv):
        runpy.run_path(sys.argv[0], run_name="__main__")
