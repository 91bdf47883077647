"""DIFF V1's ``combined`` backend: the combined map A1 − λ·A2 materialised once, in one autograd node.

    P = softmax(Q·Kᵀ·s + mask) over all 2H query heads at once (one batched product), A = P[map 1] − λ·P[map 2],
    X = A·V over the 2d-wide V, Y = X·rsqrt(mean(X²) + eps)·w·(1 − λ_init) in megatron-core's [s, b, H·2d]

The forward is the eager reference's arithmetic; the backward is written out (the softmax backward, λ's and the
norm's gradients), so one layer is about a dozen kernels each way, where autograd over the same definition runs
three times as many and the library layout (``sdpa``) computes each Q·Kᵀ twice. The map costs O(s²) memory per
head: this is the CPU's backend at short sequences, where it beats torch's CPU flash kernel; ``auto`` takes it
without a GPU up to ``MAX_SEQ`` tokens a rank while a stage's maps stay under ``MAP_BYTES_LIMIT``
(``training.backend_choice``). A GPU's flash kernels keep no map: ``auto`` never takes it there.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from diff_transformer.models.attention.base import causal_mask
from diff_transformer.models.documents import same_document

# ``auto`` on a CPU: the longest per-rank sequence it takes ``combined`` at, and the most bytes of maps (A1 and A2
# of every layer of a stage, one micro-batch) it lets that keep. One layer's forward and backward, 2 heads of d = 32
# on 2 cores (benchmarks/results/core_attention_d32_N*_cpu-2core_2026-11-27.md; vanilla = 1): at 128 tokens 1.97x
# against sdpa's 3.36x (micro-batch 4) and 1.73x against 2.88x (16); at 256 a tie (2.65x both); from 512 on it
# loses (2.86x against 2.18x at 512, 7.8x against 2.2x at 2048), its matrix products computing the masked half too.
MAX_SEQ = 256
MAP_BYTES_LIMIT = 1 << 30


def map_bytes(micro_batch: int, heads: int, seq: int) -> int:
    """Bytes of the fp32 maps one layer's ``combined`` attention keeps for its backward: A1 and A2 of H heads."""
    return 2 * micro_batch * heads * seq * seq * 4


@functools.lru_cache(maxsize=4)
def _causal_bias(s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(s, s): 0 on and below the diagonal, −inf above (made once per shape; only ever read)."""
    return torch.full((s, s), float("-inf"), dtype=dtype, device=device).triu_(1)


def _score_bias(s: int, document_ids: Optional[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """The additive mask, 0 where a query may attend and −inf elsewhere: causal, (s, s); within each document of a
    packed sample with ``document_ids`` (b, s): (b, 1, s, s)."""
    if document_ids is None:
        return _causal_bias(s, dtype, torch.device(device))
    visible = causal_mask(s, s, device) & same_document(document_ids, document_ids)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


class CombinedMapAttention(torch.autograd.Function):
    """y = RMSNorm((softmax(Q1K1ᵀs) − λ·softmax(Q2K2ᵀs))·V)·w·out_scale, from and to megatron-core's layouts.

    query (s, b, 2H, d), key and value (s, b, 2G, d) (query head 2h + m is map m of head h, key head 2g + m its key,
    value heads 2g and 2g + 1 the two halves of group g's 2d-wide V; GQA: head h reads group h // (H/G)); lam a 0-dim
    tensor; weight (2d) or None (no sub-layer norm). Computed in fp32 (fp64 for fp64 inputs); returns (s, b, H·2d)
    in the query's dtype.
    """

    @staticmethod
    def forward(ctx, query, key, value, lam, weight, softmax_scale: float, eps: float, out_scale: float,
                document_ids: Optional[torch.Tensor]):
        s, b, two_h, d = query.shape
        heads, kv_groups = two_h // 2, key.shape[2] // 2
        per_group = heads // kv_groups
        dtype = torch.promote_types(query.dtype, torch.float32)
        q = query.permute(1, 2, 0, 3).to(dtype).reshape(b * two_h, s, d)
        k = key.permute(1, 2, 0, 3).to(dtype)  # (b, 2G, s, d)
        if per_group > 1:  # key head 2g + m serves query heads 2h + m of the group's heads h
            k = k.unflatten(1, (kv_groups, 2)).repeat_interleave(per_group, dim=1).flatten(1, 2)
        k = k.reshape(b * two_h, s, d)
        v = value.reshape(s, b, kv_groups, 2 * d).permute(1, 2, 0, 3).to(dtype).unsqueeze(2)  # (b, G, 1, s, 2d)
        lam32 = lam.to(dtype)
        bias = _score_bias(s, document_ids, dtype, query.device)
        if bias.dim() == 2:
            scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=softmax_scale)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(softmax_scale).view(b, two_h, s, s).add_(bias)
        probs = torch.softmax(scores, dim=-1).view(b, heads, 2, s, s)
        del scores
        combined = torch.addcmul(probs[:, :, 0], probs[:, :, 1], -lam32)  # A1 − λ·A2, (b, H, s, s)
        x = torch.matmul(combined.view(b, kv_groups, per_group, s, s), v).view(b, heads, s, 2 * d)
        out = torch.empty(s, b, heads, 2 * d, dtype=query.dtype, device=query.device)
        factor = weight.to(dtype) * out_scale if weight is not None else None
        if factor is not None:
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
            out.permute(1, 2, 0, 3).copy_(x * rstd * factor)
        else:
            rstd = None
            out.permute(1, 2, 0, 3).copy_(x * out_scale)
        ctx.save_for_backward(q, k, v, probs, lam32, x, rstd, factor)
        ctx.shape = (s, b, heads, kv_groups, d)
        ctx.softmax_scale, ctx.out_scale = softmax_scale, out_scale
        ctx.dtypes = (query.dtype, key.dtype, value.dtype, lam.dtype, None if weight is None else weight.dtype)
        return out.view(s, b, heads * 2 * d)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probs, lam32, x, rstd, factor = ctx.saved_tensors
        s, b, heads, kv_groups, d = ctx.shape
        per_group = heads // kv_groups
        dtype = x.dtype
        q_dtype, k_dtype, v_dtype, lam_dtype, w_dtype = ctx.dtypes
        grad_y = grad_out.view(s, b, heads, 2 * d).permute(1, 2, 0, 3).to(dtype)  # (b, H, s, 2d)
        grad_weight = None
        if factor is not None:
            x_hat = x * rstd
            if ctx.needs_input_grad[4]:
                grad_weight = (grad_y * x_hat).sum(dim=(0, 1, 2)).mul_(ctx.out_scale).to(w_dtype)
            grad_hat = grad_y * factor
            grad_x = (grad_hat - x_hat * (grad_hat * x_hat).mean(-1, keepdim=True)).mul_(rstd)
        else:
            grad_x = grad_y * ctx.out_scale
        grad_x = grad_x.view(b, kv_groups, per_group, s, 2 * d)
        # the combined map again (not the forward's addcmul: under trainer.compile AOT autograd would merge the two and
        # keep the forward's map for the backward, a third fp32 map a layer; measured on a CPU)
        combined = (probs[:, :, 0] - lam32 * probs[:, :, 1]).view(b, kv_groups, per_group, s, s)
        grad_v = torch.matmul(combined.transpose(-1, -2), grad_x).sum(2)  # (b, G, s, 2d)
        del combined
        grad_combined = torch.matmul(grad_x, v.transpose(-1, -2)).view(b, heads, s, s)
        grad_lam = None
        if ctx.needs_input_grad[3]:
            grad_lam = -torch.vdot(grad_combined.flatten(), probs[:, :, 1].flatten()).to(lam_dtype)
        # map 1's gradient is the combined map's, map 2's −λ times it: (b, H, 2, s, s) in one product
        grad_probs = grad_combined.unsqueeze(2) * torch.stack([torch.ones_like(lam32), -lam32]).view(2, 1, 1)
        del grad_combined
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, dtype).view(b * heads * 2, s, s)
        grad_scores.mul_(ctx.softmax_scale)
        grad_q = torch.bmm(grad_scores, k).view(b, 2 * heads, s, d).permute(2, 0, 1, 3).to(q_dtype)
        grad_k = torch.bmm(grad_scores.transpose(1, 2), q).view(b, heads, 2, s, d)
        if per_group > 1:
            grad_k = grad_k.view(b, kv_groups, per_group, 2, s, d).sum(2)
        grad_k = grad_k.reshape(b, 2 * kv_groups, s, d).permute(2, 0, 1, 3).to(k_dtype)
        grad_v = grad_v.permute(2, 0, 1, 3).reshape(s, b, 2 * kv_groups, d).to(v_dtype)
        return grad_q, grad_k, grad_v, grad_lam, grad_weight, None, None, None, None


def combined_map_attention(query, key, value, lam, weight, eps: float, softmax_scale: float, out_scale: float,
                           document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:class:`CombinedMapAttention` (see there): (s, b, H·2d) from megatron-core's query, key and value; ``weight``
    and ``eps`` the sub-layer norm's."""
    return CombinedMapAttention.apply(query, key, value, lam, weight, softmax_scale, eps, out_scale, document_ids)
