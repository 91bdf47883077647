"""Figures of evaluate and analyze; several runs are overlaid (or set side by side) in one figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from diff_transformer.evaluation.niah import REGIONS
from diff_transformer.figure_style import human_number, kind_color, variant_name

LINE_STYLES = ("-", "--", "-.", ":")
UNIFORM_LABEL = "uniform attention"  # the reference line of the NIAH allocation figure
REGION_TITLES = {"answer": "the answer needle", "distractors": "the other needles", "haystack": "the haystack",
                 "queries": "the query"}


def _run_styles(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Plot keywords per run label: its kind's colour (DIFF red, the Transformer blue, ...), and a line style that
    tells apart several runs of one kind."""
    seen: Dict[str, int] = {}
    styles = {}
    for label, run in runs.items():
        kind = (run or {}).get("attention", "")
        index = seen[kind] = seen.get(kind, -1) + 1
        styles[label] = {"color": kind_color(kind), "linestyle": LINE_STYLES[index % len(LINE_STYLES)]}
    return styles


def _legend(label: str, run: Dict[str, Any] | None) -> str:
    """A run's legend entry: its label, then its kind as figures name it, the tokens it had seen and its seed."""
    run = run or {}
    parts = [variant_name(run["attention"])] if run.get("attention") else []
    if run.get("tokens"):
        parts.append(f"{human_number(run['tokens'])} tokens")
    if run.get("seed") is not None:
        parts.append(f"seed {run['seed']}")
    return f"{label} ({', '.join(parts)})" if parts else label


def _data_of(runs: Dict[str, Dict[str, Any]]) -> str:
    labels = list(dict.fromkeys((run or {}).get("data") or "unrecorded data" for run in runs.values()))
    return "; ".join(labels)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_position_loss(results: Dict[str, Dict[str, Any]], path: Path,
                       runs: Dict[str, Dict[str, Any]] | None = None) -> Path:
    """Validation NLL at each position of the window, one line per run (``runs``: each label's run description,
    for its kind's colour and its data)."""
    plt = _pyplot()
    runs = runs or {label: {} for label in results}
    styles = _run_styles(runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ppl in results.items():
        curve = np.array([np.nan if v is None else v for v in ppl["validation"]["position_nll"]], dtype=float)
        ax.plot(np.arange(1, len(curve) + 1), curve,
                label=f"{_legend(label, runs.get(label))}: ppl {ppl['validation']['perplexity']:.1f}", **styles[label])
    ax.set_xlabel("position in the window (tokens of context)")
    ax.set_ylabel("validation NLL (nats)")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Loss by position (validation split of {_data_of(runs)})", fontsize=9)
    return _save(fig, path)


def plot_niah_heatmaps(results: Dict[str, Dict[str, Any]], path: Path,
                       runs: Dict[str, Dict[str, Any]] | None = None) -> Path:
    """Accuracy by context length (rows) and depth (columns), one panel per run (``runs``: each label's run
    description, for its data)."""
    plt = _pyplot()
    runs = runs or {label: {} for label in results}
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, (label, result) in zip(axes[0], results.items()):
        grid = np.array(result["accuracy_by_length_depth"], dtype=float)
        cfg = result["config"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(cfg["depths"])), [f"{d:g}" for d in cfg["depths"]])
        ax.set_yticks(range(len(cfg["lengths"])), [str(n) for n in cfg["lengths"]])
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("depth of the asked needles")
        ax.set_ylabel("context length")
        ax.set_title(f"{_legend(label, runs.get(label))}\nN={cfg['needles']}, R={cfg['asked']}: accuracy "
                     f"{result['accuracy']:.2f}", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"NIAH accuracy (haystack: validation split of {_data_of(runs)})", fontsize=10)
    return _save(fig, path)


def plot_attention_allocation(results: Dict[str, Dict[str, Any]], path: Path,
                              runs: Dict[str, Dict[str, Any]] | None = None) -> Path:
    """Share of the answer rows' attention on each region by layer: one panel per region (the answer needle, the other
    needles, the haystack, the query), one line per run in its kind's colour (``runs``: each label's run
    description, for its kind and its data)."""
    plt = _pyplot()
    runs = runs or {label: {} for label in results}
    styles = _run_styles(runs)
    fig, axes = plt.subplots(1, len(REGIONS), figsize=(3.2 * len(REGIONS), 3.4), sharey=True)
    # the share uniform attention would give: the same for every run (same samples), absent from older results
    uniform = next((r["uniform_allocation"] for r in results.values() if r.get("uniform_allocation")), None)
    for ax, region in zip(axes, REGIONS):
        for label, result in results.items():
            allocation = result["attention_allocation"]
            layers = sorted(allocation, key=int)
            ax.plot([int(x) for x in layers], [allocation[x][region] for x in layers], marker="o",
                    label=_legend(label, runs.get(label)), **styles[label])
        if uniform is not None:
            ax.axhline(uniform[region], color="0.4", linestyle=":", lw=1.2, label=UNIFORM_LABEL)
        ax.set_title(REGION_TITLES.get(region, region), fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of the answer rows' attention")
    axes[0].legend(fontsize=7)
    config = next(iter(results.values()))["config"]
    fig.suptitle(f"NIAH: where the answer rows attend (N={config['needles']}, R={config['asked']}; "
                 f"haystack: validation split of {_data_of(runs)})", fontsize=10)
    return _save(fig, path)


ANALYSIS_PANELS = (
    ("combined/entropy", "entropy (nats)"),
    ("combined/gini", "Gini"),
    ("combined/top1pct_mass", "mass in top 1% keys"),
    ("combined/sink_rate", "sink rate (ε = 0.3)"),
    ("logits/top1", "largest |attention logit|"),
    ("hidden/top1", "largest |hidden state|"),
    ("differential/cosine_relevant", "cos(A1, A2), relevant keys"),
    ("differential/cosine_irrelevant", "cos(A1, A2), irrelevant keys"),
    ("differential/negative_relative_mass", "negative mass share of A1 − λA2"),
    ("differential/effective_rank_lambda_A2", "effective rank of λ·A2"),
    ("differential/effective_rank_A1_minus_lambda_A2", "effective rank of A1 − λ·A2"),
)


def plot_analysis(results: Dict[str, Dict[str, Any]], path: Path) -> Path:
    """One panel per metric, per layer, every run overlaid; λ's trajectory over checkpoints in the last panel."""
    plt = _pyplot()
    panels = [p for p in ANALYSIS_PANELS
              if any(r["layers"][0]["mean"].get(p[0]) is not None for r in results.values())]
    trajectories = {label: r["lambda_trajectory"] for label, r in results.items() if r.get("lambda_trajectory")}
    styles = _run_styles({label: r.get("run") for label, r in results.items()})
    count = len(panels) + (1 if trajectories else 0)
    cols = 3
    rows = (count + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    flat: List[Any] = list(axes.flat)
    for ax, (key, title) in zip(flat, panels):
        for k, (label, result) in enumerate(results.items()):
            layers = [layer["layer"] for layer in result["layers"]]
            values = [layer["mean"].get(key) for layer in result["layers"]]
            if all(v is None for v in values):
                continue
            ax.plot(layers, [np.nan if v is None else v for v in values], marker="o",
                    label=_legend(label, result.get("run")), **styles[label])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.xaxis.set_major_locator(_pyplot().MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if trajectories:
        ax = flat[len(panels)]
        sources = set()
        for label, trajectory in trajectories.items():
            steps = [t["step"] for t in trajectory]
            per_layer = np.array([t["lambda"] for t in trajectory])
            sources.add(results[label].get("lambda_trajectory_source", "checkpoints"))
            shades = plt.get_cmap("viridis")(np.linspace(0, 0.9, per_layer.shape[1]))
            for layer in range(per_layer.shape[1]):
                ax.plot(steps, per_layer[:, layer], marker="." if len(steps) <= 20 else None, color=shades[layer],
                        linestyle=styles[label]["linestyle"], label=f"{label}: layer {layer + 1}")
        ax.set_title("λ per layer over training" + (" (metrics.jsonl)" if sources == {"metrics.jsonl"} else
                                                    " (checkpoints)" if sources == {"checkpoints"} else ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in flat[count:]:
        ax.axis("off")
    flat[0].legend(fontsize=7)
    probes = {(r.get("probe") or {}).get("source", "?") for r in results.values()}
    fig.suptitle(f"Attention per layer on {', '.join(sorted(probes))} probes (data: "
                 f"{_data_of({label: r.get('run') for label, r in results.items()})})", fontsize=10)
    return _save(fig, path)
