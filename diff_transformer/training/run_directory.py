"""One run per directory: what a run directory holds, whether a start may use it, and moving an old run aside.

A start either resumes (``checkpoint.resume=auto`` finds a checkpoint, or ``checkpoint.resume`` names one) or starts
fresh at step 0. A fresh start is refused where a run already is, since its ``metrics.jsonl``, W&B run and
checkpoints would mix with the old ones: in a run directory whose ``metrics.jsonl`` records steps or whose checkpoint
directory holds checkpoints, and in particular where ``metrics.jsonl`` shows progress but the checkpoint directory
(say a ``checkpoint.dir`` pointed elsewhere) holds nothing to resume. ``overwrite_run=true`` moves the old run aside
(``<dir>.old-<time>``) instead. Standard library only: train.py refuses before it imports torch or megatron-core.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from diff_transformer.training.checkpoint_files import (
    CHECKPOINTS_DIRNAME,
    checkpoints_dir,
    list_checkpoints,
    move_aside,
)
from diff_transformer.training.metrics import METRICS_FILE, last_logged_step

HYDRA_SUBDIR = ".hydra"  # Hydra's record of this launch, written before the run starts: it stays with the new run


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


def check_start(cfg: Any, run_dir: str, will_resume: Optional[bool] = None) -> Optional[RunDirectory]:
    """Refuse (RunDirectoryInUse) a fresh start in a directory that holds a run, naming what is there and the
    choices; returns the directory's state when the start is fresh there under ``overwrite_run=true`` (the caller
    moves the old run aside once every other start-up check has passed), else None. ``will_resume``: the trainer's
    decision once checkpoints are verified; None guesses it from the files (the cheap check before any import)."""
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
        raise RunDirectoryInUse(
            f"run directory {run_dir} holds a run ({state.describe()}) but checkpoint directory "
            f"{state.checkpoint_root} holds no checkpoint to resume from; starting at step 0 would mix two runs in "
            f"one directory: if the checkpoints moved, set checkpoint.dir to where they are; or {choices}"
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
    ``<name>.old-<time>``; this launch's ``.hydra`` record comes back into the new, empty run directory. Returns
    (old path, new path) pairs."""
    stamp = time.strftime(".old-%Y%m%d-%H%M%S")
    moved = []
    inside = os.path.realpath(state.checkpoint_root).startswith(os.path.realpath(state.run_dir) + os.sep)
    if state.checkpoints and not inside:
        moved.append((state.checkpoint_root, move_aside(state.checkpoint_root, stamp)))
    if os.path.isdir(state.run_dir):
        aside = move_aside(state.run_dir, stamp)
        moved.append((state.run_dir, aside))
        os.makedirs(state.run_dir)
        if os.path.isdir(os.path.join(aside, HYDRA_SUBDIR)):
            shutil.copytree(os.path.join(aside, HYDRA_SUBDIR), os.path.join(state.run_dir, HYDRA_SUBDIR))
    return moved
