"""Scaling-law fits and the ratios the paper reports: L(N) = E + A·(N/N_ref)^-α per variant (attention kind and its
ablation keys), the parameter ratio N_variant / N_reference at equal loss (the paper, DIFF against the Transformer:
62.2% at 6.8B), and the token ratio along one run of each (63.7% at 3B), for every variant present against a
reference (default ``vanilla``), DIFF V2 against its own baseline (``vanilla model.num_kv_heads=Hkv/2``, recorded in
its run.json) when that was trained. Uncertainties come from the fits' covariances, propagated to the ratios by
sampling."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Sequence

import numpy as np

from diff_transformer.analysis.runs import (
    BASELINE,
    DIFF,
    PARAMETER_COUNTS,
    RunRecord,
    check_comparable,
)

LABELS = {DIFF: "DIFF", BASELINE: "the Transformer"}


def label(variant: str) -> str:
    return LABELS.get(variant, variant)


@dataclasses.dataclass
class PowerLawFit:
    """L(x) = E + A * (x / x_ref)^(-alpha), with the covariance of (E, A, alpha)."""

    E: float
    A: float
    alpha: float
    x_ref: float
    covariance: np.ndarray
    num_points: int

    @property
    def params(self) -> np.ndarray:
        return np.array([self.E, self.A, self.alpha])

    @property
    def stderr(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.sqrt(np.diag(self.covariance))

    @property
    def has_uncertainty(self) -> bool:
        return bool(np.all(np.isfinite(self.covariance)))

    @property
    def A_unscaled(self) -> float:
        """A for L = E + A * x^(-alpha) in raw units of x."""
        return self.A * self.x_ref**self.alpha

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * (np.asarray(x, dtype=np.float64) / self.x_ref) ** (-self.alpha)

    def inverse(self, loss: np.ndarray | float) -> np.ndarray:
        """x at which the law reaches `loss` (nan where loss is at or below the asymptote E)."""
        gap = np.asarray(loss, dtype=np.float64) - self.E
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return np.where(gap > 0, self.x_ref * (np.maximum(gap, 1e-300) / self.A) ** (-1.0 / self.alpha), np.nan)

    def describe(self, unit: str) -> str:
        E_err, A_err, alpha_err = self.stderr if self.has_uncertainty else (math.nan,) * 3
        return (
            f"L({unit}) = {self.E:.4f}±{E_err:.4f} + {self.A:.4f}±{A_err:.4f} * ({unit}/{self.x_ref:.3g})"
            f"^-({self.alpha:.3f}±{alpha_err:.3f})  [{self.num_points} points]"
        )


def fit_power_law(x: Sequence[float], loss: Sequence[float]) -> PowerLawFit:
    """Least-squares fit of L = E + A (x/x_ref)^-alpha; needs 3 points, 4+ for an uncertainty."""
    from scipy.optimize import OptimizeWarning, curve_fit

    x = np.asarray(x, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    if x.shape != loss.shape or x.ndim != 1:
        raise ValueError(f"x and loss must be 1-D and the same length, got {x.shape} and {loss.shape}")
    if len(np.unique(x)) < 3:
        raise ValueError(f"a fit of E + A x^-alpha needs 3 distinct x, got {len(np.unique(x))}: {x.tolist()}")
    if np.any(x <= 0) or not np.all(np.isfinite(loss)):
        raise ValueError(f"x must be positive and losses finite, got x={x.tolist()} loss={loss.tolist()}")
    x_ref = float(np.exp(np.mean(np.log(x))))
    scaled = x / x_ref

    def law(s, E, A, alpha):
        return E + A * s ** (-alpha)

    # Start from the best alpha on a grid, with E and A solved linearly for each: the 3-parameter fit is then local.
    best = None
    for alpha in np.linspace(0.02, 3.0, 150):
        design = np.stack([np.ones_like(scaled), scaled ** (-alpha)], axis=1)
        (E, A), *_ = np.linalg.lstsq(design, loss, rcond=None)
        if A <= 0 or E < 0:
            continue
        residual = float(np.sum((design @ np.array([E, A]) - loss) ** 2))
        if best is None or residual < best[0]:
            best = (residual, E, A, alpha)
    if best is None:
        raise ValueError(
            f"losses {loss.tolist()} do not fall with x {x.tolist()}; a power law E + A x^-alpha cannot describe them"
        )
    _, E0, A0, alpha0 = best
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        params, covariance = curve_fit(
            law, scaled, loss, p0=[E0, A0, alpha0], bounds=([0.0, 0.0, 1e-4], [np.inf, np.inf, 10.0]), maxfev=20000
        )
    if len(x) <= 3:
        covariance = np.full((3, 3), np.inf)
    return PowerLawFit(float(params[0]), float(params[1]), float(params[2]), x_ref, np.asarray(covariance), len(x))


@dataclasses.dataclass
class RatioEstimate:
    """x_diff / x_baseline at equal loss, with a 68% interval from sampling both fits' parameters."""

    at: float
    loss: float
    ratio: float
    low: float
    high: float
    std: float
    valid_fraction: float

    def describe(self, what: str, unit: str, variant: str = DIFF, reference: str = BASELINE) -> str:
        name, other = label(variant), label(reference)
        if not math.isfinite(self.ratio):
            return (
                f"{name} at {human_number(self.at)} {unit} (loss {self.loss:.4f}) is below {other}'s fitted "
                f"asymptote: no {what} of {other} matches it"
            )
        spread = (
            f" (68% interval {100 * self.low:.1f}-{100 * self.high:.1f}%, ±{100 * self.std:.1f}%)"
            if math.isfinite(self.std)
            else " (no uncertainty: each fit needs 4 or more points)"
        )
        return (
            f"{name} at {human_number(self.at)} {unit} (loss {self.loss:.4f}) matches {other} at "
            f"{human_number(self.at / self.ratio)} {unit}: {what} ratio {100 * self.ratio:.1f}%{spread}"
        )


def _sample_params(fit: PowerLawFit, rng: np.random.Generator, num_samples: int) -> np.ndarray:
    samples = rng.multivariate_normal(fit.params, fit.covariance, size=num_samples, method="eigh")
    return samples


def matching_ratio(
    diff_fit: PowerLawFit,
    baseline_fit: PowerLawFit,
    at: float,
    num_samples: int = 4000,
    seed: int = 0,
) -> RatioEstimate:
    """Ratio at / x_b where baseline_fit(x_b) equals diff_fit(at): how much of the baseline's size (or data) DIFF needs."""
    loss = float(diff_fit(at))
    ratio = float(at / baseline_fit.inverse(loss))
    if not (diff_fit.has_uncertainty and baseline_fit.has_uncertainty):
        return RatioEstimate(at, loss, ratio, math.nan, math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    d = _sample_params(diff_fit, rng, num_samples)
    b = _sample_params(baseline_fit, rng, num_samples)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        sampled_loss = d[:, 0] + d[:, 1] * (at / diff_fit.x_ref) ** (-d[:, 2])
        gap = sampled_loss - b[:, 0]
        valid = (gap > 0) & (b[:, 1] > 0) & (b[:, 2] > 0) & (d[:, 2] > 0)
        x_b = baseline_fit.x_ref * (gap[valid] / b[valid, 1]) ** (-1.0 / b[valid, 2])
        ratios = at / x_b
    ratios = ratios[np.isfinite(ratios)]
    if len(ratios) < 10:
        return RatioEstimate(at, loss, ratio, math.nan, math.nan, math.nan, len(ratios) / num_samples)
    low, high = np.percentile(ratios, [15.865, 84.135])
    # Half the central 68% width: a standard deviation that heavy tails of the sampled ratios cannot blow up.
    return RatioEstimate(at, loss, ratio, float(low), float(high), float((high - low) / 2), len(ratios) / num_samples)


@dataclasses.dataclass
class PairComparison:
    """One variant against its reference: the parameter ratio at each of its trained sizes (and any asked for), and
    the token ratio along the largest model both trained."""

    variant: str
    reference: str
    parameter_ratios: list[RatioEstimate]
    token_pair: tuple[RunRecord, RunRecord] | None
    token_fits: dict[str, PowerLawFit]
    token_ratio: RatioEstimate | None

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "reference": self.reference,
            "parameter_ratios": [dataclasses.asdict(r) for r in self.parameter_ratios],
            "token_ratio_runs": [r.name for r in self.token_pair] if self.token_pair else None,
            "token_fits": {k: _fit_dict(v) for k, v in self.token_fits.items()},
            "token_ratio": dataclasses.asdict(self.token_ratio) if self.token_ratio else None,
        }


def _fit_dict(fit: PowerLawFit) -> dict:
    return {
        "E": fit.E,
        "A": fit.A,
        "alpha": fit.alpha,
        "x_ref": fit.x_ref,
        "stderr": fit.stderr.tolist() if fit.has_uncertainty else None,
        "num_points": fit.num_points,
    }


@dataclasses.dataclass
class Comparison:
    """Every variant's size fit, and each variant against its reference (``pairs``; DIFF's first). The first pair's
    ratios are also ``parameter_ratios``, ``token_pair``, ``token_fits`` and ``token_ratio``: the figure's."""

    runs: list[RunRecord]
    parameter_count: str
    size_fits: dict[str, PowerLawFit]
    pairs: list[PairComparison]
    notes: list[str]

    @property
    def primary(self) -> PairComparison | None:
        return self.pairs[0] if self.pairs else None

    @property
    def parameter_ratios(self) -> list[RatioEstimate]:
        return self.primary.parameter_ratios if self.primary else []

    @property
    def token_pair(self) -> tuple[RunRecord, RunRecord] | None:
        return self.primary.token_pair if self.primary else None

    @property
    def token_fits(self) -> dict[str, PowerLawFit]:
        return self.primary.token_fits if self.primary else {}

    @property
    def token_ratio(self) -> RatioEstimate | None:
        return self.primary.token_ratio if self.primary else None

    def summary(self) -> dict:
        primary = self.primary.summary() if self.primary else {
            "parameter_ratios": [], "token_ratio_runs": None, "token_fits": {}, "token_ratio": None}
        return {
            "parameter_count": self.parameter_count,
            "runs": [
                {
                    "name": r.name,
                    "model": r.model,
                    "attention": r.attention,
                    "variant": r.variant,
                    "seed": r.seed,
                    "parameters": r.parameters(self.parameter_count),
                    "final_val_loss": r.final_val_loss,
                    "tokens": r.token_budget,
                }
                for r in self.runs
            ],
            "size_fits": {k: _fit_dict(v) for k, v in self.size_fits.items()},
            "parameter_ratios": primary["parameter_ratios"],
            "token_ratio_runs": primary["token_ratio_runs"],
            "token_fits": primary["token_fits"],
            "token_ratio": primary["token_ratio"],
            "pairs": [pair.summary() for pair in self.pairs],
            "notes": self.notes,
        }


def reference_pairs(runs: Sequence[RunRecord], reference: str = BASELINE) -> tuple[list[tuple[str, str]], list[str]]:
    """(variant, reference) for every variant present but the reference, DIFF's first, and notes on those left
    without one. A variant whose runs name a baseline of their own (run.json ``baseline_variant``: DIFF V2's
    ``vanilla num_kv_heads=Hkv/2``) is compared with it when it was trained, else with ``reference``."""
    variants = list(dict.fromkeys(r.variant for r in runs))
    own = {r.variant: r.baseline_variant for r in runs if r.baseline_variant}
    pairs, notes = [], []
    for variant in sorted(variants, key=lambda v: (v != DIFF, variants.index(v))):
        if variant == reference:
            continue
        if own.get(variant) in variants:
            pairs.append((variant, own[variant]))
        elif reference in variants:
            if variant in own:
                notes.append(f"{variant}: its own baseline ({own[variant]}) was not trained; compared with {reference}")
            pairs.append((variant, reference))
        else:
            notes.append(f"{variant}: no run of the reference {reference!r} (--reference) to compare with")
    return pairs, notes


def _largest_pair(runs: Sequence[RunRecord], model: str | None, count: str, variant: str,
                  reference: str) -> tuple[RunRecord, RunRecord] | None:
    by_model: dict[str, dict[str, RunRecord]] = {}
    for run in runs:
        by_model.setdefault(run.model, {})[run.variant] = run
    pairs = {m: kinds for m, kinds in by_model.items() if variant in kinds and reference in kinds}
    if model is not None:
        chosen = pairs.get(model)
    elif pairs:
        chosen = max(pairs.values(), key=lambda kinds: kinds[variant].parameters(count))
    else:
        return None
    return (chosen[variant], chosen[reference]) if chosen else None


def _token_comparison(pair: tuple[RunRecord, RunRecord], token_fit_from: float, notes: list[str]):
    fits: dict[str, PowerLawFit] = {}
    for run in pair:
        keep = run.val_tokens >= token_fit_from * run.token_budget
        if np.count_nonzero(keep) < 3:
            notes.append(
                f"{run.name}: {np.count_nonzero(keep)} evaluations past {token_fit_from:.0%} of training; "
                "the token fit needs 3 (lower trainer.eval_interval)"
            )
            return fits, None
        try:
            fits[run.variant] = fit_power_law(run.val_tokens[keep], run.val_loss[keep])
        except ValueError as error:
            notes.append(f"{run.name}: no token fit: {error}")
            return fits, None
    variant_run, reference_run = pair
    ratio = matching_ratio(fits[variant_run.variant], fits[reference_run.variant], float(variant_run.val_tokens[-1]))
    return fits, ratio


def compare_runs(
    runs: Sequence[RunRecord],
    parameter_count: str = "total",
    token_ratio_model: str | None = None,
    token_fit_from: float = 0.1,
    require_finished: bool = True,
    at_parameters: Sequence[float] = (),
    reference: str = BASELINE,
) -> Comparison:
    """Fit the scaling laws of every variant and compute both ratios of each against its reference (see
    :func:`reference_pairs`); refuses runs that are not comparable."""
    if parameter_count not in PARAMETER_COUNTS:
        raise ValueError(f"parameter_count={parameter_count!r}; use one of {PARAMETER_COUNTS}")
    runs = list(runs)
    check_comparable(runs, require_finished=require_finished)
    variants = list(dict.fromkeys(r.variant for r in runs))
    notes: list[str] = []
    size_fits: dict[str, PowerLawFit] = {}
    for kind in variants:
        of_kind = [r for r in runs if r.variant == kind]
        sizes = {r.parameters(parameter_count) for r in of_kind}
        if len(sizes) < 3:
            notes.append(f"{kind}: {len(sizes)} model size(s); a scaling-law fit needs 3 (4+ for an uncertainty)")
            continue
        try:
            size_fits[kind] = fit_power_law(
                [r.parameters(parameter_count) for r in of_kind], [r.final_val_loss for r in of_kind]
            )
        except ValueError as error:  # the curves are still worth drawing
            notes.append(f"{kind}: no scaling-law fit: {error}")
    pair_names, pair_notes = reference_pairs(runs, reference)
    notes += pair_notes
    if token_ratio_model is not None and not any(
            _largest_pair(runs, token_ratio_model, parameter_count, v, r) for v, r in pair_names):
        raise ValueError(f"--token-ratio-model {token_ratio_model!r} has no run of both a variant and its reference; "
                         f"models: {sorted({r.model for r in runs})}")
    pairs = []
    for variant, ref in pair_names:
        parameter_ratios = []
        if variant in size_fits and ref in size_fits:
            # At each size of the variant trained, then at any size asked for (an extrapolation of both fits).
            sizes = sorted({r.parameters(parameter_count) for r in runs if r.variant == variant})
            parameter_ratios = [matching_ratio(size_fits[variant], size_fits[ref], n) for n in sizes]
            parameter_ratios += [matching_ratio(size_fits[variant], size_fits[ref], float(n)) for n in at_parameters]
        token_pair = _largest_pair(runs, token_ratio_model, parameter_count, variant, ref)
        token_fits: dict[str, PowerLawFit] = {}
        token_ratio = None
        if token_pair is None:
            notes.append(f"{variant} vs {ref}: no model size has runs of both: no token ratio")
        else:
            token_fits, token_ratio = _token_comparison(token_pair, token_fit_from, notes)
        pairs.append(PairComparison(variant, ref, parameter_ratios, token_pair, token_fits, token_ratio))
    return Comparison(runs, parameter_count, size_fits, pairs, notes)


def human_number(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def format_report(comparison: Comparison) -> str:
    count = comparison.parameter_count
    width = max([9] + [len(r.variant) for r in comparison.runs])
    lines = [f"{'run':<40} {'variant':<{width}} {'params (' + count + ')':>22} {'tokens':>10} {'final val loss':>15}"]
    for r in sorted(comparison.runs, key=lambda r: (r.variant, r.parameters(count))):
        lines.append(
            f"{r.name:<40} {r.variant:<{width}} {r.parameters(count):>22,} {human_number(r.token_budget):>10} "
            f"{r.final_val_loss:>15.4f}"
        )
    lines.append("")
    for kind, fit in comparison.size_fits.items():
        lines.append(f"scaling fit {kind:<{width}} {fit.describe('N')}")
    for pair in comparison.pairs:
        lines.append("")
        lines.append(f"{label(pair.variant)} against {label(pair.reference)}:")
        for estimate in pair.parameter_ratios:
            lines.append("  " + estimate.describe("parameter", "parameters", pair.variant, pair.reference))
        if pair.token_pair is not None:
            for kind, fit in pair.token_fits.items():
                lines.append(f"  token fit {kind:<{width}} {fit.describe('D')}")
            if pair.token_ratio is not None:
                lines.append(f"  along {pair.token_pair[0].name} vs {pair.token_pair[1].name}: "
                             + pair.token_ratio.describe("token", "tokens", pair.variant, pair.reference))
    for note in comparison.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
