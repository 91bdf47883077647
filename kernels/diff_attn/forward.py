"""The forward kernels of the fused differential attention (the layout is in function.py).

The DIFF epilogue runs inside the forward: out = RMSNorm(y)·w·s over the 2d columns of a head (V1's sub-layer
norm, with w the norm weight and s = 1 − λ_init the output scale), or out = y·s without a norm weight. The forward
stores out, the pre-norm y and rstd for the backward, and both maps' LSE.

Forward, two designs (kernels/diff_attn/tuning.py picks one per GPU and head dim):
  onepass  one program per query block keeps two online-softmax states (m1, l1, acc1), (m2, l2, acc2): 6d
           multiply-adds a (query, key) pair in V1, two accumulators as wide as V.
  twopass  an LSE pass computes both maps' LSE (S1, S2 only), then a second pass accumulates
           (P1/l1 − λ·P2/l2)·V in one accumulator with one P·V product: also 6d in V1 (5d in V2), but one accumulator,
           so a 128-row query tile with V 2d = 256 wide fits the registers of 8 warps.
"""

import triton
import triton.language as tl

from kernels.diff_attn.tiles import (
    _document_key_ranges,
    _dot_nt,
    _key_ranges,
    _key_value_sources,
    _load_pair,
    _load_row_vector,
    _query_block_program,
    _query_pair,
    _row_documents,
    _rowsum_product,
    _sources,
    _store_pair,
    _visible_in_documents,
)


@triton.jit
def _scores(q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, block_n, stride_kn, N_K, qk_scale,
            HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_N: tl.constexpr,
            SHARED_K: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """S1 and S2 (log2 units) of one key block, from one load of K in V2 and one of each K in V1."""
    ka, kb = _load_pair(k1_a, k1_b, block_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC, UPCAST)
    s1 = _dot_nt(q1a, q1b, ka, kb, BLOCK_D2, DOT_PRECISION) * qk_scale
    if not SHARED_K:
        ka, kb = _load_pair(k2_a, k2_b, block_n, stride_kn, N_K, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC,
                            UPCAST)
    s2 = _dot_nt(q2a, q2b, ka, kb, BLOCK_D2, DOT_PRECISION) * qk_scale
    return s1, s2


@triton.jit
def _online_softmax_step(s, m, l):
    """One key block of an online softmax: the new running max and sum, the block's P and the rescale factor. A row
    that has seen no key yet (max −inf) keeps P = 0 instead of exp2(−inf + inf)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    return p, alpha * l + tl.sum(p, 1), m_new, alpha


@triton.jit
def _fwd_onepass_loop(
    acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2, q1a, q1b, q2a, q2b,
    k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, VALUE_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    q_docs, doc_k, DOCUMENTS: tl.constexpr,
):
    for block_n in range(start_n, end_n, BLOCK_N):
        s1, s2 = _scores(q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, block_n, stride_kn, N_K, qk_scale,
                         HEAD_D, BLOCK_D, BLOCK_D2, BLOCK_N, SHARED_K, USE_DESC, UPCAST, DOT_PRECISION)
        if MASKED:
            visible = _visible_in_documents(offs_m, block_n + tl.arange(0, BLOCK_N), N_K, causal_offset, CAUSAL,
                                            q_docs, doc_k, DOCUMENTS)
            s1 = tl.where(visible, s1, float("-inf"))
            s2 = tl.where(visible, s2, float("-inf"))
        p1, l1, m1, alpha1 = _online_softmax_step(s1, m1, l1)
        p2, l2, m2, alpha2 = _online_softmax_step(s2, m2, l2)
        va, vb = _load_pair(v_a, v_b, block_n, stride_vn, N_K, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC,
                            UPCAST)
        acc1a = tl.dot(p1.to(va.dtype), va, acc1a * alpha1[:, None], input_precision=DOT_PRECISION)
        acc2a = tl.dot(p2.to(va.dtype), va, acc2a * alpha2[:, None], input_precision=DOT_PRECISION)
        if BLOCK_DV2 > 0:
            acc1b = tl.dot(p1.to(vb.dtype), vb, acc1b * alpha1[:, None], input_precision=DOT_PRECISION)
            acc2b = tl.dot(p2.to(vb.dtype), vb, acc2b * alpha2[:, None], input_precision=DOT_PRECISION)
    return acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2


@triton.jit
def _fwd_lse_loop(
    l1, m1, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, stride_kn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, USE_DESC: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    q_docs, doc_k, DOCUMENTS: tl.constexpr,
):
    for block_n in range(start_n, end_n, BLOCK_N):
        s1, s2 = _scores(q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, block_n, stride_kn, N_K, qk_scale,
                         HEAD_D, BLOCK_D, BLOCK_D2, BLOCK_N, SHARED_K, USE_DESC, UPCAST, DOT_PRECISION)
        if MASKED:
            visible = _visible_in_documents(offs_m, block_n + tl.arange(0, BLOCK_N), N_K, causal_offset, CAUSAL,
                                            q_docs, doc_k, DOCUMENTS)
            s1 = tl.where(visible, s1, float("-inf"))
            s2 = tl.where(visible, s2, float("-inf"))
        _, l1, m1, _ = _online_softmax_step(s1, m1, l1)
        _, l2, m2, _ = _online_softmax_step(s2, m2, l2)
    return l1, m1, l2, m2


@triton.jit
def _fwd_combined_loop(
    acc_a, acc_b, q1a, q1b, q2a, q2b, lse1, lse2, lam,
    k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
    offs_m, start_n, end_n, causal_offset, qk_scale, N_K,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, VALUE_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, SHARED_K: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    q_docs, doc_k, DOCUMENTS: tl.constexpr,
):
    """acc += (P1 − λ·P2)·V with P1, P2 normalised by the given LSE (log2 units): one product with V a key block."""
    for block_n in range(start_n, end_n, BLOCK_N):
        s1, s2 = _scores(q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, block_n, stride_kn, N_K, qk_scale,
                         HEAD_D, BLOCK_D, BLOCK_D2, BLOCK_N, SHARED_K, USE_DESC, UPCAST, DOT_PRECISION)
        p = tl.math.exp2(s1 - lse1[:, None]) - lam[:, None] * tl.math.exp2(s2 - lse2[:, None])
        if MASKED:
            visible = _visible_in_documents(offs_m, block_n + tl.arange(0, BLOCK_N), N_K, causal_offset, CAUSAL,
                                            q_docs, doc_k, DOCUMENTS)
            p = tl.where(visible, p, 0.0)
        va, vb = _load_pair(v_a, v_b, block_n, stride_vn, N_K, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC,
                            UPCAST)
        acc_a = tl.dot(p.to(va.dtype), va, acc_a, input_precision=DOT_PRECISION)
        if BLOCK_DV2 > 0:
            acc_b = tl.dot(p.to(vb.dtype), vb, acc_b, input_precision=DOT_PRECISION)
    return acc_a, acc_b


@triton.jit
def _epilogue_store(
    ya, yb, offs_m, b, h, OUT, Y, RSTD, NORM_W, stride_ob, stride_on, stride_oh, N_HEADS, N_Q, out_scale, norm_eps,
    VALUE_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, EPILOGUE: tl.constexpr,
    NORM: tl.constexpr,
):
    """Store out = RMSNorm(y)·w·s (NORM), y·s (EPILOGUE only) or y, and with an epilogue also y and rstd.

    out and y share their strides. rstd is (B, H, Nq) fp32. The columns past VALUE_D of a padded block are 0."""
    head = b * stride_ob + h * stride_oh
    if EPILOGUE:
        _store_pair(Y + head, ya, yb, offs_m, stride_on, N_Q, VALUE_D, BLOCK_DV, BLOCK_DV2)
        if NORM:
            rstd = 1.0 / tl.sqrt(_rowsum_product(ya, yb, ya, yb, BLOCK_DV2) / VALUE_D + norm_eps)
            tl.store(RSTD + (b * N_HEADS + h) * N_Q + offs_m, rstd, mask=offs_m < N_Q)
            cols = tl.arange(0, BLOCK_DV)
            w_a = tl.load(NORM_W + cols, mask=cols < VALUE_D, other=0.0).to(tl.float32)
            ya = ya * rstd[:, None] * (w_a * out_scale)[None, :]
            if BLOCK_DV2 > 0:
                w_b = tl.load(NORM_W + BLOCK_DV + tl.arange(0, BLOCK_DV2)).to(tl.float32)
                yb = yb * rstd[:, None] * (w_b * out_scale)[None, :]
        else:
            ya = ya * out_scale
            yb = yb * out_scale
    _store_pair(OUT + head, ya, yb, offs_m, stride_on, N_Q, VALUE_D, BLOCK_DV, BLOCK_DV2)


@triton.jit
def _diff_attn_fwd_kernel(
    Q, K, V, LAM, OUT, Y, LSE, RSTD, NORM_W,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_ob, stride_on, stride_oh,
    N_HEADS, GROUP, N_Q, N_K, causal_offset, qk_scale, out_scale, norm_eps,
    DOC_Q, DOC_K, stride_docq, stride_dock,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    EPILOGUE: tl.constexpr, NORM: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOCUMENTS: tl.constexpr,
):
    """One pass: both maps' online softmax and outputs, then the epilogue."""
    start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, CAUSAL, BLOCK_M,
    )
    q1a, q1b, q2a, q2b = _query_pair(q1_base, start_m, stride_qn, stride_qh, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2,
                                     USE_DESC, UPCAST)
    k1_a, k1_b, k2_a, k2_b, v_a, v_b = _key_value_sources(k1_base, k2_base, v_base, N_K, stride_kn, stride_vn, HEAD_D,
                                                          VALUE_D, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_DV2,
                                                          USE_DESC)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1a = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc2a = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc1b = acc1a
    acc2b = acc2a
    if BLOCK_DV2 > 0:
        acc1b = tl.zeros([BLOCK_M, BLOCK_DV2], tl.float32)
        acc2b = tl.zeros([BLOCK_M, BLOCK_DV2], tl.float32)

    full_end, end = _key_ranges(start_m, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    doc_q = DOC_Q + b * stride_docq
    doc_k = DOC_K + b * stride_dock
    start, full_lo, full_hi, end = _document_key_ranges(start_m, full_end, end, doc_q, doc_k, N_Q, N_K, BLOCK_M,
                                                        BLOCK_N, DOCUMENTS)
    q_docs = _row_documents(doc_q, offs_m, N_Q, DOCUMENTS)
    if DOCUMENTS:  # the key blocks where the rows' first document starts
        acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2 = _fwd_onepass_loop(
            acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, v_a, v_b,
            stride_kn, stride_vn, offs_m, start, full_lo, causal_offset, qk_scale, N_K,
            HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
            DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
        )
    acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2 = _fwd_onepass_loop(
        acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, v_a, v_b,
        stride_kn, stride_vn, offs_m, full_lo, full_hi, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, False, CAUSAL, SHARED_K, USE_DESC, UPCAST,
        DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
    )
    acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2 = _fwd_onepass_loop(
        acc1a, acc1b, l1, m1, acc2a, acc2b, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, v_a, v_b,
        stride_kn, stride_vn, offs_m, full_hi, end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
        DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
    )

    row_valid = offs_m < N_Q
    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    lam = lam.to(tl.float32)
    ya = acc1a / l1[:, None] - lam[:, None] * (acc2a / l2[:, None])
    yb = ya
    if BLOCK_DV2 > 0:
        yb = acc1b / l1[:, None] - lam[:, None] * (acc2b / l2[:, None])
    _epilogue_store(ya, yb, offs_m, b, h, OUT, Y, RSTD, NORM_W, stride_ob, stride_on, stride_oh, N_HEADS, N_Q,
                    out_scale, norm_eps, VALUE_D, BLOCK_DV, BLOCK_DV2, EPILOGUE, NORM)
    # LSE is stored in natural-log units, (B, 2H, Nq) contiguous: row 2h is map 1, row 2h+1 is map 2.
    tl.store(LSE + row_stats + offs_m, (m1 + tl.math.log2(l1)) / 1.4426950408889634, mask=row_valid)
    tl.store(LSE + row_stats + N_Q + offs_m, (m2 + tl.math.log2(l2)) / 1.4426950408889634, mask=row_valid)


@triton.jit
def _diff_attn_fwd_lse_kernel(
    Q, K, LSE,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    N_HEADS, GROUP, N_Q, N_K, causal_offset, qk_scale,
    DOC_Q, DOC_K, stride_docq, stride_dock,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, CAUSAL: tl.constexpr,
    SHARED_K: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOCUMENTS: tl.constexpr,
):
    """Two-pass forward, pass 1: both maps' LSE (natural log; −inf for a row that sees no key)."""
    start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, _ = _query_block_program(
        Q, K, K, stride_qb, stride_qh, stride_kb, stride_kh, stride_kb, stride_kh, N_HEADS, GROUP, N_Q,
        SHARED_K, CAUSAL, BLOCK_M,
    )
    q1a, q1b, q2a, q2b = _query_pair(q1_base, start_m, stride_qn, stride_qh, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2,
                                     USE_DESC, UPCAST)
    k1_a, k1_b = _sources(k1_base, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC)
    k2_a, k2_b = _sources(k2_base, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    full_end, end = _key_ranges(start_m, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    doc_q = DOC_Q + b * stride_docq
    doc_k = DOC_K + b * stride_dock
    start, full_lo, full_hi, end = _document_key_ranges(start_m, full_end, end, doc_q, doc_k, N_Q, N_K, BLOCK_M,
                                                        BLOCK_N, DOCUMENTS)
    q_docs = _row_documents(doc_q, offs_m, N_Q, DOCUMENTS)
    if DOCUMENTS:  # the key blocks where the rows' first document starts
        l1, m1, l2, m2 = _fwd_lse_loop(
            l1, m1, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, stride_kn, offs_m, start, full_lo,
            causal_offset, qk_scale, N_K, HEAD_D, BLOCK_D, BLOCK_D2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
            DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
        )
    l1, m1, l2, m2 = _fwd_lse_loop(
        l1, m1, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, stride_kn, offs_m, full_lo, full_hi, causal_offset,
        qk_scale, N_K, HEAD_D, BLOCK_D, BLOCK_D2, BLOCK_N, False, CAUSAL, SHARED_K, USE_DESC, UPCAST, DOT_PRECISION,
        q_docs, doc_k, DOCUMENTS,
    )
    l1, m1, l2, m2 = _fwd_lse_loop(
        l1, m1, l2, m2, q1a, q1b, q2a, q2b, k1_a, k1_b, k2_a, k2_b, stride_kn, offs_m, full_hi, end, causal_offset,
        qk_scale, N_K, HEAD_D, BLOCK_D, BLOCK_D2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST, DOT_PRECISION,
        q_docs, doc_k, DOCUMENTS,
    )
    row_valid = offs_m < N_Q
    tl.store(LSE + row_stats + offs_m, (m1 + tl.math.log2(l1)) / 1.4426950408889634, mask=row_valid)
    tl.store(LSE + row_stats + N_Q + offs_m, (m2 + tl.math.log2(l2)) / 1.4426950408889634, mask=row_valid)


@triton.jit
def _diff_attn_fwd_out_kernel(
    Q, K, V, LAM, LSE, OUT, Y, RSTD, NORM_W,
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_ln, stride_lh,
    stride_ob, stride_on, stride_oh,
    N_HEADS, GROUP, N_Q, N_K, causal_offset, qk_scale, out_scale, norm_eps,
    DOC_Q, DOC_K, stride_docq, stride_dock,
    HEAD_D: tl.constexpr, VALUE_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, CAUSAL: tl.constexpr, SHARED_K: tl.constexpr,
    EPILOGUE: tl.constexpr, NORM: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOCUMENTS: tl.constexpr,
):
    """Two-pass forward, pass 2: y = (P1 − λ·P2)·V from the LSE of pass 1, then the epilogue."""
    start_m, offs_m, b, h, row_stats, q1_base, k1_base, k2_base, v_base = _query_block_program(
        Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
        SHARED_K, CAUSAL, BLOCK_M,
    )
    q1a, q1b, q2a, q2b = _query_pair(q1_base, start_m, stride_qn, stride_qh, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2,
                                     USE_DESC, UPCAST)
    k1_a, k1_b, k2_a, k2_b, v_a, v_b = _key_value_sources(k1_base, k2_base, v_base, N_K, stride_kn, stride_vn, HEAD_D,
                                                          VALUE_D, BLOCK_N, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_DV2,
                                                          USE_DESC)
    row_valid = offs_m < N_Q
    # Rows past Nq get LSE = +inf, so their probabilities are exactly 0.
    lse1 = _load_row_vector(LSE + row_stats, offs_m, N_Q, float("inf")) * 1.4426950408889634
    lse2 = _load_row_vector(LSE + row_stats + N_Q, offs_m, N_Q, float("inf")) * 1.4426950408889634
    lam = tl.load(LAM + b * stride_lb + offs_m * stride_ln + h * stride_lh, mask=row_valid, other=0.0)
    lam = lam.to(tl.float32)

    acc_a = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_b = acc_a
    if BLOCK_DV2 > 0:
        acc_b = tl.zeros([BLOCK_M, BLOCK_DV2], tl.float32)
    full_end, end = _key_ranges(start_m, N_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    doc_q = DOC_Q + b * stride_docq
    doc_k = DOC_K + b * stride_dock
    start, full_lo, full_hi, end = _document_key_ranges(start_m, full_end, end, doc_q, doc_k, N_Q, N_K, BLOCK_M,
                                                        BLOCK_N, DOCUMENTS)
    q_docs = _row_documents(doc_q, offs_m, N_Q, DOCUMENTS)
    if DOCUMENTS:  # the key blocks where the rows' first document starts
        acc_a, acc_b = _fwd_combined_loop(
            acc_a, acc_b, q1a, q1b, q2a, q2b, lse1, lse2, lam, k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
            offs_m, start, full_lo, causal_offset, qk_scale, N_K,
            HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
            DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
        )
    acc_a, acc_b = _fwd_combined_loop(
        acc_a, acc_b, q1a, q1b, q2a, q2b, lse1, lse2, lam, k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
        offs_m, full_lo, full_hi, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, False, CAUSAL, SHARED_K, USE_DESC, UPCAST,
        DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
    )
    acc_a, acc_b = _fwd_combined_loop(
        acc_a, acc_b, q1a, q1b, q2a, q2b, lse1, lse2, lam, k1_a, k1_b, k2_a, k2_b, v_a, v_b, stride_kn, stride_vn,
        offs_m, full_hi, end, causal_offset, qk_scale, N_K,
        HEAD_D, BLOCK_D, BLOCK_D2, VALUE_D, BLOCK_DV, BLOCK_DV2, BLOCK_N, True, CAUSAL, SHARED_K, USE_DESC, UPCAST,
        DOT_PRECISION, q_docs, doc_k, DOCUMENTS,
    )
    _epilogue_store(acc_a, acc_b, offs_m, b, h, OUT, Y, RSTD, NORM_W, stride_ob, stride_on, stride_oh, N_HEADS, N_Q,
                    out_scale, norm_eps, VALUE_D, BLOCK_DV, BLOCK_DV2, EPILOGUE, NORM)
