"""One run per directory: what a run directory holds, whether a start may use it, and moving an old run aside.

A start either resumes (``checkpoint.resume=auto`` finds a checkpoint, or ``checkpoint.resume`` names one) or starts
fresh at step 0. A fresh start is refused where a run already is, since its ``metrics.jsonl``, W&B run and
checkpoints would mix with the old ones: in a run directory whose ``metrics.jsonl`` records steps or whose checkpoint
directory holds checkpoints, and in particular where ``metrics.jsonl`` shows progress but the checkpoint directory
(say a ``checkpoint.dir`` pointed elsewhere) holds nothing to resume. ``overwrite_run=true`` moves the old run aside
(``<dir>.old-<time>``) instead. Standard library only: train.py refuses before it imports torch or megatron-core.

A run directory is also locked for the lifetime of the run that uses it (``.run.lock``: an OS lock, so a crash
releases it): a second start there, say the same command launched twice, is refused naming the holder. So is its
checkpoint directory (its own ``.run.lock``), so that two runs given one ``checkpoint.dir`` cannot run at once; and
``checkpoint.resume=auto`` resumes no checkpoint beyond the steps the run's own ``metrics.jsonl`` records.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from data.locking import HeldLock, LockHeld, hold_lock, this_process
from diff_transformer.fileio import atomic_write_text, check_writable, move_aside, name_some, old_suffix
from diff_transformer.training.checkpoint_files import (
    CHECKPOINTS_DIRNAME,
    check_readable,
    checkpoint_bytes,
    checkpoints_dir,
    ensure_free_space,
    list_checkpoints,
    pointer_problem,
    pointer_target,
    read_trainer_state,
    resolve_checkpoint_path,
)
from diff_transformer.training.metrics import LOG_FILE, METRICS_FILE, last_logged_step

LOCK_FILE = ".run.lock"
LAUNCH_RECORD_DIR = ".hydra"  # Hydra's record of a launch (config.launch_record), written by the run itself
RESOLVED_CONFIG = "config.yaml"  # the resolved config a run writes once its start-up checks have passed


RUN_INFO = "run.json"
# What this framework writes into a run directory (the run, the SLURM launcher, W&B, the profiler): anything else
# there is someone else's, and a fresh start is refused rather than write config.yaml and run.json beside it.
OWN_ENTRIES = (
    LOCK_FILE, LAUNCH_RECORD_DIR, RESOLVED_CONFIG, RUN_INFO, METRICS_FILE, LOG_FILE, CHECKPOINTS_DIRNAME, "wandb",
    "attention_backend.json", "deepspeed_config.json", "code", "submit.sbatch", "launch.json",
)
OWN_PATTERNS = ("slurm-*.out", "profile_step_*.json", ".write-probe-*")


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


def foreign_entries(run_dir: str) -> List[str]:
    """What ``run_dir`` holds that this framework did not write (a config.yaml or run.json counts as its own when
    it reads as the run's: a config with model and trainer sections, a run description with its engine)."""
    try:
        names = sorted(os.listdir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    foreign = []
    for name in names:
        path = os.path.join(run_dir, name)
        if name == RESOLVED_CONFIG and not _reads_as(path, ("model", "trainer")):
            foreign.append(name)
        elif name == RUN_INFO and not _reads_as(path, ("engine",)):
            foreign.append(name)
        elif name not in OWN_ENTRIES and not any(fnmatch.fnmatch(name, p) for p in OWN_PATTERNS):
            foreign.append(name + ("/" if os.path.isdir(path) else ""))
    return foreign


def _reads_as(path: str, keys: Tuple[str, ...]) -> bool:
    """Whether the YAML (or JSON) mapping at ``path`` has every key of ``keys``."""
    try:
        if path.endswith(".json"):
            with open(path) as f:
                content = json.load(f)
        else:
            from omegaconf import OmegaConf

            content = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - whatever cannot be read as ours is not ours
        return False
    return isinstance(content, dict) and all(key in content for key in keys)


def resumes(cfg: Any, state: RunDirectory) -> bool:
    """Whether this start will resume, as far as the files tell before any is verified: an explicit
    ``checkpoint.resume`` path, or ``auto`` with a complete checkpoint under the checkpoint directory."""
    resume = cfg.checkpoint.resume
    return resume not in ("auto", "none") or (resume == "auto" and bool(state.checkpoints))


def check_resume_is_this_runs(run_dir: str, checkpoint: str, step: int) -> None:
    """``checkpoint.resume=auto``: a run logs every step to its metrics.jsonl before it saves that step, so a
    checkpoint beyond the last step logged there (or any, where nothing is logged) was saved by another run that
    shares the checkpoint directory: refused (ValueError naming both steps). Resuming it on purpose is
    ``checkpoint.resume=PATH``."""
    last = last_logged_step(os.path.join(run_dir, METRICS_FILE))
    if step <= (last or 0):
        return
    logged = f"step {last}, the last this run's {METRICS_FILE} in {run_dir} records" if last else (
        f"step 0: this run's {METRICS_FILE} in {run_dir} records no step")
    raise ValueError(
        f"checkpoint {checkpoint} is at step {step}, beyond {logged}; another run saved it into the same checkpoint "
        f"directory, and resuming it would mix two runs: give each run its own checkpoint.dir, or resume that "
        f"checkpoint on purpose (checkpoint.resume={checkpoint})"
    )


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
    decision once checkpoints are verified; None guesses it from the files (the cheap check before any import).
    The checkpoint the start would load is refused here too, before torch is imported, when its format is newer,
    its ``.metadata`` would run code, or (``auto``) it is another run's (:func:`check_resume_is_this_runs`)."""
    to_load = []
    for key, path in (("checkpoint.resume", cfg.checkpoint.resume), ("checkpoint.load_weights_only",
                                                                     cfg.checkpoint.load_weights_only)):
        if path is not None and path not in ("auto", "none"):
            try:  # a path that names no complete checkpoint: refused, never replaced by another
                to_load.append(resolve_checkpoint_path(path))
            except ValueError as err:
                raise ValueError(f"{key}={path}: {err}") from None
    state = inspect_run_directory(cfg, run_dir)
    latest = pointer_target(state.checkpoint_root)
    if cfg.checkpoint.resume == "auto" and latest is not None and pointer_problem(state.checkpoint_root) is None:
        to_load.append(os.path.join(state.checkpoint_root, latest))
        try:
            step = int(read_trainer_state(to_load[-1])["step"])
        except (OSError, ValueError, KeyError, TypeError):
            step = None  # unreadable: verification says so
        if step is not None:  # (the trainer checks again what it then selects)
            check_resume_is_this_runs(run_dir, to_load[-1], step)
    for path in to_load:  # a newer format, a file that would run code: refused before torch is imported
        check_readable(path)
    if (resumes(cfg, state) if will_resume is None else will_resume):
        return None
    if not state.used:
        foreign = foreign_entries(run_dir)
        if foreign:
            shown = name_some(foreign, 5)
            raise RunDirectoryInUse(
                f"run directory {run_dir} holds files this framework did not write ({shown}) and no run: a new run "
                f"there would write {RESOLVED_CONFIG}, {RUN_INFO}, {METRICS_FILE} and checkpoints among them; start "
                "it in a new or empty directory (hydra.run.dir=NEW), or move those files away"
            )
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
    ``<name>.old-<time>``, leaving a new, empty run directory (and checkpoint directory), locked by this process
    where it held the old ones' locks. Returns (old path, new path) pairs."""
    stamp = old_suffix()
    moved = []
    inside = os.path.realpath(state.checkpoint_root).startswith(os.path.realpath(state.run_dir) + os.sep)
    if state.checkpoints and not inside:
        key = os.path.realpath(state.checkpoint_root)
        aside = move_aside(state.checkpoint_root, stamp)
        moved.append((state.checkpoint_root, aside))
        _relock_moved(key, aside)
    if os.path.isdir(state.run_dir):
        key = os.path.realpath(state.run_dir)
        aside = move_aside(state.run_dir, stamp)
        moved.append((state.run_dir, aside))
        os.makedirs(state.run_dir)
        _relock_moved(key, aside)
    return moved


def _relock_moved(old: str, aside: str) -> None:
    """The locks this process held on directory ``old`` (a real path) and those under it went aside with them to
    ``aside``: lock new directories at the old paths, then let the old locks go (their files removed)."""
    for key, lock in sorted(_held.items()):
        if key != old and not key.startswith(old + os.sep):
            continue
        os.makedirs(key, exist_ok=True)
        _held[key] = hold_lock(os.path.join(key, LOCK_FILE), lock.owner)
        lock.release()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(aside + key[len(old):], LOCK_FILE))


# ------------------------------------------------------------------------------------------------------------------
# The lock: one run per directory at a time
# ------------------------------------------------------------------------------------------------------------------
_held: dict = {}  # realpath of a locked run or checkpoint directory -> HeldLock, for this process
_created: List[str] = []  # checkpoint directories created to be locked


def lock_run_directory(run_dir: str, checkpoint_root: Optional[str] = None) -> HeldLock:
    """Hold the run directory's lock, and the checkpoint directory's (``checkpoint_root``, created if absent), until
    :func:`release_run_directory` (or the process ends); RunDirectoryInUse naming the holder (host, pid, start
    time) when another run holds either: two runs saving into one checkpoint directory would resume each other's
    checkpoints."""
    owner = {**this_process(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "run_dir": os.path.abspath(run_dir)}
    lock = _lock_directory(run_dir, owner, f"run directory {run_dir}", (
        "two runs in one directory would write the same metrics.jsonl and checkpoints; wait for it to end or stop "
        "it, or start this run in a new directory (hydra.run.dir=NEW)"))
    if checkpoint_root is not None:
        try:
            if not os.path.isdir(checkpoint_root):
                os.makedirs(checkpoint_root)
                _created.append(checkpoint_root)  # removed again if the run leaves it empty
        except OSError as err:
            raise ValueError(
                f"cannot create the checkpoint directory {checkpoint_root}: {err.strerror or err}"
            ) from None
        _lock_directory(checkpoint_root, owner, f"checkpoint directory {checkpoint_root}", (
            "two runs saving into one checkpoint directory would resume each other's checkpoints; wait for it to "
            "end or stop it, or give this run its own checkpoint.dir"))
    return lock


def _lock_directory(directory: str, owner: Dict[str, Any], what: str, why: str) -> HeldLock:
    key = os.path.realpath(directory)
    if key in _held:
        return _held[key]
    try:
        lock = hold_lock(os.path.join(directory, LOCK_FILE), owner)
    except LockHeld as held:
        h = held.holder
        who = (f"pid {h.get('pid')} on host {h.get('host')}, started {h.get('started')}" if h
               else "another process")
        if h.get("run_dir") and os.path.realpath(h["run_dir"]) != key:
            who += f", run directory {h['run_dir']}"
        raise RunDirectoryInUse(f"{what} is in use by a run that is still going ({who}): {why}") from None
    except OSError as err:
        raise ValueError(f"cannot lock the {what}: {err.strerror or err}") from None
    _held[key] = lock
    return lock


def release_run_directory() -> None:
    """Give up every run- and checkpoint-directory lock this process holds (a run ended, or its start was
    refused)."""
    while _held:
        _, lock = _held.popitem()
        lock.release()
    while _created:
        with contextlib.suppress(OSError):
            os.rmdir(_created.pop())
