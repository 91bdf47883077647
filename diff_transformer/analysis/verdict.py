"""The verdict of one variant against its reference: is its final validation loss better, worse, or not
distinguishable from seed noise, over the sizes both trained?

The test. At each size both trained, the difference in final validation loss (variant − reference, nats) is taken
per seed where both have the same seeds (paired: the same seed sees the same data in the same order), else between
the two seed means (unpaired). The effect is the mean of the per-size mean differences, the sizes as blocks (each
size weighs the same, whatever the size's own level of loss). Its standard error comes from the spread over seeds
within each size (pooled over the sizes: the paired differences' variance, or the runs' variance for unpaired sizes;
Welch–Satterthwaite degrees of freedom where both designs occur). A two-sided t-test at level 5% gives:

- ``better`` / ``worse``: the 95% interval of the effect excludes 0, below / above it (from the variant's side);
- ``indistinguishable``: it includes 0 — the difference is not distinguishable from seed noise. The evidence says
  whether the interval lies within ± the seed noise (one run's standard deviation over seeds: the two are then
  practically equivalent) or is wider (more seeds could still find a difference that large);
- ``undetermined``: not testable — a size with one seed of either, no size in common, or under 2 degrees of freedom.

Under no effect the test calls ``better`` or ``worse`` in 5% of sweeps (2.5% each), the rate the tests check on
synthetic sweeps; several variants tested in one sweep each carry that rate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from diff_transformer.analysis.runs import RunRecord
from diff_transformer.figure_style import human_number, variant_name

LEVEL = 0.05  # two-sided
OUTCOMES = ("better", "worse", "indistinguishable", "undetermined")
TEST = ("two-sided t-test of the mean over sizes of the per-size mean difference in final validation loss "
        "(paired by seed where the seeds match, else unpaired), sizes as blocks, seed variance pooled over sizes")


def significant(value: float, digits: int = 2) -> str:
    """``value`` to ``digits`` significant figures, never in exponent form for the magnitudes losses take."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.{digits - 1}f}" if math.isfinite(value) else "n/a"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{round(value, decimals):.{decimals}f}"


def p_text(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {significant(p)}"


def interval_text(mean: float, low: float, high: float) -> tuple[str, str, str]:
    """A mean and its interval to the decimals of 2 significant figures of the interval's half-width."""
    half = (high - low) / 2
    if half <= 0 or not math.isfinite(half):
        return significant(mean), significant(low), significant(high)
    decimals = max(0, 1 - math.floor(math.log10(half)))
    return tuple(f"{value:.{decimals}f}" for value in (mean, low, high))


@dataclasses.dataclass
class SizeDifference:
    """variant − reference in final validation loss at one size: paired by seed, or between the seed means."""

    model: str
    parameters: int
    variant_seeds: int
    reference_seeds: int
    paired: bool
    mean: float
    differences: list[float]  # per seed, where paired
    squares: float  # the within-size sum of squares the pooled variance uses
    df: int
    weight: float  # Var(mean) = pooled variance × weight

    def summary(self) -> dict:
        return {"model": self.model, "parameters": self.parameters, "variant_seeds": self.variant_seeds,
                "reference_seeds": self.reference_seeds, "paired": self.paired, "mean_difference": self.mean,
                "paired_differences": self.differences if self.paired else None}

    def describe(self) -> str:
        seeds = (f"{len(self.differences)} paired seeds" if self.paired
                 else f"{self.variant_seeds} vs {self.reference_seeds} seeds, unpaired")
        return f"{self.model} ({human_number(self.parameters)}): {significant(self.mean)} ({seeds})"


@dataclasses.dataclass
class Verdict:
    """The outcome, from the variant's side, and its evidence; numbers are finite or None with ``reason``."""

    variant: str
    reference: str
    outcome: str
    sizes: list[SizeDifference]
    reason: str | None = None  # why undetermined
    mean: float | None = None  # the effect: the mean over sizes of the per-size mean difference (nats)
    interval: tuple[float, float] | None = None  # its 95% interval
    p_value: float | None = None
    df: float | None = None
    seed_noise: float | None = None  # one run's standard deviation over seeds, pooled over every cell of the pair
    level: float = LEVEL

    @property
    def is_finding(self) -> bool:
        """Whether a ratio between the two may be presented as a finding."""
        return self.outcome in ("better", "worse")

    @property
    def within_seed_noise(self) -> bool | None:
        if self.interval is None or self.seed_noise is None:
            return None
        return -self.seed_noise <= self.interval[0] and self.interval[1] <= self.seed_noise

    def summary(self) -> dict:
        return {
            "outcome": self.outcome,
            "reason": self.reason,
            "test": TEST,
            "level": self.level,
            "two_sided": True,
            "effect": "mean over sizes of (variant − reference) final validation loss, nats; negative: variant better",
            "mean_difference": self.mean,
            "interval_95": list(self.interval) if self.interval else None,
            "p_value": self.p_value,
            "df": self.df,
            "seed_noise": self.seed_noise,
            "interval_within_seed_noise": self.within_seed_noise,
            "sizes": [s.summary() for s in self.sizes],
        }

    def describe(self) -> str:
        """The ``verdict:`` line and its evidence, one line each."""
        name, other = variant_name(self.variant), variant_name(self.reference)
        if self.outcome == "undetermined":
            head = f"verdict: {name} undetermined against {other}: {self.reason}"
        else:
            relation = {"better": "better than", "worse": "worse than",
                        "indistinguishable": "indistinguishable from"}[self.outcome]
            mean, low, high = interval_text(self.mean, *self.interval)
            head = (f"verdict: {name} {relation} {other}: final val loss {mean} nats "
                    f"({name} − {other}, mean over {len(self.sizes)} size{'s' if len(self.sizes) != 1 else ''}), "
                    f"95% interval {low} to {high}, {p_text(self.p_value)}")
        lines = [head]
        if self.mean is not None:
            noise = f"seed noise (one run's SD over seeds) {significant(self.seed_noise)} nats"
            if self.outcome == "indistinguishable":
                noise += ("; the interval lies within ± the seed noise" if self.within_seed_noise else
                          "; the interval is wider than ± the seed noise: more seeds could find a difference that size")
            lines.append(f"  test: {TEST}; level {self.level:.0%}, df {significant(self.df)}; {noise}")
        if self.sizes:
            lines.append(f"  per size ({name} − {other}, nats): " + "; ".join(s.describe() for s in self.sizes))
        return "\n".join(lines)


def _cells(runs: Sequence[RunRecord], variant: str) -> dict[str, dict]:
    """model → {seed: final val loss} of one variant; a run without a recorded seed keys by its name (never pairs)."""
    cells: dict[str, dict] = {}
    for run in runs:
        if run.variant == variant:
            key = run.seed if run.seed is not None else f"unrecorded:{run.name}"
            cells.setdefault(run.model, {})[key] = run.final_val_loss
    return cells


def _size_difference(model: str, parameters: int, values: dict, reference: dict) -> SizeDifference:
    common = [seed for seed in values if seed in reference]
    if len(common) >= 2:
        differences = np.array([values[s] - reference[s] for s in common])
        return SizeDifference(model, parameters, len(values), len(reference), True, float(differences.mean()),
                              differences.tolist(), float(((differences - differences.mean()) ** 2).sum()),
                              len(common) - 1, 1.0 / len(common))
    v, r = np.array(list(values.values())), np.array(list(reference.values()))
    squares = float(((v - v.mean()) ** 2).sum() + ((r - r.mean()) ** 2).sum())
    return SizeDifference(model, parameters, len(v), len(r), False, float(v.mean() - r.mean()), [], squares,
                          len(v) + len(r) - 2, 1.0 / len(v) + 1.0 / len(r))


def seed_noise(cells: Sequence[dict]) -> float | None:
    """One run's standard deviation over seeds, pooled over every cell with two seeds or more."""
    squares = df = 0.0
    for cell in cells:
        values = np.array(list(cell.values()))
        if len(values) >= 2:
            squares += float(((values - values.mean()) ** 2).sum())
            df += len(values) - 1
    return math.sqrt(squares / df) if df else None


def verdict(runs: Sequence[RunRecord], variant: str, reference: str, parameter_count: str = "total",
            level: float = LEVEL) -> Verdict:
    """The verdict of ``variant`` against ``reference`` over the sizes (models) both trained (see the module)."""
    from scipy import stats

    mine, theirs = _cells(runs, variant), _cells(runs, reference)
    parameters = {r.model: r.parameters(parameter_count) for r in runs if r.variant == variant}
    models = sorted((m for m in mine if m in theirs), key=lambda m: parameters[m])
    noise = seed_noise([mine[m] for m in models] + [theirs[m] for m in models])
    if not models:
        return Verdict(variant, reference, "undetermined", [], "no size has runs of both", level=level)
    single = [f"{variant_name(v)} {m}" for m in models for v, cells in ((variant, mine), (reference, theirs))
              if len(cells[m]) < 2]
    sizes = [_size_difference(m, parameters[m], mine[m], theirs[m]) for m in models]
    if single:
        return Verdict(variant, reference, "undetermined", sizes,
                       f"one seed at {', '.join(single[:4])}{f' and {len(single) - 4} more' if len(single) > 4 else ''}"
                       ": seed noise cannot be told from a difference; train several seeds per size",
                       seed_noise=noise, level=level)
    # Each design (paired, unpaired) pools its own variance over its sizes; the effect's variance combines them.
    groups = {}
    for size in sizes:
        squares, df, weight = groups.get(size.paired, (0.0, 0, 0.0))
        groups[size.paired] = (squares + size.squares, df + size.df, weight + size.weight / len(sizes) ** 2)
    parts = [(weight * squares / df, df) for squares, df, weight in groups.values() if df > 0]
    variance = sum(part for part, _ in parts)
    if variance > 0:
        df = variance**2 / sum(part**2 / d for part, d in parts)
    else:
        df = float(sum(d for _, d in parts))
    if df < 2:
        return Verdict(variant, reference, "undetermined", sizes,
                       f"{significant(df)} degrees of freedom for the seed variance; a test needs ≥ 2 (more seeds)",
                       seed_noise=noise, level=level)
    mean = float(np.mean([size.mean for size in sizes]))
    if variance == 0:  # identical seeds to the last digit: any difference at all is outside the (zero) noise
        p, half = (1.0 if mean == 0 else 0.0), 0.0
    else:
        error = math.sqrt(variance)
        p = float(2 * stats.t.sf(abs(mean) / error, df))
        half = float(stats.t.ppf(1 - level / 2, df)) * error
    outcome = "indistinguishable" if p >= level else ("better" if mean < 0 else "worse")
    return Verdict(variant, reference, outcome, sizes, None, mean, (mean - half, mean + half), p, float(df), noise,
                   level)
