"""Scaling-law fits and the ratios the paper reports: L(N) = E + A·(N/N_ref)^-α per attention kind, the parameter
ratio N_diff / N_baseline at equal loss (the paper: 62.2% at 6.8B), and the token ratio along one run of each kind
(63.7% at 3B). Uncertainties come from the fits' covariances, propagated to the ratios by sampling."""

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

    def describe(self, what: str, unit: str) -> str:
        if not math.isfinite(self.ratio):
            return (
                f"DIFF at {human_number(self.at)} {unit} (loss {self.loss:.4f}) is below the baseline's fitted asymptote: "
                f"no baseline {what} matches it"
            )
        spread = (
            f" (68% interval {100 * self.low:.1f}-{100 * self.high:.1f}%, ±{100 * self.std:.1f}%)"
            if math.isfinite(self.std)
            else " (no uncertainty: each fit needs 4 or more points)"
        )
        return (
            f"DIFF at {human_number(self.at)} {unit} (loss {self.loss:.4f}) matches the baseline at "
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
class Comparison:
    runs: list[RunRecord]
    parameter_count: str
    size_fits: dict[str, PowerLawFit]
    parameter_ratios: list[RatioEstimate]
    token_pair: tuple[RunRecord, RunRecord] | None
    token_fits: dict[str, PowerLawFit]
    token_ratio: RatioEstimate | None
    notes: list[str]

    def summary(self) -> dict:
        def fit_dict(fit: PowerLawFit) -> dict:
            return {
                "E": fit.E,
                "A": fit.A,
                "alpha": fit.alpha,
                "x_ref": fit.x_ref,
                "stderr": fit.stderr.tolist() if fit.has_uncertainty else None,
                "num_points": fit.num_points,
            }

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
            "size_fits": {k: fit_dict(v) for k, v in self.size_fits.items()},
            "parameter_ratios": [dataclasses.asdict(r) for r in self.parameter_ratios],
            "token_ratio_runs": [r.name for r in self.token_pair] if self.token_pair else None,
            "token_fits": {k: fit_dict(v) for k, v in self.token_fits.items()},
            "token_ratio": dataclasses.asdict(self.token_ratio) if self.token_ratio else None,
            "notes": self.notes,
        }


def _largest_pair(runs: Sequence[RunRecord], model: str | None, count: str) -> tuple[RunRecord, RunRecord] | None:
    by_model: dict[str, dict[str, RunRecord]] = {}
    for run in runs:
        by_model.setdefault(run.model, {})[run.variant] = run
    pairs = {m: kinds for m, kinds in by_model.items() if DIFF in kinds and BASELINE in kinds}
    if model is not None:
        if model not in pairs:
            raise ValueError(f"--token-ratio-model {model!r} needs a DIFF and a baseline run; models with both: {sorted(pairs)}")
        chosen = pairs[model]
    elif pairs:
        chosen = max(pairs.values(), key=lambda kinds: kinds[DIFF].parameters(count))
    else:
        return None
    return chosen[DIFF], chosen[BASELINE]


def compare_runs(
    runs: Sequence[RunRecord],
    parameter_count: str = "total",
    token_ratio_model: str | None = None,
    token_fit_from: float = 0.1,
    require_finished: bool = True,
    at_parameters: Sequence[float] = (),
) -> Comparison:
    """Fit the scaling laws and compute both ratios; refuses runs that are not comparable."""
    if parameter_count not in PARAMETER_COUNTS:
        raise ValueError(f"parameter_count={parameter_count!r}; use one of {PARAMETER_COUNTS}")
    runs = list(runs)
    check_comparable(runs, require_finished=require_finished)
    notes: list[str] = []
    size_fits: dict[str, PowerLawFit] = {}
    for kind in dict.fromkeys(r.variant for r in runs):  # every variant gets its fit; DIFF and vanilla their ratio
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
    parameter_ratios = []
    if DIFF in size_fits and BASELINE in size_fits:
        # At each DIFF size trained, then at any size asked for (an extrapolation of both fits).
        diff_sizes = sorted({r.parameters(parameter_count) for r in runs if r.variant == DIFF})
        parameter_ratios = [matching_ratio(size_fits[DIFF], size_fits[BASELINE], n) for n in diff_sizes]
        parameter_ratios += [matching_ratio(size_fits[DIFF], size_fits[BASELINE], float(n)) for n in at_parameters]

    token_pair = _largest_pair(runs, token_ratio_model, parameter_count)
    token_fits: dict[str, PowerLawFit] = {}
    token_ratio = None
    if token_pair is None:
        notes.append("no model size has both a DIFF and a baseline run: no token ratio")
    else:
        for run in token_pair:
            keep = run.val_tokens >= token_fit_from * run.token_budget
            if np.count_nonzero(keep) < 3:
                notes.append(
                    f"{run.name}: {np.count_nonzero(keep)} evaluations past {token_fit_from:.0%} of training; "
                    "the token fit needs 3 (lower trainer.eval_interval)"
                )
                break
            try:
                token_fits[run.variant] = fit_power_law(run.val_tokens[keep], run.val_loss[keep])
            except ValueError as error:
                notes.append(f"{run.name}: no token fit: {error}")
                break
        if len(token_fits) == 2:
            diff_run = token_pair[0]
            token_ratio = matching_ratio(token_fits[DIFF], token_fits[BASELINE], float(diff_run.val_tokens[-1]))
    return Comparison(runs, parameter_count, size_fits, parameter_ratios, token_pair, token_fits, token_ratio, notes)


def human_number(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def format_report(comparison: Comparison) -> str:
    count = comparison.parameter_count
    lines = [f"{'run':<40} {'attention':<9} {'params (' + count + ')':>22} {'tokens':>10} {'final val loss':>15}"]
    for r in sorted(comparison.runs, key=lambda r: (r.variant, r.parameters(count))):
        lines.append(
            f"{r.name:<40} {r.variant:<9} {r.parameters(count):>22,} {human_number(r.token_budget):>10} {r.final_val_loss:>15.4f}"
        )
    lines.append("")
    for kind, fit in comparison.size_fits.items():
        lines.append(f"scaling fit {kind:<8} {fit.describe('N')}")
    for estimate in comparison.parameter_ratios:
        lines.append(estimate.describe("parameter", "parameters"))
    if comparison.token_pair is not None:
        pair = comparison.token_pair
        lines.append("")
        for kind, fit in comparison.token_fits.items():
            lines.append(f"token fit {kind:<8} {fit.describe('D')}")
        if comparison.token_ratio is not None:
            lines.append(f"along {pair[0].name} vs {pair[1].name}: " + comparison.token_ratio.describe("token", "tokens"))
    for note in comparison.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
