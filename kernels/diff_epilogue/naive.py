"""The DIFF epilogue in plain PyTorch: the definition the fused kernel is tested against, and the unfused path of the
model (``model`` backends ``eager`` and, with ``trainer.fusions`` off, ``sdpa`` and ``flash_attn``).

Library attention kernels return the two softmax maps' outputs of a differential head separately; the epilogue
turns them into the core attention's output in megatron-core's layout:

    x_h = concat_c (O_c[map 1, h] − λ·O_c[map 2, h])      in fp32, c over the d-wide parts of V (V1: two; V2: one)
    y_h = x_h · rsqrt(mean(x_h²) + eps) · w · scale       (V1's sub-layer norm over the n·d features of a head, then
                                                            its (1 − λ_init); without a norm: x_h · scale)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def diff_epilogue_naive(
    halves: Sequence[torch.Tensor],
    lam: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    scale: float = 1.0,
) -> torch.Tensor:
    """The epilogue of differential attention, unfused.

    Args:
        halves: one or two tensors (B, N, 2, H, d): ``[:, :, 0]`` the first map's output, ``[:, :, 1]`` the second's,
            for each d-wide part of V (any strides); or (B, N, 1, H, d), the maps already combined ((A1 − λ·A2)·V:
            the eager reference, better conditioned when λ is near 1).
        lam: a 0-dim tensor (one λ) or (B, N, H) (one per token and head).
        weight: the RMSNorm weight over a head's n·d features (n = len(halves)); None: no norm.
        eps, scale: the norm's epsilon; the factor every output is multiplied by.
    Returns:
        (N, B, H·n·d) in the halves' dtype, rounded once from fp32 (computed in fp64 for fp64 inputs).
    """
    compute = torch.promote_types(halves[0].dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    lam = lam.to(compute)
    if lam.dim():
        lam = lam.unsqueeze(-1)  # (B, N, H, 1)
    x = torch.cat(
        [o[:, :, 0].to(compute) - lam * o[:, :, 1].to(compute) if o.shape[2] == 2 else o[:, :, 0].to(compute)
         for o in halves],
        dim=-1,
    )  # (B, N, H, n·d)
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    x = x * scale
    batch, seq, heads, width = x.shape
    return x.to(halves[0].dtype).transpose(0, 1).reshape(seq, batch, heads * width)
