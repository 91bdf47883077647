"""Scaling-law fits and the ratios the paper reports: L(N) = E + A·(N/N_ref)^-α per variant (attention kind and its
ablation keys), the parameter ratio N_variant / N_reference at equal loss (the paper, DIFF against the Transformer:
62.2% at 6.8B), and the token ratio along one run of each (63.7% at 3B), for every variant present against a
reference (default ``vanilla``), DIFF V2 against its own baseline (``vanilla model.num_kv_heads=Hkv/2``, recorded in
its run.json) when that was trained.

The fits follow Hoffmann et al. 2022 (approach 3) and Besiroglu et al. 2024: the law in log-sum-exp form,
log L = LSE(e, a − α·log(x/x_ref)) with E = exp(e) and A = exp(a), a Huber loss (δ = 1e-3) on the log-losses, the best
of a grid of starts; 68% intervals are percentiles of refits to bootstrap resamples (runs resampled within each size
where every size has several seeds, otherwise the fit's residuals resampled over the points). A law is fitted only to
more distinct x than it has parameters: E + A·x^-α to ≥ 4, the reduced form with E fixed (at 0 unless asked) to ≥ 3.
A ratio whose matched size lies outside the sizes measured is marked extrapolated. Every number stored is finite or
null with a reason."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from diff_transformer.analysis.runs import (
    BASELINE,
    DIFF,
    PARAMETER_COUNTS,
    RunRecord,
    check_comparable,
    split_budgets,
)
from diff_transformer.analysis.verdict import Verdict, significant, verdict
from diff_transformer.figure_style import human_number, variant_name

LABELS = {DIFF: "DIFF", BASELINE: "the Transformer"}  # in sentences; figures and tables use variant_name
MIN_RESIDUAL_DF = 2  # a fit with fewer residual degrees of freedom gives no interval
UNBOUNDED_RATIO = 1e6  # refits matching at a millionth of the size or less do not bound a ratio
HUBER_DELTA = 1e-3
BOOTSTRAP_SAMPLES = 200
INTERVAL_PERCENTILES = (15.865, 84.135)  # the central 68%
ALPHA_BOUNDS = (1e-4, 10.0)
E_START_FRACTIONS = (1e-3, 0.5, 0.8, 0.9, 0.95, 0.99)  # of the lowest loss
ALPHA_STARTS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5)
COMPUTE_OPTIMAL_TOKENS_PER_PARAMETER = 20  # Hoffmann et al. 2022
FIT_METHOD = (f"Huber loss (δ={HUBER_DELTA:g}) on log-loss, log-sum-exp form, best of a grid of starts "
              "(Hoffmann et al. 2022, approach 3)")


def label(variant: str) -> str:
    return LABELS.get(variant, variant)


def format_ratio(ratio: float) -> str:
    """To 2 significant figures: 62%, 120%, 3.4%, or from 10x a multiple (12x); past 1000x "over 1000x"."""
    if ratio >= 1000:
        return "over 1000x"
    if ratio >= 10:
        return f"{significant(ratio)}x"
    return f"{significant(100 * ratio)}%"


class FitRefused(ValueError):
    """Too few distinct points for the law asked for, or losses no power law describes."""


@dataclasses.dataclass
class PowerLawFit:
    """L(x) = E + A·(x/x_ref)^-α (E fitted, or fixed at ``fixed_E``), with the parameters of its bootstrap refits."""

    E: float
    A: float
    alpha: float
    x_ref: float
    num_points: int
    num_x: int  # distinct x: what the law is fitted across
    x_min: float
    x_max: float
    fixed_E: float | None
    bootstrap: np.ndarray  # (resamples, 3): E, A, alpha of each refit
    bootstrap_method: str

    @property
    def num_parameters(self) -> int:
        return 3 if self.fixed_E is None else 2

    @property
    def params(self) -> np.ndarray:
        return np.array([self.E, self.A, self.alpha])

    @property
    def A_unscaled(self) -> float:
        """A for L = E + A * x^(-alpha) in raw units of x."""
        return self.A * self.x_ref**self.alpha

    @property
    def alpha_at_bound(self) -> bool:
        return self.alpha >= ALPHA_BOUNDS[1] * 0.999

    def form(self, unit: str = "x", coefficient: str = "A", exponent: str = "α") -> str:
        power = f"{coefficient}·{unit}^-{exponent}"
        if self.fixed_E is None:
            return f"E + {power}"
        return f"{power} (E fixed at 0)" if self.fixed_E == 0 else f"E + {power} (E fixed at {self.fixed_E:g})"

    def interval(self, name: str) -> tuple[float, float] | None:
        """The 68% bootstrap interval of E, A or alpha; None for a fixed E or without resamples."""
        if self.interval_reason or (name == "E" and self.fixed_E is not None):
            return None
        column = {"E": 0, "A": 1, "alpha": 2}[name]
        low, high = np.percentile(self.bootstrap[:, column], INTERVAL_PERCENTILES)
        return float(low), float(high)

    @property
    def residual_df(self) -> int:
        return self.num_points - self.num_parameters

    @property
    def interval_reason(self) -> str | None:
        if self.residual_df < MIN_RESIDUAL_DF:
            return (f"{self.num_points} points for {self.num_parameters} parameters leave {self.residual_df} residual "
                    f"degree{'s' if self.residual_df != 1 else ''} of freedom; an interval needs ≥ {MIN_RESIDUAL_DF}")
        return None if len(self.bootstrap) >= 10 else f"{len(self.bootstrap)} bootstrap refits; intervals need 10"

    @property
    def warnings(self) -> list[str]:
        found = []
        if self.alpha_at_bound:
            found.append(f"α at its bound ({ALPHA_BOUNDS[1]:g}): the points do not constrain the law")
        if self.fixed_E is None and self.E < 1e-6:
            found.append("E fitted to 0: the points show no floor (a pure power law fits them as well)")
        return found

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * (np.asarray(x, dtype=np.float64) / self.x_ref) ** (-self.alpha)

    def inverse(self, loss: np.ndarray | float) -> np.ndarray:
        """x at which the law reaches `loss` (nan where loss is at or below the asymptote E)."""
        return _inverse(np.asarray(loss, dtype=np.float64), self.E, self.A, self.alpha, self.x_ref)

    def describe(self, unit: str = "N", coefficient: str = "A", exponent: str = "α", points: str = "sizes") -> str:
        def value(name, number, digits):
            interval = self.interval(name)
            shown = f"{number:.{digits}g}"
            return f"{shown} [{interval[0]:.{digits}g}, {interval[1]:.{digits}g}]" if interval else shown

        terms = [] if self.fixed_E is not None else [f"E = {value('E', self.E, 3)}"]
        terms += [f"{coefficient} = {value('A', self.A, 2)}", f"{exponent} = {value('alpha', self.alpha, 2)}"]
        spread = (f"68% bootstrap intervals in brackets ({len(self.bootstrap)} resamples: {self.bootstrap_method})"
                  if self.interval_reason is None else f"no intervals: {self.interval_reason}")
        text = (f"L({unit}) = {self.form(f'({unit}/{human_number(self.x_ref)})', coefficient, exponent)}: "
                f"{', '.join(terms)}; {self.num_x} {points}, {spread}")
        return text + "".join(f"; {warning}" for warning in self.warnings)

    def summary(self) -> dict:
        intervals = {name: self.interval(name) for name in ("E", "A", "alpha")}
        return {
            "form": self.form(),
            "E": self.E,
            "E_fixed": self.fixed_E is not None,
            "A": self.A,
            "alpha": self.alpha,
            "x_ref": self.x_ref,
            "interval_68": None if self.interval_reason else {k: list(v) if v else None for k, v in intervals.items()},
            "interval_reason": self.interval_reason
            or ("E is fixed, not fitted" if self.fixed_E is not None else None),
            "bootstrap": {"resamples": len(self.bootstrap), "method": self.bootstrap_method},
            "fit": FIT_METHOD,
            "num_points": self.num_points,
            "num_x": self.num_x,
            "x_range": [self.x_min, self.x_max],
            "warnings": self.warnings,
        }


def _inverse(loss, E, A, alpha, x_ref):
    gap = loss - E
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return np.where((gap > 0) & (A > 0) & (alpha > 0),
                        x_ref * (np.maximum(gap, 1e-300) / np.maximum(A, 1e-300)) ** (-1.0 / alpha), np.nan)


def _log_law(theta: np.ndarray, log_s: np.ndarray, log_E: float | None):
    """log L and its Jacobian for a batch: theta (B, 3) = (e, a, alpha), or (B, 2) = (a, alpha) with e fixed at
    log_E (-inf: E = 0); log_s (B, n). Returns (B, n) and (B, n, p)."""
    if log_E is None:
        e, a, alpha = theta[:, 0:1], theta[:, 1:2], theta[:, 2:3]
    else:
        e, a, alpha = log_E, theta[:, 0:1], theta[:, 1:2]
    power = a - alpha * log_s
    predicted = np.logaddexp(e, power)
    share = np.exp(power - predicted)  # the power term's share of L
    columns = [share, -share * log_s]
    if log_E is None:
        columns.insert(0, 1.0 - share)
    return predicted, np.stack(columns, axis=2)


def _huber(residual: np.ndarray) -> np.ndarray:
    size = np.abs(residual)
    return np.where(size <= HUBER_DELTA, 0.5 * residual**2, HUBER_DELTA * (size - 0.5 * HUBER_DELTA)).sum(axis=1)


def _grid_starts(log_s: np.ndarray, loss: np.ndarray, log_E: float | None) -> np.ndarray:
    """(starts, p): E at fractions of the lowest loss x α on a grid, A matching the losses' geometric mean."""
    E_starts = [f * loss.min() for f in E_START_FRACTIONS] if log_E is None else [0.0]
    starts = []
    for E0 in E_starts:
        gap = np.maximum(loss - (E0 if log_E is None else math.exp(log_E)), 1e-9 * loss.min())
        for alpha0 in ALPHA_STARTS:
            a0 = float(np.mean(np.log(gap) + alpha0 * log_s))
            starts.append([math.log(E0), a0, alpha0] if log_E is None else [a0, alpha0])
    return np.array(starts)


def _bounds(log_loss: np.ndarray, log_E: float | None) -> tuple[np.ndarray, np.ndarray]:
    if log_E is None:
        return np.array([-30.0, -60.0, ALPHA_BOUNDS[0]]), np.array([float(log_loss.max()), 60.0, ALPHA_BOUNDS[1]])
    return np.array([-60.0, ALPHA_BOUNDS[0]]), np.array([60.0, ALPHA_BOUNDS[1]])


def _huber_fit(log_s: np.ndarray, log_loss: np.ndarray, log_E: float | None, theta: np.ndarray,
               iterations: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Minimise the Huber loss of the log-residuals for a batch of problems at once (rows of log_s, log_loss, theta:
    one start each) by Levenberg-Marquardt on iteratively reweighted least squares, within the bounds; a row stops
    once no step improves it. Returns (theta, loss) per row."""
    lower, upper = _bounds(log_loss, log_E)
    theta = np.clip(np.array(theta, dtype=np.float64), lower, upper)
    predicted, jacobian = _log_law(theta, log_s, log_E)
    objective = _huber(predicted - log_loss)
    damping = np.full(len(theta), 1e-3)
    eye = np.eye(theta.shape[1])
    active = np.arange(len(theta))
    for _ in range(iterations):
        s, y, J, p, t, d = log_s[active], log_loss[active], jacobian[active], predicted[active], theta[active], \
            damping[active]
        residual = p - y
        weighted = J * np.minimum(1.0, HUBER_DELTA / np.maximum(np.abs(residual), 1e-300))[..., None]
        normal = np.matmul(weighted.transpose(0, 2, 1), J)
        gradient = np.matmul(weighted.transpose(0, 2, 1), residual[..., None])
        scale = np.diagonal(normal, axis1=1, axis2=2) + 1e-12
        step = np.linalg.solve(normal + d[:, None, None] * eye * scale[:, None, :], -gradient)[..., 0]
        trial = np.clip(t + step, lower, upper)
        trial_predicted, trial_jacobian = _log_law(trial, s, log_E)
        trial_objective = _huber(trial_predicted - y)
        better = trial_objective < objective[active]
        taken = active[better]
        theta[taken], predicted[taken], jacobian[taken] = trial[better], trial_predicted[better], trial_jacobian[better]
        objective[taken] = trial_objective[better]
        damping[active] = np.where(better, d / 3, d * 4)
        active = active[(damping[active] <= 1e10) & (objective[active] > 1e-30)]
        if len(active) == 0:
            break
    return theta, objective


def _as_params(theta: np.ndarray, log_E: float | None) -> tuple[float, float, float]:
    if log_E is None:
        return math.exp(theta[0]), math.exp(theta[1]), float(theta[2])
    return (0.0 if log_E == -math.inf else math.exp(log_E)), math.exp(theta[0]), float(theta[1])


def fit_power_law(
    x: Sequence[float],
    loss: Sequence[float],
    fixed_E: float | None = None,
    points: str = "sizes",
    num_bootstrap: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
) -> PowerLawFit:
    """Fit L = E + A (x/x_ref)^-alpha (E fixed at ``fixed_E`` when given) by a Huber loss on log L from a grid of
    starts, and refit it to ``num_bootstrap`` resamples. Refuses fewer distinct x than parameters + 1, naming both."""
    x = np.asarray(x, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    if x.shape != loss.shape or x.ndim != 1:
        raise ValueError(f"x and loss must be 1-D and the same length, got {x.shape} and {loss.shape}")
    if np.any(x <= 0) or not np.all(np.isfinite(loss)) or np.any(loss <= 0):
        raise ValueError(f"x and losses must be positive and finite, got x={x.tolist()} loss={loss.tolist()}")
    num_parameters = 3 if fixed_E is None else 2
    distinct = len(np.unique(x))
    if distinct < num_parameters + 1:
        form = "E + A·x^-α" if fixed_E is None else "A·x^-α with E fixed"
        raise FitRefused(f"a fit of {form} needs ≥ {num_parameters + 1} {points}; have {distinct}")
    if fixed_E is not None and fixed_E >= loss.min():
        raise FitRefused(f"E fixed at {fixed_E:g} is not below every loss (the lowest is {loss.min():.4f})")
    x_ref = float(np.exp(np.mean(np.log(x))))
    log_s, log_loss = np.log(x / x_ref), np.log(loss)
    log_E = None if fixed_E is None else (math.log(fixed_E) if fixed_E > 0 else -math.inf)
    starts = _grid_starts(log_s, loss, log_E)
    thetas, objectives = _huber_fit(np.tile(log_s, (len(starts), 1)), np.tile(log_loss, (len(starts), 1)), log_E,
                                    starts)
    theta = thetas[int(np.argmin(objectives))]
    E, A, alpha = _as_params(theta, log_E)
    if A <= 1e-20 or (fixed_E is None and alpha <= ALPHA_BOUNDS[0] * 1.001):
        raise FitRefused(f"losses {np.round(loss, 4).tolist()} do not fall with x {x.tolist()}; "
                         "a power law E + A·x^-α cannot describe them")
    predicted = _log_law(theta[None], log_s[None], log_E)[0][0]
    if len(x) - num_parameters < MIN_RESIDUAL_DF:  # residuals this few say nothing about the spread
        num_bootstrap = 0
    # Each resample refitted from the fit's optimum and from every seventh grid start, the best kept.
    resampled_s, resampled_log_loss, method = _resamples(log_s, log_loss, predicted, num_parameters,
                                                         np.random.default_rng(seed), num_bootstrap, points)
    refits = []
    if num_bootstrap > 0:
        refit_starts = np.concatenate([theta[None], starts[::7]])
        k = len(refit_starts)
        thetas, objectives = _huber_fit(np.repeat(resampled_s, k, axis=0), np.repeat(resampled_log_loss, k, axis=0),
                                        log_E, np.tile(refit_starts, (len(resampled_s), 1)))
        best = np.argmin(objectives.reshape(-1, k), axis=1)
        refits = [_as_params(t, log_E) for t in thetas.reshape(-1, k, len(theta))[np.arange(len(best)), best]]
    return PowerLawFit(E, A, alpha, x_ref, len(x), distinct, float(x.min()), float(x.max()), fixed_E,
                       np.array(refits, dtype=np.float64).reshape(-1, 3), method)


def _resamples(log_s, log_loss, predicted, num_parameters, rng, count, points):
    """Bootstrap resamples of (log x, log L) as (count, n) arrays and how they were drawn: the points at each x
    resampled when every x has several (seeds), otherwise the fit's residuals resampled over all points (scaled by
    sqrt(n / (n − p)) for the fitted parameters)."""
    n = len(log_s)
    strata = [np.flatnonzero(log_s == value) for value in np.unique(log_s)]
    if all(len(stratum) >= 2 for stratum in strata):
        index = np.concatenate([stratum[rng.integers(0, len(stratum), (count, len(stratum)))] for stratum in strata],
                               axis=1)
        return log_s[index], log_loss[index], (f"the {n} {points} resampled within each x "
                                               f"({min(map(len, strata))}-{max(map(len, strata))} seeds each)")
    residuals = log_loss - predicted
    noise = residuals[rng.integers(0, n, (count, n))] * math.sqrt(n / (n - num_parameters))
    return np.tile(log_s, (count, 1)), predicted + noise, f"the fit's residuals resampled over the {n} {points}"


def fit_supported_law(x: Sequence[float], loss: Sequence[float], name: str, notes: list[str],
                      fixed_E: float | None = None, points: str = "sizes", unit: str = "N",
                      num_bootstrap: int = BOOTSTRAP_SAMPLES) -> tuple[PowerLawFit | None, str | None]:
    """The fullest law the points support: E + A·x^-α with ≥ 4 distinct x, else A·x^-α with E fixed at 0 with 3
    (or E fixed at ``fixed_E`` when given); returns (fit, None) or (None, why there is none). Notes say which."""
    distinct = len(np.unique(np.asarray(x, dtype=np.float64)))
    if fixed_E is None and distinct == 3:
        notes.append(f"{name}: a fit of E + A·{unit}^-α needs ≥ 4 {points}; have 3: fitted the reduced form "
                     f"A·{unit}^-α (E fixed at 0) instead")
        fixed_E = 0.0
    elif fixed_E is None and distinct < 3:
        reason = (f"fit needs ≥ 4 {points} (≥ 3 for A·{unit}^-α with E fixed at 0); have {distinct}")
        notes.append(f"{name}: no fit: {reason}")
        return None, reason
    try:
        return fit_power_law(x, loss, fixed_E, points, num_bootstrap), None
    except FitRefused as error:
        notes.append(f"{name}: no fit: {error}")
        return None, str(error)


@dataclasses.dataclass
class RatioEstimate:
    """x_variant / x_reference at equal loss: the fits' point estimate and a 68% interval from pairing their
    bootstrap refits. ``ratio`` is None (with ``reason``) where no reference size reaches the variant's loss;
    ``extrapolated`` says which size lies outside the measured range, if any."""

    at: float
    loss: float
    ratio: float | None
    low: float | None
    high: float | None
    valid_fraction: float | None
    reason: str | None = None
    interval_reason: str | None = None
    extrapolated: str | None = None
    unconstrained_reason: str | None = None  # why the points do not pin the ratio down, if they do not

    @property
    def std(self) -> float | None:
        """Half the 68% interval's width: a standard deviation that heavy tails cannot blow up."""
        return None if self.low is None else (self.high - self.low) / 2

    @property
    def matched(self) -> float | None:
        return self.at / self.ratio if self.ratio else None

    @property
    def unconstrained(self) -> bool:
        """A fit at a bound of its exponent, or refits that disagree by more than a factor of 4 either side."""
        return self.unconstrained_reason is not None

    def summary(self) -> dict:
        return {**dataclasses.asdict(self), "std": self.std, "matched": self.matched,
                "unconstrained": self.unconstrained,
                "interval_68": None if self.low is None else [self.low, self.high]}

    def describe(self, what: str, unit: str, variant: str = DIFF, reference: str = BASELINE) -> str:
        name, other = label(variant), label(reference)
        if self.ratio is None:
            return f"{name} at {human_number(self.at)} {unit} (loss {self.loss:.3f}): no {what} ratio: {self.reason}"
        spread = (f", 68% bootstrap interval {format_ratio(self.low)} to {format_ratio(self.high)}" if self.low
                  is not None else f" (no interval: {self.interval_reason})")
        spread += f" (unconstrained: {self.unconstrained_reason})" if self.unconstrained else ""
        text = (f"{name} at {human_number(self.at)} {unit} (loss {self.loss:.3f}) matches {other} at "
                f"{human_number(self.matched)} {unit}: {what} ratio {format_ratio(self.ratio)}{spread}")
        return text + (f" [extrapolated: {self.extrapolated}]" if self.extrapolated else "")


def _outside(value: float, low: float, high: float) -> str | None:
    if value < low * (1 - 1e-9):
        return "below"
    if value > high * (1 + 1e-9):
        return "above"
    return None


def matching_ratio(variant_fit: PowerLawFit, reference_fit: PowerLawFit, at: float, unit: str = "parameters",
                   variant: str = DIFF, reference: str = BASELINE) -> RatioEstimate:
    """Ratio at / x_r where reference_fit(x_r) equals variant_fit(at): how much of the reference's size (or data) the
    variant needs, with a 68% interval over paired bootstrap refits (a refit whose reference never reaches the
    variant's loss counts as ratio 0)."""
    loss = float(variant_fit(at))
    matched = float(reference_fit.inverse(loss))
    extrapolated = []
    side = _outside(at, variant_fit.x_min, variant_fit.x_max)
    if side:
        extrapolated.append(f"{label(variant)} at {human_number(at)} {unit} lies {side} its measured range "
                            f"({human_number(variant_fit.x_min)}-{human_number(variant_fit.x_max)})")
    bound = [f"{label(k)}'s exponent at its bound" for k, fit in ((variant, variant_fit), (reference, reference_fit))
             if fit.alpha_at_bound]
    if not math.isfinite(matched):
        return RatioEstimate(at, loss, None, None, None, None,
                             reason=f"the loss is at or below {label(reference)}'s fitted asymptote "
                                    f"E={reference_fit.E:.4f}: no {label(reference)} size matches it",
                             extrapolated="; ".join(extrapolated) or None)
    side = _outside(matched, reference_fit.x_min, reference_fit.x_max)
    if side:
        extrapolated.append(f"{label(reference)} at {human_number(matched)} {unit} lies {side} its measured range "
                            f"({human_number(reference_fit.x_min)}-{human_number(reference_fit.x_max)})")
    count = min(len(variant_fit.bootstrap), len(reference_fit.bootstrap))
    low = high = valid_fraction = interval_reason = None
    if variant_fit.interval_reason or reference_fit.interval_reason:
        interval_reason = "; ".join(f"{label(k)}: {fit.interval_reason}" for k, fit in
                                    ((variant, variant_fit), (reference, reference_fit)) if fit.interval_reason)
    elif count < 10:
        interval_reason = f"{count} paired bootstrap refits; an interval needs 10"
    else:
        v, r = variant_fit.bootstrap[:count], reference_fit.bootstrap[:count]
        with np.errstate(over="ignore"):
            losses = v[:, 0] + v[:, 1] * (at / variant_fit.x_ref) ** (-v[:, 2])
        x_r = _inverse(losses, r[:, 0], r[:, 1], r[:, 2], reference_fit.x_ref)
        valid = np.isfinite(x_r) & (x_r > 0)
        with np.errstate(over="ignore", divide="ignore"):
            # a refit whose reference never reaches the loss: ratio 0 (no reference size is enough)
            ratios = np.where(valid, at / np.where(valid, x_r, 1.0), 0.0)
        valid_fraction = float(valid.mean())
        low, high = (float(q) for q in np.percentile(ratios, INTERVAL_PERCENTILES))
        if not (math.isfinite(high) and high <= UNBOUNDED_RATIO):
            low = high = None
            interval_reason = (f"over {100 - INTERVAL_PERCENTILES[1]:.0f}% of the refits match at a size under "
                               f"1/{UNBOUNDED_RATIO:.0e} of {label(variant)}'s: the refits do not bound the ratio")
    ratio = at / matched
    if low is not None and (high > 4 * ratio or low < ratio / 4):
        bound.append("the refits disagree by more than a factor of 4")
    return RatioEstimate(at, loss, ratio, low, high, valid_fraction, None, interval_reason,
                         "; ".join(extrapolated) or None, "; ".join(bound) or None)


@dataclasses.dataclass
class Convergence:
    """How far one run got: tokens per parameter against the compute-optimal ~20, and whether its loss still fell at
    the end (the last 10% of logged steps against the 10% before, beyond twice their standard error)."""

    run: str
    tokens_per_parameter: float
    still_falling: bool | None
    fall: float | None
    basis: str

    def describe(self) -> str:
        budget = (f"{self.tokens_per_parameter:.2g} tokens per parameter "
                  f"(≈{COMPUTE_OPTIMAL_TOKENS_PER_PARAMETER} is compute-optimal)")
        if self.still_falling is None:
            return f"{self.run}: {budget}; {self.basis}"
        trend = "still falling at the end" if self.still_falling else "flat at the end"
        return f"{self.run}: {budget}; loss {trend} ({significant(-self.fall)} {self.basis})"


    def summary(self) -> dict:
        return dataclasses.asdict(self) | {"note": self.describe()}


STILL_FALLING_NATS = 1e-3  # a validation loss that fell by more than this over the last quarter is still falling
FLAT_EVALUATIONS = 4  # evaluations in the last quarter needed to call a loss flat (fewer tell only a fall)
FLAT_TRAIN_WINDOW = 5  # train records per tenth of the run needed to call the train loss flat


def convergence_of(run: RunRecord, parameter_count: str = "total") -> Convergence:
    """From the validation losses of the last quarter of training where it has two evaluations or more (the same
    held-out samples every time, so their change is not batch noise), else the train loss's last 10% of steps
    against the 10% before (beyond twice their standard error)."""
    tokens_per_parameter = run.token_budget / max(1, run.parameters(parameter_count))
    late = run.val_steps >= run.last_step - 0.25 * run.last_step
    if np.count_nonzero(late) >= 2:
        values = run.val_loss[late]
        fall = float(values[0] - values[-1])
        steps = int(run.val_steps[late][-1] - run.val_steps[late][0])
        if fall > STILL_FALLING_NATS or len(values) >= FLAT_EVALUATIONS:
            return Convergence(run.name, tokens_per_parameter, fall > STILL_FALLING_NATS, fall,
                               f"in validation loss over the last {steps} steps")
    loss = run.train_loss
    window = len(loss) // 10
    if window >= FLAT_TRAIN_WINDOW:
        last, before = loss[-window:], loss[-2 * window:-window]
        fall = float(before.mean() - last.mean())
        error = math.sqrt(before.var(ddof=1) / window + last.var(ddof=1) / window)
        return Convergence(run.name, tokens_per_parameter, fall > 2 * error, fall,
                           "in train loss over the last 10% of steps")
    if len(run.val_loss) >= 2 and run.val_loss[-2] - run.val_loss[-1] > STILL_FALLING_NATS:
        fall = float(run.val_loss[-2] - run.val_loss[-1])
        return Convergence(run.name, tokens_per_parameter, True, fall, "in validation loss between the last two evaluations")
    return Convergence(run.name, tokens_per_parameter, None, None,
                       f"too few evaluations to tell whether the loss still falls ({len(run.val_loss)} evaluations, "
                       f"{len(loss)} train records; a flat call needs {FLAT_EVALUATIONS} in the last quarter)")


def convergence_summary(convergences: Sequence[Convergence]) -> str | None:
    """One line for a report or a figure when runs are short of converged, else None."""
    falling = [c for c in convergences if c.still_falling]
    budgets = [c.tokens_per_parameter for c in convergences]
    short = min(budgets) < COMPUTE_OPTIMAL_TOKENS_PER_PARAMETER / 4
    if not falling and not short:
        return None
    spread = f"{min(budgets):.2g}" if f"{min(budgets):.2g}" == f"{max(budgets):.2g}" else \
        f"{min(budgets):.2g}-{max(budgets):.2g}"
    return (f"{len(falling)} of {len(convergences)} run{'s' if len(convergences) != 1 else ''} still falling at the "
            f"end; {spread} tokens per parameter "
            f"(≈{COMPUTE_OPTIMAL_TOKENS_PER_PARAMETER} is compute-optimal): the fits describe these budgets, "
            "not converged models")


@dataclasses.dataclass
class CostComparison:
    """One pair at equal loss in a unit people pay in (training FLOPs, device seconds): each kind's L(cost) fit over
    its sizes, the ratio at each size of the variant, and where the two fits cross; ``note`` says why any is
    missing."""

    unit: str
    fits: dict[str, PowerLawFit]
    ratios: list[RatioEstimate]
    crossover: dict | None = None
    note: str | None = None

    def summary(self) -> dict:
        return {"unit": self.unit, "fits": {k: v.summary() for k, v in self.fits.items()},
                "ratios": [r.summary() for r in self.ratios], "crossover": self.crossover, "note": self.note}


@dataclasses.dataclass
class PairComparison:
    """One variant against its reference: the verdict against seed noise, the parameter ratio at each of its trained
    sizes (and any asked for), the token ratio on one model size, the ratios in FLOPs and device time; the notes say
    why any is missing. A ratio is a finding only where the verdict is ``better`` or ``worse``."""

    variant: str
    reference: str
    verdict: Verdict
    parameter_ratios: list[RatioEstimate]
    token_points: dict[str, tuple[np.ndarray, np.ndarray]]  # kind → (tokens, losses) the token fits saw
    token_fits: dict[str, PowerLawFit]
    token_ratio: RatioEstimate | None
    parameter_ratio_note: str | None = None
    token_note: str | None = None
    token_model: str | None = None
    token_basis: str | None = None  # what the token fits are fitted on
    flops: CostComparison | None = None
    device_time: CostComparison | None = None

    @property
    def ratios_are_findings(self) -> bool:
        return self.verdict.is_finding

    @property
    def withheld_reason(self) -> str | None:
        if self.ratios_are_findings:
            return None
        if self.verdict.outcome == "indistinguishable":
            return "not distinguishable from seed noise (verdict: indistinguishable)"
        return f"the verdict is undetermined ({self.verdict.reason})"

    def _ratios(self) -> dict:
        return {
            "parameter_ratios": [r.summary() for r in self.parameter_ratios],
            "token_ratio": self.token_ratio.summary() if self.token_ratio else None,
            "flops": self.flops.summary() if self.flops else None,
            "device_time": self.device_time.summary() if self.device_time else None,
        }

    def summary(self) -> dict:
        ratios = self._ratios()
        shown = ratios if self.ratios_are_findings else {
            "parameter_ratios": [], "token_ratio": None, "flops": None, "device_time": None}
        return {
            "variant": self.variant,
            "reference": self.reference,
            "verdict": self.verdict.summary(),
            "ratios_are_findings": self.ratios_are_findings,
            **shown,
            # The ratios the verdict does not support, kept for inspection, never a finding.
            "withheld_ratios": None if self.ratios_are_findings else {"reason": self.withheld_reason, **ratios},
            "parameter_ratio_note": self.parameter_ratio_note,
            "token_model": self.token_model,
            "token_basis": self.token_basis,
            "token_fits": {k: v.summary() for k, v in self.token_fits.items()},
            "token_note": self.token_note,
        }


@dataclasses.dataclass
class Comparison:
    """Every variant's size fit (or why it has none), each variant against its reference (``pairs``; DIFF's first),
    and each run's convergence. ``runs`` are the main runs (the largest budget of each replicate, the best learning
    rate of each cell); ``budget_runs`` the shorter ones (cooldown branches) the token fits use."""

    runs: list[RunRecord]
    parameter_count: str
    size_fits: dict[str, PowerLawFit]
    pairs: list[PairComparison]
    notes: list[str]
    size_fit_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    convergence: dict[str, Convergence] = dataclasses.field(default_factory=dict)
    budget_runs: list[RunRecord] = dataclasses.field(default_factory=list)
    lr_selection: list[dict] = dataclasses.field(default_factory=list)

    @property
    def primary(self) -> PairComparison | None:
        return self.pairs[0] if self.pairs else None

    @property
    def parameter_ratios(self) -> list[RatioEstimate]:
        return self.primary.parameter_ratios if self.primary else []

    @property
    def token_fits(self) -> dict[str, PowerLawFit]:
        return self.primary.token_fits if self.primary else {}

    @property
    def token_ratio(self) -> RatioEstimate | None:
        return self.primary.token_ratio if self.primary else None

    @property
    def convergence_note(self) -> str | None:
        return convergence_summary(list(self.convergence.values()))

    @property
    def seeds(self) -> str:
        """How many seeds each (variant, size) has: "3 seeds", "1-3 seeds"."""
        counts: dict[tuple, int] = {}
        for run in self.runs:
            counts[(run.variant, run.model)] = counts.get((run.variant, run.model), 0) + 1
        low, high = min(counts.values()), max(counts.values())
        return f"{low} seed{'s' if high > 1 else ''}" if low == high else f"{low}-{high} seeds"

    def summary(self) -> dict:
        primary = self.primary.summary() if self.primary else {"parameter_ratios": [], "token_ratio": None}
        return {
            "parameter_count": self.parameter_count,
            "fit_method": FIT_METHOD,
            "runs": [
                {
                    "name": r.name,
                    "model": r.model,
                    "attention": r.attention,
                    "variant": r.variant,
                    "seed": r.seed,
                    "lr": r.lr,
                    "parameters": r.parameters(self.parameter_count),
                    "final_val_loss": r.final_val_loss,
                    "tokens": r.token_budget,
                    "training_flops": r.training_flops,
                    "device": r.device,
                    "measured_tokens_per_s": r.measured_tokens_per_s,
                    "lr_decay": r.decay,
                    "data": r.data_label,
                    "convergence": self.convergence[r.name].summary() if r.name in self.convergence else None,
                }
                for r in self.runs
            ],
            "budget_runs": [{"name": r.name, "model": r.model, "variant": r.variant, "seed": r.seed, "lr": r.lr,
                             "tokens": r.token_budget, "final_val_loss": r.final_val_loss,
                             "branch": r.branch} for r in self.budget_runs],
            "lr_selection": self.lr_selection,
            "size_fits": {k: v.summary() for k, v in self.size_fits.items()},
            "size_fits_missing": dict(self.size_fit_reasons),
            "verdict": primary.get("verdict"),
            "parameter_ratios": primary["parameter_ratios"],
            "token_ratio": primary["token_ratio"],
            "pairs": [pair.summary() for pair in self.pairs],
            "convergence_note": self.convergence_note,
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


def select_learning_rates(runs: Sequence[RunRecord]) -> tuple[set[tuple], list[dict]]:
    """Where a (variant, model) cell has runs at several learning rates, the one with the lowest mean final
    validation loss over seeds: returns the (variant, model, lr) left out and one record per such cell."""
    cells: dict[tuple[str, str], dict] = {}
    for run in runs:
        cells.setdefault((run.variant, run.model), {}).setdefault(run.lr, []).append(run.final_val_loss)
    left_out, selections = set(), []
    for (variant, model), by_lr in cells.items():
        if len(by_lr) < 2:
            continue
        means = {lr: float(np.mean(losses)) for lr, losses in by_lr.items()}
        best = min(means, key=means.get)
        left_out |= {(variant, model, lr) for lr in by_lr if lr != best}
        selections.append({"variant": variant, "model": model, "best_lr": best,
                           "by_lr": [{"lr": lr, "mean_final_val_loss": means[lr], "seeds": len(by_lr[lr])}
                                     for lr in sorted(by_lr, key=lambda v: (v is None, v))]})
    return left_out, selections


def _describe_lr_selection(selection: dict) -> str:
    def lr(value):
        return "unrecorded" if value is None else f"{value:g}"

    options = ", ".join(f"{lr(row['lr'])}: {row['mean_final_val_loss']:.3f} ({row['seeds']} seeds)"
                        for row in selection["by_lr"])
    return (f"{variant_name(selection['variant'])} {selection['model']}: best lr {lr(selection['best_lr'])} by mean "
            f"final val loss over seeds ({options}); the other lrs are left out")


SCHEDULE_WARNING = ("evaluations along one run under a decaying learning rate mix data with the schedule (the loss "
                    "at D tokens depends on how far the decay has gone)")


def _token_comparison(variant: str, reference: str, main: Sequence[RunRecord], shorter: Sequence[RunRecord],
                      model: str | None, count: str, token_fit_from: float, notes: list[str], num_bootstrap: int):
    """The token ratio on one model size: L(D) of each kind fitted on the final losses of its finished runs at
    several token budgets (cooldown branches, or runs with different max_steps), the ratio at the variant's main
    budget; else, only where both ran a constant learning rate, on the evaluations along one run. Returns (model,
    basis, points, fits, ratio, note)."""
    every = list(main) + list(shorter)
    parameters = {r.model: r.parameters(count) for r in main}

    def budgets(kind, m):
        return {r.token_budget for r in every if r.variant == kind and r.model == m}

    both = [m for m in parameters if any(r.variant == variant and r.model == m for r in main)
            and any(r.variant == reference and r.model == m for r in main)]
    if model is not None:
        both = [m for m in both if m == model]
    if not both:
        return None, None, {}, {}, None, "no model size has runs of both: no token ratio"
    with_budgets = [m for m in both if min(len(budgets(variant, m)), len(budgets(reference, m))) >= 2]
    if with_budgets:
        chosen = max(with_budgets, key=parameters.get)
        points, fits = {}, {}
        for kind in (variant, reference):
            runs = [r for r in every if r.variant == kind and r.model == chosen]
            x = np.array([r.token_budget for r in runs], dtype=np.float64)
            y = np.array([r.final_val_loss for r in runs])
            points[kind] = (x, y)
            fit, reason = fit_supported_law(x, y, f"{kind} {chosen} (token fit)", notes, points="token budgets",
                                            unit="D", num_bootstrap=num_bootstrap)
            if fit is None:
                return chosen, "final losses of finished runs at several token budgets", points, fits, None, (
                    f"{label(kind)} {chosen}: {reason} (train cooldown branches at more token budgets)")
            fits[kind] = fit
        at = max(r.token_budget for r in main if r.variant == variant and r.model == chosen)
        ratio = matching_ratio(fits[variant], fits[reference], float(at), "tokens", variant, reference)
        return chosen, "final losses of finished runs at several token budgets", points, fits, ratio, None
    chosen = max(both, key=parameters.get)
    pair = [next(r for r in main if r.variant == kind and r.model == chosen) for kind in (variant, reference)]
    unknown = [r.name for r in pair if r.decay is None]
    decaying = [f"{r.name} ({r.decay})" for r in pair if r.decay not in (None, "constant")]
    if unknown or decaying:
        why = (f"{', '.join(unknown)} record{'s' if len(unknown) == 1 else ''} no lr_schedule (runs older than the "
               "key), so a decaying schedule cannot be ruled out" if unknown else
               f"{', '.join(decaying)} decay{'s' if len(decaying) == 1 else ''} the learning rate")
        return chosen, None, {}, {}, None, (
            f"no finished runs at several token budgets on {chosen}, and {why}: {SCHEDULE_WARNING}; train cooldown "
            "branches (optim.decay=wsd) or finished runs at several trainer.max_steps")
    points, fits = {}, {}
    for run in pair:
        keep = run.val_tokens >= token_fit_from * run.token_budget
        points[run.variant] = (run.val_tokens[keep], run.val_loss[keep])
        fit, reason = fit_supported_law(run.val_tokens[keep], run.val_loss[keep], f"{run.name} (token fit)", notes,
                                        points=f"evaluations past {token_fit_from:.0%} of training", unit="D",
                                        num_bootstrap=num_bootstrap)
        if fit is None:
            return chosen, None, points, fits, None, f"{run.name}: {reason} (lower trainer.eval_interval)"
        fits[run.variant] = fit
    ratio = matching_ratio(fits[variant], fits[reference], float(pair[0].val_tokens[-1]), "tokens", variant,
                           reference)
    return chosen, "evaluations along one run at a constant learning rate", points, fits, ratio, None


def crossover(variant_fit: PowerLawFit, reference_fit: PowerLawFit, variant: str, unit: str) -> dict:
    """Where the two fitted curves of loss against cost cross (searched over 1000x either side of the measured
    range): the cost from which the variant wins (or stops winning), marked extrapolated outside the measured
    range; or that they do not cross there."""
    low, high = min(variant_fit.x_min, reference_fit.x_min), max(variant_fit.x_max, reference_fit.x_max)
    grid = np.geomspace(low / 1000, high * 1000, 4001)
    gap = variant_fit(grid) - reference_fit(grid)  # below 0: the variant wins
    name = label(variant)

    def amount(x):  # human_number stops at T
        return human_number(x) if x < 1e15 else f"{x:.2g}"

    changes = np.flatnonzero(np.sign(gap[:-1]) != np.sign(gap[1:]))
    if len(changes) == 0:
        side = "wins" if gap[len(grid) // 2] < 0 else "loses"
        return {"at": None, "text": f"the fits do not cross from {amount(grid[0])} to {amount(grid[-1])} "
                                    f"{unit}: {name} {side} throughout", "extrapolated": None}
    i = int(changes[0])
    at = float(math.sqrt(grid[i] * grid[i + 1]))
    verb = "starts to win" if gap[i] > 0 else "stops winning"
    inside = low <= at <= high
    extrapolated = None if inside else (f"{amount(at)} {unit} lies outside the measured range "
                                        f"({amount(low)}-{amount(high)})")
    return {"at": at, "direction": verb, "extrapolated": extrapolated,
            "text": f"{name} {verb} at ≈ {amount(at)} {unit}" + (" (extrapolated)" if extrapolated else
                                                                        " (inside the measured range)")}


def _cost_comparison(unit: str, costs: dict[str, float], main: Sequence[RunRecord], variant: str, reference: str,
                     notes: list[str], num_bootstrap: int, with_crossover: bool) -> CostComparison:
    """L(cost) of each kind over its runs (``costs`` by run name, the same for every seed of a size) and the cost
    ratio at equal loss at each size of the variant."""
    fits, reasons = {}, {}
    for kind in (variant, reference):
        runs = [r for r in main if r.variant == kind]
        fit, reason = fit_supported_law([costs[r.name] for r in runs], [r.final_val_loss for r in runs],
                                        f"{kind} (loss against {unit})", notes, num_bootstrap=num_bootstrap, unit="C")
        if fit is None:
            reasons[kind] = reason
        else:
            fits[kind] = fit
    if reasons:
        return CostComparison(unit, fits, [], None, "; ".join(f"{label(k)}: no fit ({v})" for k, v in reasons.items()))
    at = sorted({costs[r.name] for r in main if r.variant == variant})
    ratios = [matching_ratio(fits[variant], fits[reference], c, unit, variant, reference) for c in at]
    return CostComparison(unit, fits, ratios, crossover(fits[variant], fits[reference], variant, unit)
                          if with_crossover else None)


def _device_seconds(main: Sequence[RunRecord]) -> tuple[dict[str, float] | None, str | None]:
    """Each run's device seconds (its tokens over its measured tokens/s), averaged over the seeds of its size, when
    every run ran on the same kind of device and measured its throughput; else None and why."""
    devices = {r.device for r in main}
    if None in devices:
        return None, "runs without a recorded device (older runs): no device-time ratio"
    if len(devices) > 1:
        return None, f"runs on different kinds of device ({', '.join(sorted(devices))}): no device-time ratio"
    unmeasured = [r.name for r in main if r.measured_tokens_per_s is None]
    if unmeasured:
        return None, f"{', '.join(unmeasured[:3])}: no tokens_per_s logged: no device-time ratio"
    by_size: dict[tuple, list[float]] = {}
    for run in main:
        by_size.setdefault((run.variant, run.model), []).append(run.token_budget / run.measured_tokens_per_s)
    return {r.name: float(np.mean(by_size[(r.variant, r.model)])) for r in main}, None


def compare_runs(
    runs: Sequence[RunRecord],
    parameter_count: str = "total",
    token_ratio_model: str | None = None,
    token_fit_from: float = 0.1,
    require_finished: bool = True,
    at_parameters: Sequence[float] = (),
    reference: str = BASELINE,
    fixed_E: float | None = None,
    num_bootstrap: int = BOOTSTRAP_SAMPLES,
) -> Comparison:
    """The verdict of every variant against its reference (see :func:`reference_pairs`), the scaling laws of every
    variant (the fullest form the sizes support, or E fixed at ``fixed_E``), and each pair's ratios at equal loss in
    parameters, tokens, FLOPs and device time; refuses runs that are not comparable."""
    if parameter_count not in PARAMETER_COUNTS:
        raise ValueError(f"parameter_count={parameter_count!r}; use one of {PARAMETER_COUNTS}")
    runs = list(runs)
    check_comparable(runs, require_finished=require_finished, same_budget=False)
    main, shorter = split_budgets(runs)
    check_comparable(main, require_finished=require_finished)
    notes: list[str] = []
    left_out, lr_selection = select_learning_rates(main)
    if left_out:
        main = [r for r in main if (r.variant, r.model, r.lr) not in left_out]
        shorter = [r for r in shorter if (r.variant, r.model, r.lr) not in left_out]
        notes += [_describe_lr_selection(selection) for selection in lr_selection]
    variants = list(dict.fromkeys(r.variant for r in main))
    size_fits: dict[str, PowerLawFit] = {}
    reasons: dict[str, str] = {}
    for kind in variants:
        of_kind = [r for r in main if r.variant == kind]
        fit, reason = fit_supported_law([r.parameters(parameter_count) for r in of_kind],
                                        [r.final_val_loss for r in of_kind], variant_name(kind), notes, fixed_E,
                                        num_bootstrap=num_bootstrap)
        if fit is not None:
            size_fits[kind] = fit
        else:
            reasons[kind] = reason
    pair_names, pair_notes = reference_pairs(main, reference)
    notes += pair_notes
    models = {r.model for r in main}
    if token_ratio_model is not None and token_ratio_model not in models:
        raise ValueError(f"--token-ratio-model {token_ratio_model!r} has no runs; models: {sorted(models)}")
    flops = {r.name: r.training_flops for r in main}
    flops_note = None if all(v is not None for v in flops.values()) else (
        "runs without flops_per_token in run.json (older runs): no FLOPs ratio")
    seconds, seconds_note = _device_seconds(main)
    pairs = []
    for variant, ref in pair_names:
        parameter_ratios, ratio_note = [], None
        if variant in size_fits and ref in size_fits:
            # At each size of the variant trained, then at any size asked for (an extrapolation of both fits).
            sizes = sorted({r.parameters(parameter_count) for r in main if r.variant == variant})
            parameter_ratios = [matching_ratio(size_fits[variant], size_fits[ref], float(n), "parameters", variant,
                                               ref) for n in list(sizes) + list(at_parameters)]
        else:
            ratio_note = "; ".join(f"{label(k)}: no size fit ({reasons[k]})" for k in (variant, ref) if k in reasons)
        pair_runs = [r for r in main if r.variant in (variant, ref)]
        token_model, basis, points, token_fits, token_ratio, token_note = _token_comparison(
            variant, ref, pair_runs, [r for r in shorter if r.variant in (variant, ref)], token_ratio_model,
            parameter_count, token_fit_from, notes, num_bootstrap)
        # (a cost fit's notes would repeat what the pair's line says)
        cost_flops = (CostComparison("FLOPs", {}, [], None, flops_note) if flops_note else
                      _cost_comparison("FLOPs", flops, pair_runs, variant, ref, [], num_bootstrap, True))
        cost_time = (CostComparison("device seconds", {}, [], None, seconds_note) if seconds_note else
                     _cost_comparison("device seconds", seconds, pair_runs, variant, ref, [], num_bootstrap, False))
        pairs.append(PairComparison(variant, ref, verdict(pair_runs, variant, ref, parameter_count), parameter_ratios,
                                    points, token_fits, token_ratio, ratio_note, token_note, token_model, basis,
                                    cost_flops, cost_time))
    convergence = {r.name: convergence_of(r, parameter_count) for r in main}
    return Comparison(main, parameter_count, size_fits, pairs, notes, reasons, convergence, shorter, lr_selection)


def _cost_lines(cost: CostComparison, pair: PairComparison) -> list[str]:
    if cost.note:
        return [f"  no {cost.unit} ratio: {cost.note}"]
    lines = [f"  {cost.unit} ratio: " + estimate.describe(f"{cost.unit}", cost.unit, pair.variant, pair.reference)
             for estimate in cost.ratios]
    if cost.crossover:
        lines.append(f"  loss against {cost.unit}: {cost.crossover['text']}")
    return lines


def format_report(comparison: Comparison) -> str:
    count = comparison.parameter_count
    width = max([11] + [len(variant_name(r.variant)) for r in comparison.runs])
    lines = [f"data: {comparison.runs[0].data_label}; {comparison.seeds} per size",
             f"{'run':<40} {'variant':<{width}} {'seed':>5} {'params (' + count + ')':>22} {'tokens':>10} "
             f"{'final val loss':>15}"]
    for r in sorted(comparison.runs, key=lambda r: (r.variant, r.parameters(count), str(r.seed))):
        lines.append(
            f"{r.name:<40} {variant_name(r.variant):<{width}} {str(r.seed if r.seed is not None else '-'):>5} "
            f"{r.parameters(count):>22,} {human_number(r.token_budget):>10} {r.final_val_loss:>15.3f}"
        )
    if comparison.budget_runs:
        lines.append(f"and {len(comparison.budget_runs)} shorter runs (cooldown branches or smaller max_steps) for "
                     "the token fits")
    lines.append("")
    lines.append(f"fits: {FIT_METHOD}")
    for kind, fit in comparison.size_fits.items():
        lines.append(f"scaling fit {variant_name(kind):<{width}} {fit.describe('N')}")
    for kind, reason in comparison.size_fit_reasons.items():
        lines.append(f"scaling fit {variant_name(kind):<{width}} none: {reason}")
    for pair in comparison.pairs:
        lines.append("")
        lines.append(f"{variant_name(pair.variant)} against {variant_name(pair.reference)}:")
        lines.append(pair.verdict.describe())
        if not pair.ratios_are_findings:
            lines.append(f"  parameter, token, FLOPs and device-time ratios: {pair.withheld_reason}; withheld "
                         "(compare.json: withheld_ratios)")
        else:
            for estimate in pair.parameter_ratios:
                lines.append("  " + estimate.describe("parameter", "parameters", pair.variant, pair.reference))
            if pair.token_ratio is not None:
                lines.append(f"  token ratio on {pair.token_model} from {pair.token_basis}: "
                             + pair.token_ratio.describe("token", "tokens", pair.variant, pair.reference))
            for cost in (pair.flops, pair.device_time):
                if cost is not None:
                    lines.extend(_cost_lines(cost, pair))
        if pair.parameter_ratio_note:
            lines.append(f"  no parameter ratio: {pair.parameter_ratio_note}")
        for kind, fit in pair.token_fits.items():
            lines.append(f"  token fit {variant_name(kind):<{width}} {fit.describe('D', 'B', 'β', 'token points')}")
        if pair.token_note:
            lines.append(f"  no token ratio: {pair.token_note}")
    lines.append("")
    lines.append("convergence:")
    for run in sorted(comparison.runs, key=lambda r: (r.variant, r.parameters(count), str(r.seed))):
        lines.append("  " + comparison.convergence[run.name].describe())
    if comparison.convergence_note:
        lines.append(f"note: {comparison.convergence_note}")
    for note in comparison.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
