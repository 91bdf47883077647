"""The Triton helpers that the forward and backward kernels share (forward.py, backward.py): tiles loaded through
pointers or tensor descriptors, a head dim as one block or two, the causal and document masks.

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
"""

import triton
import triton.language as tl


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
