"""Figures: the scaling comparison (curves and size fits of every variant; the first pair's ratios, DIFF against its
reference when both were trained, and its token fit), the seed spread of every variant of an ablation sweep, and the
quickstart's curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List

import numpy as np

from diff_transformer.analysis.runs import BASELINE, DIFF, RunRecord
from diff_transformer.analysis.scaling import Comparison, RatioEstimate
from diff_transformer.analysis.variants import VariantStats

LABELS = {DIFF: "DIFF", BASELINE: "Transformer"}
STYLES = {DIFF: "-", BASELINE: "--"}
MARKERS = {DIFF: "o", BASELINE: "s"}
KIND_COLORS = {DIFF: "C0", BASELINE: "C1"}
OTHER_STYLES, OTHER_MARKERS = ("-.", ":"), ("^", "v", "D", "P", "X", "<", ">", "*")


def _label(variant: str) -> str:
    return LABELS.get(variant, variant)


def _style(variant: str, variants: List[str]) -> str:
    return STYLES.get(variant) or OTHER_STYLES[variants.index(variant) % len(OTHER_STYLES)]


def _marker(variant: str, variants: List[str]) -> str:
    return MARKERS.get(variant) or OTHER_MARKERS[variants.index(variant) % len(OTHER_MARKERS)]


def _color(variant: str, variants: List[str]) -> str:
    return KIND_COLORS.get(variant) or f"C{2 + variants.index(variant) % 8}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    plt = _pyplot()
    count = comparison.parameter_count
    runs = sorted(comparison.runs, key=lambda r: r.parameters(count))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    _draw_loss_curves(axes[0], runs, plt)
    _draw_size_fit(axes[1], comparison, runs)
    _draw_token_fit(axes[2], comparison)
    if title:
        fig.suptitle(title)
    return _save(fig, out_path, plt)


def _draw_loss_curves(ax, runs: List[RunRecord], plt) -> None:
    """Train (faint) and validation (marked) loss against tokens, one colour per model size."""
    models = list(dict.fromkeys(r.model for r in runs))
    variants = sorted({r.variant for r in runs})
    colors = {m: plt.get_cmap("viridis")(i / max(1, len(models) - 1) * 0.85) for i, m in enumerate(models)}
    for r in runs:
        style = _style(r.variant, variants)
        ax.plot(r.tokens, r.train_loss, style, color=colors[r.model], alpha=0.35, lw=1)
        ax.plot(r.val_tokens, r.val_loss, style, marker=_marker(r.variant, variants), ms=3,
                color=colors[r.model], label=f"{_label(r.variant)} {r.model}")
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


def _draw_size_fit(ax, comparison: Comparison, runs: List[RunRecord]) -> None:
    """Final validation loss against parameters, each kind's L(N) fit, and the parameter ratio at the largest size."""
    count = comparison.parameter_count
    all_n = np.array([r.parameters(count) for r in runs], dtype=np.float64)
    grid = np.geomspace(all_n.min() / 1.5, all_n.max() * 1.5, 200)
    variants = sorted({r.variant for r in runs})
    for kind in variants:
        of_kind = [r for r in runs if r.variant == kind]
        ax.plot([r.parameters(count) for r in of_kind], [r.final_val_loss for r in of_kind], _marker(kind, variants),
                color=_color(kind, variants), label=f"{_label(kind)} runs")
        if kind in comparison.size_fits:
            fit = comparison.size_fits[kind]
            ax.plot(grid, fit(grid), _style(kind, variants), color=_color(kind, variants),
                    label=f"{_label(kind)} fit: E={fit.E:.3f}, α={fit.alpha:.2f}")
    trained = [e for e in comparison.parameter_ratios if e.at <= all_n.max()]
    if trained:
        _annotate_ratio(ax, trained[-1], "params")
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


def _draw_token_fit(ax, comparison: Comparison) -> None:
    """Validation loss against tokens along the first pair's runs, each run's L(D) fit, and the token ratio."""
    if comparison.token_pair is not None:
        variants = sorted({r.variant for r in comparison.runs})
        for run in comparison.token_pair:
            color = _color(run.variant, variants)
            ax.plot(run.val_tokens, run.val_loss, _marker(run.variant, variants), color=color, ms=4,
                    label=f"{_label(run.variant)} {run.model}")
            if run.variant in comparison.token_fits:
                fit = comparison.token_fits[run.variant]
                tokens = np.geomspace(max(run.val_tokens.min(), 1.0), run.val_tokens.max() * 1.5, 200)
                ax.plot(tokens, fit(tokens), _style(run.variant, variants), color=color,
                        label=f"{_label(run.variant)} fit: α={fit.alpha:.2f}")
        if comparison.token_ratio is not None:
            _annotate_ratio(ax, comparison.token_ratio, "tokens")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("data: L(D) = E + B·D^-β along one run")
    ax.grid(alpha=0.3, which="both")


def plot_variant_spread(stats: List[VariantStats], out_path: str | Path, title: str | None = None) -> Path:
    """Final validation loss of every variant: each seed a dot, the mean ± one standard deviation a bar, and the
    references' means as vertical lines, so that a difference can be read against the seed-to-seed spread."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(stats) + 1.6))
    for y, s in enumerate(stats):
        ax.errorbar(s.mean, y, xerr=s.std if math.isfinite(s.std) else 0, fmt="o", color="k", capsize=4, zorder=3)
        ax.scatter(s.values, [y] * len(s.values), color="C0", alpha=0.6, s=18, zorder=2)
    compared = {r for s in stats for r in s.deltas}
    for i, ref in enumerate(s for s in stats if s.variant in compared):
        ax.axvline(ref.mean, color=f"C{1 + i}", ls="--", lw=1, label=f"{ref.variant} mean ({ref.model})")
    ax.set_yticks(range(len(stats)), [f"{s.variant} (n={s.n})" for s in stats], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("final validation loss (dots: seeds; bar: mean ± std over seeds)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, out_path, plt)


def _save(fig, out_path: str | Path, plt) -> Path:
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


QUICKSTART_LABELS = {DIFF: "DIFF Transformer", BASELINE: "Transformer (2H heads)"}
QUICKSTART_COLORS = {DIFF: "tab:red", BASELINE: "tab:blue"}


def plot_loss_curves(runs: Dict[str, List[dict]], out_path: str | Path,
                     title: str = "tiny DIFF vs its mirrored baseline on the bundled corpus (CPU)") -> Path:
    """Train loss (raw and smoothed) and validation loss against steps, from each kind's metrics.jsonl records."""
    plt = _pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, records in runs.items():
        steps = np.array([r["step"] for r in records])
        loss = np.array([r["loss"] for r in records])
        window = max(1, len(loss) // 30)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax_train.plot(steps, loss, color=QUICKSTART_COLORS[kind], alpha=0.2, lw=0.8)
        ax_train.plot(steps[window - 1:], smooth, color=QUICKSTART_COLORS[kind], label=QUICKSTART_LABELS[kind])
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax_val.plot(*zip(*val), marker="o", color=QUICKSTART_COLORS[kind], label=QUICKSTART_LABELS[kind])
    tail = np.concatenate([[r["loss"] for r in recs[len(recs) // 5:]] for recs in runs.values()])
    ax_train.set_ylim(tail.min() - 0.1, np.percentile(tail, 99) + 0.3)
    for ax, name in ((ax_train, "train loss"), (ax_val, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return _save(fig, out_path, plt)
