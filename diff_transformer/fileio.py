"""Atomic file writes and the outputs commands write: the one place the framework replaces a file or a directory,
so that a crash leaves the old or the new one and nothing a user wrote is lost.

A command that writes a directory (export, import_hf, data.tokenizer, checkpoint convert, evaluate, analyze) marks
it as its own (``.written_by.json``); :func:`check_output` refuses, before any work, an output that overlaps one of
its inputs, lies in a run or a checkpoint, or holds files the command did not write (unless ``--force``, which then
moves them aside), and :func:`replace_directory` swaps a finished directory in, never deleting one it did not write.
No write goes through a symbolic link: files are written new and renamed into place (a link there is replaced), and
:func:`check_no_links` refuses a link where a command opens a file or makes a directory in place.

Standard library only, so every package (``data``, ``diff_transformer.*``, ``launch``) may import it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from typing import IO, Any, Callable, Iterable, Optional, Sequence


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
    _atomic_write(path, "w", lambda f: f.writelines(lines))


def atomic_write_bytes(path: str, data: bytes) -> None:
    _atomic_write(path, "wb", lambda f: f.write(data))


def atomic_write_binary(path: str, write: Callable[[IO], Any]) -> None:
    """``write(f)`` into a binary file that replaces ``path`` once complete (e.g. ``torch.save(obj, f)``)."""
    _atomic_write(path, "wb", write)


def _atomic_write(path: str, mode: str, write: Callable[[IO], Any]) -> None:
    """``write`` to a new same-directory temporary file, fsynced, then renamed over ``path``. A symbolic link at
    ``path`` is replaced, never written through (exclusive creation also refuses a link planted at the temporary
    name); the file gets the mode any new file of the user's gets (its umask)."""
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with open(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
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


def name_some(names: Sequence[str], limit: int) -> str:
    """The first ``limit`` of ``names``, and how many more there are: what a refusal shows of a directory."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


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


def check_outside_training(out: str, real: str, start: str, option: str = "--out") -> None:
    """Refuse (ValueError) an output ``out`` (resolved: ``real``) when ``start`` (``real`` or a directory above it)
    or a directory above that is a run directory or a checkpoint: what a command writes there would mix with a run's
    files or replace them."""
    parent = start
    while True:
        what = training_artifact(parent)
        if what is not None:
            where = "is" if parent == real else f"lies inside {parent},"
            raise ValueError(f"{option} {out} {where} {what}; writing there would mix with or replace it: give a "
                             "directory outside runs and checkpoints")
        if os.path.dirname(parent) == parent:
            return
        parent = os.path.dirname(parent)


def check_no_links(paths: Iterable[str], out: str, option: str = "--out") -> None:
    """Refuse (ValueError) a symbolic link at a path a command would open for writing or create a directory at:
    it would write through the link to a file or a directory outside its output."""
    for path in paths:
        if os.path.islink(path):
            raise ValueError(f"{option} {out}: {path} is a symbolic link (to {os.readlink(path)}); writing through it "
                             "would change files outside the output: remove the link, or give another output")


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
    check_outside_training(out, real, real if not ours else os.path.dirname(real), option)
    if directory and os.path.isdir(real) and not ours and os.listdir(real) and not force:
        names = sorted(os.listdir(real))
        shown = name_some(names, 4)
        raise ValueError(f"{option} {out} holds files this command did not write ({shown}); give a new or empty "
                         f"directory, or add --force to move them aside (to {out.rstrip('/')}.old-<time>)")
    if not directory and os.path.lexists(out) and not force:
        link = f" (a symbolic link to {os.readlink(out)}: --force replaces the link, not its target)" \
            if os.path.islink(out) else ""
        raise ValueError(f"{option} {out} exists{link}; give a new path, or add --force to replace it")


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


def current_umask() -> int:
    """This process's umask (read without changing it where Linux shows it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def staging_directory(target: str) -> str:
    """A new empty directory beside ``target`` to write its replacement in (then :func:`replace_directory`), with
    the mode of any directory the user creates (mkdtemp's 0700 would hide the output from the group)."""
    target = os.path.abspath(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=os.path.dirname(target))
    os.chmod(staging, 0o777 & ~current_umask())
    return staging


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
        if os.path.islink(old):  # ``target`` was a link to an earlier output: the link goes, what it named stays
            os.unlink(old)
        else:
            shutil.rmtree(old, ignore_errors=True)
    return kept
