"""Rotary position embedding in one Triton kernel each way (rotate-half layout, megatron-core's [s, b, heads, d])."""

from kernels.rope.fused import RotaryFunction, rotary

__all__ = ["RotaryFunction", "rotary"]
