"""Atomic file writes and the outputs commands write: the one place the framework replaces a file or a directory,
so that a crash leaves the old or the new one and nothing a user wrote is lost.

A command that writes a directory (export, import_hf, data.tokenizer, checkpoint convert, evaluate, analyze) marks
it as its own (``.written_by.json``); :func:`check_output` refuses, before any work, an output that overlaps one of
its inputs, lies in a run or a checkpoint, or holds files the command did not write (unless ``--force``, which then
moves them aside), and :func:`replace_directory` swaps a finished directory in, never deleting one it did not write.

Standard library only, so every package (``data``, ``diff_transformer.*``, ``launch``) may import it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Iterable, Optional, Sequence


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


def move_aside(path: str, suffix: str) -> str:
    """Rename ``path`` to ``path + suffix`` (``.2``, ``.3``, ... appended while that exists); returns the new path."""
    target, n = path.rstrip("/") + suffix, 1
    while os.path.exists(target):
        n += 1
        target = f"{path.rstrip('/')}{suffix}.{n}"
    os.rename(path, target)
    return target


def old_suffix() -> str:
    """The suffix of something moved aside to make room: ``.old-<time>``."""
    return time.strftime(".old-%Y%m%d-%H%M%S")


# ------------------------------------------------------------------------------------------------------------------
# The outputs of commands
# ------------------------------------------------------------------------------------------------------------------
OUTPUT_MARKER = ".written_by.json"  # {"command": ..., "written_at": ...}: the directory is that command's output
# What marks a directory as a training run or a checkpoint (the names metrics, run_directory and checkpoint_files use)
RUN_ENTRIES = ("metrics.jsonl", "run.json", "train.log", ".hydra")
CHECKPOINT_ENTRIES = ("trainer_state.json", "latest")


def directory_writer(path: str) -> Optional[str]:
    """The command whose output directory ``path`` is (its marker), or None."""
    try:
        with open(os.path.join(path, OUTPUT_MARKER)) as f:
            return str(json.load(f)["command"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def training_artifact(path: str) -> Optional[str]:
    """"a run directory" or "a checkpoint" when ``path`` is one, else None."""
    if not os.path.isdir(path):
        return None
    if any(os.path.exists(os.path.join(path, name)) for name in CHECKPOINT_ENTRIES):
        return "a checkpoint"
    if any(os.path.exists(os.path.join(path, name)) for name in RUN_ENTRIES):
        return "a run directory"
    return None


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def check_output(out: str, inputs: Sequence[str] = (), command: str = "", force: bool = False,
                 directory: bool = True, option: str = "--out") -> None:
    """Refuse (ValueError naming the path and what would be right) an output that would lose what is there: a path
    under a regular file, a file where a directory goes (or the reverse), an output that is, holds or lies inside one
    of ``inputs``, one that is or lies inside a run directory or a checkpoint it did not write, and a non-empty
    directory that ``command`` did not write (unless ``force``: :func:`replace_directory` then moves it aside).
    Cheap and standard library only: commands call it before any work."""
    real = os.path.realpath(out)
    probe = os.path.dirname(real)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{option} {out}: {probe} is a file, not a directory; give a path in a directory")
    if os.path.exists(real) and directory and not os.path.isdir(real):
        raise ValueError(f"{option} {out} is a file; give a directory (new or empty) to write into")
    if os.path.isdir(real) and not directory:
        raise ValueError(f"{option} {out} is a directory; give the path of the file to write")
    for given in inputs:
        source = os.path.realpath(given)
        if real == source:
            how = "is"
        elif _inside(real, source):
            how = "lies inside"
        elif _inside(source, real):
            how = "holds"
        else:
            continue
        raise ValueError(f"{option} {out} {how} the input {given}: writing it would destroy what it reads; give an "
                         "output outside the inputs")
    ours = os.path.isdir(real) and directory_writer(real) == command
    parent = real if not ours else os.path.dirname(real)
    while True:
        what = training_artifact(parent)
        if what is not None:
            where = "is" if parent == real else f"lies inside {parent},"
            raise ValueError(f"{option} {out} {where} {what}; writing there would mix with or replace it: give a "
                             "directory outside runs and checkpoints")
        if os.path.dirname(parent) == parent:
            break
        parent = os.path.dirname(parent)
    if directory and os.path.isdir(real) and not ours and os.listdir(real) and not force:
        names = sorted(os.listdir(real))
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(f"{option} {out} holds files this command did not write ({shown}); give a new or empty "
                         f"directory, or add --force to move them aside (to {out.rstrip('/')}.old-<time>)")
    if not directory and os.path.isfile(real) and not force:
        raise ValueError(f"{option} {out} exists; give a new path, or add --force to replace it")


def check_writable(path: str, what: str) -> None:
    """Refuse (ValueError naming ``what`` and why) a directory this process could not create or write files in,
    by trying: a probe file created and removed in it, or in its nearest existing parent when it does not exist."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{what}={path} lies under {probe}, a file, not a directory; give a directory path")
    try:
        fd, name = tempfile.mkstemp(prefix=".write-probe-", dir=probe)
        os.close(fd)
        os.remove(name)
    except OSError as err:
        where = "it" if probe == os.path.abspath(path) else f"{probe}, where it would be created"
        raise ValueError(f"{what}={path} is not writable: cannot create a file in {where} "
                         f"({err.strerror or err}); give a directory you can write to") from None


def staging_directory(target: str) -> str:
    """A new empty directory beside ``target`` to write its replacement in (then :func:`replace_directory`)."""
    target = os.path.abspath(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=os.path.dirname(target))


def replace_directory(staging: str | os.PathLike, target: str | os.PathLike, command: str) -> Optional[str]:
    """Put the finished directory ``staging`` (a sibling of ``target``) in place of ``target`` as ``command``'s
    output: its files fsynced, the renames made durable. An earlier output of ``command`` (or an empty directory) is
    replaced; anything else there is moved aside to ``<target>.old-<time>``, whose path is returned, never deleted."""
    staging, target = os.fspath(staging), os.fspath(target)
    atomic_write_json(os.path.join(staging, OUTPUT_MARKER),
                      {"command": command, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    for name in os.listdir(staging):
        path = os.path.join(staging, name)
        if os.path.isfile(path):
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    kept, old = None, None
    if os.path.lexists(target):
        if os.path.isdir(target) and (directory_writer(target) == command or not os.listdir(target)):
            old = move_aside(target, f".replaced-{os.getpid()}")  # removed once the new one is in place
        else:
            kept = move_aside(target, old_suffix())
    os.rename(staging, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return kept
