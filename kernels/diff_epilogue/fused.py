"""The DIFF epilogue fused in Triton: kernels, launchers, autograd, public function.

Forward, one program per (block of tokens, head): load both maps' outputs of every d-wide part of V for the head,
form x = O1 − λ·O2 in fp32 registers, the RMSNorm over the head's n·d features with the weight already multiplied
by the output factor (folded at run time; the parameters stay as they are), and store y once in the output dtype,
straight into megatron-core's [s, b, H·n·d] layout. Saves only rstd (one fp32 per token and head): the maps'
outputs are saved by the attention kernels that produced them anyway. The maps may also come already combined
((B, N, 1, H, d): x = O, no λ; context parallelism's fused ring, which subtracts inside its kernels).

Backward, a fixed number of programs per head, each looping over blocks of tokens: recompute x from the saved
outputs, then with g = dy·w·scale
    dx = rstd·(g − x·rstd²·mean(g·x)),   dO1 = dx,   dO2 = −λ·dx,   dλ = −Σ dx·O2,   dw = scale·Σ_tokens dy·x·rstd
the sums over tokens kept per program and added in PyTorch (deterministic, no atomics).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kernels import gpu_target

_INTERPRET = gpu_target.INTERPRET
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements of one (tokens x head_dim) tile a program holds per map output (4 tokens at d = 128). Compiled for sm_90
# (check_compile.py, Triton 3.9): forward 32 registers, backward 96 with the norm, no spills (2048 spilled 884 B).
_TILE_ELEMENTS = 512
# Tiles in the interpreter: each program costs milliseconds there, so few and large (the tests make them small).
_INTERPRET_TILE_ELEMENTS = 4096


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _load_pair(O, base, j, mask, s_m, s_d):
    """Both maps' outputs of one d-wide part of V for a tile of tokens, in fp32."""
    first = tl.load(O + base[:, None] + j[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(O + base[:, None] + s_m + j[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _load_combined(O, base, j, mask, s_m, s_d, lam, TWO_MAPS: tl.constexpr):
    """x = O1 − λ·O2 of one d-wide part of V for a tile of tokens in fp32, and O2 (0 for maps already combined, whose
    x does not depend on λ)."""
    if TWO_MAPS:
        first, second = _load_pair(O, base, j, mask, s_m, s_d)
        x = first - lam * second
    else:
        x = tl.load(O + base[:, None] + j[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
        second = 0.0
    return x, second


@triton.jit
def _token_tile(block, seq_len, n_tokens, BLOCK_T: tl.constexpr):
    t = tl.arange(0, BLOCK_T).to(tl.int64) + block * BLOCK_T
    return t, t // seq_len, t % seq_len, t < n_tokens


@triton.jit
def _diff_epilogue_fwd_kernel(
    OA, OB, LAM, W, OUT, RSTD,
    n_tokens, seq_len, batch, heads, head_dim, head_width,
    sa_b, sa_s, sa_m, sa_h, sa_d,
    sb_b, sb_s, sb_m, sb_h, sb_d,
    sl_b, sl_s, sl_h,
    eps, scale,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TWO_HALVES: tl.constexpr, LAM_PER_TOKEN: tl.constexpr, HAS_NORM: tl.constexpr, TWO_MAPS: tl.constexpr,
):
    h = tl.program_id(1)
    t, b, s, t_mask = _token_tile(tl.program_id(0), seq_len, n_tokens, BLOCK_T)
    j = tl.arange(0, BLOCK_D)
    j_mask = j < head_dim
    mask = t_mask[:, None] & j_mask[None, :]
    if LAM_PER_TOKEN:
        lam = tl.load(LAM + b * sl_b + s * sl_s + h * sl_h, mask=t_mask, other=0.0).to(tl.float32)[:, None]
    else:
        lam = tl.load(LAM).to(tl.float32)
    xa, _ = _load_combined(OA, b * sa_b + s * sa_s + h * sa_h, j, mask, sa_m, sa_d, lam, TWO_MAPS)
    squares = tl.sum(xa * xa, axis=1)
    if TWO_HALVES:
        xb, _ = _load_combined(OB, b * sb_b + s * sb_s + h * sb_h, j, mask, sb_m, sb_d, lam, TWO_MAPS)
        squares += tl.sum(xb * xb, axis=1)
    out = OUT + ((s * batch + b) * heads + h)[:, None] * head_width + j[None, :]
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(squares / head_width + eps)
        tl.store(RSTD + t * heads + h, rstd, mask=t_mask)
        wa = tl.load(W + j, mask=j_mask, other=0.0).to(tl.float32) * scale
        ya = xa * rstd[:, None] * wa[None, :]
    else:
        ya = xa * scale
    tl.store(out, ya.to(OUT.dtype.element_ty), mask=mask)
    if TWO_HALVES:
        if HAS_NORM:
            wb = tl.load(W + head_dim + j, mask=j_mask, other=0.0).to(tl.float32) * scale
            yb = xb * rstd[:, None] * wb[None, :]
        else:
            yb = xb * scale
        tl.store(out + head_dim, yb.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _diff_epilogue_bwd_kernel(
    OA, OB, LAM, W, RSTD, DOUT, DOA, DOB, DLAM, DW,
    n_tokens, seq_len, batch, heads, head_dim, head_width, n_blocks, n_programs,
    sa_b, sa_s, sa_m, sa_h, sa_d,
    sb_b, sb_s, sb_m, sb_h, sb_d,
    sga_b, sga_s, sga_m, sga_h, sga_d,
    sgb_b, sgb_s, sgb_m, sgb_h, sgb_d,
    sl_b, sl_s, sl_h,
    scale,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TWO_HALVES: tl.constexpr, LAM_PER_TOKEN: tl.constexpr, HAS_NORM: tl.constexpr, TWO_MAPS: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_D)
    j_mask = j < head_dim
    if HAS_NORM:
        wa = tl.load(W + j, mask=j_mask, other=0.0).to(tl.float32) * scale
        if TWO_HALVES:
            wb = tl.load(W + head_dim + j, mask=j_mask, other=0.0).to(tl.float32) * scale
    dwa = tl.zeros([BLOCK_D], dtype=tl.float32)
    dwb = tl.zeros([BLOCK_D], dtype=tl.float32)
    dlam_acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for block in range(pid, n_blocks, n_programs):
        t, b, s, t_mask = _token_tile(block, seq_len, n_tokens, BLOCK_T)
        mask = t_mask[:, None] & j_mask[None, :]
        if LAM_PER_TOKEN:
            lam = tl.load(LAM + b * sl_b + s * sl_s + h * sl_h, mask=t_mask, other=0.0).to(tl.float32)[:, None]
        else:
            lam = tl.load(LAM).to(tl.float32)
        base_a = b * sa_b + s * sa_s + h * sa_h
        xa, a2 = _load_combined(OA, base_a, j, mask, sa_m, sa_d, lam, TWO_MAPS)
        dout = DOUT + ((s * batch + b) * heads + h)[:, None] * head_width + j[None, :]
        dya = tl.load(dout, mask=mask, other=0.0).to(tl.float32)
        if TWO_HALVES:
            base_b = b * sb_b + s * sb_s + h * sb_h
            xb, b2 = _load_combined(OB, base_b, j, mask, sb_m, sb_d, lam, TWO_MAPS)
            dyb = tl.load(dout + head_dim, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.load(RSTD + t * heads + h, mask=t_mask, other=0.0)
            ga = dya * wa[None, :]
            dot = tl.sum(ga * xa, axis=1)
            if TWO_HALVES:
                gb = dyb * wb[None, :]
                dot += tl.sum(gb * xb, axis=1)
            c = (dot * rstd * rstd / head_width)[:, None]
            dxa = (ga - xa * c) * rstd[:, None]
            dwa += tl.sum(dya * xa * rstd[:, None], axis=0)
            if TWO_HALVES:
                dxb = (gb - xb * c) * rstd[:, None]
                dwb += tl.sum(dyb * xb * rstd[:, None], axis=0)
        else:
            dxa = dya * scale
            if TWO_HALVES:
                dxb = dyb * scale
        dlam = -tl.sum(dxa * a2, axis=1)
        grad_a = DOA + (b * sga_b + s * sga_s + h * sga_h)[:, None] + j[None, :] * sga_d
        tl.store(grad_a, dxa.to(DOA.dtype.element_ty), mask=mask)
        if TWO_MAPS:
            tl.store(grad_a + sga_m, (-lam * dxa).to(DOA.dtype.element_ty), mask=mask)
        if TWO_HALVES:
            dlam -= tl.sum(dxb * b2, axis=1)
            grad_b = DOB + (b * sgb_b + s * sgb_s + h * sgb_h)[:, None] + j[None, :] * sgb_d
            tl.store(grad_b, dxb.to(DOB.dtype.element_ty), mask=mask)
            if TWO_MAPS:
                tl.store(grad_b + sgb_m, (-lam * dxb).to(DOB.dtype.element_ty), mask=mask)
        if LAM_PER_TOKEN:
            tl.store(DLAM + t * heads + h, dlam, mask=t_mask)
        else:
            dlam_acc += dlam
    if not LAM_PER_TOKEN:
        tl.store(DLAM + pid * heads + h, tl.sum(dlam_acc, axis=0))
    if HAS_NORM:
        dw = DW + (pid * heads + h) * head_width + j
        tl.store(dw, dwa * scale, mask=j_mask)
        if TWO_HALVES:
            tl.store(dw + head_dim, dwb * scale, mask=j_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _tile(head_dim: int):
    block_d = triton.next_power_of_2(head_dim)
    elements = _TILE_ELEMENTS if gpu_target.gpu_branch() else _INTERPRET_TILE_ELEMENTS
    return max(1, elements // block_d), block_d


def _strides(x: Optional[torch.Tensor], like: torch.Tensor):
    return (x if x is not None else like).stride()


def _lam_strides(lam: torch.Tensor):
    return lam.stride() if lam.dim() else (0, 0, 0)


def _forward(oa, ob, lam, weight, eps, scale):
    batch, seq, _, heads, head_dim = oa.shape
    n_halves = 1 if ob is None else 2
    head_width = n_halves * head_dim
    n_tokens = batch * seq
    out = torch.empty(seq, batch, heads * head_width, dtype=oa.dtype, device=oa.device)
    rstd = torch.empty(n_tokens, heads, dtype=torch.float32, device=oa.device) if weight is not None else None
    block_t, block_d = _tile(head_dim)
    grid = (triton.cdiv(n_tokens, block_t), heads)
    _diff_epilogue_fwd_kernel[grid](
        oa, ob if ob is not None else oa, lam, weight if weight is not None else lam, out,
        rstd if rstd is not None else out,
        n_tokens, seq, batch, heads, head_dim, head_width,
        *oa.stride(), *_strides(ob, oa), *_lam_strides(lam),
        float(eps), float(scale),
        BLOCK_T=block_t, BLOCK_D=block_d,
        TWO_HALVES=ob is not None, LAM_PER_TOKEN=lam.dim() > 0, HAS_NORM=weight is not None,
        TWO_MAPS=oa.shape[2] == 2, num_warps=4,
    )
    return out, rstd


def _programs_per_head(n_blocks: int, heads: int, device: torch.device) -> int:
    """Programs that loop over the token blocks of one head: about four waves of the GPU over all heads."""
    if not gpu_target.gpu_branch():
        return min(n_blocks, 2)
    sms = gpu_target.device_properties(device).multiprocessors
    return max(1, min(n_blocks, triton.cdiv(4 * sms, heads)))


def _backward(dout, oa, ob, lam, weight, rstd, scale):
    batch, seq, _, heads, head_dim = oa.shape
    head_width = (1 if ob is None else 2) * head_dim
    n_tokens = batch * seq
    block_t, block_d = _tile(head_dim)
    n_blocks = triton.cdiv(n_tokens, block_t)
    n_programs = _programs_per_head(n_blocks, heads, oa.device)
    # oa's strides where oa is dense (a permuted attention output: the gradient reaches the attention kernel in its own
    # layout); a view that skips elements (a half of a wider V) gets compact strides, which the kernel is given
    doa = torch.empty_like(oa)
    dob = torch.empty_like(ob) if ob is not None else None
    per_token, two_maps = lam.dim() > 0, oa.shape[2] == 2
    dlam = torch.empty((n_tokens if per_token else n_programs), heads, dtype=torch.float32, device=oa.device)
    dw = (torch.empty(n_programs, heads, head_width, dtype=torch.float32, device=oa.device)
          if weight is not None else None)
    _diff_epilogue_bwd_kernel[(n_programs, heads)](
        oa, ob if ob is not None else oa, lam, weight if weight is not None else lam,
        rstd if rstd is not None else dlam, dout.contiguous(), doa, dob if dob is not None else doa, dlam,
        dw if dw is not None else dlam,
        n_tokens, seq, batch, heads, head_dim, head_width, n_blocks, n_programs,
        *oa.stride(), *_strides(ob, oa), *doa.stride(), *_strides(dob, doa), *_lam_strides(lam),
        float(scale),
        BLOCK_T=block_t, BLOCK_D=block_d,
        TWO_HALVES=ob is not None, LAM_PER_TOKEN=per_token, HAS_NORM=weight is not None,
        TWO_MAPS=two_maps, num_warps=4,
    )
    dweight = dw.sum(dim=(0, 1)).to(weight.dtype) if weight is not None else None
    if not two_maps:  # maps already combined: the output does not depend on λ
        return doa, dob, None, dweight
    dlam = dlam.view(batch, seq, heads) if per_token else dlam.sum()
    return doa, dob, dlam.to(lam.dtype), dweight


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------
class DiffEpilogueFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, oa, ob, lam, weight, eps, scale):
        out, rstd = _forward(oa, ob, lam, weight, eps, scale)
        ctx.save_for_backward(oa, ob, lam, weight, rstd)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        oa, ob, lam, weight, rstd = ctx.saved_tensors
        doa, dob, dlam, dweight = _backward(dout, oa, ob, lam, weight, rstd, ctx.scale)
        return doa, dob, dlam, dweight, None, None


# ----------------------------------------------------------------------------------------------------------------
# API
# ----------------------------------------------------------------------------------------------------------------
def _check(halves, lam, weight):
    if len(halves) not in (1, 2):
        raise ValueError(f"halves has {len(halves)} tensors; expected one or two (B, N, 2, H, d) map outputs")
    first = halves[0]
    if first.dim() != 5 or first.shape[2] not in (1, 2):
        raise ValueError(f"halves[0] has shape {tuple(first.shape)}; expected (B, N, 2, H, d), or (B, N, 1, H, d) "
                         "for maps already combined")
    if first.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"halves[0] has dtype {first.dtype}; expected one of float16, bfloat16, float32")
    for o in halves[1:]:
        if o.shape != first.shape or o.dtype != first.dtype or o.device != first.device:
            raise ValueError(f"halves[1] is {tuple(o.shape)} {o.dtype} on {o.device}; expected halves[0]'s "
                             f"{tuple(first.shape)} {first.dtype} on {first.device}")
    batch, seq, _, heads, head_dim = first.shape
    if tuple(lam.shape) not in ((), (batch, seq, heads)):
        raise ValueError(f"lam has shape {tuple(lam.shape)}; expected () or (B, N, H) = {(batch, seq, heads)}")
    if weight is not None and tuple(weight.shape) != (len(halves) * head_dim,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected ({len(halves) * head_dim},), "
                         "the features of one head")
    if not _INTERPRET and first.device.type != "cuda":
        raise ValueError(f"the fused epilogue needs CUDA tensors, got {first.device}; on CPU set TRITON_INTERPRET=1 "
                         "before importing triton, or use kernels.diff_epilogue.naive")


def diff_epilogue(
    halves: Sequence[torch.Tensor],
    lam: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    scale: float = 1.0,
) -> torch.Tensor:
    """The DIFF epilogue in one kernel each way; the same arguments and result as
    :func:`kernels.diff_epilogue.naive.diff_epilogue_naive`. Differentiable in the halves, lam and weight."""
    _check(halves, lam, weight)
    return DiffEpilogueFunction.apply(
        halves[0], halves[1] if len(halves) == 2 else None, lam.to(halves[0].device), weight, eps, scale
    )
