"""Fused differential FlashAttention (V1 and V2) in Triton: kernels, launchers, autograd, public functions.

V1: q (B, Nq, 2H, d), k (B, Nk, 2Hkv, d), v (B, Nk, Hkv, 2d); map 1 uses (q[2h], k[2g]), map 2 (q[2h+1], k[2g+1]),
    both read v[g] (2d wide); y (B, Nq, H, 2d) = O1 − λ·O2 with λ one value or one per head.
V2: q (B, Nq, 2H, d), k and v (B, Nk, Hkv, d); both maps read k[g] and v[g]; y (B, Nq, H, d) = O1 − λ·O2 with
    λ one value per token and head.
g = h // (H / Hkv) in both. Internally λ is a (B, Nq, H) view (stride 0 where it broadcasts). Every program of
every kernel owns both maps of a head (or KV group), so each K/V (or Q/dO) tile it loads serves both.

The DIFF epilogue runs inside the forward: out = RMSNorm(y)·w·s over the 2d columns of a head (V1's sub-layer
norm, with w the norm weight and s = 1 − λ_init the output scale), or out = y·s without a norm weight. The forward
stores out, the pre-norm y and rstd for the backward, and both maps' LSE.

Forward, two designs (kernels/diff_attn/tuning.py picks one per GPU and head dim):
  onepass  one program per query block keeps two online-softmax states (m1, l1, acc1), (m2, l2, acc2): 6d
           multiply-adds a (query, key) pair in V1, two accumulators as wide as V.
  twopass  an LSE pass computes both maps' LSE (S1, S2 only), then a second pass accumulates
           (P1/l1 − λ·P2/l2)·V in one accumulator with one P·V product: also 6d in V1 (5d in V2), but one accumulator,
           so a 128-row query tile with V 2d = 256 wide fits the registers of 8 warps.
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
Causal masking is aligned to the bottom right by default (query i sees keys j <= i + Nk − Nq; any offset can be
given); key blocks a query block cannot see are skipped, only diagonal or ragged blocks pay for masking, and causal
query blocks run heaviest first.

Document masking (packed samples, DOCUMENTS): each query and key carries its document id (B, N) int32, non-decreasing
along a sample, and a query sees only keys of its own document. A query-block program finds, by binary search over
the key ids, the keys of its rows' first and last documents and skips every key block outside them; a key-block
program (dK, dV) does the same over the query ids. Only the blocks a document boundary crosses pay for the id
comparison; a key block inside the one document of a query block whose rows all lie in it runs unmasked, so a sample
that is one document computes exactly what the kernels compute without ids.

Two code-generation switches, per design: tensor descriptors (TMA loads on Hopper, built inside the kernel; pointer
loads on older GPUs and where strides are not 16-byte aligned), and split head dims (a head dim that is not a power
of two, 96, is two column blocks, 64 + 32, instead of one block padded to 128: every product runs on the real
columns). Triton (3.6, 3.9) waits for each S = Q·Kᵀ wgmma right after issuing it (`warp_group_dot_wait {pendings =
0}`, also when S is computed one key block ahead), so a P·V product overlaps only the next block's loads and S
issue, and `tl.range(warp_specialize=True)` makes no warp groups on sm_90 (kernels/diff_attn/configs_sm90.md).

Block sizes come from tuning.py; fp32 inputs run their products in TF32 on a GPU (fp32 accumulation and softmax
statistics), in full fp32 in the interpreter.
"""

import math
import os

import torch
import triton
import triton.language as tl

from kernels import gpu_target
from kernels.diff_attn import tuning
from kernels.diff_attn.tuning import BlockConfig

_INTERPRET = gpu_target.INTERPRET
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 128

# Block sizes in the interpreter (no tuning there); small, so that the tests cross block edges.
_INTERPRET_CONFIGS = {
    "forward": BlockConfig(32, 16, 4, 1),
    "forward_lse": BlockConfig(32, 16, 4, 1),
    "forward_out": BlockConfig(16, 32, 4, 1),
    "preprocess": BlockConfig(16, 32, 4, 1),
    "dkdv": BlockConfig(16, 32, 4, 1),
    "dk": BlockConfig(16, 32, 4, 1),
    "dv": BlockConfig(32, 16, 4, 1),
    "dkdq": BlockConfig(16, 32, 4, 1),
    "dq": BlockConfig(16, 32, 4, 1),
}


# ----------------------------------------------------------------------------------------------------------------
# Tiles: pointer or tensor-descriptor loads, a head dim as one block or two
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _sources(base, n_rows, row_stride, N_COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
             BLOCK_C2: tl.constexpr, USE_DESC: tl.constexpr):
    """What `_load_pair` reads a (rows, N_COLS) matrix through: two tensor descriptors (one per column block), or its
    base pointer twice."""
    if USE_DESC:
        src_a = tl.make_tensor_descriptor(base, [n_rows, N_COLS], [row_stride, 1], [BLOCK_R, BLOCK_C])
        if BLOCK_C2 > 0:
            src_b = tl.make_tensor_descriptor(base, [n_rows, N_COLS], [row_stride, 1], [BLOCK_R, BLOCK_C2])
        else:
            src_b = src_a
    else:
        src_a = base
        src_b = base
    return src_a, src_b


@triton.jit
def _load_block(src, row0, col0, row_stride, n_rows, N_COLS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr):
    """Rows [row0, row0 + BLOCK_R) and columns [col0, col0 + BLOCK_C); out-of-range elements read as 0."""
    if USE_DESC:
        tile = src.load([row0, col0])
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = col0 + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < N_COLS)
        tile = tl.load(src + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _load_pair(src_a, src_b, row0, row_stride, n_rows, N_COLS: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_C2: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr):
    """A row block as its two column blocks (the second is the first again when BLOCK_C2 is 0: one block)."""
    a = _load_block(src_a, row0, 0, row_stride, n_rows, N_COLS, BLOCK_R, BLOCK_C, USE_DESC, UPCAST)
    if BLOCK_C2 > 0:
        b = _load_block(src_b, row0, BLOCK_C, row_stride, n_rows, N_COLS, BLOCK_R, BLOCK_C2, USE_DESC, UPCAST)
    else:
        b = a
    return a, b


@triton.jit
def _dot_nt(xa, xb, ya, yb, BLOCK_C2: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x·yᵀ (fp32) over both column blocks of x (R, C) and y (S, C)."""
    s = tl.dot(xa, tl.trans(ya), input_precision=DOT_PRECISION)
    if BLOCK_C2 > 0:
        s = tl.dot(xb, tl.trans(yb), s, input_precision=DOT_PRECISION)
    return s


@triton.jit
def _store_pair(ptr, xa, xb, offs_r, row_stride, n_rows, N_COLS: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_C2: tl.constexpr):
    cols = tl.arange(0, BLOCK_C)
    rows_ok = offs_r[:, None] < n_rows
    base = ptr + offs_r[:, None] * row_stride
    tl.store(base + cols[None, :], xa.to(ptr.dtype.element_ty), mask=rows_ok & (cols[None, :] < N_COLS))
    if BLOCK_C2 > 0:
        cols2 = BLOCK_C + tl.arange(0, BLOCK_C2)
        tl.store(base + cols2[None, :], xb.to(ptr.dtype.element_ty), mask=rows_ok)


@triton.jit
def _rowsum_product(xa, xb, ya, yb, BLOCK_C2: tl.constexpr):
    """rowsum(x ∘ y) over both column blocks, in fp32."""
    total = tl.sum(xa.to(tl.float32) * ya.to(tl.float32), 1)
    if BLOCK_C2 > 0:
        total += tl.sum(xb.to(tl.float32) * yb.to(tl.float32), 1)
    return total


@triton.jit
def _load_row_vector(ptr, offs, n, other):
    return tl.load(ptr + offs, mask=offs < n, other=other)


@triton.jit
def _kv_heads(g, SHARED_K: tl.constexpr):
    """Heads of k that KV group g uses for map 1 and map 2: 2g and 2g+1 in V1, g for both in V2."""
    k_head1 = g if SHARED_K else 2 * g
    k_head2 = g if SHARED_K else 2 * g + 1
    return k_head1, k_head2


@triton.jit
def _query_block_program(
    Q, K, V, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, N_HEADS, GROUP, N_Q,
    SHARED_K: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Decode a program of the (query block, batch × head) grid of the forward, preprocess and dQ kernels.

    Causal query blocks run last first (the last sees the most keys), so the longest programs start first. Returns
    the first query row and rows, b (int64, so batch offsets cannot overflow), h, the offset of map 1's row of (b, h)
    in the (B, 2H, Nq) LSE and delta tensors (map 2's is N_Q further), and the bases of q[2h] (q[2h+1] is one
    stride_qh further), of k for each map and of v.
    """
    block = tl.program_id(0)
    if CAUSAL:
        block = tl.num_programs(0) - 1 - block
    start_m = block * BLOCK_M
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
def _query_pair(q1_base, start_m, stride_qn, stride_qh, N_Q, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr):
    """Q1 and Q2 (q[2h], q[2h+1]) of a query block, each as its two column blocks."""
    q_a, q_b = _sources(q1_base, N_Q, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC)
    q1a, q1b = _load_pair(q_a, q_b, start_m, stride_qn, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC, UPCAST)
    q_a, q_b = _sources(q1_base + stride_qh, N_Q, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC)
    q2a, q2b = _load_pair(q_a, q_b, start_m, stride_qn, N_Q, HEAD_D, BLOCK_M, BLOCK_D, BLOCK_D2, USE_DESC, UPCAST)
    return q1a, q1b, q2a, q2b


@triton.jit
def _key_value_sources(k1_base, k2_base, v_base, N_K, stride_kn, stride_vn, HEAD_D: tl.constexpr,
                       VALUE_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                       BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr, USE_DESC: tl.constexpr):
    """What a query block's key loop reads K1, K2 and V through (`_sources`)."""
    k1_a, k1_b = _sources(k1_base, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC)
    k2_a, k2_b = _sources(k2_base, N_K, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, BLOCK_D2, USE_DESC)
    v_a, v_b = _sources(v_base, N_K, stride_vn, VALUE_D, BLOCK_N, BLOCK_DV, BLOCK_DV2, USE_DESC)
    return k1_a, k1_b, k2_a, k2_b, v_a, v_b


@triton.jit
def _key_ranges(start_m, N_K, causal_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys [0, full_end) that every row of the query block sees, and [full_end, end) that need masks (empty when
    the block sees no key)."""
    if CAUSAL:
        end = tl.minimum(start_m + BLOCK_M + causal_offset, N_K)
        full_end = tl.minimum(tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N,
                              N_K // BLOCK_N * BLOCK_N)
    else:
        end = N_K
        full_end = N_K // BLOCK_N * BLOCK_N
    return full_end, end


@triton.jit
def _visible(offs_m, offs_n, N_K, causal_offset, CAUSAL: tl.constexpr):
    """(rows, keys) mask of the keys each query row sees."""
    visible = offs_n[None, :] < N_K
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
    return visible


@triton.jit
def _first_at_least(ids, n, value):
    """The first index i < n with ids[i] >= value, or n: a binary search (document ids never decrease)."""
    lo = n * 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        right = tl.load(ids + mid) < value
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _row_documents(doc_base, offs, n, DOCUMENTS: tl.constexpr):
    """The documents of rows `offs` (−1 past n); `offs` itself, unused, without documents."""
    docs = offs
    if DOCUMENTS:
        docs = tl.load(doc_base + offs, mask=offs < n, other=-1)
    return docs


@triton.jit
def _document_key_ranges(start_m, full_end, end, doc_q, doc_k, N_Q, N_K, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr):
    """A query block's keys as masked [start, full_lo), whole [full_lo, full_hi) and masked [full_hi, end), from the
    causal ranges (whole [0, full_end), masked [full_end, end)). With documents, key blocks before the first document
    of the block's rows or after its last are skipped, and a key block is whole only inside the one document of a
    query block whose rows all lie in it."""
    start = full_end * 0
    full_lo = start
    full_hi = full_end
    if DOCUMENTS:
        first = tl.load(doc_q + start_m)
        last = tl.load(doc_q + tl.minimum(start_m + BLOCK_M, N_Q) - 1)
        key_lo = _first_at_least(doc_k, N_K, first)
        key_hi = _first_at_least(doc_k, N_K, last + 1)
        start = key_lo // BLOCK_N * BLOCK_N
        end = tl.minimum(end, key_hi)
        full_lo = tl.cdiv(key_lo, BLOCK_N) * BLOCK_N
        full_hi = tl.minimum(full_end, key_hi // BLOCK_N * BLOCK_N)
        whole = (first == last) & (full_lo < full_hi)
        full_lo = tl.where(whole, full_lo, start)
        full_hi = tl.where(whole, full_hi, start)
    return start, full_lo, full_hi, end


@triton.jit
def _visible_in_documents(offs_m, offs_n, N_K, causal_offset, CAUSAL: tl.constexpr, q_docs, doc_k,
                          DOCUMENTS: tl.constexpr):
    """`_visible`, and with documents only the keys of each row's own document."""
    visible = _visible(offs_m, offs_n, N_K, causal_offset, CAUSAL)
    if DOCUMENTS:
        k_docs = tl.load(doc_k + offs_n, mask=offs_n < N_K, other=-2)
        visible = visible & (q_docs[:, None] == k_docs[None, :])
    return visible


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# dK/dV-kernel flags (COMPUTE_DK, COMPUTE_DV, ATOMIC_DQ) by kernel name.
_KEY_BLOCK_FLAGS = {"dkdv": (True, True, False), "dk": (True, False, False), "dv": (False, True, False),
                    "dkdq": (True, False, True)}
# The smallest BLOCK_M of any config: the norm weight's partial sums have a row for each query block of at most this.
_MIN_BLOCK_M = 16
# Chosen designs and configs by (device index, problem): selection runs once per shape class, a dict lookup after
# (configs also by the call's own values, looked up first).
_CHOSEN_DESIGNS = {}
_CHOSEN_CONFIGS = {}
_CONFIG_CACHE = {}


def _capability_major(device):
    """The GPU's compute capability major (the simulated GPU's); the interpreter's own branch plans as on Hopper (the
    table's main entries)."""
    if not gpu_target.gpu_branch():
        return 9
    return gpu_target.device_properties(device).capability[0]


def _design(q, value_dim, plan):
    """The explicit plan's design, else the table's for this GPU and these head dims (with DIFF_ATTN_DESIGN)."""
    if plan is not None:
        return plan.design
    key = (gpu_target.key(), q.device.index, q.shape[3], value_dim, os.environ.get(tuning.DESIGN_ENV, ""))
    design = _CHOSEN_DESIGNS.get(key)
    if design is None:
        design = tuning.default_design(_capability_major(q.device), q.shape[3], value_dim)
        _CHOSEN_DESIGNS[key] = design
    return design


def _descriptors_usable(*tensors):
    """TMA needs 16-byte aligned bases and row strides (each head's base is then aligned too) and unit last strides."""
    return all(
        x.data_ptr() % 16 == 0 and x.stride(-1) == 1 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
        for x in tensors
    )


def _use_descriptors(design, *tensors):
    if not design.descriptors or not _descriptors_usable(*tensors):
        return False
    # Tensor descriptors built inside a kernel live in a global scratch buffer that Triton asks the host for, through
    # an allocator kept per thread: the backward may run on autograd's device thread, so every launch checks.
    gpu_target.ensure_allocator()
    return True


def _dims(head_dim, value_dim, split_dims):
    block_d, block_d2 = tuning.dim_blocks(head_dim, split_dims)
    block_dv, block_dv2 = tuning.dim_blocks(value_dim, split_dims)
    return dict(HEAD_D=head_dim, VALUE_D=value_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_DV=block_dv,
                BLOCK_DV2=block_dv2)


def _kernel_constants(q, value_dim, causal, shared_k, design, use_desc):
    return dict(
        **_dims(q.shape[3], value_dim, design.split_dims),
        CAUSAL=causal,
        SHARED_K=shared_k,
        USE_DESC=use_desc,
        # The interpreter computes bf16 arithmetic wrongly, so bf16 tiles are widened to fp32 after loading there.
        UPCAST=_INTERPRET and q.dtype == torch.bfloat16,
        # fp32 inputs: TF32 products with fp32 accumulation on a GPU (IEEE fp32 dots are an order of magnitude slower
        # on tensor cores); the interpreter multiplies in full fp32, which the reference tests rely on. 16-bit inputs
        # ignore it.
        DOT_PRECISION="ieee" if _INTERPRET else "tf32",
    )


def _block_config(name, kernel, grid, args, constants, q, n_q, n_k, plan, design, value_dim):
    """The block config `kernel` launches with at this problem (kernels/diff_attn/tuning.py explains the choice)."""
    if plan is not None:
        return plan.configs[name]
    if not gpu_target.gpu_branch():
        return _INTERPRET_CONFIGS[name]
    # first by the call's own values, a lookup without building the problem (a launch's host time counts: six a call)
    call_key = ("call", gpu_target.key(), q.device.index, name, q.dtype, constants["HEAD_D"], value_dim,
                constants["SHARED_K"], constants["CAUSAL"], n_q, n_k, design.split_dims, constants["USE_DESC"],
                constants.get("HEAD_LOOP", False), os.environ.get(tuning.AUTOTUNE_ENV))
    config = _CHOSEN_CONFIGS.get(call_key)
    if config is not None:
        return config
    autotuning = tuning.autotune_enabled() and not _INTERPRET  # nothing to time in the interpreter
    problem = tuning.KernelProblem.of(name, _DTYPE_NAMES[q.dtype], constants["HEAD_D"], value_dim,
                                      constants["SHARED_K"], constants["CAUSAL"], n_q, n_k, design.split_dims,
                                      constants["USE_DESC"], constants.get("HEAD_LOOP", False))
    memo_key = (gpu_target.key(), q.device.index, problem, autotuning)
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
    _CHOSEN_CONFIGS[call_key] = config
    return config


def _launch(name, kernel, grid, args, constants, q, n_q, n_k, plan, design, value_dim=None):
    """Launch `kernel` over `grid(config)` with the block config chosen for it (the problem's value dim: the
    kernel's VALUE_D unless the kernel has none)."""
    config = _block_config(name, kernel, grid, args, constants, q, n_q, n_k, plan, design,
                           constants["VALUE_D"] if value_dim is None else value_dim)
    if constants["USE_DESC"]:
        gpu_target.require_allocator()
    kernel[grid(config)](*args, **constants, **config.launch_options())


# Buffers the kernels write in full are poisoned with NaN under test, so that any element a kernel fails to write shows
# up: DIFF_ATTN_POISON=1, the default in the interpreter (tests/conftest.py sets it, so the GPU tests poison too).
# Elsewhere they are left uninitialised: a fill is a launch and a full write of the tensor, ten a layer's call.
POISON_ENV = "DIFF_ATTN_POISON"


def poison_setting() -> bool:
    """``DIFF_ATTN_POISON`` (0 or 1; unset: 1 in the interpreter, 0 on a GPU)."""
    value = os.environ.get(POISON_ENV, "1" if _INTERPRET else "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{POISON_ENV}={value!r}; expected 0 (buffers left uninitialised) or 1 (NaN-poisoned)")
    return value == "1"


_POISON = poison_setting()


def _written(shape, dtype, device) -> torch.Tensor:
    """A buffer the kernels write every element of: NaN-poisoned under test (``_POISON``), uninitialised otherwise."""
    if _POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


_PLACEHOLDERS = {}


def _placeholder(device) -> torch.Tensor:
    """An int32 argument the kernels never read (no document ids): one per device, not an allocation per launch."""
    device = torch.device(device)
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _PLACEHOLDERS[device]


def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _query_grid(n_q, batch, n_heads):
    return lambda config: (triton.cdiv(n_q, config.block_m), batch * n_heads)


def _document_args(documents, q):
    """The kernels' (DOC_Q, DOC_K, stride_docq, stride_dock) and DOCUMENTS: the queries' and keys' document ids
    ((B, Nq), (B, Nk) int32, rows contiguous), or an unread placeholder without documents."""
    if documents is None:
        placeholder = _placeholder(q.device)
        return (placeholder, placeholder, 0, 0), dict(DOCUMENTS=False)
    q_ids, k_ids = documents
    return (q_ids, k_ids, q_ids.stride(0), k_ids.stride(0)), dict(DOCUMENTS=True)


def _diff_attn_lse(q, k, value_dim, causal, causal_offset, softmax_scale, shared_k, design, plan, documents=None):
    """The two-pass forward's first pass: lse (B, 2H, Nq) fp32, natural log. The kernel reads no V; `value_dim`
    picks the table entry of the problem it belongs to. `documents`: (query ids, key ids) or None."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k = two_h // 2, k.shape[1]
    group = n_heads // (k.shape[2] if shared_k else k.shape[2] // 2)
    lse = _written((batch, two_h, n_q), torch.float32, q.device)
    constants = _kernel_constants(q, q.shape[3], causal, shared_k, design, _use_descriptors(design, q, k))
    for name in ("VALUE_D", "BLOCK_DV", "BLOCK_DV2"):
        del constants[name]
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    args = (q, k, lse, *_strides3(q), *_strides3(k), n_heads, group, n_q, n_k, causal_offset,
            softmax_scale * _LOG2E, *document_args)
    _launch("forward_lse", _diff_attn_fwd_lse_kernel, _query_grid(n_q, batch, n_heads), args, constants, q, n_q,
            n_k, plan, design, value_dim)
    return lse


def _diff_attn_forward(q, k, v, lam_rows, norm_weight, causal, causal_offset, softmax_scale, shared_k, norm_eps,
                       output_scale, design, plan, lse=None, out_dtype=None, documents=None):
    """Launch the forward kernels of `design`; returns out (B, Nq, H, Dv), the pre-norm y (out itself without an
    epilogue), lse (B, 2H, Nq) fp32 natural log and rstd (B, H, Nq) fp32 (None without a norm weight).

    With `lse` given the two-pass forward's output pass alone runs with it (context-parallel pieces)."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    norm = norm_weight is not None
    epilogue = norm or output_scale != 1.0
    out = _written((batch, n_q, n_heads, value_dim), out_dtype or q.dtype, q.device)
    y = _written(out.shape, out.dtype, q.device) if epilogue else out
    rstd = _written((batch, n_heads, n_q), torch.float32, q.device) if norm else None
    constants = _kernel_constants(q, value_dim, causal, shared_k, design, _use_descriptors(design, q, k, v))
    constants.update(EPILOGUE=epilogue, NORM=norm)
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    grid = _query_grid(n_q, batch, n_heads)
    tail = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(out),
            n_heads, n_heads // n_kv_groups, n_q, n_k, causal_offset, softmax_scale * _LOG2E, output_scale, norm_eps,
            *document_args)
    if design.forward == "twopass" or lse is not None:
        if lse is None:
            lse = _diff_attn_lse(q, k, value_dim, causal, causal_offset, softmax_scale, shared_k, design, plan,
                                 documents)
        args = (q, k, v, lam_rows, lse, out, y, rstd if norm else lse, norm_weight if norm else lse, *tail)
        _launch("forward_out", _diff_attn_fwd_out_kernel, grid, args, constants, q, n_q, n_k, plan, design)
    else:
        lse = _written((batch, two_h, n_q), torch.float32, q.device)
        args = (q, k, v, lam_rows, out, y, lse, rstd if norm else lse, norm_weight if norm else lse, *tail)
        _launch("forward", _diff_attn_fwd_kernel, grid, args, constants, q, n_q, n_k, plan, design)
    return out, y, lse, rstd


def _diff_attn_preprocess(dout, q, k, v, lam_rows, y, lse, rstd, norm_weight, causal, causal_offset, softmax_scale,
                          shared_k, output_scale, design, plan, documents=None):
    """The epilogue's backward and δ: returns dy (dout itself without an epilogue), delta (B, 2H, Nq), r2 (B, H, Nq)
    and the norm weight's partial sums (rows, Dv) fp32 (None without a norm weight)."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    norm = norm_weight is not None
    epilogue = norm or output_scale != 1.0
    dy = _written(y.shape, y.dtype, y.device) if epilogue else dout
    delta = _written((batch, two_h, n_q), torch.float32, q.device)
    r2 = _written((batch, n_heads, n_q), torch.float32, q.device)
    # Rows of query blocks that a config with larger blocks has no program for stay 0 in the sum.
    dw_partial = torch.zeros((batch * n_heads * triton.cdiv(n_q, _MIN_BLOCK_M), value_dim) if norm else (1,),
                             dtype=torch.float32, device=q.device)
    constants = _kernel_constants(q, value_dim, causal, shared_k, design, _use_descriptors(design, q, k, v))
    constants.update(EPILOGUE=epilogue, NORM=norm)
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    args = (
        q, k, v, lam_rows, y, dout, dy, lse, rstd if norm else lse, norm_weight if norm else lse, delta, r2,
        dw_partial, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(y),
        *_strides3(dout), n_heads, n_heads // n_kv_groups, n_q, n_k, causal_offset, softmax_scale * _LOG2E,
        output_scale, *document_args,
    )
    _launch("preprocess", _diff_attn_bwd_preprocess_kernel, _query_grid(n_q, batch, n_heads), args, constants, q,
            n_q, n_k, plan, design)
    return dy, delta, r2, dw_partial if norm else None


def _diff_attn_grads(dy, q, k, v, lam_rows, lse, delta, causal, causal_offset, softmax_scale, shared_k, design,
                     plan, grad_dtype=None, documents=None):
    """dq, dk, dv from dy, the LSE and δ, by the design's backward kernels (in `grad_dtype`, default the inputs')."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    group = n_heads // n_kv_groups
    grad_dtype = grad_dtype or q.dtype
    dk = _written(k.shape, grad_dtype, k.device)
    dv = _written(v.shape, grad_dtype, v.device)
    if design.backward == "atomic":
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq = _written(q.shape, grad_dtype, q.device)
    constants = _kernel_constants(q, value_dim, causal, shared_k, design, _use_descriptors(design, q, k, v, dy))
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    qk_scale = softmax_scale * _LOG2E
    common_strides = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(dy))
    key_grid = lambda config: (triton.cdiv(n_k, config.block_n), batch * n_kv_groups)  # noqa: E731
    kv_args = (
        q, k, v, lam_rows, dy, lse, delta, dk, dv, dq,
        *common_strides, *_strides3(dk), *_strides3(dv), *_strides3(dq),
        n_heads, n_kv_groups, group, n_q, n_k, causal_offset, qk_scale, softmax_scale, *document_args,
    )
    kv_kernels = [name for name in tuning.BACKWARD_DESIGNS[design.backward] if name in _KEY_BLOCK_FLAGS]
    for name in kv_kernels:
        compute_dk, compute_dv, atomic_dq = _KEY_BLOCK_FLAGS[name]
        flags = dict(COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv, ATOMIC_DQ=atomic_dq, HEAD_LOOP=group > 1)
        _launch(name, _diff_attn_bwd_kv_kernel, key_grid, kv_args, constants | flags, q, n_q, n_k, plan, design)
    if design.backward == "atomic":
        return dq.to(grad_dtype), dk, dv
    dq_args = (
        q, k, v, lam_rows, dy, lse, delta, dq, *common_strides, *_strides3(dq),
        n_heads, group, n_q, n_k, causal_offset, qk_scale, softmax_scale, *document_args,
    )
    _launch("dq", _diff_attn_bwd_dq_kernel, _query_grid(n_q, batch, n_heads), dq_args, constants, q, n_q, n_k, plan,
            design)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------


def _lam_rows(lam, batch, n_q, n_heads):
    """λ as a (B, Nq, H) view; stride 0 along the dimensions it is shared over."""
    if lam.dim() == 3:
        return lam
    return lam.reshape(1, 1, -1).expand(batch, n_q, n_heads)


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


# ----------------------------------------------------------------------------------------------------------------
# Pieces for context parallelism (ring attention), no autograd
#
# The two-pass forward splits over key chunks without rescaling: the LSE of every chunk merges into the full LSE
# (logsumexp over chunks), and with the full LSE each chunk's (P1 − λ·P2)·V is its exact share of y, so the shares
# add. The backward's r2 and dq add over key chunks the same way, dk and dv over query chunks; δ needs the whole r2.
# A chunk of queries starting at global position a against a chunk of keys starting at b is causal with
# causal_offset = a − b (query i sees key j when j <= i + causal_offset); rows that see no key of a chunk get an
# LSE of −inf and contribute nothing. With document masking each piece takes the chunks' own document ids
# (`q_document_ids`, `k_document_ids`, (B, N) each); a row sees only keys of its document, and blocks of a chunk
# pair that share no document are skipped inside the kernels.
# ----------------------------------------------------------------------------------------------------------------


def _pieces_setup(q, k, v, lam, shared_k, causal, causal_offset, softmax_scale):
    if v is not None:
        _check_common(q, k, v, lam, False, softmax_scale)
        (_check_v2_shapes if shared_k else _check_v1_shapes)(q, k, v)
    offset = k.shape[1] - q.shape[1] if causal_offset is None else int(causal_offset)
    scale = _softmax_scale(softmax_scale, q.shape[3])
    value_dim = v.shape[3] if v is not None else (q.shape[3] if shared_k else 2 * q.shape[3])
    # The pieces are the two-pass forward's and the split backward's kernels, with the table's switches.
    table = _design(q, value_dim, None)
    design = tuning.Design("twopass", "split", descriptors=table.descriptors, split_dims=table.split_dims)
    lam_rows = _lam_rows(lam, q.shape[0], q.shape[1], q.shape[2] // 2) if lam is not None else None
    return offset, scale, design, lam_rows


def diff_attn_chunk_lse(q, k, *, shared_k=False, causal=True, causal_offset=None, softmax_scale=None,
                        q_document_ids=None, k_document_ids=None):
    """Both maps' LSE of queries q against the key chunk k: (B, 2H, Nq) fp32, natural log (−inf: no key seen)."""
    offset, scale, design, _ = _pieces_setup(q, k, None, None, shared_k, causal, causal_offset, softmax_scale)
    value_dim = q.shape[3] if shared_k else 2 * q.shape[3]
    return _diff_attn_lse(_unit_stride_last(q), _unit_stride_last(k), value_dim, causal, offset, scale, shared_k,
                          design, None, _documents(k_document_ids, q, k, q_document_ids))


def diff_attn_chunk_forward(q, k, v, lam, lse, *, shared_k=False, causal=True, causal_offset=None,
                            softmax_scale=None, q_document_ids=None, k_document_ids=None):
    """The key chunk's share of y = (P1 − λ·P2)·V (B, Nq, H, Dv) in fp32, with P normalised by the full `lse`
    (B, 2H, Nq): the shares of all chunks sum to y (before the epilogue)."""
    offset, scale, design, lam_rows = _pieces_setup(q, k, v, lam, shared_k, causal, causal_offset, softmax_scale)
    out, _, _, _ = _diff_attn_forward(_unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v), lam_rows, None,
                                      causal, offset, scale, shared_k, 1e-5, 1.0, design, None,
                                      lse=lse.contiguous(), out_dtype=torch.float32,
                                      documents=_documents(k_document_ids, q, k, q_document_ids))
    return out


def diff_attn_chunk_r2(dy, q, k, v, lse, *, shared_k=False, causal=True, causal_offset=None, softmax_scale=None,
                       q_document_ids=None, k_document_ids=None):
    """The key chunk's share of r2 = rowsum(dy ∘ O2) (B, H, Nq) fp32, with the full `lse`. With r2 summed over the
    chunks, δ (B, 2H, Nq) has rows 2h: rowsum(dy ∘ y) + λ·r2 and 2h+1: −λ·r2, and dλ = −r2 (summed as λ is
    shared)."""
    lam = torch.zeros((), dtype=torch.float32, device=q.device)
    offset, scale, design, lam_rows = _pieces_setup(q, k, v, lam, shared_k, causal, causal_offset, softmax_scale)
    _, _, r2, _ = _diff_attn_preprocess(_unit_stride_last(dy), _unit_stride_last(q), _unit_stride_last(k),
                                        _unit_stride_last(v), lam_rows, _unit_stride_last(dy), lse.contiguous(), None,
                                        None, causal, offset, scale, shared_k, 1.0, design, None,
                                        documents=_documents(k_document_ids, q, k, q_document_ids))
    return r2


def diff_attn_delta(dy, y, lam, r2):
    """δ (B, 2H, Nq) fp32 of the chunk backward from dy and y (B, Nq, H, Dv), λ (0-dim, (H,) or (B, Nq, H)) and r2
    (B, H, Nq) summed over every key chunk: row 2h is rowsum(dy ∘ y) + λ·r2, row 2h+1 is −λ·r2."""
    batch, n_q, n_heads, _ = y.shape
    lam_rows = _lam_rows(lam.detach(), batch, n_q, n_heads).float().transpose(1, 2)
    dy_dot_y = (dy.float() * y.float()).sum(-1).transpose(1, 2)
    return torch.stack((dy_dot_y + lam_rows * r2, -lam_rows * r2), dim=2).flatten(1, 2).contiguous()


def diff_attn_chunk_backward(dy, q, k, v, lam, lse, delta, *, shared_k=False, causal=True, causal_offset=None,
                             softmax_scale=None, q_document_ids=None, k_document_ids=None):
    """The chunk pair's shares of dq, dk and dv in fp32, from dy (the gradient of y), the full `lse` and `delta`."""
    offset, scale, design, lam_rows = _pieces_setup(q, k, v, lam, shared_k, causal, causal_offset, softmax_scale)
    return _diff_attn_grads(_unit_stride_last(dy), _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v),
                            lam_rows, lse.contiguous(), delta.contiguous(), causal, offset, scale, shared_k, design,
                            None, grad_dtype=torch.float32,
                            documents=_documents(k_document_ids, q, k, q_document_ids))
