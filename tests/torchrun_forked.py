"""`python tests/torchrun_forked.py [torchrun's flags] SCRIPT ARGS`: torchrun, with its ranks
forked from this process after it imported torch, datasets and torch's compiler once, instead
of each rank importing them anew: 6 s of CPU a rank on a 2-core machine, most of what a short
test run costs. It is torchrun itself (torch.distributed.run: its flags, rendezvous, agent
store, environment and failure handling), given two of its own flags: --run-path (each rank runs
SCRIPT with runpy, as `python SCRIPT ARGS` would) and --start-method fork.

For the tests whose subject is what a run trains or saves. A test about the launch itself (a
signal, a killed, failing or hung rank, torchrun's restarts) starts the real torchrun, as a user
does (conftest.run_script)."""

import os
import sys

# What every rank imports, imported once, here (and in tests/fork_server.py, which imports this
# module). Ours (data, model, training) is left to each rank, as the script's own imports.
import datasets  # noqa: F401
import tokenizers  # noqa: F401
import torch._dynamo  # noqa: F401  (torch.optim imports it on the first optimizer)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
from torch.distributed.run import main

if __name__ == "__main__":
    # the trainer's modules first on sys.path, as `python train_ddp.py` puts its folder (each
    # wrapper and tool in a folder below inserts the root itself)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    main(["--run-path", "--start-method", "fork", *sys.argv[1:]])
