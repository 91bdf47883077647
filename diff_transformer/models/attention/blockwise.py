"""The controls that change the attention map itself (top-k, signed mask) share this: no fused kernel exists, so
`eager` materialises the map and `sdpa` (the default backend) runs the same math one block of queries at a time,
recomputing each block in the backward."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.utils.checkpoint
from megatron.core.utils import get_pg_rank

from diff_transformer.models.attention.base import CoreAttentionBase
from diff_transformer.models.documents import document_starts, documents_of

# Controls that change the attention map itself: no fused kernel exists, so `eager` materialises the map and `sdpa`
# (the default backend) runs the same math one block of queries at a time, recomputing each block in the backward.
BLOCK_QUERIES = 128  # rows of the map alive at once in the blockwise backend: BLOCK_QUERIES x N per head


def _attention_block(q, k, v, first_query: int, scale: float, score_transform, prob_transform, first_key: int = 0,
                     q_ids=None, k_ids=None):
    """Causal softmax attention of one block of queries, in fp32. q (b, h, m, d) holds queries first_query ..
    first_query + m − 1; k, v (b, h, n, ·) the keys first_key .. first_key + n − 1; with document ids of the queries
    and keys ((b, m), (b, n)) a query sees only its own document."""
    rows = torch.arange(first_query, first_query + q.shape[-2], device=q.device)
    cols = torch.arange(first_key, first_key + k.shape[-2], device=q.device)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    if q_ids is not None:
        scores = scores.masked_fill(q_ids[:, None, :, None] != k_ids[:, None, None, :], float("-inf"))
    if score_transform is not None:
        scores = score_transform(scores)
    probs = torch.softmax(scores, dim=-1)
    if prob_transform is not None:
        probs = prob_transform(probs, rows, cols)
    return torch.matmul(probs, v.float())


def blockwise_attention(q, k, v, scale: float, score_transform=None, prob_transform=None,
                        block: Optional[int] = BLOCK_QUERIES, document_ids=None) -> torch.Tensor:
    """Causal attention with a transform of the scores before the softmax and of the probabilities after it.

    q (b, h, sq, d), k and v (b, h, sk, ·) with matching heads; returns fp32 (b, h, sq, ·). With ``block`` set, one
    block of queries is materialised at a time and recomputed in the backward (activation checkpointing), so memory
    is O(block·sk) per head instead of O(sq·sk); ``block=None`` materialises the whole map (the eager backend).
    With ``document_ids`` (b, sk) a query sees only its own document, and a block reads no key before the first
    document of its queries.
    """
    sq, sk = q.shape[-2], k.shape[-2]
    offset = sk - sq  # bottom-right alignment, as everywhere else
    q_ids = document_ids[:, offset:] if document_ids is not None else None
    if block is None or block >= sq:
        return _attention_block(q, k, v, offset, scale, score_transform, prob_transform, 0, q_ids, document_ids)
    # the first key each block's queries can see: where the document of its first query starts (one host sync)
    first_keys = ([0] * len(range(0, sq, block)) if document_ids is None
                  else document_starts(document_ids)[:, offset::block].min(dim=0).values.tolist())
    outs = []
    for start, first in zip(range(0, sq, block), first_keys):
        stop = min(start + block, sq)
        visible = stop + offset  # keys the block's last query sees; later keys are masked for the whole block
        args = (q[:, :, start:stop], k[:, :, first:visible], v[:, :, first:visible])
        fn = functools.partial(_attention_block, first_query=start + offset, scale=scale,
                               score_transform=score_transform, prob_transform=prob_transform, first_key=first,
                               q_ids=q_ids[:, start:stop] if q_ids is not None else None,
                               k_ids=document_ids[:, first:visible] if document_ids is not None else None)
        if torch.is_grad_enabled():
            outs.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return torch.cat(outs, dim=-2)


class MapControlCoreAttention(CoreAttentionBase):
    """Shared forward of the controls that transform the softmax map: 2H heads of d, GQA over 2Hkv KV heads."""

    SUPPORTED_BACKENDS = ("eager", "sdpa")

    def __init__(self, config, layer_number, attn_mask_type, **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        # This rank's heads are the tp_rank-th slice of all heads (None outside a SelfAttention: rank 0).
        self.tp_rank = get_pg_rank(getattr(protocol.get("pg_collection"), "tp", None))
        if self.backend not in self.SUPPORTED_BACKENDS:
            raise ValueError(
                f"model.attention_backend={self.backend} has no {type(self).__name__} (no fused kernel transforms the map); "
                "use sdpa (blockwise) or eager"
            )

    def transforms(self, first_head: int, num_heads: int):
        """(score_transform, prob_transform) for this rank's heads first_head .. first_head + num_heads − 1."""
        raise NotImplementedError

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        documents = self._check_call(attn_mask_type, attention_bias, packed_seq_params)
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        groups = heads // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        score_transform, prob_transform = self.transforms(self.tp_rank * heads, heads)
        out = blockwise_attention(q, k, v, self.softmax_scale, score_transform, prob_transform,
                                  block=None if self.backend == "eager" else BLOCK_QUERIES,
                                  document_ids=documents_of(documents))
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(s, b, heads * d)
