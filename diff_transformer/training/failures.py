"""Failure handling: preemption signals agreed on collectively, requeueing a SLURM job from inside it, and a guard
that skips NaN/Inf or spiking steps.

Signals: the handler only records that a signal came; at the next step boundary every rank all-reduces the flag,
so all ranks save the same step together and exit (a handler that saved by itself would deadlock the collectives).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import threading
from collections import deque
from typing import Any, Deque, List, Optional

from diff_transformer.config import FailureConfig
from diff_transformer.distributed import any_rank

logger = logging.getLogger("diff_transformer")

def grace_period_seconds(f: FailureConfig) -> float:
    if f.grace_period_s is not None:
        return float(f.grace_period_s)
    return float(os.environ.get("SHUTDOWN_GRACE_S", "120"))


class TrainingDiverged(RuntimeError):
    """Raised after ``max_consecutive_bad_steps`` skipped steps in a row (a checkpoint has been written)."""


class PreemptionSignals:
    """Records SIGTERM/SIGUSR1/... and lets the ranks agree on it at a step boundary."""

    def __init__(self, names: List[str], grace_period_s: float):
        self.names = list(names)
        self.grace_period_s = grace_period_s
        self.received: Optional[str] = None
        self._previous = {}
        self._watchdog: Optional[threading.Timer] = None

    def install(self) -> "PreemptionSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for name in self.names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self._watchdog = threading.Timer(self.grace_period_s, self._grace_exceeded)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _grace_exceeded(self) -> None:
        # the previous checkpoint stays loadable (saves are atomic); exiting now beats being killed mid-write later
        logger.error("no checkpoint %.0f s after %s: exiting without one", self.grace_period_s, self.received)
        os._exit(143)

    def agreed(self) -> bool:
        """True on every rank when any rank received a signal (collective: call at the same point on all ranks)."""
        return any_rank(self.received is not None)

    def uninstall(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class BadStepGuard:
    """Decides whether a step's loss is bad (NaN/Inf, or above ``factor`` times the mean of recent good losses).

    Every rank sees the same loss (reduced over DP, broadcast over PP), so every rank reaches the same verdict."""

    def __init__(self, config: FailureConfig, consecutive: int = 0):
        self.config = config
        self.consecutive = consecutive
        self.recent: Deque[float] = deque(maxlen=config.loss_spike_window)

    def check(self, loss: float) -> Optional[str]:
        """The reason a step is bad, or None (then the loss joins the recent window)."""
        if not math.isfinite(loss):
            reason = f"loss is {loss}"
        elif (
            self.config.loss_spike_factor
            and len(self.recent) == self.recent.maxlen
            and loss > self.config.loss_spike_factor * (sum(self.recent) / len(self.recent))
        ):
            reason = (
                f"loss {loss:.4f} exceeds {self.config.loss_spike_factor} x the mean "
                f"{sum(self.recent) / len(self.recent):.4f} of the last {len(self.recent)} steps"
            )
        else:
            self.consecutive = 0
            self.recent.append(loss)
            return None
        self.consecutive += 1
        return reason

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.config.max_consecutive_bad_steps


def poison_gradients(model_chunks: List[Any]) -> None:
    """Fill every accumulated gradient with NaN (the test hook for a diverged step: an applied update would show)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grad.fill_(float("nan"))


def current_slurm_job_id() -> Optional[str]:
    """This process's SLURM job id, in the form scontrol takes (array tasks as <array job>_<task>)."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_current_job() -> bool:
    """Put this SLURM job back in the queue (it restarts with the same id and resumes); False outside SLURM or on error.

    Call once, from global rank 0, after the checkpoint is on disk: SLURM stops every task of the job right after.
    """
    job_id = current_slurm_job_id()
    if not job_id:
        return False
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        logger.warning("cannot requeue job %s: scontrol is not on PATH", job_id)
        return False
    except subprocess.CalledProcessError as error:
        logger.warning("scontrol requeue %s failed: %s", job_id, (error.stderr or error.stdout).strip())
        return False
    except subprocess.TimeoutExpired:
        logger.warning("scontrol requeue %s timed out", job_id)
        return False
    logger.info("requeued SLURM job %s", job_id)
    return True
