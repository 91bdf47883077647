"""What every command line shares: a user error is one ``error:`` line on stderr and exit status 2, never a
traceback, and the exit statuses are the same everywhere.

Standard library only, so that every entry point (``train.py``, ``data.*``, ``launch.*``, ``diff_transformer.*``)
refuses bad input before it imports torch or megatron-core.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Optional, Sequence

EXIT_COMPLETED = 0
EXIT_FAILURE = 1  # a crash, a full disk during a save, a diverged run
EXIT_REFUSED = 2  # bad input, refused before any expensive work; nothing written is lost
# stopped by a signal after saving a checkpoint: rerunning the same command resumes (sysexits' EX_TEMPFAIL, "try
# again later"); a job that requeued itself under SLURM exits 0 instead, so that SLURM does not count it as failed
EXIT_STOPPED_RESUMABLE = 75

# Errors that mean the input was wrong (a value, a path, a file's contents), not that the program failed.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def error_text(err: BaseException) -> str:
    """The message of ``err`` on one line; an OSError reads as "<what>: <file>" rather than "[Errno 2] ..."."""
    if isinstance(err, OSError) and err.strerror and err.filename:
        text = f"{err.strerror}: {err.filename}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def print_error(err: BaseException | str) -> None:
    message = err if isinstance(err, str) else error_text(err)
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (with where to find the usage) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print_error(f"{message} (usage: {self.prog} --help)")
        sys.exit(EXIT_REFUSED)


def run(main: Callable[[Optional[Sequence[str]]], Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """``main(argv)``'s status (None counts as 0), with a user error reported as one line and status 2."""
    try:
        return main(argv) or EXIT_COMPLETED
    except USER_ERRORS as err:
        print_error(err)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130
