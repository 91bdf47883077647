"""A file lock shared by processes that prepare the same data (torchrun ranks, pytest workers, two CLI runs)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if absent); the kernel releases it if the process dies."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
