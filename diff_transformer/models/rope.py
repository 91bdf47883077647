"""Rotary position embedding fused into one kernel each way, for megatron-core's ``apply_rope_fusion`` hook (which
otherwise needs TransformerEngine; ``compat.install_fused_rope`` puts it there).

megatron-core's unfused RoPE (``_apply_rotary_pos_emb_bshd``) is six kernels and a ``cat`` forward and autograd's
transposes of them backward, and keeps cos/sin-sized temporaries for the backward. Here the forward and the backward
are each one kernel, and the backward is written out (the transpose of the rotation) and keeps only the frequencies.
Same math, same rounding of cos/sin to the input's dtype as megatron-core's, so fp32 results are the same. Two
implementations of it:

- on a GPU, one Triton kernel each way (``kernels.rope``): one launch, where a compiled function pays
  torch.compile's call overhead (guards, its wrapper) on every call, twice per layer and micro-batch;
- on a CPU, and inside a compiled region (``trainer.compile``, where inductor fuses RoPE into the layer's graph), one
  function each way that ``jit_fuser`` (megatron-core's own torch.compile decorator) fuses."""

from __future__ import annotations

import torch
from megatron.core.jit import jit_fuser


@jit_fuser
def _rope_forward(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    rotated, rest = t[..., : freqs.shape[-1]], t[..., freqs.shape[-1]:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(rotated, 2, dim=-1)
    return torch.cat((rotated * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


@jit_fuser
def _rope_backward(grad: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    rotated, rest = grad[..., : freqs.shape[-1]], grad[..., freqs.shape[-1]:]
    cos, sin = torch.cos(freqs).to(grad.dtype), torch.sin(freqs).to(grad.dtype)
    g1, g2 = torch.chunk(rotated * sin, 2, dim=-1)  # rotate_half's transpose: (y1, y2) -> (y2, −y1)
    return torch.cat((rotated * cos + torch.cat((g2, -g1), dim=-1), rest), dim=-1)


class FusedRoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return _rope_forward(t, freqs)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _rope_backward(grad, freqs), None


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **unused):
    """RoPE of t [s, b, heads, d] with freqs [s, 1, 1, d_rot] (fp32), rotate-half layout; TransformerEngine's
    signature, as megatron-core calls it (rope_utils.py:287)."""
    if interleaved:
        raise ValueError("the fused RoPE implements the rotate-half layout; rotary_interleaved needs the unfused one")
    if t.is_cuda and not torch.compiler.is_compiling():
        from kernels.rope import rotary

        return rotary(t, freqs)
    return FusedRoPEFunction.apply(t, freqs)
