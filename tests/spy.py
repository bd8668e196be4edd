"""Record what a training run's arithmetic really was, so that a test can tell a flag took
effect and was not silently ignored (every loss would still fall):
    matmul_dtypes    the dtypes the Linear layers' outputs came out in, seen by a forward hook
                     on every module, and the one the chunked loss computes the LM head's
                     matmuls in (left out under --compile, whose graphs would trace it)
    compiled_graphs  how many graphs torch.compile built (torch._dynamo's own count)
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

    from training import chunked_loss
    real_chunked_loss = chunked_loss.chunked_loss

    def record_loss_dtype(h, weight, targets, chunk, dtype):  # the LM head's three matmuls run in dtype
        dtypes.add(str(dtype).removeprefix("torch."))
        return real_chunked_loss(h, weight, targets, chunk, dtype)

    graphs_before = _graphs_built()
    hook = None if compiled else torch.nn.modules.module.register_module_forward_hook(record_dtype)
    chunked_loss.chunked_loss = record_loss_dtype
    try:
        yield
    finally:
        chunked_loss.chunked_loss = real_chunked_loss
        if hook is not None:
            hook.remove()
        with open(os.path.join(spy_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump({"matmul_dtypes": sorted(dtypes), "compiled_graphs": _graphs_built() - graphs_before}, f)


if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    with recording(os.environ["SPY_DIR"], compiled="--compile" in sys.argv):
        runpy.run_path(sys.argv[0], run_name="__main__")
