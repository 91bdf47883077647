"""One run per directory: what a run directory holds, whether a start may use it, and moving an old run aside.

A start either resumes (``checkpoint.resume=auto`` finds a checkpoint, or ``checkpoint.resume`` names one) or starts
fresh at step 0. A fresh start is refused where a run already is, since its ``metrics.jsonl``, W&B run and
checkpoints would mix with the old ones: in a run directory whose ``metrics.jsonl`` records steps or whose checkpoint
directory holds checkpoints, and in particular where ``metrics.jsonl`` shows progress but the checkpoint directory
(say a ``checkpoint.dir`` pointed elsewhere) holds nothing to resume. ``overwrite_run=true`` moves the old run aside
(``<dir>.old-<time>``) instead. Standard library only: train.py refuses before it imports torch or megatron-core.

A run directory is also locked for the lifetime of the run that uses it (``.run.lock``: an OS lock, so a crash
releases it): a second start there, say the same command launched twice, is refused naming the holder.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from data.locking import HeldLock, LockHeld, hold_lock
from diff_transformer.fileio import atomic_write_text, check_writable, move_aside, old_suffix
from diff_transformer.training.checkpoint_files import (
    CHECKPOINTS_DIRNAME,
    checkpoint_bytes,
    checkpoints_dir,
    ensure_free_space,
    list_checkpoints,
    resolve_checkpoint_path,
)
from diff_transformer.training.metrics import METRICS_FILE, last_logged_step

LOCK_FILE = ".run.lock"
LAUNCH_RECORD_DIR = ".hydra"  # Hydra's record of a launch (config.launch_record), written by the run itself
RESOLVED_CONFIG = "config.yaml"  # the resolved config a run writes once its start-up checks have passed


class RunDirectoryInUse(ValueError):
    """A fresh start refused in a directory that holds a run; the message names what is there and the choices."""


@dataclass
class RunDirectory:
    """What a run directory and its checkpoint directory hold."""

    run_dir: str
    checkpoint_root: str
    last_step: Optional[int] = None  # the last step metrics.jsonl records
    checkpoints: List[Tuple[int, str]] = field(default_factory=list)  # complete ones under checkpoint_root
    other_checkpoints: List[Tuple[int, str]] = field(default_factory=list)  # under <run_dir>/checkpoints, not used

    @property
    def used(self) -> bool:
        return bool(self.last_step) or bool(self.checkpoints) or bool(self.other_checkpoints)

    def describe(self) -> str:
        parts = []
        if self.last_step:
            parts.append(f"{METRICS_FILE} up to step {self.last_step}")
        for found, where in ((self.checkpoints, self.checkpoint_root),
                             (self.other_checkpoints, os.path.join(self.run_dir, CHECKPOINTS_DIRNAME))):
            if found:
                parts.append(f"{len(found)} checkpoint{'s' if len(found) > 1 else ''} in {where} (newest "
                             f"{os.path.basename(found[-1][1])})")
        return "; ".join(parts)


def inspect_run_directory(cfg: Any, run_dir: str) -> RunDirectory:
    root = checkpoints_dir(cfg, run_dir)
    state = RunDirectory(run_dir, root, last_logged_step(os.path.join(run_dir, METRICS_FILE)), list_checkpoints(root))
    default_root = os.path.join(run_dir, CHECKPOINTS_DIRNAME)
    if os.path.realpath(default_root) != os.path.realpath(root):
        state.other_checkpoints = list_checkpoints(default_root)
    return state


def resumes(cfg: Any, state: RunDirectory) -> bool:
    """Whether this start will resume, as far as the files tell before any is verified: an explicit
    ``checkpoint.resume`` path, or ``auto`` with a complete checkpoint under the checkpoint directory."""
    resume = cfg.checkpoint.resume
    return resume not in ("auto", "none") or (resume == "auto" and bool(state.checkpoints))


def recorded_checkpoint_dir(run_dir: str) -> Optional[str]:
    """The checkpoint directory the run in ``run_dir`` wrote to, as its config.yaml records it (None: unknown)."""
    path = os.path.join(run_dir, RESOLVED_CONFIG)
    if not os.path.isfile(path):
        return None
    from omegaconf import OmegaConf

    try:
        recorded = OmegaConf.select(OmegaConf.load(path), "checkpoint.dir")
    except Exception:  # noqa: BLE001 - an unreadable record tells nothing
        return None
    return recorded or os.path.join(run_dir, CHECKPOINTS_DIRNAME)


def write_launch_record(run_dir: str, record: Dict[str, str]) -> None:
    """``.hydra/`` (the record of this launch: composed config, Hydra's config, overrides), replacing an earlier
    launch's."""
    if not record:
        return
    os.makedirs(os.path.join(run_dir, LAUNCH_RECORD_DIR), exist_ok=True)
    for name, text in record.items():
        atomic_write_text(os.path.join(run_dir, LAUNCH_RECORD_DIR, name), text)


def check_disks(cfg: Any, run_dir: str) -> None:
    """The run directory and the checkpoint directory must take files (a read-only mount, a path under a file), and
    a resume needs room for one more checkpoint of the size of the one it resumes: checked at start-up, before torch
    is imported, rather than at the first save (the trainer checks the room again, with the model's size, for a
    fresh start)."""
    check_writable(run_dir, "the run directory hydra.run.dir")
    root = checkpoints_dir(cfg, run_dir)
    check_writable(root, "checkpoint.dir" if cfg.checkpoint.dir else "the checkpoint directory")
    found = list_checkpoints(root)
    if cfg.checkpoint.check_free_space and cfg.checkpoint.resume == "auto" and found:
        ensure_free_space(root, checkpoint_bytes(found[-1][1]), cfg.checkpoint.keep_last)


def check_start(cfg: Any, run_dir: str, will_resume: Optional[bool] = None) -> Optional[RunDirectory]:
    """Refuse (RunDirectoryInUse) a fresh start in a directory that holds a run, naming what is there and the
    choices; returns the directory's state when the start is fresh there under ``overwrite_run=true`` (the caller
    moves the old run aside once every other start-up check has passed), else None. ``will_resume``: the trainer's
    decision once checkpoints are verified; None guesses it from the files (the cheap check before any import)."""
    for key, path in (("checkpoint.resume", cfg.checkpoint.resume), ("checkpoint.load_weights_only",
                                                                     cfg.checkpoint.load_weights_only)):
        if path is not None and path not in ("auto", "none"):
            try:  # a path that names no complete checkpoint: refused, never replaced by another
                resolve_checkpoint_path(path)
            except ValueError as err:
                raise ValueError(f"{key}={path}: {err}") from None
    state = inspect_run_directory(cfg, run_dir)
    if (resumes(cfg, state) if will_resume is None else will_resume) or not state.used:
        return None
    if cfg.overwrite_run:
        return state
    choices = (
        "start the new run in a new directory (hydra.run.dir=NEW), or move the old run aside and start over here "
        "(overwrite_run=true)"
    )
    if cfg.checkpoint.resume == "auto" and not state.checkpoints:
        recorded = recorded_checkpoint_dir(run_dir)
        moved = state.other_checkpoints or (
            recorded is not None and os.path.realpath(recorded) != os.path.realpath(state.checkpoint_root))
        if not moved:  # the run stopped before its first save (a crash, a full disk): nothing to resume
            raise RunDirectoryInUse(
                f"run directory {run_dir} holds a run that saved no checkpoint ({state.describe()}; checkpoint "
                f"directory {state.checkpoint_root} holds none), so there is nothing to resume: start it again from "
                f"step 0 with the same command and overwrite_run=true, which keeps the old run aside as "
                f"{run_dir.rstrip('/')}.old-<time>; or start it in a new directory (hydra.run.dir=NEW)"
            )
        where = f" (its config.yaml records {recorded})" if recorded and not state.other_checkpoints else ""
        raise RunDirectoryInUse(
            f"run directory {run_dir} holds a run ({state.describe()}) but checkpoint directory "
            f"{state.checkpoint_root} holds no checkpoint to resume from; starting at step 0 would mix two runs in "
            f"one directory: if the checkpoints moved, set checkpoint.dir to where they are{where}; or {choices}"
        )
    how = "checkpoint.resume=none" if cfg.checkpoint.resume == "none" else "this start"
    if cfg.checkpoint.load_weights_only:
        how = "checkpoint.load_weights_only (a new run at step 0)"
    raise RunDirectoryInUse(
        f"run directory {run_dir} already holds a run ({state.describe()}); {how} would mix a new run with it: "
        f"resume it (checkpoint.resume=auto), or {choices}"
    )


def move_old_run_aside(state: RunDirectory) -> List[Tuple[str, str]]:
    """Rename the old run's directory (and its checkpoint directory, when it lies elsewhere) to
    ``<name>.old-<time>``, leaving a new, empty run directory, locked by this process when it held the old one's
    lock. Returns (old path, new path) pairs."""
    stamp = old_suffix()
    moved = []
    inside = os.path.realpath(state.checkpoint_root).startswith(os.path.realpath(state.run_dir) + os.sep)
    if state.checkpoints and not inside:
        moved.append((state.checkpoint_root, move_aside(state.checkpoint_root, stamp)))
    if os.path.isdir(state.run_dir):
        relock = _held.get(os.path.realpath(state.run_dir))
        aside = move_aside(state.run_dir, stamp)
        moved.append((state.run_dir, aside))
        os.makedirs(state.run_dir)
        if relock is not None:  # the lock file went aside with the old run: lock the new directory, then let go
            _held[os.path.realpath(state.run_dir)] = hold_lock(os.path.join(state.run_dir, LOCK_FILE), relock.owner)
            relock.release()
            if os.path.exists(os.path.join(aside, LOCK_FILE)):
                os.remove(os.path.join(aside, LOCK_FILE))
    return moved


# ------------------------------------------------------------------------------------------------------------------
# The lock: one run per directory at a time
# ------------------------------------------------------------------------------------------------------------------
_held: dict = {}  # realpath of the run directory -> HeldLock, for this process


def lock_run_directory(run_dir: str) -> HeldLock:
    """Hold the run directory's lock until :func:`release_run_directory` (or the process ends); RunDirectoryInUse
    naming the holder (host, pid, start time) when another run holds it."""
    key = os.path.realpath(run_dir)
    if key in _held:
        return _held[key]
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        lock = hold_lock(os.path.join(run_dir, LOCK_FILE), owner)
    except LockHeld as held:
        h = held.holder
        who = (f"pid {h.get('pid')} on host {h.get('host')}, started {h.get('started')}" if h
               else "another process")
        raise RunDirectoryInUse(
            f"run directory {run_dir} is in use by a run that is still going ({who}): two runs in one directory "
            "would write the same metrics.jsonl and checkpoints; wait for it to end or stop it, or start this run in "
            "a new directory (hydra.run.dir=NEW)"
        ) from None
    except OSError as err:
        raise ValueError(f"cannot lock the run directory {run_dir}: {err.strerror or err}") from None
    _held[key] = lock
    return lock


def release_run_directory() -> None:
    """Give up every run-directory lock this process holds (a run ended, or its start was refused)."""
    while _held:
        _, lock = _held.popitem()
        lock.release()
