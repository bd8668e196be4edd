"""Run a script (argv[1:]) and record every file this process creates, opens for writing,
renames, links or deletes under $WATCH_DIR, and every folder it makes or removes: Python's
audit hooks see open, os.rename/os.replace, os.link, os.remove, os.mkdir, os.rmdir and
shutil.rmtree; torch.save and Tokenizer.save, which write from C++ and Rust without an
audit event, are wrapped. The list goes to $WRITE_LOG_DIR/rank<RANK>.txt. Used to prove
which rank writes what (test_only_rank_0_writes_files; the two-node test proves it at the
OS level for DDP, from an output folder of each node's own)."""

import os
import runpy
import sys

watched = os.path.realpath(os.environ["WATCH_DIR"])
log = os.path.join(os.environ["WRITE_LOG_DIR"], f"rank{os.environ.get('RANK', '0')}.txt")
writes = []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def inside(path):
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False  # a file descriptor
    path = os.path.realpath(os.fsdecode(path))
    return path == watched or path.startswith(watched + os.sep)


def hook(event, args):
    if event == "open" and inside(args[0]):
        mode, flags = args[1], args[2]
        if (mode and any(c in mode for c in "wax+")) or (not mode and flags & WRITE_FLAGS):
            writes.append(f"open {args[0]}")
    elif event in ("os.rename", "os.link") and (inside(args[0]) or inside(args[1])):
        writes.append(f"{event} {args[0]} -> {args[1]}")
    elif event in ("os.remove", "os.mkdir", "os.rmdir", "os.truncate", "shutil.rmtree", "os.symlink",
                   "os.chmod", "os.utime") and inside(args[0]):
        writes.append(f"{event} {args[0]}")


def recording(save, path_arg):
    """save(...) that first records the path it writes to (argument number path_arg), if any."""
    def wrapped(*args, **kwargs):
        target = args[path_arg] if len(args) > path_arg else None
        if inside(target):
            writes.append(f"{save.__qualname__} {target}")
        return save(*args, **kwargs)
    return wrapped


import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

torch.save = recording(torch.save, 1)  # torch.save(obj, path): a path is written from C++
Tokenizer.save = recording(Tokenizer.save, 1)  # Tokenizer.save(self, path), from Rust


sys.addaudithook(hook)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:  # not atexit: a rank forked by tests/torchrun_forked.py ends without running it
    with open(log, "w") as f:
        f.write("".join(w + "\n" for w in writes))
