"""What every command line shares: a user error is one ``error:`` line on stderr and exit status 2, never a
traceback, and the exit statuses are the same everywhere.

Standard library only, so that every entry point (``train.py``, ``data.*``, ``launch.*``, ``diff_transformer.*``)
refuses bad input before it imports torch or megatron-core. Importing it hides the libraries' notices
(:func:`quiet_library_notices`): every entry point imports it before any library, so every command is quiet alike.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings
from typing import Callable, NoReturn, Optional, Sequence

EXIT_COMPLETED = 0
EXIT_FAILURE = 1  # a crash, a full disk during a save, a diverged run
EXIT_REFUSED = 2  # bad input, refused before any expensive work; nothing written is lost
# stopped by a signal after saving a checkpoint: rerunning the same command resumes (sysexits' EX_TEMPFAIL, "try
# again later"); a job that requeued itself under SLURM exits 0 instead, so that SLURM does not count it as failed
EXIT_STOPPED_RESUMABLE = 75
EXIT_INTERRUPTED = 130  # Ctrl-C before training started, or a second one during a save (128 + SIGINT)

# Errors that mean the input was wrong (a value, a path, a file's contents), not that the program failed.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


# Third-party notices that tell a user nothing (optional packages not installed, deprecations inside the libraries'
# own calls), by category and the start of the message; every other warning is shown.
LIBRARY_NOTICES = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    (FutureWarning, r"`(load|save)_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
# Loggers whose INFO lines are such notices too (megatron-core's FSDP saying which of its backends it found).
LIBRARY_NOTICE_LOGGERS = ("megatron.core.distributed.fsdp", "megatron_fsdp")


def quiet_library_notices() -> None:
    """Hide :data:`LIBRARY_NOTICES` (also in every process started after, which inherits the filters when forked)
    and the notice loggers' INFO lines, from the console and from train.log."""
    for category, message in LIBRARY_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in LIBRARY_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


# every command line imports this module before torch or megatron-core: one place, so that no command shows the notices
quiet_library_notices()


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


def exit_on_sigint(message: str, speak: bool = True, cleanup: Optional[Callable[[], None]] = None) -> None:
    """Until something else takes SIGINT over: Ctrl-C prints ``error: <message>`` (when ``speak``), runs ``cleanup``
    and exits EXIT_INTERRUPTED at once. Nothing unwinds: an import cut half-way by KeyboardInterrupt fails later in
    confusing ways (or is swallowed, and the command goes on). A forked child (a data loader worker) keeps Python's
    KeyboardInterrupt."""
    owner = os.getpid()

    def interrupted(signum, frame) -> None:
        if os.getpid() != owner:
            raise KeyboardInterrupt
        if speak:
            print_error(message)
        try:
            if cleanup is not None:
                cleanup()
        finally:
            os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, interrupted)


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
        return EXIT_INTERRUPTED
