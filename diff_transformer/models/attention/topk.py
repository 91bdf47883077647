"""The sparsity control: softmax over each query's k largest causal scores."""

from __future__ import annotations

import functools

import torch

from diff_transformer.models.attention.blockwise import MapControlCoreAttention
from diff_transformer.models.attention_maps import AttentionMaps

def keep_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Scores outside each row's k largest become −inf (masked scores are −inf already, so a row with k or fewer
    visible keys keeps them all; ties with the k-th score are kept too)."""
    if k >= scores.shape[-1]:
        return scores
    kth = scores.detach().topk(k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


class TopKCoreAttention(MapControlCoreAttention):
    """Softmax attention where each query keeps only its k largest causal scores (the sparsity control):
    softmax(topk_k(Q·Kᵀ·s + causal mask))·V, scores outside the k largest set to −inf before the softmax."""

    def __init__(self, config, layer_number, attn_mask_type, *, topk: int = 32, **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        if topk < 1:
            raise ValueError(f"model.topk={topk} must be >= 1")
        self.topk = topk

    def transforms(self, first_head, num_heads):
        return functools.partial(keep_top_k, k=self.topk), None

    def attention_maps(self, query, key, value, attention_bias=None, rows=None, document_ids=None) -> AttentionMaps:
        rows, logits, probs = self._softmax_maps(query, key, rows, functools.partial(keep_top_k, k=self.topk),
                                                 document_ids)
        return AttentionMaps(components={"A": probs}, logits={"A": logits}, combined=probs, rows=rows,
                             document_ids=document_ids)
