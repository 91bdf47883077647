"""flash-attn-4's causal attention as two torch custom operators, forward and backward, so that ``trainer.compile``
keeps it in a layer's graph.

flash-attn-4's own entry (``flash_attn.cute.flash_attn_func``) is an autograd Function whose kernels the CuTe DSL
compiles and launches from Python: dynamo cannot trace it, and a layer's graph would break around it (the core
attention eager, with every elementwise operation around it issued one by one, as without compilation). As custom
operators with their output shapes declared (``register_fake``) and their backward registered
(``register_autograd``), dynamo records one opaque call each way, and inductor fuses DIFF's λ, layouts and epilogue
around it, as it does around torch's SDPA. Eagerly they cost a dispatcher call more than the library's own entry.

The forward is the library's public entry with ``return_lse`` (the backward needs the LSE); the backward is its
``flash_attn.cute.interface._flash_attn_bwd``, called as its autograd Function calls it, its gradients made
contiguous (the layout declared here, whatever layout q, k and v have; a copy only where the library's is not). A V
wider than Q·K (DIFF V1's one call over the 2d-wide V) gets Hopper tiles that fit (``flash_attn4_tiles``) each way.
Variable-length calls (documents) keep the library's own entry: the longest document is a host integer, and document
masking keeps the core attention out of compiled graphs anyway.
"""

from __future__ import annotations

import importlib
from typing import Tuple

import torch

from diff_transformer.models.attention.flash_attn4_tiles import fit_tiles_for


@torch.library.custom_op("diff_transformer::flash_attn4_causal", mutates_args=())
def flash_attn4_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (b, s, h, d) over k (b, s, h_kv, d) and v (b, s, h_kv, d_v), query head i reading KV
    head i // (h / h_kv): the output (b, s, h, d_v) and the LSE (b, h, s) in fp32."""
    fit_tiles_for(q, v)
    out, lse = importlib.import_module("flash_attn.cute").flash_attn_func(
        q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@flash_attn4_causal.register_fake
def _(q, k, v, scale):
    b, s, heads, _ = q.shape
    return q.new_empty(b, s, heads, v.shape[-1]), q.new_empty(b, heads, s, dtype=torch.float32)


@torch.library.custom_op("diff_transformer::flash_attn4_causal_backward", mutates_args=())
def flash_attn4_causal_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, scale: float
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of :func:`flash_attn4_causal`, contiguous."""
    fit_tiles_for(q, v)
    grads = importlib.import_module("flash_attn.cute.interface")._flash_attn_bwd(q, k, v, out, dout, lse, scale, True)
    return tuple(g.contiguous() for g in grads[:3])  # the library's own buffers, copied only where one is strided


@flash_attn4_causal_backward.register_fake
def _(dout, q, k, v, out, lse, scale):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only the LSE was used (nothing in this project does that)
        dout = torch.zeros_like(out)
    dq, dk, dv = flash_attn4_causal_backward(dout, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


flash_attn4_causal.register_autograd(_backward, setup_context=_setup_context)
