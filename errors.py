"""Errors the user can fix, and how they are shown: one line on stderr, never a traceback."""


class UsageError(ValueError):
    """Bad input the user can fix (flags, data, files): the scripts print it as one line
    on stderr and exit with status 2, before anything is overwritten."""


class RankError(UsageError):
    """An error that only this rank meets (it stopped waiting for the others): this rank
    prints it, whatever its number."""


def first_line(e: BaseException) -> str:
    """The first line of the innermost cause: "JSON parse error ... in row 1", not the
    wrapper's "An error occurred while generating the dataset"."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
