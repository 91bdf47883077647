"""How fast one configuration trains against another: short timed windows of each in turn, in one process, many
rounds, the ratio from each round's pair (:func:`paired_throughput`); a neighbour's load slows both windows of a round
alike, where two runs made one after the other see different loads. :func:`paired_run_throughput` does it for two
runs' configurations (the quickstart's DIFF and Transformer, ``benchmarks/train_throughput.py``'s rows).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

CONFIDENCE = 0.95  # of the interval around the median ratio
NOISE_LIMIT = 0.05  # the interval's half-width, relative to the ratio, above which the machine was too noisy to tell


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Optional[Tuple[float, float]]:
    """A distribution-free interval for the median of ``values`` (order statistics, binomial coverage at least
    ``confidence``), or None when there are too few values for that coverage (fewer than 6 at 95%)."""
    ordered, n = sorted(values), len(values)
    # the largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2: the interval is the k-th value from each end
    tail, k = 0.0, 0
    while True:
        tail += math.comb(n, k) / 2**n
        if tail > (1 - confidence) / 2:
            break
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k >= 1 else None


@dataclass(frozen=True)
class PairedRatio:
    """A's throughput over B's: the median over rounds of B's window time over A's, with its interval."""

    ratio: float
    interval: Optional[Tuple[float, float]]  # None: too few rounds for one
    rounds: int
    steps: int  # steps in each timed window
    noise_limit: float = NOISE_LIMIT

    @property
    def spread(self) -> float:
        """The interval's half-width relative to the ratio (infinite without an interval)."""
        if self.interval is None:
            return math.inf
        return (self.interval[1] - self.interval[0]) / (2 * self.ratio)

    @property
    def noisy(self) -> bool:
        return self.spread > self.noise_limit

    def describe(self, a: str, b: str) -> str:
        how = f"{self.rounds} rounds of {self.steps}-step windows of each, alternating"
        if self.interval is None:
            return f"{a} / {b} throughput: {self.ratio:.2f} (too few rounds to tell, no interval: {how})"
        low, high = self.interval
        text = (f"{a} / {b} throughput: {self.ratio:.2f} ({CONFIDENCE:.0%} interval {low:.2f} to {high:.2f}; {how})")
        if self.noisy:
            text += (f"; the machine was too noisy to tell (interval ±{100 * self.spread:.0f}%, above "
                     f"±{100 * self.noise_limit:.0f}%): measure again on a quiet machine")
        return text

    def to_json(self) -> Dict[str, Any]:
        return {"ratio": self.ratio, "interval": list(self.interval) if self.interval else None,
                "confidence": CONFIDENCE, "rounds": self.rounds, "steps_per_window": self.steps,
                "noisy": self.noisy, "noise_limit": self.noise_limit}


def paired_throughput(step_a: Callable[[], Any], step_b: Callable[[], Any], rounds: int = 10, steps: int = 2,
                      warmup: int = 1, noise_limit: float = NOISE_LIMIT,
                      clock: Callable[[], float] = time.perf_counter) -> PairedRatio:
    """A's throughput over B's, each ``step_*()`` one step of the same tokens: ``warmup`` untimed steps of each, then
    ``rounds`` rounds of a window of ``steps`` steps of each, A first in even rounds and B first in odd ones (a load
    that rises through a round favours neither). A step function must return once its step is done (a GPU's too)."""
    for _ in range(warmup):
        step_a()
        step_b()

    def window(step: Callable[[], Any]) -> float:
        start = clock()
        for _ in range(steps):
            step()
        return clock() - start

    ratios = []
    for r in range(rounds):
        if r % 2 == 0:
            time_a = window(step_a)
            time_b = window(step_b)
        else:
            time_b = window(step_b)
            time_a = window(step_a)
        ratios.append(time_b / time_a)
    return PairedRatio(statistics.median(ratios), median_interval(ratios), rounds, steps, noise_limit)


MIN_WINDOW_S = 0.5  # a timed window is at least this long (a few scheduler slices), when the run's data allows


@contextlib.contextmanager
def run_steppers(config_a: str, config_b: str):
    """(step of A, step of B, clock, the steps each run's data holds): two runs' configurations (their resolved
    ``config.yaml``) set up in this process from fresh weights on the runs' data and batch, in scratch run directories
    (the runs are untouched). On a CPU the clock is this thread's CPU time and the steps run on one thread: a
    neighbour's load takes wall time, not that; on a GPU it is wall time, each step waited for."""
    import shutil
    import tempfile

    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.distributed import destroy_distributed
    from diff_transformer.training.engines import create_trainer

    scratch = tempfile.mkdtemp(prefix="paired-throughput-")
    restore = contextlib.ExitStack()
    try:
        steppers, available = [], []
        for i, path in enumerate((config_a, config_b)):
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path)))
            cfg.trainer.eval_interval, cfg.trainer.profile_step = 0, None
            cfg.checkpoint.resume, cfg.checkpoint.dir, cfg.checkpoint.check_free_space = "none", None, False
            cfg.logging.level, cfg.logging.wandb.mode = "ERROR", "disabled"  # its start-up was said by its run
            trainer = create_trainer(cfg, os.path.join(scratch, f"run{i}"))
            trainer.setup()
            batches = trainer._loader(trainer.train_ds, 0)  # the run's batches, from its first
            steppers.append(lambda trainer=trainer, batches=batches: _finished(trainer.train_step(batches)))
            available.append(cfg.trainer.max_steps)
        clock = time.perf_counter
        if not torch.cuda.is_available():
            restore.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(1)
            clock = time.thread_time
        yield steppers[0], steppers[1], clock, min(available)
    finally:
        restore.close()
        destroy_distributed()
        shutil.rmtree(scratch, ignore_errors=True)


def paired_run_throughput(config_a: str, config_b: str, rounds: int = 10, noise_limit: float = NOISE_LIMIT,
                          min_window_s: float = MIN_WINDOW_S) -> PairedRatio:
    """:func:`paired_throughput` of two runs (:func:`run_steppers`): windows hold as many steps as take
    ``min_window_s`` for the faster, within the runs' ``trainer.max_steps``."""
    with run_steppers(config_a, config_b) as (step_a, step_b, clock, available):
        step_a(), step_b()  # warm-up: allocation, first-call costs
        start = clock()
        step_a()
        middle = clock()
        step_b()
        fastest = min(middle - start, clock() - middle)
        most = max(1, (available - 2) // rounds)  # the steps the runs' data holds for each window
        steps = min(most, max(1, math.ceil(min_window_s / max(fastest, 1e-9))))
        return paired_throughput(step_a, step_b, rounds=rounds, steps=steps, warmup=0, noise_limit=noise_limit,
                                 clock=clock)


def _finished(result: Any) -> Any:
    """A step's result once the device has done its work (a timed window ends when its last step is done)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result
