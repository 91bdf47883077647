"""flash-attn 2's module of its entry points (where ``backend_choice.installed`` looks for flash-attn 2)."""

from flash_attn._reference import fa2_func as flash_attn_func, fa2_varlen as flash_attn_varlen_func  # noqa: F401
