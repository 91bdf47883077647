"""Failure handling: preemption signals agreed on collectively, and a guard that skips NaN/Inf or spiking steps.

Signals: the handler only records that a signal came; at the next step boundary every rank all-reduces the flag,
so all ranks save the same step together and exit (a handler that saved by itself would deadlock the collectives).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, List, Optional

import torch

logger = logging.getLogger("diff_transformer")

SIGNAL_NAMES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


@dataclass
class FailureConfig:
    signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGUSR2"])  # save, then exit
    # seconds from the signal to a forced exit, when the save has not finished (the scheduler kills soon after);
    # None: SHUTDOWN_GRACE_S from the launcher, else 120
    grace_period_s: Optional[float] = None
    max_consecutive_bad_steps: int = 5  # stop with a checkpoint after this many skipped steps in a row
    loss_spike_factor: float = 0.0  # skip a step whose loss exceeds this times the recent mean (0: off)
    loss_spike_window: int = 20  # good steps in that mean; no spike test before the window is full
    inject_nan_at_steps: List[int] = field(default_factory=list)  # testing: these steps' loss and grads become NaN


def validate_failure_config(f: FailureConfig) -> None:
    for name in f.signals:
        if name not in SIGNAL_NAMES:
            raise ValueError(f"failures.signals has {name!r}; use names from {', '.join(SIGNAL_NAMES)}")
    if f.grace_period_s is not None and f.grace_period_s <= 0:
        raise ValueError(f"failures.grace_period_s={f.grace_period_s} must be positive (or null for the default)")
    if f.max_consecutive_bad_steps < 1:
        raise ValueError(f"failures.max_consecutive_bad_steps={f.max_consecutive_bad_steps} must be >= 1")
    if f.loss_spike_factor != 0 and f.loss_spike_factor <= 1:
        raise ValueError(f"failures.loss_spike_factor={f.loss_spike_factor} must be > 1 (or 0 to turn it off)")
    if f.loss_spike_window < 1:
        raise ValueError(f"failures.loss_spike_window={f.loss_spike_window} must be >= 1")


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

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank received a signal (collective: call at the same point on all ranks)."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

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
