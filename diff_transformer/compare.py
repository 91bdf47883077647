"""Compare DIFF with its mirrored baseline: loss curves, scaling-law fits, and the parameter and token ratios at equal loss.

    python -m diff_transformer.compare multirun/tiny/2026-11-25_22-10-00 --out docs/tiny_sweep.png
    python -m diff_transformer.compare --wandb my-team/diff-transformer/paper-scaling

Runs are read from run directories (`run.json` + `metrics.jsonl`, found recursively under each path) or from the W&B
API. Per attention kind the final validation losses are fitted with L(N) = E + A * (N / N_ref)^(-alpha); the parameter
ratio is N_diff / N_baseline at which both fits give the same loss (the paper: 62.2% at 6.8B). The token ratio does the
same along one run of each kind with L(D) over the validation losses at its evaluation steps (the paper: 63.7% at 3B).
Uncertainties come from the fits' covariances, propagated to the ratios by sampling the fitted parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

DIFF = "diff"
BASELINE = "vanilla"
ATTENTION_KINDS = (DIFF, BASELINE)
PARAMETER_COUNTS = ("total", "non_embedding")


class RunMismatchError(ValueError):
    """Runs that cannot be compared: different data, token budgets, or unfinished."""


@dataclasses.dataclass
class RunRecord:
    """One training run: its description from run.json and its logged metrics."""

    name: str
    source: str
    attention: str
    model: str
    num_parameters: int
    num_non_embedding_parameters: int
    tokens_per_step: int
    seq_length: int
    max_steps: int
    data: Any
    steps: np.ndarray
    tokens: np.ndarray
    train_loss: np.ndarray
    val_steps: np.ndarray
    val_tokens: np.ndarray
    val_loss: np.ndarray

    @property
    def token_budget(self) -> int:
        return self.tokens_per_step * self.max_steps

    @property
    def last_step(self) -> int:
        return int(self.steps[-1]) if len(self.steps) else 0

    @property
    def final_val_loss(self) -> float:
        return float(self.val_loss[-1])

    def parameters(self, count: str) -> int:
        return self.num_parameters if count == "total" else self.num_non_embedding_parameters


def _metric_rows_to_arrays(rows: Iterable[dict], tokens_per_step: int) -> dict[str, np.ndarray]:
    """Train and validation series by step; a step logged twice (replayed after a resume) keeps its last record."""
    train: dict[int, tuple[float, float]] = {}
    val: dict[int, tuple[float, float]] = {}
    for row in rows:
        if row.get("step") is None:
            continue
        step = int(row["step"])
        tokens = float(row["tokens"]) if row.get("tokens") is not None else float(step * tokens_per_step)
        if row.get("loss") is not None:
            train[step] = (tokens, float(row["loss"]))
        if row.get("val_loss") is not None:
            val[step] = (tokens, float(row["val_loss"]))
    steps = sorted(train)
    val_steps = sorted(val)
    return {
        "steps": np.array(steps, dtype=np.int64),
        "tokens": np.array([train[s][0] for s in steps], dtype=np.float64),
        "train_loss": np.array([train[s][1] for s in steps], dtype=np.float64),
        "val_steps": np.array(val_steps, dtype=np.int64),
        "val_tokens": np.array([val[s][0] for s in val_steps], dtype=np.float64),
        "val_loss": np.array([val[s][1] for s in val_steps], dtype=np.float64),
    }


def _record_from_description(name: str, source: str, description: dict, rows: Iterable[dict]) -> RunRecord:
    missing = [k for k in ("attention", "num_parameters", "tokens_per_step", "max_steps") if description.get(k) is None]
    if missing:
        raise ValueError(f"run {name} ({source}) lacks {', '.join(missing)} in its description; was it written by train.py?")
    tokens_per_step = int(description["tokens_per_step"])
    return RunRecord(
        name=name,
        source=source,
        attention=str(description["attention"]),
        model=str(description.get("model", name)),
        num_parameters=int(description["num_parameters"]),
        num_non_embedding_parameters=int(description.get("num_non_embedding_parameters") or description["num_parameters"]),
        tokens_per_step=tokens_per_step,
        seq_length=int(description.get("seq_length") or 0),
        max_steps=int(description["max_steps"]),
        data=description.get("data"),
        **_metric_rows_to_arrays(rows, tokens_per_step),
    )


def load_run(run_dir: str | Path, name: str | None = None) -> RunRecord:
    """Read one run directory written by train.py."""
    run_dir = Path(run_dir)
    description_path = run_dir / "run.json"
    metrics_path = run_dir / "metrics.jsonl"
    if not description_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no run.json; pass a run directory written by train.py or a sweep directory")
    description = json.loads(description_path.read_text())
    rows = []
    lines = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # A last line cut short by a killed job is the only expected damage: skip it, refuse anything else.
            if line_number == len(lines):
                continue
            raise ValueError(f"{metrics_path}:{line_number} is not JSON: {line[:80]!r}") from None
    return _record_from_description(name or run_dir.name, str(run_dir), description, rows)


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories (those holding run.json) at or under each path, in a stable order."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if (path / "run.json").is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.rglob("run.json") if "checkpoints" not in p.parts)
        if not below:
            raise FileNotFoundError(f"no run.json under {path}; pass run directories or a sweep directory")
        found.extend(below)
    return list(dict.fromkeys(found))


def _display_names(run_dirs: Sequence[Path]) -> list[str]:
    """Shortest path suffixes that tell the runs apart."""
    for depth in range(1, 8):
        names = ["/".join(d.parts[-depth:]) for d in run_dirs]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


def load_runs(paths: Sequence[str | Path]) -> list[RunRecord]:
    run_dirs = find_run_dirs(paths)
    return [load_run(d, name) for d, name in zip(run_dirs, _display_names(run_dirs))]


def check_comparable(runs: Sequence[RunRecord], require_finished: bool = True) -> None:
    """Refuse runs that saw different data or token budgets, or stopped early, naming them."""
    if not runs:
        raise RunMismatchError("no runs to compare")
    unknown = [f"{r.name} (attention={r.attention})" for r in runs if r.attention not in ATTENTION_KINDS]
    if unknown:
        raise RunMismatchError(f"unknown attention kind in {', '.join(unknown)}; expected one of {ATTENTION_KINDS}")
    for field, describe in (
        ("data", lambda r: json.dumps(r.data, sort_keys=True, default=str)),
        ("token budget", lambda r: f"{r.token_budget:,} tokens ({r.max_steps} steps x {r.tokens_per_step:,})"),
    ):
        groups: dict[str, list[RunRecord]] = {}
        for run in runs:
            groups.setdefault(describe(run), []).append(run)
        if len(groups) > 1:
            # Name the odd runs out against what most runs share.
            common_value, common_runs = max(groups.items(), key=lambda item: len(item[1]))
            odd = "; ".join(
                f"{run.name} ({run.source}) has {value}"
                for value, group in groups.items() if value != common_value for run in group
            )
            raise RunMismatchError(
                f"runs differ in {field} and cannot be compared: {odd}; while {len(common_runs)} run(s) "
                f"({', '.join(r.name for r in common_runs[:4])}{', ...' if len(common_runs) > 4 else ''}) have "
                f"{common_value}. Compare runs trained on the same data with the same token budget."
            )
    if require_finished:
        unfinished = [f"{r.name} ({r.source}, step {r.last_step} of {r.max_steps})" for r in runs if r.last_step < r.max_steps]
        if unfinished:
            raise RunMismatchError(f"runs not finished: {', '.join(unfinished)}; wait for them or leave them out")
    no_val = [f"{r.name} ({r.source})" for r in runs if len(r.val_loss) == 0]
    if no_val:
        raise RunMismatchError(
            f"runs without a validation loss: {', '.join(no_val)}; train with trainer.eval_interval > 0"
        )


# ----------------------------------------------------------------------------------------------------------- fits


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
                f"DIFF at {_human(self.at)} {unit} (loss {self.loss:.4f}) is below the baseline's fitted asymptote: "
                f"no baseline {what} matches it"
            )
        spread = (
            f" (68% interval {100 * self.low:.1f}-{100 * self.high:.1f}%, ±{100 * self.std:.1f}%)"
            if math.isfinite(self.std)
            else " (no uncertainty: each fit needs 4 or more points)"
        )
        return (
            f"DIFF at {_human(self.at)} {unit} (loss {self.loss:.4f}) matches the baseline at "
            f"{_human(self.at / self.ratio)} {unit}: {what} ratio {100 * self.ratio:.1f}%{spread}"
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
        by_model.setdefault(run.model, {})[run.attention] = run
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
    for kind in ATTENTION_KINDS:
        of_kind = [r for r in runs if r.attention == kind]
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
    if len(size_fits) == 2:
        # At each DIFF size trained, then at any size asked for (an extrapolation of both fits).
        diff_sizes = sorted({r.parameters(parameter_count) for r in runs if r.attention == DIFF})
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
                token_fits[run.attention] = fit_power_law(run.val_tokens[keep], run.val_loss[keep])
            except ValueError as error:
                notes.append(f"{run.name}: no token fit: {error}")
                break
        if len(token_fits) == 2:
            diff_run = token_pair[0]
            token_ratio = matching_ratio(token_fits[DIFF], token_fits[BASELINE], float(diff_run.val_tokens[-1]))
    return Comparison(runs, parameter_count, size_fits, parameter_ratios, token_pair, token_fits, token_ratio, notes)


# ------------------------------------------------------------------------------------------------------- reports


def _human(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def format_report(comparison: Comparison) -> str:
    count = comparison.parameter_count
    lines = [f"{'run':<40} {'attention':<9} {'params (' + count + ')':>22} {'tokens':>10} {'final val loss':>15}"]
    for r in sorted(comparison.runs, key=lambda r: (r.attention, r.parameters(count))):
        lines.append(
            f"{r.name:<40} {r.attention:<9} {r.parameters(count):>22,} {_human(r.token_budget):>10} {r.final_val_loss:>15.4f}"
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


def _spread_label(estimate: RatioEstimate) -> str:
    if not math.isfinite(estimate.std):
        return " (no uncertainty)"
    if estimate.std > estimate.ratio:  # a degenerate fit: a ± of thousands of percent says nothing
        return " (unconstrained)"
    return f" ±{100 * estimate.std:.0f}%"


def _annotate_ratio(ax, estimate: RatioEstimate, unit: str) -> None:
    """An arrow from the DIFF point to where the baseline reaches the same loss, labelled with the ratio."""
    if not math.isfinite(estimate.ratio):
        return
    matched = estimate.at / estimate.ratio
    ax.annotate("", xy=(matched, estimate.loss), xytext=(estimate.at, estimate.loss),
                arrowprops=dict(arrowstyle="<->", color="k", lw=0.8))
    ax.text(math.sqrt(matched * estimate.at), estimate.loss,
            f"{100 * estimate.ratio:.1f}%{_spread_label(estimate)} {unit}\n", va="bottom", ha="center", fontsize=9)


def plot_comparison(comparison: Comparison, out_path: str | Path, title: str | None = None) -> Path:
    """Train/validation curves, the size fit with its parameter ratio, and the token fit along one run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = comparison.parameter_count
    runs = sorted(comparison.runs, key=lambda r: r.parameters(count))
    models = list(dict.fromkeys(r.model for r in runs))
    colors = {m: plt.get_cmap("viridis")(i / max(1, len(models) - 1) * 0.85) for i, m in enumerate(models)}
    styles = {DIFF: "-", BASELINE: "--"}
    markers = {DIFF: "o", BASELINE: "s"}
    labels = {DIFF: "DIFF", BASELINE: "Transformer"}

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ax = axes[0]
    for r in runs:
        ax.plot(r.tokens, r.train_loss, styles[r.attention], color=colors[r.model], alpha=0.35, lw=1)
        ax.plot(r.val_tokens, r.val_loss, styles[r.attention], marker=markers[r.attention], ms=3, color=colors[r.model],
                label=f"{labels[r.attention]} {r.model}")
    # Early steps dwarf the curves' ends: frame the validation losses, with the train curves' tail in view.
    val_all = np.concatenate([r.val_loss for r in runs])
    tail_all = np.concatenate([r.train_loss[len(r.train_loss) // 10:] for r in runs])
    low, high = min(val_all.min(), tail_all.min()), max(val_all.max(), np.percentile(tail_all, 95))
    ax.set_ylim(low - 0.05 * (high - low), high + 0.1 * (high - low))
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (train faint, validation marked)")
    ax.set_title("loss curves")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)

    ax = axes[1]
    all_n = np.array([r.parameters(count) for r in runs], dtype=np.float64)
    grid = np.geomspace(all_n.min() / 1.5, all_n.max() * 1.5, 200)
    for kind in ATTENTION_KINDS:
        of_kind = [r for r in runs if r.attention == kind]
        if not of_kind:
            continue
        ax.plot([r.parameters(count) for r in of_kind], [r.final_val_loss for r in of_kind], markers[kind], color="C0" if kind == DIFF else "C1", label=f"{labels[kind]} runs")
        if kind in comparison.size_fits:
            fit = comparison.size_fits[kind]
            ax.plot(grid, fit(grid), styles[kind], color="C0" if kind == DIFF else "C1",
                    label=f"{labels[kind]} fit: E={fit.E:.3f}, α={fit.alpha:.2f}")
    trained = [e for e in comparison.parameter_ratios if e.at <= all_n.max()]
    if trained:
        largest = trained[-1]
        _annotate_ratio(ax, largest, "params")
    # Frame the measured losses: a steep fit extrapolated past the smallest size would flatten them.
    finals = np.array([r.final_val_loss for r in runs])
    span = max(finals.max() - finals.min(), 0.05)
    ax.set_ylim(finals.min() - 0.4 * span, finals.max() + 0.6 * span)
    ax.set_xscale("log")
    ax.set_xlabel(f"parameters ({count.replace('_', '-')})")
    ax.set_ylabel("final validation loss")
    ax.set_title("scaling: L(N) = E + A·N^-α")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")

    ax = axes[2]
    if comparison.token_pair is not None:
        for run in comparison.token_pair:
            color = "C0" if run.attention == DIFF else "C1"
            ax.plot(run.val_tokens, run.val_loss, markers[run.attention], color=color, ms=4,
                    label=f"{labels[run.attention]} {run.model}")
            if run.attention in comparison.token_fits:
                fit = comparison.token_fits[run.attention]
                tokens = np.geomspace(max(run.val_tokens.min(), 1.0), run.val_tokens.max() * 1.5, 200)
                ax.plot(tokens, fit(tokens), styles[run.attention], color=color, label=f"{labels[run.attention]} fit: α={fit.alpha:.2f}")
        estimate = comparison.token_ratio
        if estimate is not None:
            _annotate_ratio(ax, estimate, "tokens")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("data: L(D) = E + B·D^-β along one run")
    ax.grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


# ----------------------------------------------------------------------------------------------------------- W&B


def _lookup(sources: Sequence[dict], dotted: str) -> Any:
    for source in sources:
        value: Any = source
        for key in dotted.split("."):
            if not isinstance(value, dict) or key not in value:
                value = None
                break
            value = value[key]
        if value is not None:
            return value
    return None


def load_wandb_runs(path: str, api: Any = None) -> list[RunRecord]:
    """Runs of one W&B group, path ENTITY/PROJECT/GROUP; each run's config holds the resolved config and run.json."""
    parts = path.strip("/").split("/")
    if len(parts) != 3:
        raise ValueError(f"--wandb {path!r}: expected ENTITY/PROJECT/GROUP")
    entity, project, group = parts
    if api is None:
        try:
            import wandb
        except ImportError as error:
            raise SystemExit(f"reading runs from W&B needs the wandb package: {error}") from None
        api = wandb.Api()
    records = []
    for run in api.runs(f"{entity}/{project}", filters={"group": group}):
        config = dict(run.config)
        summary = dict(getattr(run, "summary", {}) or {})
        # run.json's fields, either logged at the top of the config, under "run", or in the summary.
        sources = [config.get("run") or {}, config, summary]
        description = {
            "attention": _lookup(sources, "attention") or _lookup([config], "model.attention"),
            "model": _lookup(sources, "model") if isinstance(_lookup(sources, "model"), str) else _lookup([config], "model.name"),
            "num_parameters": _lookup(sources, "num_parameters"),
            "num_non_embedding_parameters": _lookup(sources, "num_non_embedding_parameters"),
            "tokens_per_step": _lookup(sources, "tokens_per_step"),
            "seq_length": _lookup(sources, "seq_length") or _lookup([config], "model.seq_length"),
            "max_steps": _lookup(sources, "max_steps") or _lookup([config], "trainer.max_steps"),
            "data": _lookup([config.get("run") or {}], "data") or _lookup([config], "data"),
        }
        rows = ({"step": row.get("_step") if row.get("step") is None else row.get("step"), **row}
                for row in run.scan_history(keys=None))
        records.append(_record_from_description(run.name, f"wandb:{entity}/{project}/{run.id}", description, rows))
    if not records:
        raise RunMismatchError(f"no W&B runs in group {group!r} of {entity}/{project}")
    return records


def log_to_wandb(comparison: Comparison, png: Path, path: str) -> str:
    """Log the figure and the tables as a `compare` run in the same W&B group; returns its URL."""
    import wandb

    entity, project, group = path.strip("/").split("/")
    run = wandb.init(entity=entity, project=project, group=group, job_type="compare", name=f"compare-{group}")
    count = comparison.parameter_count
    runs_table = wandb.Table(columns=["run", "model", "attention", f"parameters_{count}", "tokens", "final_val_loss"])
    for r in comparison.runs:
        runs_table.add_data(r.name, r.model, r.attention, r.parameters(count), r.token_budget, r.final_val_loss)
    ratio_table = wandb.Table(columns=["kind", "diff_at", "loss", "ratio", "low_68", "high_68", "std"])
    for estimate in comparison.parameter_ratios:
        ratio_table.add_data("parameters", estimate.at, estimate.loss, estimate.ratio, estimate.low, estimate.high, estimate.std)
    if comparison.token_ratio is not None:
        t = comparison.token_ratio
        ratio_table.add_data("tokens", t.at, t.loss, t.ratio, t.low, t.high, t.std)
    run.log({"comparison": wandb.Image(str(png)), "runs": runs_table, "ratios": ratio_table})
    run.summary.update({"summary": comparison.summary()})
    url = run.url
    run.finish()
    return url


# ----------------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diff_transformer.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="run directories or sweep directories holding them")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT/GROUP", help="read the runs of this W&B group instead, and log the comparison there")
    parser.add_argument("--out", help="figure path (default: compare.png in the first path, or ./compare-<group>.png)")
    parser.add_argument("--parameters", choices=PARAMETER_COUNTS, default="total", help="parameter count on the x axis of the size fit")
    parser.add_argument("--token-ratio-model", help="model name whose DIFF/baseline pair gives the token ratio (default: the largest)")
    parser.add_argument("--token-fit-from", type=float, default=0.1, help="fit L(D) on evaluations past this fraction of training")
    parser.add_argument("--at", type=float, nargs="+", default=[], metavar="N",
                        help="also report the parameter ratio at these DIFF sizes, e.g. --at 6.8e9 (extrapolated)")
    parser.add_argument("--allow-unfinished", action="store_true", help="compare runs that stopped before max_steps")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run or sweep directories, or --wandb ENTITY/PROJECT/GROUP (one of the two)")
    try:
        runs = load_wandb_runs(args.wandb) if args.wandb else load_runs(args.paths)
        comparison = compare_runs(runs, args.parameters, args.token_ratio_model, args.token_fit_from,
                                  not args.allow_unfinished, args.at)
    except (RunMismatchError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
    elif args.paths:
        first = Path(args.paths[0])
        out = (first if first.is_dir() else first.parent) / "compare.png"
    else:
        out = Path(f"compare-{args.wandb.rstrip('/').split('/')[-1]}.png")
    print(format_report(comparison))
    plot_comparison(comparison, out, args.title)
    out.with_suffix(".json").write_text(json.dumps(comparison.summary(), indent=2, default=float) + "\n")
    print(f"\nfigure: {out}\nsummary: {out.with_suffix('.json')}")
    if args.wandb:
        print(f"logged to W&B: {log_to_wandb(comparison, out, args.wandb)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
