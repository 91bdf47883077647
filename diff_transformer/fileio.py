"""Atomic file writes: the one place the framework replaces a file so that a crash leaves the old or the new one.

Standard library only, so every package (``data``, ``diff_transformer.*``, ``launch``) may import it.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable


def fsync_dir(path: str) -> None:
    """Flush a directory entry (a rename or a new file in it) to disk."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a same-directory temporary file, fsynced, then renamed over it."""
    atomic_write_lines(path, [text])


def atomic_write_lines(path: str, lines: Iterable[str]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def atomic_write_json(path: str, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2) + "\n")


def replace_directory(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the finished directory ``staging`` (a sibling of ``target``) in place of ``target``: its files fsynced,
    whatever ``target`` held removed, the rename made durable."""
    for name in os.listdir(staging):
        path = os.path.join(staging, name)
        if os.path.isfile(path):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    if os.path.exists(target):
        shutil.rmtree(target)
    os.rename(staging, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
