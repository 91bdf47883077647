"""The seed spread of every variant of an ablation sweep: runs grouped by their variant label (the attention kind and
its ablation keys, run.json "variant"), the mean ± standard deviation of the final validation loss over seeds, and
each variant's difference from reference variants paired by seed, with a t-test, so that a reader can tell signal
from noise.

Pairing by seed is what makes three seeds informative: runs with the same seed see the same data in the same order
and are validated on the same samples, so the paired difference removes that shared variance (the architectures still
start from different weights). The test is a two-sided paired t-test over the seeds both variants have; with three
seeds it has two degrees of freedom, and ten variants tested at p < 0.05 give about one false positive in two sweeps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from diff_transformer.analysis.runs import RunRecord
from diff_transformer.figure_style import variant_name

SIGNIFICANCE = 0.05


@dataclasses.dataclass
class PairedDelta:
    """variant − reference in final validation loss over the seeds both have."""

    reference: str
    mean: float
    std: float
    n: int
    p_value: float

    @property
    def outside_noise(self) -> bool:
        return self.n >= 2 and self.p_value < SIGNIFICANCE

    def summary(self) -> dict:
        finite = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
                  for k, v in dataclasses.asdict(self).items() if k != "reference"}
        reason = None if self.n >= 2 else ("no seed in common" if self.n == 0 else "one seed in common")
        return {"reference": self.reference, **finite, "reason": reason, "outside_noise": self.outside_noise}

    def describe(self) -> str:
        if self.n == 0:
            return "no seed in common"
        if self.n < 2:
            return f"{self.mean:+.4f} (1 seed)"
        verdict = "outside noise" if self.outside_noise else "inside noise"
        return f"{self.mean:+.4f} ± {self.std:.4f} (p={self.p_value:.3f}, {verdict})"


@dataclasses.dataclass
class VariantStats:
    variant: str
    model: str
    parameters: int
    seeds: list[int | None]
    values: list[float]
    deltas: dict[str, PairedDelta]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (nan with one seed)."""
        return float(np.std(self.values, ddof=1)) if self.n > 1 else math.nan

    def summary(self) -> dict:
        """JSON-ready: every number finite, or null with the reason next to it."""
        return {
            "variant": self.variant, "model": self.model, "parameters": self.parameters, "seeds": self.seeds,
            "final_val_losses": self.values, "mean": self.mean, "std": self.std if self.n > 1 else None,
            "std_reason": None if self.n > 1 else "one seed",
            "deltas": {k: v.summary() for k, v in self.deltas.items()},
        }


def _paired_delta(runs: dict, reference_runs: dict, reference: str) -> PairedDelta:
    from scipy import stats

    seeds = [s for s in runs if s in reference_runs]
    diffs = np.array([runs[s] - reference_runs[s] for s in seeds], dtype=np.float64)
    if len(diffs) == 0:
        return PairedDelta(reference, math.nan, math.nan, 0, math.nan)
    if len(diffs) == 1:
        return PairedDelta(reference, float(diffs[0]), math.nan, 1, math.nan)
    std = float(np.std(diffs, ddof=1))
    if std == 0:
        p = 0.0 if diffs.mean() != 0 else 1.0
    else:
        p = float(stats.ttest_1samp(diffs, 0.0).pvalue)
    return PairedDelta(reference, float(diffs.mean()), std, len(diffs), p)


def seed_spread(runs: Sequence[RunRecord], references: Sequence[str] = ("vanilla", "diff"),
                parameter_count: str = "total") -> list[VariantStats]:
    """One VariantStats per (model, variant), in the order the variants first appear after the references."""
    groups: dict[tuple[str, str], dict] = {}
    for run in runs:
        by_seed = groups.setdefault((run.model, run.variant), {})
        seed = run.seed if run.seed is not None else len(by_seed)
        if seed in by_seed:
            raise ValueError(
                f"two runs of {run.variant} ({run.model}) with seed {seed}: {by_seed[seed].source} and {run.source}"
            )
        by_seed[seed] = run
    order = sorted(groups, key=lambda key: (key[0], key[1] not in references,
                                            references.index(key[1]) if key[1] in references else 0))
    result = []
    for model, variant in order:
        by_seed = groups[(model, variant)]
        losses = {seed: run.final_val_loss for seed, run in by_seed.items()}
        deltas = {}
        for reference in references:
            if reference != variant and (model, reference) in groups:
                reference_losses = {s: r.final_val_loss for s, r in groups[(model, reference)].items()}
                deltas[reference] = _paired_delta(losses, reference_losses, reference)
        first = next(iter(by_seed.values()))
        result.append(VariantStats(variant, model, first.parameters(parameter_count), list(by_seed),
                                   list(losses.values()), deltas))
    return result


def format_table(stats: Sequence[VariantStats]) -> str:
    """A markdown table: variant, parameters, seeds, mean ± std, and the paired difference from each reference."""
    compared = {r for s in stats for r in s.deltas}
    references = list(dict.fromkeys(s.variant for s in stats if s.variant in compared))  # in the table's order
    header = ["variant", "model", "parameters", "seeds", "final val loss (mean ± std)"]
    header += [f"Δ vs {variant_name(r)} (paired mean ± std, p)" for r in references]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in stats:
        spread = f"{s.mean:.4f} ± {s.std:.4f}" if s.n > 1 else f"{s.mean:.4f}"
        row = [variant_name(s.variant), s.model, f"{s.parameters:,}", ",".join(str(x) for x in s.seeds), spread]
        row += [s.deltas[r].describe() if r in s.deltas else "" for r in references]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
