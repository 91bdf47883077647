"""File locks: one shared by processes that prepare the same data (torchrun ranks, pytest workers, two CLI runs),
waited for; and one that a process holds for its lifetime to own something (a run directory), refused to others with
the holder's name. Both are OS locks (flock), released by the kernel when the process dies."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from typing import Any, Dict, Iterator


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if absent); the kernel releases it if the process dies.
    A symbolic link at `path` is refused (ValueError), not followed to create or open a file elsewhere."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if os.path.islink(path):
            raise ValueError(f"lock file {path} is a symbolic link (to {os.readlink(path)}); remove it") from err
        raise
    with open(fd, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` is what it wrote about itself (empty if unreadable)."""

    def __init__(self, path: str, holder: Dict[str, Any]):
        super().__init__(f"{path} is locked by {holder or 'another process'}")
        self.path, self.holder = path, holder


class HeldLock:
    """An exclusive lock taken by :func:`hold_lock`; :meth:`release` gives it up (and removes the lock file)."""

    def __init__(self, path: str, fd: int, owner: Dict[str, Any]):
        self.path, self._fd, self.owner = path, fd, owner

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                os.unlink(self.path)  # while still held: a process that opened it before tries again (hold_lock)
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> Dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def hold_lock(path: str, owner: Dict[str, Any]) -> HeldLock:
    """Take the exclusive lock of `path` (created if absent) without waiting and write ``owner`` into it; raise
    LockHeld naming the holder when another process has it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockHeld(path, holder) from None
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # locked a file its holder removed on release: lock the one at `path` now
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(owner) + "\n").encode("utf-8"))
    return HeldLock(path, fd, owner)
