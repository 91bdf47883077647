"""Figures: the scaling comparison (curves and size fits of every variant; the first pair's ratios, DIFF against its
reference when both were trained, and its token fit), the seed spread of every variant of an ablation sweep, and the
quickstart's curves. Every kind keeps its colour (``figure_style``), every title names the data, and a panel that
cannot be drawn says why in the panel."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Dict, List

import numpy as np

from diff_transformer.analysis.runs import BASELINE, DIFF, RunRecord
from diff_transformer.analysis.scaling import FIT_METHOD, Comparison, PowerLawFit, RatioEstimate, format_ratio
from diff_transformer.analysis.variants import VariantStats
from diff_transformer.figure_style import human_number, kind_color, kind_of, log_ticks, variant_name

LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*")


def _within_kind(variant: str, variants: List[str]) -> int:
    """The variant's place among the variants of its kind: its line style and marker (its colour is the kind's)."""
    same_kind = [v for v in variants if kind_of(v) == kind_of(variant)]
    return same_kind.index(variant)


def _style(variant: str, variants: List[str]) -> str:
    return LINE_STYLES[_within_kind(variant, variants) % len(LINE_STYLES)]


def _marker(variant: str, variants: List[str]) -> str:
    return MARKERS[_within_kind(variant, variants) % len(MARKERS)]


def _shade(color: str, position: int, count: int):
    """The kind's colour, lighter for smaller models: position 0 of count is the lightest, the last the colour."""
    from matplotlib.colors import to_rgb

    mix = 0.0 if count <= 1 else 0.6 * (1 - position / (count - 1))
    return tuple(c + (1 - c) * mix for c in to_rgb(color))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _set_log_axis(axis, low: float, high: float) -> None:
    """A log axis with round ticks labelled 805K, 1M, 2M: never crowded, whatever the range."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    ticks = log_ticks(low, high)
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FixedFormatter([human_number(t) for t in ticks]))
    axis.set_minor_locator(NullLocator())


def _human_linear_axis(axis) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(5))
    axis.set_major_formatter(FuncFormatter(lambda value, _: human_number(value) if value else "0"))


def _panel_note(ax, text: str, y: float = 0.5) -> None:
    """What a panel that cannot be drawn says instead, in the panel."""
    ax.text(0.5, y, "\n".join(textwrap.wrap(text, 44)), transform=ax.transAxes, ha="center", va="center",
            fontsize=9, color="0.25", bbox=dict(boxstyle="round", facecolor="0.95", edgecolor="0.7"))


def _ratio_label(estimate: RatioEstimate, unit: str) -> str:
    text = f"{format_ratio(estimate.ratio)} {unit}"
    if estimate.unconstrained:
        text += " (unconstrained)"  # the same flag as compare.json's "unconstrained"
    if estimate.low is not None:
        text += f"\n68%: {format_ratio(estimate.low)} to {format_ratio(estimate.high)}"
    return text + ("\n(extrapolated)" if estimate.extrapolated else "")


def _annotate_ratio(ax, estimate: RatioEstimate, unit: str) -> None:
    """An arrow from the variant's point to where the reference reaches the same loss, labelled with the ratio."""
    matched = estimate.matched
    ax.annotate("", xy=(matched, estimate.loss), xytext=(estimate.at, estimate.loss),
                arrowprops=dict(arrowstyle="<->", color="k", lw=0.8, ls="--" if estimate.extrapolated else "-"))
    ax.text(math.sqrt(matched * estimate.at), estimate.loss, _ratio_label(estimate, unit) + "\n", va="bottom",
            ha="center", fontsize=8)


def _draw_fit(ax, fit: PowerLawFit, low: float, high: float, color, style: str, label: str) -> None:
    """The law solid over the x it was fitted to, dotted where it extrapolates."""
    inside = np.geomspace(fit.x_min, fit.x_max, 100)
    ax.plot(inside, fit(inside), style, color=color, label=label)
    for start, stop in ((low, fit.x_min), (fit.x_max, high)):
        if stop > start:
            outside = np.geomspace(start, stop, 30)
            ax.plot(outside, fit(outside), ":", color=color, lw=1)


def _fit_label(name: str, fit: PowerLawFit, exponent: str) -> str:
    fixed = "" if fit.fixed_E is None else f" (E fixed at {fit.fixed_E:g})"
    asymptote = f"E={fit.E:.3g}, " if fit.fixed_E is None else ""
    flag = " (α at bound: unconstrained)" if fit.alpha_at_bound else ""
    return f"{name} fit{fixed}: {asymptote}{exponent}={fit.alpha:.2f}{flag}"


def _law_title(fits: List[PowerLawFit], unit: str, coefficient: str, exponent: str) -> str:
    forms = sorted({fit.form(unit, coefficient, exponent) for fit in fits})
    return f"L({unit}) = {forms[0]}" if len(forms) == 1 else f"L({unit}): forms in the legend"


def data_label(runs: List[RunRecord]) -> str:
    labels = list(dict.fromkeys(r.data_label for r in runs))
    return labels[0] if len(labels) == 1 else "; ".join(labels)


def tokens_label(runs: List[RunRecord]) -> str:
    budgets = sorted({r.token_budget for r in runs})
    shown = human_number(budgets[0]) if len(budgets) == 1 else f"{human_number(budgets[0])}-{human_number(budgets[-1])}"
    return f"{shown} tokens per run"


def with_data(title: str, data: str) -> str:
    """A title that names the data it shows (unless it already does)."""
    return title if data in title else f"{title} (data: {data})"


def comparison_figure(comparison: Comparison, title: str | None = None):
    """The comparison figure: train/validation curves, the size fit with its parameter ratio, the token fit along
    one run; a footer with the fitting method and how far the runs are from converged."""
    plt = _pyplot()
    count = comparison.parameter_count
    runs = sorted(comparison.runs, key=lambda r: r.parameters(count))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6))
    _draw_loss_curves(axes[0], runs)
    _draw_size_fit(axes[1], comparison, runs)
    _draw_token_fit(axes[2], comparison)
    sizes = len({r.model for r in runs})
    variants = list(dict.fromkeys(variant_name(v) for v in sorted({r.variant for r in runs},
                                                                   key=lambda v: (v != DIFF, v != BASELINE, v))))
    default = (f"{' vs '.join(variants)}: {sizes} size{'s' if sizes != 1 else ''}, "
               f"{human_number(max(r.token_budget for r in runs))} tokens per run")
    fig.suptitle(with_data(title or default, data_label(runs)) + f"; {comparison.seeds} per size")
    footer = [f"Fits: {FIT_METHOD}; 68% intervals from bootstrap refits (seeds resampled within each size)."]
    pair = comparison.primary
    if pair is not None:
        footer.append(pair.verdict.describe().splitlines()[0].replace("verdict: ", "Verdict: ")
                      + ("" if pair.ratios_are_findings else "; ratios withheld"))
    if comparison.convergence_note:
        footer.append(f"Convergence: {comparison.convergence_note}.")
    fig.text(0.5, 0.01, "\n".join(footer), ha="center", va="bottom", fontsize=8, color="0.3")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    return fig


def plot_comparison(comparison: Comparison, out_path: str | Path, title: str | None = None) -> Path:
    return _save(comparison_figure(comparison, title), out_path, _pyplot(), layout=False)


def _draw_loss_curves(ax, runs: List[RunRecord]) -> None:
    """Train (faint) and validation (marked) loss against tokens: each kind in its colour, smaller models lighter."""
    variants = sorted({r.variant for r in runs})
    labelled = set()  # one legend entry per (variant, model): the seeds share it
    for r in runs:
        same = sorted({x.parameters("total") for x in runs if x.variant == r.variant})
        color = _shade(kind_color(r.variant), same.index(r.parameters("total")), len(same))
        style = _style(r.variant, variants)
        ax.plot(r.tokens, r.train_loss, style, color=color, alpha=0.3, lw=1)
        name = f"{variant_name(r.variant)} {r.model}"
        ax.plot(r.val_tokens, r.val_loss, style, marker=_marker(r.variant, variants), ms=3, color=color,
                label=None if name in labelled else name)
        labelled.add(name)
    # Early steps dwarf the curves' ends: frame the validation losses, with the train curves' tail in view.
    val_all = np.concatenate([r.val_loss for r in runs])
    tail_all = np.concatenate([r.train_loss[len(r.train_loss) // 10:] for r in runs])
    low, high = min(val_all.min(), tail_all.min()), max(val_all.max(), np.percentile(tail_all, 95))
    span = max(high - low, 1e-3)
    ax.set_ylim(low - 0.05 * span, high + 0.1 * span)
    _human_linear_axis(ax.xaxis)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (train faint, validation marked)")
    ax.set_title(f"loss curves ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    ax.legend(fontsize=7, ncol=1 if len(labelled) <= 5 else 2)
    ax.grid(alpha=0.3)


def _draw_size_fit(ax, comparison: Comparison, runs: List[RunRecord]) -> None:
    """Final validation loss against parameters, each variant's L(N) fit, and the parameter ratio at the largest
    size whose match exists."""
    count = comparison.parameter_count
    all_n = np.array([r.parameters(count) for r in runs], dtype=np.float64)
    pair = comparison.primary
    findings = pair is not None and pair.ratios_are_findings
    trained = [e for e in comparison.parameter_ratios if e.ratio is not None and e.at <= all_n.max()] if findings else []
    shown = np.concatenate([all_n, [trained[-1].matched] if trained else []])  # an extrapolated match too
    low, high = shown.min() / 1.5, shown.max() * 1.5
    variants = sorted({r.variant for r in runs})
    for kind in variants:
        of_kind = [r for r in runs if r.variant == kind]
        color = kind_color(kind)
        ax.plot([r.parameters(count) for r in of_kind], [r.final_val_loss for r in of_kind], _marker(kind, variants),
                color=color, label=f"{variant_name(kind)} runs")
        if kind in comparison.size_fits:
            _draw_fit(ax, comparison.size_fits[kind], low, high, color, _style(kind, variants),
                      _fit_label(variant_name(kind), comparison.size_fits[kind], "α"))
    if trained:
        _annotate_ratio(ax, trained[-1], "params")
    elif pair is not None and comparison.size_fits and not findings:
        _panel_note(ax, f"parameter ratio withheld: {pair.withheld_reason}", y=0.87)
    # Frame the measured losses: a steep fit extrapolated past the smallest size would flatten them.
    finals = np.array([r.final_val_loss for r in runs])
    span = max(finals.max() - finals.min(), 0.05)
    ax.set_ylim(finals.min() - 0.4 * span, finals.max() + 0.6 * span)
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    _set_log_axis(ax.xaxis, low, high)
    ax.set_xlabel(f"parameters ({count.replace('_', '-')})")
    ax.set_ylabel("final validation loss")
    if comparison.size_fits:
        ax.set_title(f"scaling: {_law_title(list(comparison.size_fits.values()), 'N', 'A', 'α')}")
    else:
        ax.set_title("scaling: final loss by size (no fit)")
    by_reason: dict = {}
    for kind, reason in comparison.size_fit_reasons.items():
        by_reason.setdefault(reason, []).append(variant_name(kind))
    if by_reason:  # below the points, which the limits keep in the upper part of the panel
        _panel_note(ax, "no scaling fit: " + "; ".join(f"{', '.join(kinds)}: {reason}"
                                                      for reason, kinds in by_reason.items()), y=0.13)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3, which="major")


def _draw_token_fit(ax, comparison: Comparison) -> None:
    """Validation loss against tokens on the first pair's model (the final losses of finished runs at several token
    budgets, or the evaluations along one constant-lr run), each kind's L(D) fit, and the token ratio when the
    verdict makes it a finding."""
    pair = comparison.primary
    if pair is None or not pair.token_points:
        ax.set_title("data: loss against tokens (not drawn)")
        ax.set_xticks([])
        ax.set_yticks([])
        reason = pair.token_note if pair is not None else "no variant with a reference to compare against"
        _panel_note(ax, f"no token fit: {reason}")
        return
    variants = sorted({r.variant for r in comparison.runs})
    ratio = pair.token_ratio if pair.ratios_are_findings and pair.token_ratio and pair.token_ratio.ratio else None
    tokens_all = np.concatenate([x for x, _ in pair.token_points.values()] + ([[ratio.matched]] if ratio else []))
    low, high = max(tokens_all.min(), 1.0) / 1.3, tokens_all.max() * 1.5
    for kind, (x, y) in pair.token_points.items():
        color = kind_color(kind)
        ax.plot(x, y, _marker(kind, variants), color=color, ms=4, label=f"{variant_name(kind)} {pair.token_model}")
        if kind in pair.token_fits:
            _draw_fit(ax, pair.token_fits[kind], low, high, color, _style(kind, variants),
                      _fit_label(variant_name(kind), pair.token_fits[kind], "β"))
    if ratio is not None:
        _annotate_ratio(ax, ratio, "tokens")
    elif pair.token_ratio is not None:
        _panel_note(ax, f"token ratio withheld: {pair.withheld_reason}", y=0.87)
    ax.set_xscale("log")
    ax.set_xlim(low, high)
    _set_log_axis(ax.xaxis, low, high)
    if pair.token_fits:
        ax.set_title(f"data: {_law_title(list(pair.token_fits.values()), 'D', 'B', 'β')} on {pair.token_model}")
    else:
        ax.set_title(f"data: validation loss on {pair.token_model} (no fit)")
    if pair.token_note:
        _panel_note(ax, f"no token ratio: {pair.token_note}", y=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel(f"tokens ({pair.token_basis or 'no token fit'})" if pair.token_basis else "tokens")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3, which="major")


def variant_spread_figure(stats: List[VariantStats], title: str | None = None, data: str | None = None):
    """Final validation loss of every variant: each seed a dot, the mean ± one standard deviation a bar (both in the
    variant's kind colour), and the references' means as vertical lines, so that a difference can be read against
    the seed-to-seed spread."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(stats) + 1.8))
    for y, s in enumerate(stats):
        color = kind_color(s.variant)
        ax.errorbar(s.mean, y, xerr=s.std if s.n > 1 else 0, fmt="o", color=color, capsize=4, zorder=3)
        ax.scatter(s.values, [y] * len(s.values), color=color, alpha=0.45, s=18, zorder=2)
    compared = {r for s in stats for r in s.deltas}
    styles = iter(LINE_STYLES[1:] * len(stats))
    for ref in (s for s in stats if s.variant in compared):
        ax.axvline(ref.mean, color=kind_color(ref.variant), ls=next(styles), lw=1,
                   label=f"{variant_name(ref.variant)} mean ({ref.model})")
    ax.set_yticks(range(len(stats)), [f"{variant_name(s.variant)} (n={s.n})" for s in stats], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("final validation loss (dots: seeds; bar: mean ± std over seeds)")
    ax.grid(alpha=0.3, axis="x")
    if compared:
        ax.legend(fontsize=8)
    heading = title or f"final validation loss of {len(stats)} variant{'s' if len(stats) != 1 else ''} over seeds"
    ax.set_title("\n".join(textwrap.wrap(with_data(heading, data) if data else heading, 75)), fontsize=10)
    fig.tight_layout()
    return fig


def plot_variant_spread(stats: List[VariantStats], out_path: str | Path, title: str | None = None,
                        data: str | None = None) -> Path:
    return _save(variant_spread_figure(stats, title, data), out_path, _pyplot(), layout=False)


def _save(fig, out_path: str | Path, plt, layout: bool = True) -> Path:
    if layout:
        fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


QUICKSTART_LABELS = {DIFF: "DIFF Transformer", BASELINE: "Transformer (2H heads)"}


def loss_curves_figure(runs: Dict[str, List[dict]], data: str,
                       title: str = "tiny DIFF vs its mirrored baseline (CPU)"):
    """Train loss (raw and smoothed) and validation loss against steps, from each kind's metrics.jsonl records;
    ``data`` names what they trained on (run.json's data_source)."""
    plt = _pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, records in runs.items():
        color = kind_color(kind)
        name = QUICKSTART_LABELS.get(kind, variant_name(kind))
        steps = np.array([r["step"] for r in records])
        loss = np.array([r["loss"] for r in records])
        window = max(1, len(loss) // 30)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax_train.plot(steps, loss, color=color, alpha=0.2, lw=0.8)
        ax_train.plot(steps[window - 1:], smooth, color=color, label=name)
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax_val.plot(*zip(*val), marker="o", color=color, label=name)
    tail = np.concatenate([[r["loss"] for r in recs[len(recs) // 5:]] for recs in runs.values()])
    ax_train.set_ylim(tail.min() - 0.1, np.percentile(tail, 99) + 0.3)
    for ax, name in ((ax_train, "train loss"), (ax_val, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
        else:
            _panel_note(ax, "no validation loss was logged (trainer.eval_interval=0)")
    fig.suptitle(with_data(title, data))
    fig.tight_layout()
    return fig


def plot_loss_curves(runs: Dict[str, List[dict]], out_path: str | Path, data: str,
                     title: str = "tiny DIFF vs its mirrored baseline (CPU)") -> Path:
    return _save(loss_curves_figure(runs, data, title), out_path, _pyplot(), layout=False)
