"""Metrics of attention maps with plain-tensor signatures; imports only torch, so any tool or test can call them.

A map has shape ``(..., N, M)``: N query rows over M keys, each row a distribution (non-negative, summing to 1) unless
a function says it takes signed weights. ``key_mask`` (broadcastable to the map, True where a key is visible) limits a
metric to the keys a query can see: for a causal map, :func:`causal_key_mask`; masked keys must carry no mass, and a
row's statistics (Gini, top-fraction mass) are over its visible keys only. Everything is computed in fp32 (inputs of
lower precision are upcast), reductions over rows and heads are left to the caller.

Definitions (the common ones in the attention-analysis literature):

- entropy: −Σ p log p in nats (0 log 0 = 0); log n for a uniform row over n keys, 0 for a one-hot row;
- Gini coefficient of a row's n visible weights: Σᵢ (2i − n − 1)·x₍ᵢ₎ / (n Σ x) over the ascending order x₍ᵢ₎;
  0 for a uniform row, 1 − 1/n for a one-hot row;
- top mass: the mass in a row's k largest weights (``top_k_mass``) or in its ⌈f·n⌉ largest (``top_fraction_mass``);
- first-token mass and sink rate: the mass a row puts on key 0, averaged over rows per head; a head is a sink head
  when that average exceeds ε (0.3, Gu et al. 2024, "When Attention Sink Emerges"), and the sink rate is the share of
  such heads;
- effective rank (Roy & Vetterli 2007): exp of the entropy of the singular values normalised to sum to 1; equals r
  for a matrix with r equal non-zero singular values.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch

SINK_THRESHOLD = 0.3


def causal_key_mask(num_rows: int, num_keys: int, rows: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """(N, M) bool, True where query row i may see key j (j <= position of i). ``rows`` holds the absolute position
    of each row; by default the rows are the last N positions (bottom-right alignment, as the attention kernels)."""
    if rows is None:
        rows = torch.arange(num_keys - num_rows, num_keys, device=device)
    cols = torch.arange(num_keys, device=rows.device)
    return cols[None, :] <= rows[:, None]


def _visible(maps: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ones_like(maps, dtype=torch.bool) if key_mask is None else key_mask.expand_as(maps)


def entropy(maps: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of every row: (..., N, M) -> (..., N)."""
    p = maps.float()
    return -torch.where(p > 0, p * torch.log(p.clamp(min=torch.finfo(torch.float32).tiny)), torch.zeros_like(p)).sum(-1)


def gini(maps: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gini coefficient of every row over its visible keys: (..., N, M) -> (..., N); 0 for a row with one key."""
    p = maps.float()
    visible = _visible(p, key_mask)
    n = visible.sum(-1, keepdim=True).float()
    # masked keys sort first (−inf) and get weight 0; a visible key's 1-based rank among the visible ones is
    # its position minus the number of masked keys before it
    ordered = torch.sort(p.masked_fill(~visible, float("-inf")), dim=-1).values
    position = torch.arange(1, p.shape[-1] + 1, device=p.device, dtype=torch.float32)
    rank = position - (p.shape[-1] - n)
    weight = torch.where(rank >= 1, 2 * rank - n - 1, torch.zeros_like(rank))
    values = torch.where(torch.isfinite(ordered), ordered, torch.zeros_like(ordered))
    total = values.sum(-1, keepdim=True)
    g = (weight * values).sum(-1, keepdim=True) / (n * total).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(n > 1, g, torch.zeros_like(g)).squeeze(-1)


def top_k_mass(maps: torch.Tensor, k: int) -> torch.Tensor:
    """Mass in each row's k largest weights (all of a row's mass when it has k or fewer keys): (..., N)."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    p = maps.float()
    return p.topk(min(k, p.shape[-1]), dim=-1).values.sum(-1)


def top_fraction_mass(maps: torch.Tensor, fraction: float = 0.01, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mass in each row's ⌈fraction·n⌉ largest weights, n its visible keys (at least one weight): (..., N)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must lie in (0, 1]")
    p = maps.float()
    visible = _visible(p, key_mask)
    n = visible.sum(-1, keepdim=True)
    keep = torch.clamp(torch.ceil(n.float() * fraction), min=1).long()
    ordered = torch.sort(p.masked_fill(~visible, 0.0), dim=-1, descending=True).values
    cumulative = ordered.cumsum(-1)
    return cumulative.gather(-1, keep - 1).squeeze(-1)


def first_token_mass(maps: torch.Tensor) -> torch.Tensor:
    """Mass of every row on key 0: (..., N)."""
    return maps[..., 0].float()


def sink_heads(maps: torch.Tensor, threshold: float = SINK_THRESHOLD) -> torch.Tensor:
    """(..., H, N, M) -> (..., H) bool: heads whose first-token mass, averaged over rows, exceeds ``threshold``."""
    return first_token_mass(maps).mean(-1) > threshold


def sink_rate(maps: torch.Tensor, threshold: float = SINK_THRESHOLD) -> torch.Tensor:
    """Share of the heads of (..., H, N, M) maps that are sink heads: a 0-dim tensor."""
    return sink_heads(maps, threshold).float().mean()


def mass_on(maps: torch.Tensor, key_subset: torch.Tensor) -> torch.Tensor:
    """Mass of every row on the keys where ``key_subset`` (broadcastable to the map) is True: (..., N)."""
    return (maps.float() * key_subset.to(torch.float32)).sum(-1)


def normalized_magnitude(weights: torch.Tensor) -> torch.Tensor:
    """|w| / Σ|w| per row: a distribution from signed weights (DIFF's A1 − λA2); softmax rows are unchanged."""
    w = weights.float().abs()
    return w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


def row_cosine(a: torch.Tensor, b: torch.Tensor, key_subset: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cosine similarity of matching rows of a and b over the keys of ``key_subset``: (..., N); NaN for a row whose
    subset is empty or all zero in a or b."""
    a, b = a.float(), b.float()
    if key_subset is not None:
        a = a * key_subset.to(torch.float32)
        b = b * key_subset.to(torch.float32)
    norm = a.norm(dim=-1) * b.norm(dim=-1)
    dot = (a * b).sum(-1)
    return torch.where(norm > 0, dot / norm.clamp(min=torch.finfo(torch.float32).tiny), torch.full_like(dot, math.nan))


def row_kl(p: torch.Tensor, q: torch.Tensor, key_subset: Optional[torch.Tensor] = None, eps: float = 1e-12) -> torch.Tensor:
    """KL(p‖q) in nats of matching rows, both restricted to ``key_subset`` and renormalised there (the divergence of
    the two maps' distributions over those keys): (..., N); NaN for a row where p has no mass on the subset."""
    p, q = p.float(), q.float()
    if key_subset is not None:
        p = p * key_subset.to(torch.float32)
        q = q * key_subset.to(torch.float32)
    p_total, q_total = p.sum(-1, keepdim=True), q.sum(-1, keepdim=True)
    p_n = p / p_total.clamp(min=eps)
    q_n = q / q_total.clamp(min=eps)
    terms = torch.where(p_n > 0, p_n * (torch.log(p_n.clamp(min=eps)) - torch.log(q_n.clamp(min=eps))),
                        torch.zeros_like(p_n))
    kl = terms.sum(-1)
    return torch.where(p_total.squeeze(-1) > 0, kl, torch.full_like(kl, math.nan))


def negative_entries(weights: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Negative entries of signed weights (A1 − λA2), per row: ``fraction`` of the visible entries that are < 0,
    ``mass`` Σ|w| over them, and ``relative_mass`` that mass over Σ|w| of the row. Each (..., N)."""
    w = weights.float()
    visible = _visible(w, key_mask)
    negative = (w < 0) & visible
    mass = (w.abs() * negative).sum(-1)
    total = (w.abs() * visible).sum(-1)
    return {
        "fraction": negative.sum(-1).float() / visible.sum(-1).clamp(min=1).float(),
        "mass": mass,
        "relative_mass": mass / total.clamp(min=torch.finfo(torch.float32).tiny),
    }


def effective_rank(matrices: torch.Tensor) -> torch.Tensor:
    """exp(entropy of the normalised singular values) of every matrix of (..., N, M): (...); 0 for a zero matrix."""
    s = torch.linalg.svdvals(matrices.float())
    total = s.sum(-1, keepdim=True)
    p = s / total.clamp(min=torch.finfo(torch.float32).tiny)
    rank = torch.exp(entropy(p))
    return torch.where(total.squeeze(-1) > 0, rank, torch.zeros_like(rank))


def magnitude_profile(values: torch.Tensor, ks: Sequence[int] = (1, 10, 100)) -> Dict[str, float]:
    """The paper's activation-outlier measures (its Table 5) of a tensor: the k-th largest |x| for each k
    (``top1``, ``top10``, ...; the smallest value when there are fewer) and the median |x|. Finite entries only."""
    x = values.detach().float().abs().flatten()
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        raise ValueError("magnitude_profile: no finite values")
    largest = x.topk(min(max(ks), x.numel())).values
    out = {f"top{k}": float(largest[min(k, largest.numel()) - 1]) for k in ks}
    out["median"] = float(x.median())
    return out
