"""Run a script (argv[1:]) and record every file this process creates, opens for writing,
renames or deletes under $WATCH_DIR, via Python's audit hooks. The list goes to
$WRITE_LOG_DIR/rank<RANK>.txt. Used to prove that only rank 0 writes to --out-dir."""

import atexit
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
    elif event in ("os.remove", "os.mkdir", "os.truncate") and inside(args[0]):
        writes.append(f"{event} {args[0]}")


@atexit.register
def dump():
    with open(log, "w") as f:
        f.write("".join(w + "\n" for w in writes))


sys.addaudithook(hook)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
