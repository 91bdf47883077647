"""Rotary position embedding (rotate-half layout) in one Triton kernel each way: kernel, launcher, autograd, public
function.

One program per (token, block of heads): it loads the token's frequencies once, forms cos and sin in fp32, rounds them
to the input's dtype (as megatron-core's unfused RoPE does), and rotates the first ``d_rot`` features of each of its
heads in fp32 registers, rounding once on the store; features past ``d_rot`` are copied. With x = (x1, x2) the two
halves of the rotated features and (c1, c2), (s1, s2) the halves of cos and sin,

    forward   y1 = x1·c1 − x2·s1,   y2 = x2·c2 + x1·s2
    backward  g1 = y1'·c1 + y2'·s2, g2 = y2'·c2 − y1'·s1       (the rotation's transpose)

so the backward is the same kernel with the sines' roles swapped, and saves only the frequencies. The input may be any
strided view (megatron's query and key are views of the fused QKV projection's output); the output is contiguous.

Its point is the host's time: one launch each way, where the compiled function it replaces on a GPU
(``diff_transformer.models.rope``) pays torch.compile's call overhead twice per layer and micro-batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gpu_target

_INTERPRET = gpu_target.INTERPRET
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements of one (heads x d_rot/2) tile per half on a GPU (8 heads at d_rot = 128). Compiled for sm_90
# (check_compile.py): 32 registers under Triton 3.9, 54 under 3.6 (the GPU image's), no spills; 1024 spilled 20 B
# under 3.6. Few and large programs in the interpreter, where each costs milliseconds.
_TILE_ELEMENTS = 512
_INTERPRET_TILE_ELEMENTS = 8192


# ----------------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(
    X, FREQS, Y,
    batch, heads, half, rest,
    s_xs, s_xb, s_xh, s_xd,
    s_fs, s_fb, s_fd,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    token = tl.program_id(0)  # s·batch + b
    s = token // batch
    b = token % batch
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    in_half = j < half
    f_row = FREQS + s * s_fs + b * s_fb
    f1 = tl.load(f_row + j * s_fd, mask=in_half, other=0.0).to(tl.float32)
    f2 = tl.load(f_row + (j + half) * s_fd, mask=in_half, other=0.0).to(tl.float32)
    dtype = Y.dtype.element_ty
    c1 = tl.cos(f1).to(dtype).to(tl.float32)
    c2 = tl.cos(f2).to(dtype).to(tl.float32)
    s1 = tl.sin(f1).to(dtype).to(tl.float32)
    s2 = tl.sin(f2).to(dtype).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation: the sines trade places and signs
        a, bb = s2, -s1
    else:
        a, bb = -s1, s2
    heads_in = h < heads
    mask = heads_in[:, None] & in_half[None, :]
    x_row = X + s.to(tl.int64) * s_xs + b.to(tl.int64) * s_xb + h[:, None].to(tl.int64) * s_xh
    width = 2 * half + rest
    y_row = Y + (token.to(tl.int64) * heads + h[:, None]) * width
    x1 = tl.load(x_row + j[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (j[None, :] + half) * s_xd, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + j[None, :], (x1 * c1[None, :] + x2 * a[None, :]).to(dtype), mask=mask)
    tl.store(y_row + half + j[None, :], (x2 * c2[None, :] + x1 * bb[None, :]).to(dtype), mask=mask)
    if BLOCK_REST > 0:  # features past d_rot pass through
        r = tl.arange(0, BLOCK_REST)
        rest_mask = heads_in[:, None] & (r < rest)[None, :]
        kept = tl.load(x_row + (r[None, :] + 2 * half) * s_xd, mask=rest_mask, other=0.0)
        tl.store(y_row + 2 * half + r[None, :], kept.to(dtype), mask=rest_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------------
def _tile(heads: int, half: int, rest: int):
    """(BLOCK_H, BLOCK_HALF, BLOCK_REST): as many of a token's heads in one program as the tile allows for the wider
    of a half of the rotated features and the features passed through."""
    block_half = triton.next_power_of_2(half)
    block_rest = triton.next_power_of_2(rest) if rest else 0
    elements = _TILE_ELEMENTS if gpu_target.gpu_branch() else _INTERPRET_TILE_ELEMENTS
    return max(1, min(triton.next_power_of_2(heads), elements // max(block_half, block_rest))), block_half, block_rest


def _rotate(x: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    seq, batch, heads, d = x.shape
    half = freqs.shape[-1] // 2
    rest = d - 2 * half
    y = torch.empty((seq, batch, heads, d), dtype=x.dtype, device=x.device)
    block_h, block_half, block_rest = _tile(heads, half, rest)
    grid = (seq * batch, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        x, freqs, y, batch, heads, half, rest, *x.stride(),
        freqs.stride(0), freqs.stride(1) if freqs.shape[1] > 1 else 0, freqs.stride(-1),
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_REST=block_rest, BACKWARD=backward, num_warps=4,
    )
    return y


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------
class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(freqs)
        return _rotate(x, freqs, backward=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _rotate(grad, freqs, backward=True), None


# ----------------------------------------------------------------------------------------------------------------
# API
# ----------------------------------------------------------------------------------------------------------------
def _check(x: torch.Tensor, freqs: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [s, b, heads, d]")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of float16, bfloat16, float32")
    seq, batch, _, d = x.shape
    if freqs.dim() != 4 or freqs.shape[1] not in (1, batch) or freqs.shape[2] != 1 or freqs.shape[0] < seq:
        raise ValueError(f"freqs has shape {tuple(freqs.shape)}; expected [s >= {seq}, 1 or b = {batch}, 1, d_rot]")
    rotated = freqs.shape[-1]
    if rotated % 2 or rotated > d:
        raise ValueError(f"freqs rotates {rotated} features; expected an even number of at most the head dim {d}")
    if freqs.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"freqs has dtype {freqs.dtype}; expected one of float32 (megatron-core's), bfloat16, float16")
    if freqs.device != x.device:
        raise ValueError(f"freqs is on {freqs.device}, x on {x.device}; expected one device")
    if not _INTERPRET and x.device.type != "cuda":
        raise ValueError(f"the fused RoPE needs CUDA tensors, got {x.device}; on CPU set TRITON_INTERPRET=1 before "
                         "importing triton, or use diff_transformer.models.rope's compiled function")


def rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE of x [s, b, heads, d] (any strides) by the angles freqs [≥ s, 1, 1, d_rot] (fp32 as megatron-core gives
    them; or [≥ s, b, 1, d_rot], each sequence's own positions, as with positions restarting per document),
    rotate-half layout; the first s rows of freqs are used, features past d_rot pass through. Returns a contiguous tensor in x's dtype; differentiable
    in x."""
    _check(x, freqs)
    return RotaryFunction.apply(x, freqs)
