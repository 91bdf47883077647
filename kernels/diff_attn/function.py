"""Fused differential FlashAttention (V1 and V2) in Triton: the autograd function and the public functions.

V1: q (B, Nq, 2H, d), k (B, Nk, 2Hkv, d), v (B, Nk, Hkv, 2d); map 1 uses (q[2h], k[2g]), map 2 (q[2h+1], k[2g+1]),
    both read v[g] (2d wide); y (B, Nq, H, 2d) = O1 − λ·O2 with λ one value or one per head.
V2: q (B, Nq, 2H, d), k and v (B, Nk, Hkv, d); both maps read k[g] and v[g]; y (B, Nq, H, d) = O1 − λ·O2 with
    λ one value per token and head.
g = h // (H / Hkv) in both. Internally λ is a (B, Nq, H) view (stride 0 where it broadcasts). Every program of
every kernel owns both maps of a head (or KV group), so each K/V (or Q/dO) tile it loads serves both.

The kernels are in forward.py and backward.py (their shared tiles and masks in tiles.py), their launchers
in launch.py; chunks.py has the pieces a context-parallel (ring) attention assembles its own pass from.
"""

import math

import torch

from kernels.diff_attn.launch import (
    _INTERPRET,
    _design,
    _diff_attn_forward,
    _diff_attn_grads,
    _diff_attn_preprocess,
    _lam_rows,
)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 128


class DiffFlashAttnFunction(torch.autograd.Function):
    """Fused differential attention; `shared_k=False` is V1, `shared_k=True` is V2. Returns (out, lse).

    `norm_weight` (or None) and `output_scale` are the epilogue; `plan` (or None: the table's) fixes the design and
    block configs."""

    @staticmethod
    def forward(ctx, q, k, v, lam, norm_weight, causal, softmax_scale, shared_k, norm_eps, output_scale, plan,
                documents=None):
        lam_rows = _lam_rows(lam, q.shape[0], q.shape[1], q.shape[2] // 2)
        causal_offset = k.shape[1] - q.shape[1]
        design = _design(q, v.shape[3], plan)
        out, y, lse, rstd = _diff_attn_forward(q, k, v, lam_rows, norm_weight, causal, causal_offset, softmax_scale,
                                               shared_k, norm_eps, output_scale, design, plan, documents=documents)
        ctx.save_for_backward(q, k, v, lam, y, lse, rstd, norm_weight)
        ctx.causal, ctx.softmax_scale, ctx.shared_k = causal, softmax_scale, shared_k
        ctx.output_scale, ctx.design, ctx.plan, ctx.documents = output_scale, design, plan, documents
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, lam, y, lse, rstd, norm_weight = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        lam_rows = _lam_rows(lam, q.shape[0], q.shape[1], q.shape[2] // 2)
        causal_offset = k.shape[1] - q.shape[1]
        common = (ctx.causal, causal_offset, ctx.softmax_scale, ctx.shared_k)
        dy, delta, r2, dw_partial = _diff_attn_preprocess(dout, q, k, v, lam_rows, y, lse, rstd, norm_weight,
                                                          *common, ctx.output_scale, ctx.design, ctx.plan,
                                                          documents=ctx.documents)
        dq, dk, dv = _diff_attn_grads(dy, q, k, v, lam_rows, lse, delta, *common, ctx.design, ctx.plan,
                                      documents=ctx.documents)
        # y = O1 − λ·O2, so dλ = −rowsum(dy ∘ O2), summed over every token and head that shares the λ.
        dlam = (-r2.transpose(1, 2)).sum_to_size(lam.shape).to(lam.dtype)
        dw = dw_partial.sum(0).to(norm_weight.dtype) if dw_partial is not None else None
        return dq, dk, dv, dlam, dw, None, None, None, None, None, None, None


def _shape(x):
    return tuple(x.shape)


def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_common(q, k, v, lam, causal, softmax_scale):
    for name, x in (("q", q), ("k", k), ("v", v), ("lam", lam)):
        _check_tensor(name, x)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; expected one of float16, bfloat16, float32")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}; expected q's dtype {q.dtype}")
    if not lam.is_floating_point():
        raise TypeError(f"lam has dtype {lam.dtype}; expected a floating-point tensor")
    for name, x in (("k", k), ("v", v), ("lam", lam)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}; expected q's device {q.device}")
    if not _INTERPRET and q.device.type != "cuda":
        raise ValueError(
            f"the fused kernel needs CUDA tensors, got q on {q.device}; on CPU set TRITON_INTERPRET=1 before "
            "importing triton, or use the reference in kernels.diff_attn.naive"
        )
    if q.dim() != 4 or q.shape[2] % 2 or q.shape[1] < 1 or q.shape[0] < 1 or q.shape[2] < 2:
        raise ValueError(f"q has shape {_shape(q)}; expected (B, N, 2*H, d) with an even number of heads 2*H")
    if not 1 <= q.shape[3] <= _MAX_HEAD_DIM:
        raise ValueError(f"q has head dim d={q.shape[3]}; expected 1 <= d <= {_MAX_HEAD_DIM}")
    if k.dim() == 4 and k.shape[1] < 1:
        raise ValueError(f"k has shape {_shape(k)}; expected at least one key (N >= 1)")
    if causal and k.dim() == 4 and q.shape[1] > k.shape[1]:
        raise ValueError(
            f"causal attention with {q.shape[1]} queries and {k.shape[1]} keys: the bottom-right aligned mask "
            "needs queries <= keys"
        )
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and 0 < softmax_scale < math.inf):
        raise ValueError(f"softmax_scale={softmax_scale!r}; expected None or a positive finite number")


def _check_v1_shapes(q, k, v):
    batch, _, two_h, head_dim = q.shape
    n_heads = two_h // 2
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] % 2 or k.shape[2] == 0 \
            or n_heads % (k.shape[2] // 2):
        raise ValueError(
            f"k has shape {_shape(k)}; expected (B={batch}, N, 2*Hkv, d={head_dim}) with 2*Hkv even and Hkv "
            f"dividing H={n_heads}"
        )
    expected_v = (batch, k.shape[1], k.shape[2] // 2, 2 * head_dim)
    if _shape(v) != expected_v:
        raise ValueError(f"v has shape {_shape(v)}; expected (B, N, Hkv, 2*d) = {expected_v}")


def _check_v2_shapes(q, k, v):
    batch, _, two_h, head_dim = q.shape
    n_heads = two_h // 2
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] == 0 or n_heads % k.shape[2]:
        raise ValueError(
            f"k has shape {_shape(k)}; expected (B={batch}, N, Hkv, d={head_dim}) with Hkv dividing H={n_heads}"
        )
    if _shape(v) != _shape(k):
        raise ValueError(f"v has shape {_shape(v)}; expected k's shape (B, N, Hkv, d) = {_shape(k)}")


def _check_epilogue(norm_weight, norm_eps, output_scale, q, value_dim):
    if norm_weight is not None:
        _check_tensor("norm_weight", norm_weight)
        if _shape(norm_weight) != (value_dim,) or not norm_weight.is_floating_point():
            raise ValueError(f"norm_weight has shape {_shape(norm_weight)} and dtype {norm_weight.dtype}; expected "
                             f"a floating-point ({value_dim},), one weight per column of a head's output")
        if norm_weight.device != q.device:
            raise ValueError(f"norm_weight is on {norm_weight.device}; expected q's device {q.device}")
    if not (isinstance(norm_eps, (int, float)) and 0 < norm_eps < math.inf):
        raise ValueError(f"norm_eps={norm_eps!r}; expected a positive finite number")
    if not (isinstance(output_scale, (int, float)) and math.isfinite(output_scale)):
        raise ValueError(f"output_scale={output_scale!r}; expected a finite number")


def _unit_stride_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _documents(document_ids, q, k, q_document_ids=None):
    """(query ids, key ids) as the kernels read them ((B, Nq), (B, Nk) int32, contiguous), or None. The queries are
    the last Nq positions of `document_ids` unless their own ids are given (context-parallel chunks)."""
    if document_ids is None:
        return None
    batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    given = (("document_ids", document_ids, n_k),) + ((("q_document_ids", q_document_ids, n_q),)
                                                      if q_document_ids is not None else ())
    for name, ids, n in given:
        _check_tensor(name, ids)
        if ids.dtype.is_floating_point or ids.is_complex() or _shape(ids) != (batch, n):
            raise ValueError(f"{name} has shape {_shape(ids)} and dtype {ids.dtype}; expected integer ids (B, N) = "
                             f"{(batch, n)}, non-decreasing along each row")
        if ids.device != q.device:
            raise ValueError(f"{name} is on {ids.device}; expected q's device {q.device}")
    k_ids = document_ids.to(torch.int32).contiguous()
    q_ids = q_document_ids.to(torch.int32).contiguous() if q_document_ids is not None else k_ids[:, n_k - n_q:]
    return q_ids.contiguous(), k_ids


def _softmax_scale(softmax_scale, head_dim):
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def diff_flash_attn(q, k, v, lam, causal=True, softmax_scale=None, return_lse=False, *, norm_weight=None,
                    norm_eps=1e-5, output_scale=1.0, plan=None, document_ids=None):
    """Differential attention V1, fused: y = softmax(Q1·K1ᵀ·s)·V − λ·softmax(Q2·K2ᵀ·s)·V, then the DIFF epilogue.

    Args:
        q: (B, Nq, 2H, d); heads 2h and 2h+1 are Q1 and Q2 of differential head h.
        k: (B, Nk, 2Hkv, d); heads 2g and 2g+1 are K1 and K2 of KV group g = h // (H / Hkv).
        v: (B, Nk, Hkv, 2d).
        lam: 0-dim tensor or shape (H,); any real value (also outside [0, 1]).
        causal: mask aligned to the bottom right (query i sees keys j <= i + Nk − Nq); needs Nq <= Nk.
        softmax_scale: s; defaults to 1/√d.
        return_lse: also return lse (B, 2H, Nq) fp32 natural-log: lse[:, 2h] is map 1, lse[:, 2h+1] map 2.
        norm_weight: (2d,) or None: out = RMSNorm(y)·norm_weight·output_scale, the RMS over each head's 2d columns
            (V1's sub-layer norm, as torch.nn.RMSNorm(2d, eps=norm_eps)); None: out = y·output_scale.
        norm_eps, output_scale: the norm's ε and the output multiplier (1 − λ_init in the model).
        plan: a tuning.Plan fixing the design and every block config (benchmarks); None: the table's.
        document_ids: (B, Nk) integer ids, non-decreasing along each row, or None: a query sees only keys of its
            own document (packed samples; the queries are the last Nq positions). Key blocks before or after a
            query block's documents are skipped in the forward and both backward passes.
    Returns:
        out (B, Nq, H, 2d) in q's dtype (and lse). Differentiable in q, k, v, lam and norm_weight.
    """
    _check_common(q, k, v, lam, causal, softmax_scale)
    _check_v1_shapes(q, k, v)
    n_heads = q.shape[2] // 2
    if _shape(lam) not in ((), (n_heads,)):
        raise ValueError(f"lam has shape {_shape(lam)}; expected () or (H,) = ({n_heads},)")
    _check_epilogue(norm_weight, norm_eps, output_scale, q, v.shape[3])
    out, lse = DiffFlashAttnFunction.apply(
        _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v), lam, norm_weight, causal,
        _softmax_scale(softmax_scale, q.shape[3]), False, float(norm_eps), float(output_scale), plan,
        _documents(document_ids, q, k),
    )
    return (out, lse) if return_lse else out


def diff_flash_attn_v2(q, k, v, lam, causal=True, softmax_scale=None, return_lse=False, *, plan=None,
                       document_ids=None):
    """Differential attention V2, fused: out = O[2h] − lam·O[2h+1] over one GQA attention of 2H query heads.

    Args:
        q: (B, Nq, 2H, d); heads 2h and 2h+1 form differential head h.
        k, v: (B, Nk, Hkv, d); Hkv divides H, so both heads of a pair use KV head g = h // (H / Hkv).
        lam: (B, Nq, H), per token and head (already through the sigmoid).
        causal, softmax_scale, return_lse, plan, document_ids: as in `diff_flash_attn`.
    Returns:
        out (B, Nq, H, d) in q's dtype (and lse (B, 2H, Nq)). Differentiable in q, k, v and lam.
    """
    _check_common(q, k, v, lam, causal, softmax_scale)
    _check_v2_shapes(q, k, v)
    batch, n_q, two_h, head_dim = q.shape
    if _shape(lam) != (batch, n_q, two_h // 2):
        raise ValueError(f"lam has shape {_shape(lam)}; expected (B, N, H) = {(batch, n_q, two_h // 2)}")
    out, lse = DiffFlashAttnFunction.apply(
        _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v), lam, None, causal,
        _softmax_scale(softmax_scale, head_dim), True, 1e-5, 1.0, plan, _documents(document_ids, q, k),
    )
    return (out, lse) if return_lse else out
