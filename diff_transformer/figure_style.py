"""One colour per attention kind in every figure (compare's, the quickstart's, analyze's), and the names the
figures give the kinds; stdlib only, so that both the analysis and the evaluation figures share it."""

from __future__ import annotations

# DIFF red, its baseline blue, every other kind a fixed colour of its own (matplotlib's tab palette).
KIND_COLORS = {
    "diff": "tab:red",
    "vanilla": "tab:blue",
    "diff_v2": "tab:orange",
    "vanilla_subln": "tab:cyan",
    "vanilla_wide": "tab:purple",
    "topk": "tab:green",
    "signed_mask": "tab:brown",
    "dex": "tab:pink",
}
UNKNOWN_KIND_COLOR = "tab:gray"
KIND_NAMES = {"diff": "DIFF", "vanilla": "Transformer", "diff_v2": "DIFF V2"}


def kind_of(variant: str) -> str:
    """The attention kind of a variant label ("vanilla num_kv_heads=1" → "vanilla")."""
    return variant.split()[0] if variant.strip() else variant


def kind_color(variant: str) -> str:
    return KIND_COLORS.get(kind_of(variant), UNKNOWN_KIND_COLOR)


def variant_name(variant: str) -> str:
    """A variant as figures name it: the kind's name, then its ablation keys ("Transformer num_kv_heads=1")."""
    kind, _, keys = variant.partition(" ")
    return f"{KIND_NAMES.get(kind, kind)} {keys}".strip()


def human_number(n: float) -> str:
    """804736 → 805K, 6.8e9 → 6.8B: tick labels and sizes that read at a glance."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def log_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """Round ticks (1, 2, 5 x 10^k and denser or sparser sets) inside [low, high] for a log axis: the densest set of
    at most ``most`` ticks, so that labels never crowd, and at least two wherever the range spans a factor of 2."""
    import math

    chosen: list[float] = []
    for mantissas in ((1,), (1, 3), (1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0**k for k in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
                 for m in mantissas if low <= m * 10.0**k <= high]
        if len(ticks) > most and len(chosen) >= 2:
            break
        chosen = ticks
        if len(ticks) >= 3:
            break
    return chosen[::math.ceil(len(chosen) / most)] if len(chosen) > most else chosen
