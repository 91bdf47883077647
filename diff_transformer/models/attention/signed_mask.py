"""The single-map control: one softmax map gated by a learnable signed per-head, per-distance factor."""

from __future__ import annotations

import math

import torch

from diff_transformer.models.attention.base import TP_REPLICATED_ATTR
from diff_transformer.models.attention.blockwise import MapControlCoreAttention
from diff_transformer.models.attention_maps import AttentionMaps

SIGNED_MASK_BUCKETS = 32
SIGNED_MASK_INIT = -3.0  # 1 − 2·sigmoid(−3) = 0.905: training starts close to plain softmax attention


def relative_position_bucket(distance: torch.Tensor, max_distance: int, num_buckets: int = SIGNED_MASK_BUCKETS):
    """T5's causal buckets of the distance i − j >= 0: one bucket per distance below num_buckets/2, then
    logarithmically wider buckets up to max_distance (farther distances share the last bucket)."""
    exact = num_buckets // 2
    max_distance = max(max_distance, 2 * exact)
    distance = distance.clamp(min=0)
    log_ratio = torch.log(distance.float().clamp(min=exact) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(distance < exact, distance, large)


class SignedMaskCoreAttention(MapControlCoreAttention):
    """One softmax map with a learnable signed gate on its weights (the single-map control):
    out = (A ⊙ G)·V with A = softmax(Q·Kᵀ·s + causal mask) and G[h, i, j] = 1 − 2·sigmoid(m[h, bucket(i − j)]),
    m a learnable logit per head and per relative-distance bucket (``relative_position_bucket``). G lies in
    (−1, 1), so a weight can be subtracted without a second map.

    m holds every head's logits on every tensor-parallel rank (each rank uses its heads' rows); its gradient is
    summed over the TP group like DIFF's λ.
    """

    def __init__(self, config, layer_number, attn_mask_type, *, max_distance: int = 2048, **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        self.max_distance = max_distance
        self.mask_logits = torch.nn.Parameter(
            torch.full((config.num_attention_heads, SIGNED_MASK_BUCKETS), SIGNED_MASK_INIT, dtype=config.params_dtype)
        )
        setattr(self.mask_logits, TP_REPLICATED_ATTR, True)

    def gate(self, rows: torch.Tensor, cols: torch.Tensor, first_head: int, num_heads: int) -> torch.Tensor:
        """G for query positions ``rows`` and key positions ``cols``: (num_heads, len(rows), len(cols)), fp32."""
        buckets = relative_position_bucket(rows[:, None] - cols[None, :], self.max_distance)
        logits = self.mask_logits[first_head : first_head + num_heads].float()
        return 1.0 - 2.0 * torch.sigmoid(logits[:, buckets])

    def transforms(self, first_head, num_heads):
        def apply_gate(probs, rows, cols):
            return probs * self.gate(rows, cols, first_head, num_heads)

        return None, apply_gate

    def attention_maps(self, query, key, value, attention_bias=None, rows=None, document_ids=None) -> AttentionMaps:
        rows, logits, probs = self._softmax_maps(query, key, rows, document_ids=document_ids)
        heads = probs.shape[1]
        cols = torch.arange(probs.shape[-1], device=probs.device)
        gate = self.gate(rows, cols, self.tp_rank * heads, heads).detach()
        return AttentionMaps(components={"A": probs}, logits={"A": logits}, combined=probs * gate, rows=rows,
                             document_ids=document_ids)


