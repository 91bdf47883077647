"""Differential attention: fused Triton kernels (V1 and V2), their plain PyTorch reference, and the pieces a
context-parallel (ring) attention assembles its own pass from.

One file a job: function.py (the autograd function, the public functions), launch.py (designs, configs, buffers,
launches), forward.py and backward.py (the kernels), tiles.py (their shared tiles and masks), chunks.py (the
ring attention's pieces), naive.py (the reference), tuning.py (designs and block configs)."""

from kernels.diff_attn.chunks import (
    diff_attn_chunk_backward,
    diff_attn_chunk_forward,
    diff_attn_chunk_lse,
    diff_attn_chunk_r2,
    diff_attn_delta,
)
from kernels.diff_attn.function import DiffFlashAttnFunction, diff_flash_attn, diff_flash_attn_v2
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
