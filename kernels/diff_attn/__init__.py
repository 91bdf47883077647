"""Differential attention: fused Triton kernels (V1 and V2) and their plain PyTorch reference."""

from kernels.diff_attn.fused import DiffFlashAttnFunction, diff_flash_attn, diff_flash_attn_v2
from kernels.diff_attn.naive import diff_attn_naive, diff_attn_v2_naive

__all__ = ["DiffFlashAttnFunction", "diff_attn_naive", "diff_attn_v2_naive", "diff_flash_attn", "diff_flash_attn_v2"]
