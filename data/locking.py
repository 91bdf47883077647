"""File locks: one shared by processes that prepare the same data (torchrun ranks, pytest workers, two CLI runs),
waited for; and one that a process holds for its lifetime to own something (a run directory), refused to others with
the holder's name. Both are OS locks (flock), released by the kernel when the process dies.

A held lock belongs to the process that took it, not to its children: its descriptor is closed on exec, and a forked
child closes its copy at once (a flock lives as long as any descriptor of it, so a child that outlived a killed
holder would keep the lock). A lock whose recorded holder is a process of this host that no longer exists is taken
over, whoever still has the file open."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import weakref
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


_HELD: "weakref.WeakSet[HeldLock]" = weakref.WeakSet()  # this process's held locks, closed in a forked child


class HeldLock:
    """An exclusive lock taken by :func:`hold_lock`; :meth:`release` gives it up (and removes the lock file)."""

    def __init__(self, path: str, fd: int, owner: Dict[str, Any]):
        self.path, self._fd, self.owner = path, fd, owner
        _HELD.add(self)

    def _forget_in_child(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)  # the child's copy only: the parent's descriptor keeps the lock
        self._fd = None

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                os.unlink(self.path)  # while still held: a process that opened it before tries again (hold_lock)
        os.close(self._fd)
        self._fd = None


def _close_held_locks_in_child() -> None:
    for lock in list(_HELD):
        if lock._fd is not None:
            lock._forget_in_child()
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_locks_in_child)


def _read_holder(fd: int) -> Dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def this_process() -> Dict[str, Any]:
    """What a lock's owner record says about the process: its host, pid and pid namespace (two containers can
    share a host name and a disk, not their pids)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace()}


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def holder_is_gone(holder: Dict[str, Any]) -> bool:
    """Whether ``holder`` (a lock's owner record, :func:`this_process`) names a process of this host and pid
    namespace that has exited (or is a zombie)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    if holder.get("pid_ns", _pid_namespace()) != _pid_namespace():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _remove_stale_lock_file(path: str, fd: int) -> None:
    """Unlink the lock file ``fd`` opened, if it is still the one at ``path`` (under a lock on its directory, so
    that two processes taking over the same stale lock cannot remove each other's new one)."""
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)
    finally:
        os.close(directory)


def hold_lock(path: str, owner: Dict[str, Any]) -> HeldLock:
    """Take the exclusive lock of `path` (created if absent) without waiting and write ``owner`` into it; raise
    LockHeld naming the holder when another process has it. A lock still held by someone but recorded by a process
    of this host that has exited (a child of a killed holder keeps the file open, say) is taken over."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if holder_is_gone(holder):
                _remove_stale_lock_file(path, fd)
                os.close(fd)
                continue
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
