"""Fused differential FlashAttention (V1 and V2) in Triton: kernels, launchers, autograd, public functions.

One program owns one (batch, differential head h, query block) and keeps two online-softmax states
(m1, l1, acc1) and (m2, l2, acc2), so every K/V tile is loaded once for both maps.

V1: q (B, Nq, 2H, d), k (B, Nk, 2Hkv, d), v (B, Nk, Hkv, 2d); map 1 uses (q[2h], k[2g]), map 2 (q[2h+1], k[2g+1]),
    both read v[g] (2d wide); out (B, Nq, H, 2d) = O1 − λ·O2 with λ one value or one per head.
V2: q (B, Nq, 2H, d), k and v (B, Nk, Hkv, d); both maps read k[g] and v[g]; out (B, Nq, H, d) = O1 − λ·O2 with
    λ one value per token and head.
g = h // (H / Hkv) in both. Internally λ is a (B, Nq, H) view (stride 0 where it broadcasts).

Backward (FlashAttention-2 style, recomputing P from the saved LSE):
  with out = O1 − λ·O2 the upstream gradients of the maps are dO1 = dO and dO2 = −λ·dO, so
  dP1 = dO·Vᵀ and dP2 = −λ·dP1 share one matmul, and dV = (P1 − λ·P2)ᵀ·dO is one matmul.
  delta_i = rowsum(dO_i ∘ O_i): only out is saved (no extra N×2d tensor, so memory matches one FlashAttention
  call), so the preprocess kernel recomputes r2 = rowsum(dO ∘ O2) = rowsum(P2 ∘ dP1) with one pass over the keys;
  then delta1 = rowsum(dO ∘ out) + λ·r2, delta2 = −λ·r2 and dλ = −r2 summed over what λ broadcasts over.
  dK/dV: one program per (batch, KV group, key block) loops over every query head of the group, so GQA needs
  no atomics and the result is deterministic. dQ: one program per (batch, head, query block).
  The products the backward needs per (query, key) pair (S1, S2 recomputed; dP; dV; dQ1, dQ2; dK1, dK2) are in V1
  as many multiply-adds as a vanilla attention of 2H heads of d needs (10·d); the preprocess (S2, dP) and the dQ
  kernel (S1, S2, dP) recompute on top of them.
Causal masking is aligned to the bottom right (query i sees keys j <= i + Nk − Nq); key blocks that a query
block cannot see are skipped, and only the blocks on the diagonal or at a ragged tail pay for masking.

Block sizes, warps and stages come from kernels/diff_attn/tuning.py: a table of known-good configs by default,
timed candidates with DIFF_ATTN_AUTOTUNE=1. fp32 inputs run their products in TF32 on a GPU (fp32 accumulation and
softmax statistics; IEEE fp32 dots are an order of magnitude slower on tensor cores), in full fp32 in the interpreter.
"""

import math
import os

import torch
import triton
import triton.language as tl

from kernels.diff_attn import tuning
from kernels.diff_attn.tuning import BlockConfig

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 128

# Block sizes in the interpreter (no tuning there); small, so that the tests cross block edges.
_INTERPRET_CONFIGS = {
    "forward": BlockConfig(32, 16, 4, 1),
    "preprocess": BlockConfig(16, 32, 4, 1),
    "dkdv": BlockConfig(16, 32, 4, 1),
    "dq": BlockConfig(16, 32, 4, 1),
}


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptr, row_idx, col_idx, row_stride, n_rows, n_cols, UPCAST: tl.constexpr):
    """Load a (rows, cols) tile with unit column stride; out-of-range elements read as 0."""
    mask = (row_idx[:, None] < n_rows) & (col_idx[None, :] < n_cols)
    tile = tl.load(ptr + row_idx[:, None] * row_stride + col_idx[None, :], mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _load_tile_t(ptr, row_idx, col_idx, row_stride, n_rows, n_cols, UPCAST: tl.constexpr):
    """Load the transpose (cols, rows) of a row-major tile; out-of-range elements read as 0."""
    mask = (row_idx[None, :] < n_rows) & (col_idx[:, None] < n_cols)
    tile = tl.load(ptr + row_idx[None, :] * row_stride + col_idx[:, None], mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _fwd_key_loop(
    acc1, l1, m1, acc2, l2, m2, q1, q2,
    k1_base, k2_base, v_base, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block_n in range(start_n, end_n, BLOCK_N):
        offs_n = block_n + tl.arange(0, BLOCK_N)
        k1t = _load_tile_t(k1_base, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
        s1 = tl.dot(q1, k1t, input_precision=DOT_PRECISION) * qk_scale
        if SHARED_K:
            s2 = tl.dot(q2, k1t, input_precision=DOT_PRECISION) * qk_scale
        else:
            k2t = _load_tile_t(k2_base, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
            s2 = tl.dot(q2, k2t, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s1 = tl.where(visible, s1, float("-inf"))
            s2 = tl.where(visible, s2, float("-inf"))
        m1_new = tl.maximum(m1, tl.max(s1, 1))
        m2_new = tl.maximum(m2, tl.max(s2, 1))
        p1 = tl.math.exp2(s1 - m1_new[:, None])
        p2 = tl.math.exp2(s2 - m2_new[:, None])
        alpha1 = tl.math.exp2(m1 - m1_new)
        alpha2 = tl.math.exp2(m2 - m2_new)
        l1 = l1 * alpha1 + tl.sum(p1, 1)
        l2 = l2 * alpha2 + tl.sum(p2, 1)
        v = _load_tile(v_base, offs_n, offs_dv, stride_vn, N_K, VALUE_D, UPCAST)
        acc1 = tl.dot(p1.to(v.dtype), v, acc1 * alpha1[:, None], input_precision=DOT_PRECISION)
        acc2 = tl.dot(p2.to(v.dtype), v, acc2 * alpha2[:, None], input_precision=DOT_PRECISION)
        m1 = m1_new
        m2 = m2_new
    return acc1, l1, m1, acc2, l2, m2


@triton.jit
def _kv_heads(g, SHARED_K: tl.constexpr):
    """Heads of k that KV group g uses for map 1 and map 2: 2g and 2g+1 in V1, g for both in V2."""
    k_head1 = g if SHARED_K else 2 * g
    k_head2 = g if SHARED_K else 2 * g + 1
    return k_head1, k_head2


@triton.jit
def _query_block_program(
    Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
    SHARED_K: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Decode a program of the (query block, batch × head) grid of the forward, preprocess and dQ kernels.

    Returns its first query row and rows, b (int64, so batch offsets cannot overflow), h, the offset of map 1's row of
    (b, h) in the (B, 2H, Nq) LSE and delta tensors (map 2's is N_Q further), and the bases of q[2h] (q[2h+1] is one
    stride_qh further), of k for each map and of v.
    """
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // N_HEADS).to(tl.int64)
    h = pid_bh % N_HEADS
    g = h // GROUP
    k_head1, k_head2 = _kv_heads(g, SHARED_K)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_stats = (b * 2 * N_HEADS + 2 * h) * N_Q
    q1_base = Q + b * stride_qb + (2 * h) * stride_qh
    k1_base = K + b * stride_kb + k_head1 * stride_kh
    k2_base = K + b * stride_kb + k_head2 * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    return start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, v_base


@triton.jit
def _key_ranges(start_m, N_Q, N_K, causal_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """Key range [0, full_end) that every row of the query block sees whole, and [full_end, end) needing masks."""
    if CAUSAL:
        end = tl.minimum(start_m + BLOCK_M + causal_offset, N_K)
        full_end = tl.minimum((start_m + causal_offset + 1) // BLOCK_N * BLOCK_N, N_K // BLOCK_N * BLOCK_N)
    else:
        end = N_K
        full_end = N_K // BLOCK_N * BLOCK_N
    return full_end, end


@triton.jit
def _diff_attn_fwd_kernel(
    Q, K, V, LAM, OUT, LSE,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_ob, stride_on, stride_oh,
    N_HEADS, GROUP, N_Q, N_K, qk_scale,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, BLOCK_M,
    )
    causal_offset = N_K - N_Q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q1 = _load_tile(q1_base, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)
    q2 = _load_tile(q1_base + stride_qh, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    full_end, end = _key_ranges(start_m, N_Q, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    acc1, l1, m1, acc2, l2, m2 = _fwd_key_loop(
        acc1, l1, m1, acc2, l2, m2, q1, q2, k1_base, k2_base, v_base, stride_kn, stride_vn,
        offs_m, 0, full_end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_N, False, CAUSAL, SHARED_K, UPCAST, DOT_PRECISION,
    )
    acc1, l1, m1, acc2, l2, m2 = _fwd_key_loop(
        acc1, l1, m1, acc2, l2, m2, q1, q2, k1_base, k2_base, v_base, stride_kn, stride_vn,
        offs_m, full_end, end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_N, True, CAUSAL, SHARED_K, UPCAST, DOT_PRECISION,
    )

    row_valid = offs_m < N_Q
    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    out = acc1 / l1[:, None] - lam.to(tl.float32)[:, None] * (acc2 / l2[:, None])
    out_ptrs = OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_valid[:, None] & (offs_dv[None, :] < VALUE_D))
    # LSE is stored in natural-log units, (B, 2H, Nq) contiguous: row 2h is map 1, row 2h+1 is map 2.
    lse_base = LSE + row_stats
    tl.store(lse_base + offs_m, (m1 + tl.math.log2(l1)) / 1.4426950408889634, mask=row_valid)
    tl.store(lse_base + N_Q + offs_m, (m2 + tl.math.log2(l2)) / 1.4426950408889634, mask=row_valid)


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_row_vector(ptr, offs, n, other):
    return tl.load(ptr + offs, mask=offs < n, other=other)


@triton.jit
def _bwd_r2_key_loop(
    r2, q2, do, lse2_log2, k2_base, v_base, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block_n in range(start_n, end_n, BLOCK_N):
        offs_n = block_n + tl.arange(0, BLOCK_N)
        k2t = _load_tile_t(k2_base, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
        p2 = tl.math.exp2(tl.dot(q2, k2t, input_precision=DOT_PRECISION) * qk_scale - lse2_log2[:, None])
        if MASKED:
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            p2 = tl.where(visible, p2, 0.0)
        vt = _load_tile_t(v_base, offs_n, offs_dv, stride_vn, N_K, VALUE_D, UPCAST)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        r2 += tl.sum(p2 * dp, 1)
    return r2


@triton.jit
def _diff_attn_bwd_preprocess_kernel(
    Q, K, V, LAM, OUT, DOUT, LSE, DELTA, R2,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_ob, stride_on, stride_oh,
    stride_dob, stride_don, stride_doh,
    N_HEADS, GROUP, N_Q, N_K, qk_scale,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """delta1, delta2 (B, 2H, Nq) and r2 = rowsum(dO ∘ O2) (B, H, Nq), recomputing O2's contribution from P2."""
    start_m, offs_m, b, h, row_stats, q1_base, _, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, BLOCK_M,
    )
    causal_offset = N_K - N_Q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_valid = offs_m < N_Q
    q2 = _load_tile(q1_base + stride_qh, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)
    do = _load_tile(DOUT + b * stride_dob + h * stride_doh, offs_m, offs_dv, stride_don, N_Q, VALUE_D, UPCAST)
    out = _load_tile(OUT + b * stride_ob + h * stride_oh, offs_m, offs_dv, stride_on, N_Q, VALUE_D, UPCAST)
    lse2_log2 = _load_row_vector(LSE + row_stats + N_Q, offs_m, N_Q, float("inf")) * 1.4426950408889634

    r2 = tl.zeros([BLOCK_M], tl.float32)
    full_end, end = _key_ranges(start_m, N_Q, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    r2 = _bwd_r2_key_loop(r2, q2, do, lse2_log2, k2_base, v_base, stride_kn, stride_vn, offs_m, 0, full_end,
                          causal_offset, qk_scale, N_K, HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_N, False, CAUSAL,
                          UPCAST, DOT_PRECISION)
    r2 = _bwd_r2_key_loop(r2, q2, do, lse2_log2, k2_base, v_base, stride_kn, stride_vn, offs_m, full_end, end,
                          causal_offset, qk_scale, N_K, HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_N, True, CAUSAL,
                          UPCAST, DOT_PRECISION)

    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    lam = lam.to(tl.float32)
    do_dot_out = tl.sum(do.to(tl.float32) * out.to(tl.float32), 1)
    delta_base = DELTA + row_stats
    tl.store(delta_base + offs_m, do_dot_out + lam * r2, mask=row_valid)
    tl.store(delta_base + N_Q + offs_m, -lam * r2, mask=row_valid)
    tl.store(R2 + (b * N_HEADS + h) * N_Q + offs_m, r2, mask=row_valid)


@triton.jit
def _bwd_dkdv_query_loop(
    dk1, dk2, dv, k1, k2, v,
    q1_base, q2_base, do_base, lse_base, delta_base, lam_base,
    stride_qn, stride_don, stride_ln, N_Q,
    offs_n, start_m, end_m, causal_offset, qk_scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, SHARED_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate dK1, dK2 (pre-scale) and dV for one key block over the query blocks in [start_m, end_m)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block_m in range(start_m, end_m, BLOCK_M):
        offs_m = block_m + tl.arange(0, BLOCK_M)
        q1t = _load_tile_t(q1_base, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)
        q2t = _load_tile_t(q2_base, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)
        # Rows past Nq get LSE = +inf, so their probabilities are exactly 0.
        lse1 = _load_row_vector(lse_base, offs_m, N_Q, float("inf")) * 1.4426950408889634
        lse2 = _load_row_vector(lse_base + N_Q, offs_m, N_Q, float("inf")) * 1.4426950408889634
        p1t = tl.math.exp2(tl.dot(k1, q1t, input_precision=DOT_PRECISION) * qk_scale - lse1[None, :])
        p2t = tl.math.exp2(tl.dot(k2, q2t, input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASKED:
            visible = offs_n[:, None] <= offs_m[None, :] + causal_offset
            p1t = tl.where(visible, p1t, 0.0)
            p2t = tl.where(visible, p2t, 0.0)
        lam = tl.load(lam_base + offs_m * stride_ln, mask=offs_m < N_Q, other=0.0).to(tl.float32)
        do = _load_tile(do_base, offs_m, offs_dv, stride_don, N_Q, VALUE_D, UPCAST)
        # dV = (P1 − λ·P2)ᵀ·dO, since the map-2 upstream gradient is −λ·dO.
        p_combined_t = p1t - lam[None, :] * p2t
        dv = tl.dot(p_combined_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        delta1 = _load_row_vector(delta_base, offs_m, N_Q, 0.0)
        delta2 = _load_row_vector(delta_base + N_Q, offs_m, N_Q, 0.0)
        ds1t = p1t * (dpt - delta1[None, :])
        ds2t = p2t * (-lam[None, :] * dpt - delta2[None, :])
        dk1 = tl.dot(ds1t.to(q1t.dtype), tl.trans(q1t), dk1, input_precision=DOT_PRECISION)
        if SHARED_K:
            dk1 = tl.dot(ds2t.to(q2t.dtype), tl.trans(q2t), dk1, input_precision=DOT_PRECISION)
        else:
            dk2 = tl.dot(ds2t.to(q2t.dtype), tl.trans(q2t), dk2, input_precision=DOT_PRECISION)
    return dk1, dk2, dv


@triton.jit
def _query_ranges(start_n, N_Q, causal_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query blocks [start, full_start) on the causal diagonal of a key block, and [full_start, end) that see it whole."""
    end = tl.cdiv(N_Q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        start = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M
        full_start = tl.minimum(tl.maximum(full_start, start), end)
    else:
        start = 0
        full_start = 0
    return start, full_start, end


@triton.jit
def _diff_attn_bwd_dkdv_kernel(
    Q, K, V, LAM, DOUT, LSE, DELTA, DK, DV,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_dob, stride_don, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    N_HEADS, N_KV_GROUPS, GROUP, N_Q, N_K, qk_scale, sm_scale,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    pid_bg = tl.program_id(1)
    b = (pid_bg // N_KV_GROUPS).to(tl.int64)
    g = pid_bg % N_KV_GROUPS
    k_head1, k_head2 = _kv_heads(g, SHARED_K)
    causal_offset = N_K - N_Q

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k1 = _load_tile(K + b * stride_kb + k_head1 * stride_kh, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
    if SHARED_K:
        k2 = k1
    else:
        k2 = _load_tile(K + b * stride_kb + k_head2 * stride_kh, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
    v = _load_tile(V + b * stride_vb + g * stride_vh, offs_n, offs_dv, stride_vn, N_K, VALUE_D, UPCAST)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    start_m, full_start, end_m = _query_ranges(start_n, N_Q, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    # Every query head of the KV group adds into the same dK/dV tile: GQA without atomics.
    for h in range(g * GROUP, (g + 1) * GROUP):
        q1_base = Q + b * stride_qb + (2 * h) * stride_qh
        q2_base = q1_base + stride_qh
        do_base = DOUT + b * stride_dob + h * stride_doh
        lse_base = LSE + (b * 2 * N_HEADS + 2 * h) * N_Q
        delta_base = DELTA + (b * 2 * N_HEADS + 2 * h) * N_Q
        lam_base = LAM + b * stride_lb + h * stride_lh
        dk1, dk2, dv = _bwd_dkdv_query_loop(
            dk1, dk2, dv, k1, k2, v, q1_base, q2_base, do_base, lse_base, delta_base, lam_base,
            stride_qn, stride_don, stride_ln, N_Q, offs_n, start_m, full_start, causal_offset, qk_scale,
            HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_M, True, SHARED_K, UPCAST, DOT_PRECISION,
        )
        dk1, dk2, dv = _bwd_dkdv_query_loop(
            dk1, dk2, dv, k1, k2, v, q1_base, q2_base, do_base, lse_base, delta_base, lam_base,
            stride_qn, stride_don, stride_ln, N_Q, offs_n, full_start, end_m, causal_offset, qk_scale,
            HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_M, False, SHARED_K, UPCAST, DOT_PRECISION,
        )

    key_valid = offs_n[:, None] < N_K
    dk_base = DK + b * stride_dkb + offs_n[:, None] * stride_dkn + offs_d[None, :]
    d_mask = key_valid & (offs_d[None, :] < HEAD_D)
    tl.store(dk_base + k_head1 * stride_dkh, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=d_mask)
    if not SHARED_K:
        tl.store(dk_base + k_head2 * stride_dkh, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=d_mask)
    dv_ptrs = DV + b * stride_dvb + g * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :]
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_valid & (offs_dv[None, :] < VALUE_D))


@triton.jit
def _bwd_dq_key_loop(
    dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam,
    k1_base, k2_base, v_base, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for block_n in range(start_n, end_n, BLOCK_N):
        offs_n = block_n + tl.arange(0, BLOCK_N)
        k1 = _load_tile(k1_base, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
        if SHARED_K:
            k2 = k1
        else:
            k2 = _load_tile(k2_base, offs_n, offs_d, stride_kn, N_K, HEAD_D, UPCAST)
        p1 = tl.math.exp2(tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION) * qk_scale - lse1[:, None])
        p2 = tl.math.exp2(tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            p1 = tl.where(visible, p1, 0.0)
            p2 = tl.where(visible, p2, 0.0)
        vt = _load_tile_t(v_base, offs_n, offs_dv, stride_vn, N_K, VALUE_D, UPCAST)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds1 = p1 * (dp - delta1[:, None])
        ds2 = p2 * (-lam[:, None] * dp - delta2[:, None])
        dq1 = tl.dot(ds1.to(k1.dtype), k1, dq1, input_precision=DOT_PRECISION)
        dq2 = tl.dot(ds2.to(k2.dtype), k2, dq2, input_precision=DOT_PRECISION)
    return dq1, dq2


@triton.jit
def _diff_attn_bwd_dq_kernel(
    Q, K, V, LAM, DOUT, LSE, DELTA, DQ,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_dob, stride_don, stride_doh,
    stride_dqb, stride_dqn, stride_dqh,
    N_HEADS, GROUP, N_Q, N_K, qk_scale, sm_scale,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, BLOCK_M,
    )
    causal_offset = N_K - N_Q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_valid = offs_m < N_Q
    q1 = _load_tile(q1_base, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)
    q2 = _load_tile(q1_base + stride_qh, offs_m, offs_d, stride_qn, N_Q, HEAD_D, UPCAST)
    do = _load_tile(DOUT + b * stride_dob + h * stride_doh, offs_m, offs_dv, stride_don, N_Q, VALUE_D, UPCAST)
    lse1 = _load_row_vector(LSE + row_stats, offs_m, N_Q, float("inf")) * 1.4426950408889634
    lse2 = _load_row_vector(LSE + row_stats + N_Q, offs_m, N_Q, float("inf")) * 1.4426950408889634
    delta1 = _load_row_vector(DELTA + row_stats, offs_m, N_Q, 0.0)
    delta2 = _load_row_vector(DELTA + row_stats + N_Q, offs_m, N_Q, 0.0)
    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    lam = lam.to(tl.float32)

    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end, end = _key_ranges(start_m, N_Q, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    dq1, dq2 = _bwd_dq_key_loop(
        dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam, k1_base, k2_base, v_base, stride_kn, stride_vn,
        offs_m, 0, full_end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_N, False, CAUSAL, SHARED_K, UPCAST, DOT_PRECISION,
    )
    dq1, dq2 = _bwd_dq_key_loop(
        dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, lam, k1_base, k2_base, v_base, stride_kn, stride_vn,
        offs_m, full_end, end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, VALUE_D, BLOCK_DV, BLOCK_N, True, CAUSAL, SHARED_K, UPCAST, DOT_PRECISION,
    )

    dq_ptrs = DQ + b * stride_dqb + (2 * h) * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :]
    d_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_D)
    tl.store(dq_ptrs, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=d_mask)
    tl.store(dq_ptrs + stride_dqh, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Chosen configs by (device index, problem): selection runs once per shape class, a dict lookup afterwards.
_CHOSEN_CONFIGS = {}
_CONFIG_CACHE = {}


def _kernel_constants(q, value_dim, causal, shared_k):
    head_dim = q.shape[3]
    return dict(
        HEAD_D=head_dim,
        VALUE_D=value_dim,
        # tl.dot needs every dimension >= 16; non-power-of-two head dims (96) are padded and masked.
        BLOCK_D=tuning.padded_dim(head_dim),
        BLOCK_DV=tuning.padded_dim(value_dim),
        CAUSAL=causal,
        SHARED_K=shared_k,
        # The interpreter computes bf16 arithmetic wrongly, so bf16 tiles are widened to fp32 after loading there.
        UPCAST=_INTERPRET and q.dtype == torch.bfloat16,
        # fp32 inputs: TF32 products with fp32 accumulation on a GPU (IEEE fp32 dots are an order of magnitude slower
        # on tensor cores); the interpreter multiplies in full fp32, which the reference tests rely on. 16-bit inputs
        # ignore it.
        DOT_PRECISION="ieee" if _INTERPRET else "tf32",
    )


def _block_config(name, kernel, grid, args, constants, q, n_q, n_k):
    """The block config `kernel` launches with at this problem (kernels/diff_attn/tuning.py explains the choice)."""
    if _INTERPRET:
        return _INTERPRET_CONFIGS[name]
    autotuning = tuning.autotune_enabled()
    problem = tuning.KernelProblem.of(name, _DTYPE_NAMES[q.dtype], constants["HEAD_D"], constants["VALUE_D"],
                                      constants["SHARED_K"], constants["CAUSAL"], n_q, n_k)
    memo_key = (q.device.index, problem, autotuning)
    config = _CHOSEN_CONFIGS.get(memo_key)
    if config is None:
        device = tuning.device_info(q.device)
        cache = None
        if autotuning:
            path = tuning.default_cache_path()
            cache = _CONFIG_CACHE.setdefault(path, tuning.ConfigCache(path))

        def bench(candidate):
            launch = lambda: kernel[grid(candidate)](*args, **constants, **candidate.launch_options())  # noqa: E731
            return triton.testing.do_bench(launch, warmup=5, rep=25, return_mode="median")

        config = tuning.select_config(problem, device, autotuning, cache, bench, triton.__version__)
        _CHOSEN_CONFIGS[memo_key] = config
    return config


def _launch(name, kernel, grid, args, constants, q, n_q, n_k):
    """Launch `kernel` over `grid(config)` with the block config chosen for it."""
    config = _block_config(name, kernel, grid, args, constants, q, n_q, n_k)
    kernel[grid(config)](*args, **constants, **config.launch_options())


def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _diff_attn_forward(q, k, v, lam_rows, causal, softmax_scale, shared_k):
    """Launch the forward kernel; returns out (B, Nq, H, Dv) and lse (B, 2H, Nq) in fp32, natural log."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    # Poisoned with NaN so that any element the kernel fails to write shows up.
    out = torch.full((batch, n_q, n_heads, value_dim), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, two_h, n_q), float("nan"), dtype=torch.float32, device=q.device)
    grid = lambda config: (triton.cdiv(n_q, config.block_m), batch * n_heads)  # noqa: E731
    args = (
        q, k, v, lam_rows, out, lse,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(out),
        n_heads, n_heads // n_kv_groups, n_q, n_k, softmax_scale * _LOG2E,
    )
    constants = _kernel_constants(q, value_dim, causal, shared_k)
    _launch("forward", _diff_attn_fwd_kernel, grid, args, constants, q, n_q, n_k)
    return out, lse


def _diff_attn_backward(dout, q, k, v, lam_rows, out, lse, causal, softmax_scale, shared_k):
    """Launch the three backward kernels; returns dq, dk, dv and r2 = rowsum(dO ∘ O2) (B, H, Nq) in fp32."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    group = n_heads // n_kv_groups
    constants = _kernel_constants(q, value_dim, causal, shared_k)
    nan = float("nan")
    delta = torch.full((batch, two_h, n_q), nan, dtype=torch.float32, device=q.device)
    r2 = torch.full((batch, n_heads, n_q), nan, dtype=torch.float32, device=q.device)
    dq = torch.full(q.shape, nan, dtype=q.dtype, device=q.device)
    dk = torch.full(k.shape, nan, dtype=k.dtype, device=k.device)
    dv = torch.full(v.shape, nan, dtype=v.dtype, device=v.device)
    qk_scale = softmax_scale * _LOG2E
    common_strides = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows))

    query_grid = lambda config: (triton.cdiv(n_q, config.block_m), batch * n_heads)  # noqa: E731
    key_grid = lambda config: (triton.cdiv(n_k, config.block_n), batch * n_kv_groups)  # noqa: E731
    preprocess_args = (
        q, k, v, lam_rows, out, dout, lse, delta, r2,
        *common_strides, *_strides3(out), *_strides3(dout),
        n_heads, group, n_q, n_k, qk_scale,
    )
    _launch("preprocess", _diff_attn_bwd_preprocess_kernel, query_grid, preprocess_args, constants, q, n_q, n_k)
    dkdv_args = (
        q, k, v, lam_rows, dout, lse, delta, dk, dv,
        *common_strides, *_strides3(dout), *_strides3(dk), *_strides3(dv),
        n_heads, n_kv_groups, group, n_q, n_k, qk_scale, softmax_scale,
    )
    _launch("dkdv", _diff_attn_bwd_dkdv_kernel, key_grid, dkdv_args, constants, q, n_q, n_k)
    dq_args = (
        q, k, v, lam_rows, dout, lse, delta, dq,
        *common_strides, *_strides3(dout), *_strides3(dq),
        n_heads, group, n_q, n_k, qk_scale, softmax_scale,
    )
    _launch("dq", _diff_attn_bwd_dq_kernel, query_grid, dq_args, constants, q, n_q, n_k)
    return dq, dk, dv, r2


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------


def _lam_rows(lam, batch, n_q, n_heads):
    """λ as a (B, Nq, H) view; stride 0 along the dimensions it is shared over."""
    if lam.dim() == 3:
        return lam
    return lam.reshape(1, 1, -1).expand(batch, n_q, n_heads)


class DiffFlashAttnFunction(torch.autograd.Function):
    """Fused differential attention; `shared_k=False` is V1, `shared_k=True` is V2. Returns (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, lam, causal, softmax_scale, shared_k):
        lam_rows = _lam_rows(lam, q.shape[0], q.shape[1], q.shape[2] // 2)
        out, lse = _diff_attn_forward(q, k, v, lam_rows, causal, softmax_scale, shared_k)
        ctx.save_for_backward(q, k, v, lam, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.shared_k = causal, softmax_scale, shared_k
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, lam, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        lam_rows = _lam_rows(lam, q.shape[0], q.shape[1], q.shape[2] // 2)
        dq, dk, dv, r2 = _diff_attn_backward(
            dout, q, k, v, lam_rows, out, lse, ctx.causal, ctx.softmax_scale, ctx.shared_k
        )
        # out = O1 − λ·O2, so dλ = −rowsum(dO ∘ O2), summed over every token and head that shares the λ.
        dlam = (-r2.transpose(1, 2)).sum_to_size(lam.shape).to(lam.dtype)
        return dq, dk, dv, dlam, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------------


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


def _unit_stride_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def diff_flash_attn(q, k, v, lam, causal=True, softmax_scale=None, return_lse=False):
    """Differential attention V1, fused: out = softmax(Q1·K1ᵀ·s)·V − λ·softmax(Q2·K2ᵀ·s)·V.

    Args:
        q: (B, Nq, 2H, d); heads 2h and 2h+1 are Q1 and Q2 of differential head h.
        k: (B, Nk, 2Hkv, d); heads 2g and 2g+1 are K1 and K2 of KV group g = h // (H / Hkv).
        v: (B, Nk, Hkv, 2d).
        lam: 0-dim tensor or shape (H,); any real value (also outside [0, 1]).
        causal: mask aligned to the bottom right (query i sees keys j <= i + Nk − Nq); needs Nq <= Nk.
        softmax_scale: s; defaults to 1/√d.
        return_lse: also return lse (B, 2H, Nq) fp32 natural-log: lse[:, 2h] is map 1, lse[:, 2h+1] map 2.
    Returns:
        out (B, Nq, H, 2d) in q's dtype (and lse). Differentiable in q, k, v and lam.
    """
    _check_common(q, k, v, lam, causal, softmax_scale)
    batch, _, two_h, head_dim = q.shape
    n_heads = two_h // 2
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] % 2 or k.shape[2] == 0 \
            or n_heads % (k.shape[2] // 2):
        raise ValueError(
            f"k has shape {_shape(k)}; expected (B={batch}, N, 2*Hkv, d={head_dim}) with 2*Hkv even and Hkv "
            f"dividing H={n_heads}"
        )
    n_kv_groups = k.shape[2] // 2
    expected_v = (batch, k.shape[1], n_kv_groups, 2 * head_dim)
    if _shape(v) != expected_v:
        raise ValueError(f"v has shape {_shape(v)}; expected (B, N, Hkv, 2*d) = {expected_v}")
    if _shape(lam) not in ((), (n_heads,)):
        raise ValueError(f"lam has shape {_shape(lam)}; expected () or (H,) = ({n_heads},)")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out, lse = DiffFlashAttnFunction.apply(
        _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v), lam, causal, scale, False
    )
    return (out, lse) if return_lse else out


def diff_flash_attn_v2(q, k, v, lam, causal=True, softmax_scale=None, return_lse=False):
    """Differential attention V2, fused: out = O[2h] − lam·O[2h+1] over one GQA attention of 2H query heads.

    Args:
        q: (B, Nq, 2H, d); heads 2h and 2h+1 form differential head h.
        k, v: (B, Nk, Hkv, d); Hkv divides H, so both heads of a pair use KV head g = h // (H / Hkv).
        lam: (B, Nq, H), per token and head (already through the sigmoid).
        causal, softmax_scale, return_lse: as in `diff_flash_attn`.
    Returns:
        out (B, Nq, H, d) in q's dtype (and lse (B, 2H, Nq)). Differentiable in q, k, v and lam.
    """
    _check_common(q, k, v, lam, causal, softmax_scale)
    batch, n_q, two_h, head_dim = q.shape
    n_heads = two_h // 2
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] == 0 or n_heads % k.shape[2]:
        raise ValueError(
            f"k has shape {_shape(k)}; expected (B={batch}, N, Hkv, d={head_dim}) with Hkv dividing H={n_heads}"
        )
    if _shape(v) != _shape(k):
        raise ValueError(f"v has shape {_shape(v)}; expected k's shape (B, N, Hkv, d) = {_shape(k)}")
    if _shape(lam) != (batch, n_q, n_heads):
        raise ValueError(f"lam has shape {_shape(lam)}; expected (B, N, H) = {(batch, n_q, n_heads)}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out, lse = DiffFlashAttnFunction.apply(
        _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v), lam, causal, scale, True
    )
    return (out, lse) if return_lse else out
