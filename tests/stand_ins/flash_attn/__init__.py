"""A stand-in for flash-attn 2 on a CPU (tests/flash_stand_in.py says how tests and the GPU run's dry run use it)."""

from flash_attn._reference import fa2_func as flash_attn_func, fa2_varlen as flash_attn_varlen_func  # noqa: F401
