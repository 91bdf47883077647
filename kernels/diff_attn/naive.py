"""Plain PyTorch reference for differential attention (V1 and V2).

Materialises both N×N attention maps in fp32. It is the numerics reference for the fused Triton kernels and
has the same signatures as `diff_flash_attn` / `diff_flash_attn_v2`; outputs are cast back to q's dtype.
"""

import math

import torch


def _softmax_map(q, k, scale, causal, document_ids=None):
    """Attention probabilities and log-sum-exp for q (B, Nq, Hq, d) against k (B, Nk, Hq, d), in fp32; with
    document ids (B, Nk) a query sees only keys of its own document."""
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale
    n_q, n_k = q.shape[1], k.shape[1]
    if causal:
        # Bottom-right alignment: query i sees keys j <= i + (Nk - Nq).
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    if document_ids is not None:
        same = document_ids[:, n_k - n_q:, None] == document_ids[:, None, :]
        scores = scores.masked_fill(~same[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def _pair_lse(lse1, lse2):
    """Interleave the two maps' LSE (B, H, Nq) into (B, 2H, Nq): index 2h is map 1, 2h+1 is map 2."""
    return torch.stack((lse1, lse2), dim=2).flatten(1, 2)


def diff_attn_naive(q, k, v, lam, causal=True, softmax_scale=None, return_lse=False, *, norm_weight=None,
                    norm_eps=1e-5, output_scale=1.0, document_ids=None):
    """Differential attention V1 reference.

    q (B, Nq, 2H, d), k (B, Nk, 2Hkv, d), v (B, Nk, Hkv, 2d), lam 0-dim or (H,).
    Returns out (B, Nq, H, 2d) = y = A1·V − λ·A2·V, then RMSNorm(y)·norm_weight·output_scale (over each head's 2d
    columns) or y·output_scale without a norm weight, and with return_lse also lse (B, 2H, Nq) in fp32. With
    document_ids (B, Nk) a query sees only keys of its own document.
    """
    n_heads, head_dim = q.shape[2] // 2, q.shape[3]
    group = n_heads // v.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    k_for_q = k.float().unflatten(2, (-1, 2)).repeat_interleave(group, dim=2)  # (B, Nk, H, 2, d)
    v_for_q = v.float().repeat_interleave(group, dim=2)  # (B, Nk, H, 2d)
    q_pair = q.float().unflatten(2, (n_heads, 2))
    a1, lse1 = _softmax_map(q_pair[:, :, :, 0], k_for_q[:, :, :, 0], scale, causal, document_ids)
    a2, lse2 = _softmax_map(q_pair[:, :, :, 1], k_for_q[:, :, :, 1], scale, causal, document_ids)
    o1 = torch.einsum("bhij,bjhe->bihe", a1, v_for_q)
    o2 = torch.einsum("bhij,bjhe->bihe", a2, v_for_q)
    lam_per_head = lam.float().reshape(-1).expand(n_heads)
    out = o1 - lam_per_head[:, None] * o2
    if norm_weight is not None:
        out = torch.nn.functional.rms_norm(out, (out.shape[-1],), norm_weight.float(), norm_eps)
    out = (out * output_scale).to(q.dtype)
    return (out, _pair_lse(lse1, lse2)) if return_lse else out


def diff_attn_v2_naive(q, k, v, lam, causal=True, softmax_scale=None, return_lse=False, *, document_ids=None):
    """Differential attention V2 reference.

    q (B, Nq, 2H, d), k and v (B, Nk, Hkv, d), lam (B, Nq, H) per token and head.
    Returns out (B, Nq, H, d) = O[2h] − lam·O[2h+1], and with return_lse also lse (B, 2H, Nq) in fp32.
    """
    n_q_heads, head_dim = q.shape[2], q.shape[3]
    group = n_q_heads // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    k_for_q = k.float().repeat_interleave(group, dim=2)
    v_for_q = v.float().repeat_interleave(group, dim=2)
    probs, lse = _softmax_map(q, k_for_q, scale, causal, document_ids)
    o = torch.einsum("bhij,bjhe->bihe", probs, v_for_q).unflatten(2, (-1, 2))  # (B, Nq, H, 2, d)
    out = (o[:, :, :, 0] - lam.float().unsqueeze(-1) * o[:, :, :, 1]).to(q.dtype)
    return (out, lse) if return_lse else out
