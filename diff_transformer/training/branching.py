"""Cooldown branches: a run that starts from another run's stable-phase checkpoint and cools down to its own budget.

``checkpoint.branch_from=<source run directory or checkpoint>`` (``checkpoint.branch_step=<step>``, by default where
the branch's own cooldown begins) loads the source's model, optimizer and data position, then trains to the branch's
``trainer.max_steps`` under ``optim.decay=wsd``, whose cooldown then ends at the branch's last step. The source is
only read: nothing there is locked, written or moved. Standard library only (train.py checks before importing torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from diff_transformer.config import cooldown_steps
from diff_transformer.training.checkpoint_files import (
    CHECKPOINTS_DIRNAME, STATE_FILE, checkpoint_name, is_complete, list_checkpoints, read_trainer_state,
)
from diff_transformer.training.run_directory import recorded_checkpoint_dir


@dataclass
class BranchSource:
    run_dir: str  # absolute path of the run branched from
    checkpoint: str  # its checkpoint at ``step``
    step: int
    max_steps: int  # the source's trainer.max_steps: the branch sizes its data like the source

    def record(self) -> dict:
        """run.json's ``branch``."""
        return {"source_run": self.run_dir, "source_step": self.step}


def branch_start_step(cfg: Any) -> int:
    """The source step a branch starts from: ``checkpoint.branch_step``, or where the branch's cooldown begins."""
    if cfg.checkpoint.branch_step is not None:
        return cfg.checkpoint.branch_step
    return cfg.trainer.max_steps - cooldown_steps(cfg.optim, cfg.trainer.max_steps)


def _source_run_and_checkpoints(path: str):
    """(source run directory, its checkpoint directory, a checkpoint named directly or None)."""
    path = os.path.abspath(path.rstrip("/"))
    if is_complete(path):  # a step_* checkpoint: its run directory is two levels up when it lies in checkpoints/
        root = os.path.dirname(path)
        run_dir = os.path.dirname(root) if os.path.basename(root) == CHECKPOINTS_DIRNAME else root
        return run_dir, root, path
    root = recorded_checkpoint_dir(path) or os.path.join(path, CHECKPOINTS_DIRNAME)
    return path, root, None


def resolve_branch(cfg: Any, run_dir: Optional[str] = None) -> Optional[BranchSource]:
    """The source of ``checkpoint.branch_from`` at the branch step, checked (ValueError naming what is wrong), or None
    when the run is no branch. Reads the source's files only."""
    c = cfg.checkpoint
    if c.branch_from is None:
        return None
    if not os.path.isdir(c.branch_from):
        raise ValueError(f"checkpoint.branch_from={c.branch_from} does not exist: give the source run's directory or "
                         "one of its step_* checkpoints")
    source_run, root, named = _source_run_and_checkpoints(c.branch_from)
    if run_dir is not None and os.path.realpath(source_run) == os.path.realpath(run_dir):
        raise ValueError(f"checkpoint.branch_from={c.branch_from} is this run's own directory: a branch is its own "
                         "run directory (hydra.run.dir=NEW)")
    step = branch_start_step(cfg)
    found = dict(list_checkpoints(root))
    if named is not None:
        saved_step = read_trainer_state(named)["step"]
        if c.branch_step is not None and c.branch_step != saved_step:
            raise ValueError(f"checkpoint.branch_step={c.branch_step} but checkpoint.branch_from={c.branch_from} is "
                             f"the checkpoint of step {saved_step}: give one of them")
        step, checkpoint = saved_step, named
    elif step in found:
        checkpoint = found[step]
    else:
        have = ", ".join(str(s) for s in sorted(found)) or "none"
        raise ValueError(
            f"checkpoint.branch_step={step} (the branch's cooldown start, trainer.max_steps={cfg.trainer.max_steps} "
            f"minus its cooldown, unless set) has no checkpoint in {root} (steps: {have}): choose a saved step, or "
            "let the source run save there (checkpoint.interval, checkpoint.keep_every)"
        )
    try:
        saved = read_trainer_state(checkpoint)
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {checkpoint}: {STATE_FILE} is unreadable ({err})") from None
    _check_same_stable_phase(cfg, saved, checkpoint, step)
    source_steps = int(saved["config"]["trainer"]["max_steps"])
    if not step < cfg.trainer.max_steps <= source_steps:
        # the sample order depends on the planned samples: within the source's plan the branch sees the source's data
        raise ValueError(f"trainer.max_steps={cfg.trainer.max_steps} must lie in ({step}, {source_steps}]: after the "
                         "branch step and within the source's trainer.max_steps, whose data order the branch "
                         "continues")
    return BranchSource(source_run, checkpoint, step, source_steps)


def _check_same_stable_phase(cfg: Any, saved: dict, checkpoint: str, step: int) -> None:
    """The branch continues the source's trajectory only if, up to ``step``, the source ran the branch's own schedule
    on the same data: same seed, batch, peak and warm-up, and ``step`` in the source's stable phase."""
    so, st = saved["config"]["optim"], saved["config"]["trainer"]
    wanted = {"seed": (saved["config"].get("seed"), cfg.seed),
              "trainer.global_batch_size": (st["global_batch_size"], cfg.trainer.global_batch_size),
              "optim.lr": (so["lr"], cfg.optim.lr), "optim.warmup_steps": (so["warmup_steps"], cfg.optim.warmup_steps),
              "optim.decay": (so["decay"], "wsd")}
    differ = [f"{key}={ours} (the source's {theirs})" for key, (theirs, ours) in wanted.items() if theirs != ours]
    if differ:
        raise ValueError(f"checkpoint.branch_from={checkpoint} ran another schedule or data order than this branch: "
                         f"{'; '.join(differ)}: a cooldown branch keeps the source's settings up to its branch step")

    class _Optim:  # the source's cooldown keys, with the defaults of checkpoints saved before they existed
        cooldown_fraction = so.get("cooldown_fraction", 0.2)
        cooldown_steps = so.get("cooldown_steps")

    stable_end = st["max_steps"] - cooldown_steps(_Optim, st["max_steps"])
    if step > stable_end:
        raise ValueError(f"checkpoint.branch_step={step} lies in the source's cooldown (it cools down from step "
                         f"{stable_end} of {st['max_steps']}): branch from a stable-phase checkpoint, at most step "
                         f"{stable_end} (e.g. {checkpoint_name(stable_end)})")
