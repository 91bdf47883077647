"""Differential attention: fused Triton kernels (V1 and V2), their plain PyTorch reference, and the pieces a
context-parallel (ring) attention assembles its own pass from."""

from kernels.diff_attn.fused import (
    DiffFlashAttnFunction,
    diff_attn_chunk_backward,
    diff_attn_chunk_forward,
    diff_attn_chunk_lse,
    diff_attn_chunk_r2,
    diff_attn_delta,
    diff_flash_attn,
    diff_flash_attn_v2,
)
from kernels.diff_attn.naive import diff_attn_naive, diff_attn_v2_naive

__all__ = [
    "DiffFlashAttnFunction",
    "diff_attn_chunk_backward",
    "diff_attn_chunk_forward",
    "diff_attn_chunk_lse",
    "diff_attn_chunk_r2",
    "diff_attn_delta",
    "diff_attn_naive",
    "diff_attn_v2_naive",
    "diff_flash_attn",
    "diff_flash_attn_v2",
]
