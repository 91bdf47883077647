"""A stand-in for flash-attn-4 (flash_attn.cute) on a CPU."""

from flash_attn._reference import fa4_func as flash_attn_func, fa4_varlen as flash_attn_varlen_func  # noqa: F401
