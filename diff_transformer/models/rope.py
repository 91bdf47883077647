"""Rotary position embedding fused into one kernel each way, for megatron-core's ``apply_rope_fusion`` hook (which
otherwise needs TransformerEngine; ``compat.install_fused_rope`` puts it there).

megatron-core's unfused RoPE (``_apply_rotary_pos_emb_bshd``) is six kernels and a ``cat`` forward and autograd's
transposes of them backward, and keeps cos/sin-sized temporaries for the backward. Here the forward and the backward
are each one kernel, and the backward is written out (the transpose of the rotation) and keeps only the angles' cos
and sin ([s, 1, 1, d_rot]). Same math, same rounding of cos/sin to the input's dtype as megatron-core's, so fp32
results are the same. Two implementations of it:

- on a GPU, one Triton kernel each way (``kernels.rope``): one launch, where a compiled function pays
  torch.compile's call overhead (guards, its wrapper) on every call, twice per layer and micro-batch;
- on a CPU, and inside a compiled region (``trainer.compile``, where inductor fuses RoPE into the layer's graph), one
  function each way that ``jit_fuser`` (megatron-core's own torch.compile decorator) fuses.

There cos and sin come from :func:`rope_cos_sin`, a custom operator, so that inductor cannot inline them. Inlined,
inductor computes both in fp32 for every element of the query and the key (b·heads times per angle); this way they are
computed once a layer (one call shared by the query and the key, saved for the backward) and the rotation's kernels
only read them, as the Triton kernel computes them once per token for all its heads."""

from __future__ import annotations

import torch
from megatron.core.jit import jit_fuser


@torch.library.custom_op("diff_transformer::rope_cos_sin", mutates_args=())
def rope_cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of RoPE's angles ``freqs`` rounded to ``dtype`` (as megatron-core rounds them), stacked:
    [2, *freqs.shape]. An operator of its own, opaque to inductor (see the module's docstring)."""
    out = freqs.new_empty((2, *freqs.shape), dtype=dtype)
    torch.cos(freqs, out=out[0])  # computed in freqs' dtype, rounded on the store: one kernel each
    torch.sin(freqs, out=out[1])
    return out


@rope_cos_sin.register_fake
def _(freqs, dtype):
    return freqs.new_empty((2, *freqs.shape), dtype=dtype)


@jit_fuser
def _rope_forward(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotated, rest = t[..., : cos.shape[-1]], t[..., cos.shape[-1]:]
    x1, x2 = torch.chunk(rotated, 2, dim=-1)
    return torch.cat((rotated * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


@jit_fuser
def _rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotated, rest = grad[..., : cos.shape[-1]], grad[..., cos.shape[-1]:]
    g1, g2 = torch.chunk(rotated * sin, 2, dim=-1)  # rotate_half's transpose: (y1, y2) -> (y2, −y1)
    return torch.cat((rotated * cos + torch.cat((g2, -g1), dim=-1), rest), dim=-1)


class FusedRoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        cos, sin = rope_cos_sin(freqs, t.dtype).unbind(0)
        ctx.save_for_backward(cos, sin)
        return _rope_forward(t, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope_backward(grad, cos, sin), None


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **unused):
    """RoPE of t [s, b, heads, d] with freqs [s, 1, 1, d_rot] (fp32), rotate-half layout; TransformerEngine's
    signature, as megatron-core calls it (rope_utils.py:287)."""
    if interleaved:
        raise ValueError("the fused RoPE implements the rotate-half layout; rotary_interleaved needs the unfused one")
    if t.is_cuda and not torch.compiler.is_compiling():
        from kernels.rope import rotary

        return rotary(t, freqs)
    return FusedRoPEFunction.apply(t, freqs)
