"""Fused kernels of the framework."""

from kernels.diff_attn import diff_flash_attn, diff_flash_attn_v2

__all__ = ["diff_flash_attn", "diff_flash_attn_v2"]
