"""Failure handling: preemption signals agreed on collectively, requeueing a SLURM job from inside it, and a guard
that skips NaN/Inf or spiking steps.

Signals: the handler only records that a signal came; at the next step boundary every rank all-reduces the flag,
so all ranks save the same step together and exit (a handler that saved by itself would deadlock the collectives).
SIGINT (Ctrl-C) is always one of them; a second SIGINT before the save is done exits at once, leaving the last good
checkpoint. Once a signal came, the signals are ignored until the process exits, so that one repeated during or
after the save cannot kill the process half-way through its exit (exit status 143, child processes left behind).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Deque, List, Optional

from diff_transformer.config import FailureConfig
from diff_transformer.distributed import any_rank
from diff_transformer.training.checkpoint_files import rerun_advice

logger = logging.getLogger("diff_transformer")

def grace_period_seconds(f: FailureConfig) -> float:
    if f.grace_period_s is not None:
        return float(f.grace_period_s)
    return float(os.environ.get("SHUTDOWN_GRACE_S", "120"))


class TrainingDiverged(RuntimeError):
    """Raised after ``max_consecutive_bad_steps`` skipped steps in a row (a checkpoint has been written)."""


EXIT_INTERRUPTED = 130  # a second SIGINT: stopped without finishing the save (diff_transformer.cli's status)
# A SIGINT within this many seconds of the first is the same Ctrl-C delivered twice (the terminal's, to the whole
# process group, and torchrun's, which forwards the one it received to its workers), not a second press.
SAME_CTRL_C_S = 1.0
EXIT_SAVE_UNFINISHED = 143  # the save did not finish within the grace period


def stop_child_processes() -> None:
    """Kill the processes this one started through multiprocessing (checkpoint writers, their queue's manager, data
    workers) before an exit that skips Python's own clean-up (``os._exit``): none may outlive the run."""
    for child in multiprocessing.active_children():
        child.kill()


class PreemptionSignals:
    """Records SIGTERM/SIGUSR1/..., and SIGINT, and lets the ranks agree on it at a step boundary."""

    def __init__(self, names: List[str], grace_period_s: float, checkpoint_root: Optional[str] = None):
        self.names = list(dict.fromkeys(list(names) + ["SIGINT"]))  # Ctrl-C saves as SIGTERM does
        self.checkpoint_root = checkpoint_root
        self.grace_period_s = grace_period_s
        self.received: Optional[str] = None
        self._previous = {}
        self._watchdog: Optional[threading.Timer] = None
        self._saved = False
        self._received_at = 0.0

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
            self._received_at = time.monotonic()
            self._watchdog = threading.Timer(self.grace_period_s, self._grace_exceeded)
            self._watchdog.daemon = True
            self._watchdog.start()
        elif signum == signal.SIGINT and not self._saved and time.monotonic() - self._received_at > SAME_CTRL_C_S:
            # Ctrl-C pressed again: the user will not wait for the save
            if os.environ.get("RANK", "0") == "0":
                advice = rerun_advice(self.checkpoint_root) if self.checkpoint_root else "rerun the same command"
                what = "a second SIGINT" if self.received == "SIGINT" else f"SIGINT after {self.received}"
                print(f"error: {what}: exiting now without saving (the last good checkpoint stays as it was): "
                      f"{advice}", file=sys.stderr, flush=True)
            stop_child_processes()
            os._exit(EXIT_INTERRUPTED)

    def _grace_exceeded(self) -> None:
        # the previous checkpoint stays loadable (saves are atomic); exiting now beats being killed mid-write later
        logger.error("no checkpoint %.0f s after %s: exiting without one", self.grace_period_s, self.received)
        stop_child_processes()
        os._exit(EXIT_SAVE_UNFINISHED)

    def saved(self) -> None:
        """The checkpoint the signal asked for is on disk: signals from now on change nothing."""
        self._saved = True
        if self._watchdog is not None:
            self._watchdog.cancel()

    def agreed(self) -> bool:
        """True on every rank when any rank received a signal (collective: call at the same point on all ranks)."""
        return any_rank(self.received is not None)

    def uninstall(self) -> None:
        """Restore the previous handlers, unless a signal came: then the process is on its way out, and the signals
        are ignored from here on, so that a repeated one cannot end it half-way through its exit (Python resets its
        own handlers to the default, deadly one while it shuts down; an ignored signal stays ignored)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if self.received is None else signal.SIG_IGN)
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
