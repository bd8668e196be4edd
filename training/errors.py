"""What the user is told: errors they can fix (one line on stderr, never a traceback) and
warnings, each said once, by the process that speaks for the job."""

import argparse
import math
import os
import sys

import torch.distributed as dist


class UsageError(ValueError):
    """Bad input the user can fix (flags, data, files): the scripts print it as one line
    on stderr and exit with status 2, before anything is overwritten."""


class RankError(UsageError):
    """An error that only this rank meets (it stopped waiting for the others): this rank
    prints it, whatever its number."""


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, allow_abbrev=False, **kwargs):  # "--mode" is no flag, not --model guessed
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message):  # one line, not argparse's usage block
        raise UsageError(message)


def path_argument(value: str) -> str:
    """argparse's type for a path argument: an empty one (an unset variable in a job script)
    is refused, never taken as the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable in a job script?)")
    return value


def at_least(minimum, kind=int):
    """argparse's type for a number of `kind` (int, or float: finite) of at least `minimum`:
    a benchmark given 0 nodes, -3 micro-steps or 0 tokens a row would divide by zero, print
    negative gigabytes, or fail after minutes of preparation."""
    def number(value: str):
        try:
            parsed = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'a whole number' if kind is int else 'a number'}, "
                                             f"got {value!r}") from None
        if not (parsed >= minimum and math.isfinite(parsed)):
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return parsed
    number.__name__ = f"{kind.__name__} of at least {minimum}"
    return number


def first_line(e: BaseException) -> str:
    """The first line of the innermost cause: "JSON parse error ... in row 1", not the
    wrapper's "An error occurred while generating the dataset"."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip() or type(e).__name__
    if text.startswith("Weights only load failed"):
        # torch.load's refusal of a file that holds more than tensors and plain values. Its
        # first line advises loading again with weights_only=False, which would run whatever
        # code the file holds: never passed on. What it refused is on a later line.
        found = [line.strip() for line in text.splitlines() if "unsupported" in line.lower()]
        return "refused: it holds more than tensors and plain values" + (f" ({found[0]})" if found else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines[0].endswith(":") and len(lines) > 1:  # "Error(s) in loading state_dict for X:", the error below it
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def is_rank0() -> bool:
    """Rank 0 of a job, or a plain `python` run: the process that speaks. Only processes that
    really belong to a job keep quiet: members of a process group, and torchrun's workers
    before it starts. A stray RANK variable in a plain run silences nothing."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        return os.environ.get("RANK", "0") == "0"
    return True


def warn(message: str):
    if is_rank0():
        print(f"warning: {message}", file=sys.stderr)
