"""The backward kernels of the fused differential attention (the layout is in function.py).

Backward (FlashAttention-2 style, recomputing P from the saved LSE): with y = O1 − λ·O2 the upstream gradients of
the maps are dO1 = dy and dO2 = −λ·dy, so dP1 = dy·Vᵀ and dP2 = −λ·dP1 share one matmul, and dV = (P1 − λ·P2)ᵀ·dy
is one matmul. δ_i = rowsum(dO_i ∘ O_i): only y is saved, so the preprocess recomputes r2 = rowsum(dy ∘ O2) =
rowsum(P2 ∘ dP1) with one pass over the keys; δ1 = rowsum(dy ∘ y) + λ·r2, δ2 = −λ·r2, dλ = −r2 summed over what λ
broadcasts over. The preprocess also runs the norm's backward (dy from d(out), y and rstd; the weight's gradient
as per-program partial sums). Then, by design:
  fused    one program per (batch, KV group, key block) accumulates dK1, dK2 and dV (as wide as a 4d attention's
           accumulators), and one program per query block accumulates dQ1 and dQ2.
  split    the dK/dV program is split in two, each recomputing S1ᵀ and S2ᵀ: dK1 and dK2 in one kernel, dV in another,
           so that no program holds more than 2d columns of fp32 accumulators; dQ as in fused.
  atomic   (opt-in, non-deterministic) the dK program also adds dS·K into an fp32 dQ with atomics; no dQ kernel.
The dK/dV programs loop over every query head of their KV group, so GQA needs no atomics outside `atomic` (that
loop costs registers around the pipelined query loops, so without GQA the kernels compile without it).
"""

import triton
import triton.language as tl

from kernels.diff_attn.tiles import (
    _document_key_ranges,
    _dot_nt,
    _first_at_least,
    _key_ranges,
    _key_value_sources,
    _kv_heads,
    _load_pair,
    _load_row_vector,
    _query_block_program,
    _query_pair,
    _row_documents,
    _sources,
    _store_pair,
    _visible_in_documents,
)


@triton.jit
def _bwd_r2_key_loop(
    r2, q2a, q2b, dya, dyb, lse2, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, VALUE_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    q_docs, doc_k, DOCUMENTS: tl.constexpr,
):
    for block_n in range(start_n, end_n, BLOCK_N):
        ka, kb = _load_pair(k2_a, k2_b, block_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC,
                            UPCAST)
        p2 = tl.math.exp2(_dot_nt(q2a, q2b, ka, kb, BLOCK_D2, DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            visible = _visible_in_documents(offs_m, block_n + tl.arange(0, BLOCK_N), N_K, causal_offset, CAUSAL,
                                            q_docs, doc_k, DOCUMENTS)
            p2 = tl.where(visible, p2, 0.0)
        va, vb = _load_pair(v_a, v_b, block_n, stride_vn, N_K, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC,
                            UPCAST)
        dp = _dot_nt(dya, dyb, va, vb, BLOCK_DV2, DOT_PRECISION)
        r2 += tl.sum(p2 * dp, 1)
    return r2


@triton.jit
def _load_columns(base, offs_m, col0, row_stride, N_Q, VALUE_D: tl.constexpr, CHUNK: tl.constexpr):
    """Columns [col0, col0 + CHUNK) of a head's (Nq, VALUE_D) rows in fp32; out-of-range elements read as 0."""
    cols = col0 + tl.arange(0, CHUNK)
    mask = (offs_m[:, None] < N_Q) & (cols[None, :] < VALUE_D)
    return tl.load(base + offs_m[:, None] * row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _epilogue_backward(
    dz_base, y_base, dy_base, rstd, offs_m, stride_don, stride_yn, N_Q, NORM_W, out_scale, partial_row,
    VALUE_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, EPILOGUE: tl.constexpr,
    NORM: tl.constexpr,
):
    """dy from dz = d(out) (stored at dy_base when there is an epilogue, in its dtype), the rows' rowsum(dy ∘ y) from
    the stored (rounded) dy, and the norm weight's partial sums over the rows. Column chunk by column chunk, so that
    no [rows, VALUE_D] fp32 tile is held: out = ŷ·w·s with ŷ = y·rstd gives dy = rstd·(g − ŷ·mean(g ∘ ŷ)) for
    g = dz·w·s, and mean(g ∘ ŷ) = rstd·rowsum(g ∘ y) / VALUE_D takes one pass before dy's."""
    CHUNK: tl.constexpr = min(64, BLOCK_DV, BLOCK_DV2 if BLOCK_DV2 > 0 else BLOCK_DV)
    if NORM:
        g_dot_y = tl.zeros([offs_m.shape[0]], tl.float32)
        for col0 in tl.static_range(0, BLOCK_DV + BLOCK_DV2, CHUNK):
            cols = col0 + tl.arange(0, CHUNK)
            w = tl.load(NORM_W + cols, mask=cols < VALUE_D, other=0.0).to(tl.float32) * out_scale
            dz = _load_columns(dz_base, offs_m, col0, stride_don, N_Q, VALUE_D, CHUNK)
            y = _load_columns(y_base, offs_m, col0, stride_yn, N_Q, VALUE_D, CHUNK)
            g_dot_y += tl.sum(dz * w[None, :] * y, 1)
            tl.store(partial_row + cols, tl.sum(dz * y * rstd[:, None], 0) * out_scale, mask=cols < VALUE_D)
        mean_g_yhat = rstd * g_dot_y / VALUE_D
    dy_dot_y = tl.zeros([offs_m.shape[0]], tl.float32)
    for col0 in tl.static_range(0, BLOCK_DV + BLOCK_DV2, CHUNK):
        dz = _load_columns(dz_base, offs_m, col0, stride_don, N_Q, VALUE_D, CHUNK)
        y = _load_columns(y_base, offs_m, col0, stride_yn, N_Q, VALUE_D, CHUNK)
        if EPILOGUE:
            cols = col0 + tl.arange(0, CHUNK)
            if NORM:
                w = tl.load(NORM_W + cols, mask=cols < VALUE_D, other=0.0).to(tl.float32) * out_scale
                dz = rstd[:, None] * (dz * w[None, :] - y * (rstd * mean_g_yhat)[:, None])
            else:
                dz = dz * out_scale
            dz = dz.to(dy_base.dtype.element_ty)
            mask = (offs_m[:, None] < N_Q) & (cols[None, :] < VALUE_D)
            tl.store(dy_base + offs_m[:, None] * stride_yn + cols[None, :], dz, mask=mask)
        dy_dot_y += tl.sum(dz.to(tl.float32) * y, 1)
    return dy_dot_y


@triton.jit
def _diff_attn_bwd_preprocess_kernel(
    Q, K, V, LAM, Y, DOUT, DY, LSE, RSTD, NORM_W, DELTA, R2, DW_PARTIAL,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_yb, stride_yn, stride_yh,
    stride_dob, stride_don, stride_doh,
    N_HEADS, GROUP, N_Q, N_K, causal_offset, qk_scale, out_scale,
    DOC_Q, DOC_K, stride_docq, stride_dock,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    EPILOGUE: tl.constexpr, NORM: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOCUMENTS: tl.constexpr,
):
    """The epilogue's backward (dy, stored when there is an epilogue; the norm weight's partial sums), then delta1,
    delta2 (B, 2H, Nq) and r2 = rowsum(dy ∘ O2) (B, H, Nq), recomputing O2's contribution from P2.

    Without an epilogue DY is DOUT (y is out); with one, DY and Y share their strides."""
    start_m, offs_m, b, h, row_stats, q1_base, _, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, CAUSAL, BLOCK_M,
    )
    row_valid = offs_m < N_Q
    rstd = offs_m.to(tl.float32)
    if NORM:
        rstd = _load_row_vector(RSTD + (b * N_HEADS + h) * N_Q, offs_m, N_Q, 0.0)
    partial_row = DW_PARTIAL + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * VALUE_D
    dy_base = DY + b * stride_yb + h * stride_yh
    dy_dot_y = _epilogue_backward(DOUT + b * stride_dob + h * stride_doh, Y + b * stride_yb + h * stride_yh,
                                  dy_base, rstd, offs_m, stride_don, stride_yn, N_Q, NORM_W, out_scale, partial_row,
                                  VALUE_D, BLOCK_DV, BLOCK_DV2, EPILOGUE, NORM)
    if EPILOGUE:
        stride_dyn = stride_yn
        # dy was stored by other threads of this program: make their stores visible before reading the tiles back.
        tl.debug_barrier()
    else:
        dy_base = DOUT + b * stride_dob + h * stride_doh
        stride_dyn = stride_don
    # Pointer loads: a tensor-descriptor (TMA) read of what this program just stored would need a proxy fence.
    dya, dyb = _load_pair(dy_base, dy_base, start_m, stride_dyn, N_Q, VALUE_D, BLOCK_M, BLOCK_DV, BLOCK_DV2, False,
                          UPCAST)

    q_a, q_b = _sources(q1_base + stride_qh, N_Q, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC)
    q2a, q2b = _load_pair(q_a, q_b, start_m, stride_qn, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC, UPCAST)
    k2_a, k2_b = _sources(k2_base, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC)
    v_a, v_b = _sources(v_base, N_K, stride_vn, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC)
    lse2 = _load_row_vector(LSE + row_stats + N_Q, offs_m, N_Q, float("inf")) * 1.4426950408889634
    r2 = tl.zeros([BLOCK_M], tl.float32)
    full_end, end = _key_ranges(start_m, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    doc_q = DOC_Q + b * stride_docq
    doc_k = DOC_K + b * stride_dock
    start, full_lo, full_hi, end = _document_key_ranges(start_m, full_end, end, doc_q, doc_k, N_Q, N_K, BLOCK_M,
                                                        BLOCK_N, DOCUMENTS)
    q_docs = _row_documents(doc_q, offs_m, N_Q, DOCUMENTS)
    if DOCUMENTS:  # the key blocks where the rows' first document starts
        r2 = _bwd_r2_key_loop(r2, q2a, q2b, dya, dyb, lse2, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn, offs_m, start,
                              full_lo, causal_offset, qk_scale, N_K, HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV,
                              BLOCK_DV2, BLOCK_N, True, CAUSAL, USE_DESC, UPCAST, DOT_PRECISION, q_docs, doc_k,
                              DOCUMENTS)
    r2 = _bwd_r2_key_loop(r2, q2a, q2b, dya, dyb, lse2, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn, offs_m, full_lo,
                          full_hi, causal_offset, qk_scale, N_K, HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV,
                          BLOCK_DV2, BLOCK_N, False, CAUSAL, USE_DESC, UPCAST, DOT_PRECISION, q_docs, doc_k, DOCUMENTS)
    r2 = _bwd_r2_key_loop(r2, q2a, q2b, dya, dyb, lse2, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn, offs_m,
                          full_hi, end, causal_offset, qk_scale, N_K, HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV,
                          BLOCK_DV2, BLOCK_N, True, CAUSAL, USE_DESC, UPCAST, DOT_PRECISION, q_docs, doc_k, DOCUMENTS)

    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    lam = lam.to(tl.float32)
    tl.store(DELTA + row_stats + offs_m, dy_dot_y + lam * r2, mask=row_valid)
    tl.store(DELTA + row_stats + N_Q + offs_m, -lam * r2, mask=row_valid)
    tl.store(R2 + (b * N_HEADS + h) * N_Q + offs_m, r2, mask=row_valid)


@triton.jit
def _atomic_add_pair(ptr, xa, xb, offs_r, row_stride, n_rows, N_COLS: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_C2: tl.constexpr):
    cols = tl.arange(0, BLOCK_C)
    rows_ok = offs_r[:, None] < n_rows
    base = ptr + offs_r[:, None] * row_stride
    tl.atomic_add(base + cols[None, :], xa, mask=rows_ok & (cols[None, :] < N_COLS), sem="relaxed")
    if BLOCK_C2 > 0:
        tl.atomic_add(base + BLOCK_C + tl.arange(0, BLOCK_C2)[None, :], xb, mask=rows_ok, sem="relaxed")


@triton.jit
def _probs_t(ka, kb, qa, qb, lse_row, offs_n, offs_m, N_Q, causal_offset, qk_scale, BLOCK_D2: tl.constexpr,
             MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr, k_docs, doc_q,
             DOCUMENTS: tl.constexpr):
    """Pᵀ (keys, queries) of one map from its LSE row; rows past Nq get LSE = +inf, so their probabilities are 0.
    Masked: causal, and with documents only the queries of each key's own document."""
    lse = _load_row_vector(lse_row, offs_m, N_Q, float("inf")) * 1.4426950408889634
    pt = tl.math.exp2(_dot_nt(ka, kb, qa, qb, BLOCK_D2, DOT_PRECISION) * qk_scale - lse[None, :])
    if MASKED:
        if CAUSAL:
            pt = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_offset, pt, 0.0)
        if DOCUMENTS:
            q_docs = tl.load(doc_q + offs_m, mask=offs_m < N_Q, other=-1)
            pt = tl.where(k_docs[:, None] == q_docs[None, :], pt, 0.0)
    return pt


@triton.jit
def _atomic_dq(dq_base, dst, ka, kb, offs_m, stride_dqn, N_Q, sm_scale, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_D2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ += dS·K·scale of one map, added into the fp32 dQ with atomics (their order varies: not deterministic)."""
    ds = tl.trans(dst)
    dqa = tl.dot(ds, ka, input_precision=DOT_PRECISION) * sm_scale
    dqb = dqa
    if BLOCK_D2 > 0:
        dqb = tl.dot(ds, kb, input_precision=DOT_PRECISION) * sm_scale
    _atomic_add_pair(dq_base, dqa, dqb, offs_m, stride_dqn, N_Q, HEAD_D, BLOCK_D, BLOCK_D2)


@triton.jit
def _bwd_kv_query_loop(
    dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb,
    q1_a, q1_b, q2_a, q2_b, do_a, do_b, lse_base, delta_base, lam_base, dq1_base,
    stride_qn, stride_don, stride_ln, stride_dqn, stride_dqh, N_Q,
    offs_n, start_m, end_m, causal_offset, qk_scale, sm_scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, VALUE_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    SHARED_K: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    USE_DESC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr, k_docs, doc_q,
    DOCUMENTS: tl.constexpr,
):
    """Accumulate dK1, dK2 (pre-scale) and/or dV for one key block over the query blocks in [start_m, end_m).

    Map by map, so that at most two [keys, queries] fp32 tiles (dPᵀ and one map's Pᵀ) are live at once in dK."""
    for block_m in range(start_m, end_m, BLOCK_M):
        offs_m = block_m + tl.arange(0, BLOCK_M)
        q1a, q1b = _load_pair(q1_a, q1_b, block_m, stride_qn, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC,
                              UPCAST)
        q2a, q2b = _load_pair(q2_a, q2_b, block_m, stride_qn, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC,
                              UPCAST)
        lam = tl.load(lam_base + offs_m * stride_ln, mask=offs_m < N_Q, other=0.0).to(tl.float32)
        doa, dob = _load_pair(do_a, do_b, block_m, stride_don, N_Q, VALUE_D, BLOCK_M, BLOCK_DV, BLOCK_DV2, USE_DESC,
                              UPCAST)
        if COMPUTE_DK:
            dpt = _dot_nt(va, vb, doa, dob, BLOCK_DV2, DOT_PRECISION)
        p1t = _probs_t(k1a, k1b, q1a, q1b, lse_base, offs_n, offs_m, N_Q, causal_offset, qk_scale, BLOCK_D2,
                       MASKED, DOT_PRECISION, CAUSAL, k_docs, doc_q, DOCUMENTS)
        if COMPUTE_DK:
            delta1 = _load_row_vector(delta_base, offs_m, N_Q, 0.0)
            ds1t = (p1t * (dpt - delta1[None, :])).to(q1a.dtype)
            dk1a = tl.dot(ds1t, q1a, dk1a, input_precision=DOT_PRECISION)
            if BLOCK_D2 > 0:
                dk1b = tl.dot(ds1t, q1b, dk1b, input_precision=DOT_PRECISION)
            if ATOMIC_DQ:
                _atomic_dq(dq1_base, ds1t, k1a, k1b, offs_m, stride_dqn, N_Q, sm_scale, HEAD_D, BLOCK_D, BLOCK_D2,
                           DOT_PRECISION)
        p2t = _probs_t(k2a, k2b, q2a, q2b, lse_base + N_Q, offs_n, offs_m, N_Q, causal_offset, qk_scale, BLOCK_D2,
                       MASKED, DOT_PRECISION, CAUSAL, k_docs, doc_q, DOCUMENTS)
        if COMPUTE_DV:
            # dV = (P1 − λ·P2)ᵀ·dy, since the map-2 upstream gradient is −λ·dy.
            p_combined_t = (p1t - lam[None, :] * p2t).to(doa.dtype)
            dva = tl.dot(p_combined_t, doa, dva, input_precision=DOT_PRECISION)
            if BLOCK_DV2 > 0:
                dvb = tl.dot(p_combined_t, dob, dvb, input_precision=DOT_PRECISION)
        if COMPUTE_DK:
            delta2 = _load_row_vector(delta_base + N_Q, offs_m, N_Q, 0.0)
            ds2t = (p2t * (-lam[None, :] * dpt - delta2[None, :])).to(q2a.dtype)
            if SHARED_K:
                dk1a = tl.dot(ds2t, q2a, dk1a, input_precision=DOT_PRECISION)
                if BLOCK_D2 > 0:
                    dk1b = tl.dot(ds2t, q2b, dk1b, input_precision=DOT_PRECISION)
            else:
                dk2a = tl.dot(ds2t, q2a, dk2a, input_precision=DOT_PRECISION)
                if BLOCK_D2 > 0:
                    dk2b = tl.dot(ds2t, q2b, dk2b, input_precision=DOT_PRECISION)
            if ATOMIC_DQ:
                _atomic_dq(dq1_base + stride_dqh, ds2t, k2a, k2b, offs_m, stride_dqn, N_Q, sm_scale, HEAD_D, BLOCK_D,
                           BLOCK_D2, DOT_PRECISION)
    return dk1a, dk1b, dk2a, dk2b, dva, dvb


@triton.jit
def _bwd_kv_head(
    dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb, h,
    Q, DY, LSE, DELTA, LAM, DQ_ACC, b, stride_qb, stride_qn, stride_qh, stride_lb, stride_ln, stride_lh,
    stride_dob, stride_don, stride_doh, stride_dqb, stride_dqn, stride_dqh, N_HEADS, N_Q, offs_n, start_m,
    full_lo, full_hi, end_m, causal_offset, qk_scale, sm_scale, k_docs, doc_q,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, VALUE_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_M: tl.constexpr, SHARED_K: tl.constexpr,
    COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_DESC: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr,
):
    """One query head's share of a key block's gradients: its diagonal query blocks (masked), then the rest (with
    documents: masked where the key block's last document ends)."""
    q1_base = Q + b * stride_qb + (2 * h) * stride_qh
    q1_a, q1_b = _sources(q1_base, N_Q, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC)
    q2_a, q2_b = _sources(q1_base + stride_qh, N_Q, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC)
    do_a, do_b = _sources(DY + b * stride_dob + h * stride_doh, N_Q, stride_don, VALUE_D, BLOCK_M, BLOCK_DV,
                          BLOCK_DV2, USE_DESC)
    lse_base = LSE + (b * 2 * N_HEADS + 2 * h) * N_Q
    delta_base = DELTA + (b * 2 * N_HEADS + 2 * h) * N_Q
    lam_base = LAM + b * stride_lb + h * stride_lh
    dq1_base = DQ_ACC + b * stride_dqb + (2 * h) * stride_dqh
    dk1a, dk1b, dk2a, dk2b, dva, dvb = _bwd_kv_query_loop(
        dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb,
        q1_a, q1_b, q2_a, q2_b, do_a, do_b, lse_base, delta_base, lam_base, dq1_base,
        stride_qn, stride_don, stride_ln, stride_dqn, stride_dqh, N_Q,
        offs_n, start_m, full_lo, causal_offset, qk_scale, sm_scale,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_M, True, SHARED_K, COMPUTE_DK, COMPUTE_DV,
        ATOMIC_DQ, USE_DESC, UPCAST, DOT_PRECISION, CAUSAL, k_docs, doc_q, DOCUMENTS,
    )
    dk1a, dk1b, dk2a, dk2b, dva, dvb = _bwd_kv_query_loop(
        dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb,
        q1_a, q1_b, q2_a, q2_b, do_a, do_b, lse_base, delta_base, lam_base, dq1_base,
        stride_qn, stride_don, stride_ln, stride_dqn, stride_dqh, N_Q,
        offs_n, full_lo, full_hi, causal_offset, qk_scale, sm_scale,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_M, False, SHARED_K, COMPUTE_DK, COMPUTE_DV,
        ATOMIC_DQ, USE_DESC, UPCAST, DOT_PRECISION, CAUSAL, k_docs, doc_q, DOCUMENTS,
    )
    if DOCUMENTS:
        dk1a, dk1b, dk2a, dk2b, dva, dvb = _bwd_kv_query_loop(
            dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb,
            q1_a, q1_b, q2_a, q2_b, do_a, do_b, lse_base, delta_base, lam_base, dq1_base,
            stride_qn, stride_don, stride_ln, stride_dqn, stride_dqh, N_Q,
            offs_n, full_hi, end_m, causal_offset, qk_scale, sm_scale,
            HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_M, True, SHARED_K, COMPUTE_DK,
            COMPUTE_DV, ATOMIC_DQ, USE_DESC, UPCAST, DOT_PRECISION, CAUSAL, k_docs, doc_q, DOCUMENTS,
        )
    return dk1a, dk1b, dk2a, dk2b, dva, dvb


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
def _document_query_ranges(start_n, start, full_start, end, doc_q, doc_k, N_Q, N_K, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr):
    """A key block's query blocks as masked [start, full_lo), whole [full_lo, full_hi) and masked [full_hi, end),
    from the causal ranges (masked [start, full_start), whole [full_start, end)). With documents, query blocks before
    the key block's first document or after its last are skipped, and a query block is whole only inside the one
    document of a key block whose keys all lie in it."""
    full_lo = full_start
    full_hi = end
    if DOCUMENTS:
        first = tl.load(doc_k + start_n)
        last = tl.load(doc_k + tl.minimum(start_n + BLOCK_N, N_K) - 1)
        query_lo = _first_at_least(doc_q, N_Q, first)
        query_hi = _first_at_least(doc_q, N_Q, last + 1)
        start = tl.maximum(start, query_lo // BLOCK_M * BLOCK_M)
        end = tl.minimum(end, tl.cdiv(query_hi, BLOCK_M) * BLOCK_M)
        full_lo = tl.maximum(full_start, tl.cdiv(query_lo, BLOCK_M) * BLOCK_M)
        full_hi = tl.where(query_hi >= N_Q, end, query_hi // BLOCK_M * BLOCK_M)
        whole = (first == last) & (full_lo < full_hi)
        full_lo = tl.where(whole, full_lo, start)
        full_hi = tl.where(whole, full_hi, start)
    return start, full_lo, full_hi, end


@triton.jit
def _diff_attn_bwd_kv_kernel(
    Q, K, V, LAM, DY, LSE, DELTA, DK, DV, DQ_ACC,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_dob, stride_don, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_dqb, stride_dqn, stride_dqh,
    N_HEADS, N_KV_GROUPS, GROUP, N_Q, N_K, causal_offset, qk_scale, sm_scale,
    DOC_Q, DOC_K, stride_docq, stride_dock,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, ATOMIC_DQ: tl.constexpr, HEAD_LOOP: tl.constexpr,
    USE_DESC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr,
):
    """dK1 and dK2 (COMPUTE_DK) and/or dV (COMPUTE_DV) of one key block: one program per (batch, KV group, key block)
    over every query head of the group (GQA without atomics); ATOMIC_DQ also adds dS·K into DQ_ACC (fp32)."""
    start_n = tl.program_id(0) * BLOCK_N
    pid_bg = tl.program_id(1)
    b = (pid_bg // N_KV_GROUPS).to(tl.int64)
    g = pid_bg % N_KV_GROUPS
    k_head1, k_head2 = _kv_heads(g, SHARED_K)
    offs_n = start_n + tl.arange(0, BLOCK_N)

    k1_base = K + b * stride_kb + k_head1 * stride_kh
    src_a, src_b = _sources(k1_base, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC)
    k1a, k1b = _load_pair(src_a, src_b, start_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC, UPCAST)
    if SHARED_K:
        k2a = k1a
        k2b = k1b
    else:
        src_a, src_b = _sources(K + b * stride_kb + k_head2 * stride_kh, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D,
                                BLOCK_D2, USE_DESC)
        k2a, k2b = _load_pair(src_a, src_b, start_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC,
                              UPCAST)
    va = k1a
    vb = k1b
    if COMPUTE_DK:
        src_a, src_b = _sources(V + b * stride_vb + g * stride_vh, N_K, stride_vn, VALUE_D, BLOCK_N, BLOCK_DV,
                                BLOCK_DV2, USE_DESC)
        va, vb = _load_pair(src_a, src_b, start_n, stride_vn, N_K, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC,
                            UPCAST)
    dk1a = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk1b = dk1a
    dk2a = dk1a
    dk2b = dk1a
    dva = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dvb = dva
    if BLOCK_D2 > 0:
        dk1b = tl.zeros([BLOCK_N, BLOCK_D2], tl.float32)
        dk2b = tl.zeros([BLOCK_N, BLOCK_D2], tl.float32)
    if BLOCK_DV2 > 0:
        dvb = tl.zeros([BLOCK_N, BLOCK_DV2], tl.float32)

    start_m, full_start, end_m = _query_ranges(start_n, N_Q, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    doc_q = DOC_Q + b * stride_docq
    doc_k = DOC_K + b * stride_dock
    start_m, full_lo, full_hi, end_m = _document_query_ranges(start_n, start_m, full_start, end_m, doc_q, doc_k, N_Q,
                                                              N_K, BLOCK_M, BLOCK_N, DOCUMENTS)
    k_docs = _row_documents(doc_k, offs_n, N_K, DOCUMENTS)
    head_args = (Q, DY, LSE, DELTA, LAM, DQ_ACC, b, stride_qb, stride_qn, stride_qh, stride_lb, stride_ln, stride_lh,
                 stride_dob, stride_don, stride_doh, stride_dqb, stride_dqn, stride_dqh, N_HEADS, N_Q, offs_n, start_m,
                 full_lo, full_hi, end_m, causal_offset, qk_scale, sm_scale, k_docs, doc_q)
    if HEAD_LOOP:
        # Every query head of the KV group adds into the same dK/dV tile: GQA without atomics, deterministic. (The
        # loop around the pipelined query loops costs registers, so GROUP = 1 compiles without it.)
        for h in range(g * GROUP, (g + 1) * GROUP):
            dk1a, dk1b, dk2a, dk2b, dva, dvb = _bwd_kv_head(
                dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb, h, *head_args,
                HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_M, SHARED_K, COMPUTE_DK, COMPUTE_DV,
                ATOMIC_DQ, USE_DESC, UPCAST, DOT_PRECISION, CAUSAL, DOCUMENTS,
            )
    else:
        dk1a, dk1b, dk2a, dk2b, dva, dvb = _bwd_kv_head(
            dk1a, dk1b, dk2a, dk2b, dva, dvb, k1a, k1b, k2a, k2b, va, vb, g, *head_args,
            HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_M, SHARED_K, COMPUTE_DK, COMPUTE_DV,
            ATOMIC_DQ, USE_DESC, UPCAST, DOT_PRECISION, CAUSAL, DOCUMENTS,
        )

    if COMPUTE_DK:
        dk_base = DK + b * stride_dkb
        _store_pair(dk_base + k_head1 * stride_dkh, dk1a * sm_scale, dk1b * sm_scale, offs_n, stride_dkn, N_K, HEAD_D,
                    BLOCK_D, BLOCK_D2)
        if not SHARED_K:
            _store_pair(dk_base + k_head2 * stride_dkh, dk2a * sm_scale, dk2b * sm_scale, offs_n, stride_dkn, N_K,
                        HEAD_D, BLOCK_D, BLOCK_D2)
    if COMPUTE_DV:
        _store_pair(DV + b * stride_dvb + g * stride_dvh, dva, dvb, offs_n, stride_dvn, N_K, VALUE_D, BLOCK_DV,
                    BLOCK_DV2)


@triton.jit
def _bwd_dq_key_loop(
    dq1a, dq1b, dq2a, dq2b, q1a, q1b, q2a, q2b, doa, dob, lse1, lse2, delta1, delta2, lam,
    k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, VALUE_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    q_docs, doc_k, DOCUMENTS: tl.constexpr,
):
    for block_n in range(start_n, end_n, BLOCK_N):
        k1a, k1b = _load_pair(k1_a, k1_b, block_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC,
                              UPCAST)
        if SHARED_K:
            k2a = k1a
            k2b = k1b
        else:
            k2a, k2b = _load_pair(k2_a, k2_b, block_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC,
                                  UPCAST)
        p1 = tl.math.exp2(_dot_nt(q1a, q1b, k1a, k1b, BLOCK_D2, DOT_PRECISION) * qk_scale - lse1[:, None])
        p2 = tl.math.exp2(_dot_nt(q2a, q2b, k2a, k2b, BLOCK_D2, DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            visible = _visible_in_documents(offs_m, block_n + tl.arange(0, BLOCK_N), N_K, causal_offset, CAUSAL,
                                            q_docs, doc_k, DOCUMENTS)
            p1 = tl.where(visible, p1, 0.0)
            p2 = tl.where(visible, p2, 0.0)
        va, vb = _load_pair(v_a, v_b, block_n, stride_vn, N_K, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC,
                            UPCAST)
        dp = _dot_nt(doa, dob, va, vb, BLOCK_DV2, DOT_PRECISION)
        ds1 = (p1 * (dp - delta1[:, None])).to(k1a.dtype)
        ds2 = (p2 * (-lam[:, None] * dp - delta2[:, None])).to(k2a.dtype)
        dq1a = tl.dot(ds1, k1a, dq1a, input_precision=DOT_PRECISION)
        dq2a = tl.dot(ds2, k2a, dq2a, input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:
            dq1b = tl.dot(ds1, k1b, dq1b, input_precision=DOT_PRECISION)
            dq2b = tl.dot(ds2, k2b, dq2b, input_precision=DOT_PRECISION)
    return dq1a, dq1b, dq2a, dq2b


@triton.jit
def _diff_attn_bwd_dq_kernel(
    Q, K, V, LAM, DY, LSE, DELTA, DQ,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_dob, stride_don, stride_doh,
    stride_dqb, stride_dqn, stride_dqh,
    N_HEADS, GROUP, N_Q, N_K, causal_offset, qk_scale, sm_scale,
    DOC_Q, DOC_K, stride_docq, stride_dock,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    USE_DESC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOCUMENTS: tl.constexpr,
):
    start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, CAUSAL, BLOCK_M,
    )
    row_valid = offs_m < N_Q
    q1a, q1b, q2a, q2b = _query_pair(q1_base, start_m, stride_qn, stride_qh, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2,
                                     USE_DESC, UPCAST)
    do_a, do_b = _sources(DY + b * stride_dob + h * stride_doh, N_Q, stride_don, VALUE_D, BLOCK_M, BLOCK_DV,
                          BLOCK_DV2, USE_DESC)
    doa, dob = _load_pair(do_a, do_b, start_m, stride_don, N_Q, VALUE_D, BLOCK_M, BLOCK_DV, BLOCK_DV2, USE_DESC,
                          UPCAST)
    k1_a, k1_b, k2_a, k2_b, v_a, v_b = _key_value_sources(k1_base, k2_base, v_base, N_K, stride_kn, stride_vn, HEAD_D,
                                                          VALUE_D, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_DV2,
                                                          USE_DESC)
    lse1 = _load_row_vector(LSE + row_stats, offs_m, N_Q, float("inf")) * 1.4426950408889634
    lse2 = _load_row_vector(LSE + row_stats + N_Q, offs_m, N_Q, float("inf")) * 1.4426950408889634
    delta1 = _load_row_vector(DELTA + row_stats, offs_m, N_Q, 0.0)
    delta2 = _load_row_vector(DELTA + row_stats + N_Q, offs_m, N_Q, 0.0)
    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    lam = lam.to(tl.float32)

    dq1a = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2a = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq1b = dq1a
    dq2b = dq2a
    if BLOCK_D2 > 0:
        dq1b = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
        dq2b = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
    full_end, end = _key_ranges(start_m, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    doc_q = DOC_Q + b * stride_docq
    doc_k = DOC_K + b * stride_dock
    start, full_lo, full_hi, end = _document_key_ranges(start_m, full_end, end, doc_q, doc_k, N_Q, N_K, BLOCK_M,
                                                        BLOCK_N, DOCUMENTS)
    q_docs = _row_documents(doc_q, offs_m, N_Q, DOCUMENTS)
    if DOCUMENTS:  # the key blocks where the rows' first document starts
        dq1a, dq1b, dq2a, dq2b = _bwd_dq_key_loop(
            dq1a, dq1b, dq2a, dq2b, q1a, q1b, q2a, q2b, doa, dob, lse1, lse2, delta1, delta2, lam,
            k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn, offs_m, start, full_lo, causal_offset, qk_scale,
            N_K,
            HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
            DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
        )
    dq1a, dq1b, dq2a, dq2b = _bwd_dq_key_loop(
        dq1a, dq1b, dq2a, dq2b, q1a, q1b, q2a, q2b, doa, dob, lse1, lse2, delta1, delta2, lam,
        k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn, offs_m, full_lo, full_hi, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, False, CAUSAL, SHARED_K, USE_DESC, UPCAST,
        DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
    )
    dq1a, dq1b, dq2a, dq2b = _bwd_dq_key_loop(
        dq1a, dq1b, dq2a, dq2b, q1a, q1b, q2a, q2b, doa, dob, lse1, lse2, delta1, delta2, lam,
        k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn, offs_m, full_hi, end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
        DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
    )
    dq_base = DQ + b * stride_dqb + (2 * h) * stride_dqh
    _store_pair(dq_base, dq1a * sm_scale, dq1b * sm_scale, offs_m, stride_dqn, N_Q, HEAD_D, BLOCK_D, BLOCK_D2)
    _store_pair(dq_base + stride_dqh, dq2a * sm_scale, dq2b * sm_scale, offs_m, stride_dqn, N_Q, HEAD_D, BLOCK_D,
                BLOCK_D2)
