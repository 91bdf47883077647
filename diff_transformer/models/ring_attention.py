"""Ring attention: causal softmax attention over a sequence split across a context-parallel (CP) group.

**Layout (load-balanced causal sharding).** A sequence of S tokens is cut into 2N chunks of c = S / 2N; CP rank r of
N holds chunks r and 2N−1−r, concatenated (:func:`load_balanced_indices`), so every rank does the same causal work.
megatron-core's rotary embedding picks the same two chunks of the positions for the rank
(``rope_utils.get_pos_emb_on_this_cp_rank``), and ``training.steps`` hands each rank these chunks of the batch.

**The ring.** K and V travel around the group: at step i rank r holds the K/V of rank r − i and starts sending them
to rank r + 1 (and receiving the next block) before it computes the block, so the transfer overlaps the compute
(:func:`diff_transformer.distributed.ring_exchange`). With the load-balanced layout the block of step i is
- i = 0: the local queries against the local keys, causal (both chunks ascend in position);
- source < r: every local query against the source's first chunk, no mask (both local chunks come after it);
- source > r: only the second local chunk against both of the source's chunks, no mask (the first comes before them).
Each softmax map keeps its own log-sum-exp; a block's partial output is merged into the map's running output by LSE
(:func:`_merge`), so after N steps every map's output is exactly its softmax over the whole causal prefix. The
callers subtract after the merge: DIFF V1 runs two maps (query heads 2h and 2h+1 against key heads 2g and 2g+1, over
the shared 2d-wide V), DIFF V2 one map of 2H query heads over shared K/V heads followed by its per-token subtraction,
the baseline one map. The backward (a custom ``autograd.Function``) walks the same blocks, each recomputing its
probabilities from the merged output and LSE, and passes dK and dV around the ring with K and V, so each rank ends with
the gradients of its own K and V.

**The block primitive** (:func:`block_forward`, :func:`block_backward`): one map, a query block against a key block,
causal (square, aligned) or not; the forward returns the output and the LSE, the backward takes the merged output and
LSE. ``eager`` is plain PyTorch (the reference; fp32, or fp64 for fp64 inputs); ``sdpa`` calls PyTorch's
LSE-returning attention ops: ``_scaled_dot_product_flash_attention_for_cpu`` on a CPU (equal head sizes only: a V
twice as wide as Q and K, DIFF V1's, is attended in halves with the same LSE), and on CUDA
``_scaled_dot_product_flash_attention`` (fp16/bf16, head sizes up to 256, V in pieces as on a CPU) or else
``_scaled_dot_product_efficient_attention``, with their backward ops. (The efficient op's bf16 backward with DIFF V1's
2d-wide V gave NaN in dQ on an H100, torch 2.11: tests/test_context_parallel.py's CUDA test.)

Tensors here are ``(batch, heads, local sequence, head size)``; a map's key heads are a slice of K's heads (GQA: a
query head i reads key and value head i // (query heads / key heads)).

**DIFF's fused ring** (:func:`differential_ring_attention`, ``model.attention_backend=triton``): the fused kernel's
context-parallel pieces (``kernels.diff_attn``, the kernel's own layout ``(batch, local sequence, heads, size)``) in
rounds of the same ring and block schedule, the diagonal block causal with offset 0 and the others unmasked. The
forward is two rounds: K alone, gathering both maps' LSE over every key block (merged by logaddexp), then K and V,
accumulating y = Σ_blocks (P1/l1 − λ·P2/l2)·V (with the merged LSE each block's share is exact, so the shares add).
The backward is two rounds: K and V for r2 = Σ_blocks rowsum(dy ∘ O2), then, with δ from r2, K and V again, each block
adding its dQ locally and its dK, dV travelling back with the block. It returns y before the DIFF epilogue, which the
caller applies once (``models.attention.epilogue``, the maps already combined).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from diff_transformer.distributed import ring_exchange
from diff_transformer.models.documents import document_segments, documents_overlap

IMPLEMENTATIONS = ("eager", "sdpa")  # the single-map block primitives; DIFF V1 and V2 also ring with "triton"


# ------------------------------------------------------------------------------------------------------------------
# The load-balanced layout
# ------------------------------------------------------------------------------------------------------------------
def check_context_parallel_length(seq_length: int, cp: int) -> None:
    if seq_length % (2 * cp):
        raise ValueError(
            f"model.seq_length={seq_length} is not divisible by 2*parallel.cp={2 * cp} (each context-parallel rank "
            "holds two equal chunks of the sequence)"
        )


def load_balanced_indices(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the full sequence that CP rank ``rank`` of ``cp`` holds: chunks rank and 2·cp−1−rank of 2·cp."""
    check_context_parallel_length(seq_length, cp)
    c = seq_length // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def context_parallel_chunks(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim`` (the sequence), concatenated."""
    if cp == 1:
        return tensor
    index = load_balanced_indices(tensor.shape[dim], cp, rank).to(tensor.device)
    return tensor.index_select(dim, index)


# ------------------------------------------------------------------------------------------------------------------
# The block primitive: one map, a query block against a key block
# ------------------------------------------------------------------------------------------------------------------
def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _causal_scores(q, k, scale, causal, same_document=None):
    dtype = _accumulation_dtype(q)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    if same_document is not None:
        scores = scores.masked_fill(~same_document, float("-inf"))
    return scores


def _eager_forward(q, k, v, scale, causal, same_document=None):
    scores = _causal_scores(q, k, scale, causal, same_document)
    lse = torch.logsumexp(scores, dim=-1)
    # a row that sees no key of the block (another document) gets LSE −inf and an output of 0, not NaN
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(scores - finite_lse[..., None]), v.to(scores.dtype)), lse


def _eager_backward(grad_out, q, k, v, out, lse, scale, causal, same_document=None):
    dtype = _accumulation_dtype(q)
    p = torch.exp(_causal_scores(q, k, scale, causal, same_document) - lse.to(dtype)[..., None])
    grad_out = grad_out.to(dtype)
    grad_v = torch.matmul(p.transpose(-1, -2), grad_out)
    delta = (grad_out * out.to(dtype)).sum(-1, keepdim=True)  # rowsum(dO ∘ O) of the merged output
    grad_scores = p * (torch.matmul(grad_out, v.to(dtype).transpose(-1, -2)) - delta)
    grad_q = torch.matmul(grad_scores, k.to(dtype)) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.to(dtype)) * scale
    return grad_q, grad_k, grad_v


def _value_pieces(q, v) -> Optional[int]:
    """How many head-size pieces V splits into for a kernel that needs equal head sizes (None: it cannot)."""
    d, dv = q.shape[-1], v.shape[-1]
    return dv // d if dv % d == 0 else None


def _flash_forward(q, k, v, scale, causal):
    """The flash op of q's device: (out, lse) for equal head sizes."""
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(grad_out, q, k, v, out, lse, scale, causal):
    if q.is_cuda:
        no_dropout = torch.empty((), dtype=torch.long, device=q.device)  # the RNG state is read only with dropout
        sq, sk = q.shape[-2], k.shape[-2]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.float().contiguous(), None, None, sq, sk, 0.0, causal, no_dropout,
            no_dropout, scale=scale,
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse.to(q.dtype), 0.0, causal, scale=scale)


def _uses_flash(q, v) -> bool:
    """Whether the flash ops compute this block: in pieces of V as wide as Q and K (DIFF V1's 2d-wide V in halves,
    each with the same scores and LSE). On CUDA: fp16 and bf16, head sizes up to 256 (else the memory-efficient op,
    which takes unequal head sizes); on a CPU any dtype (else the eager block)."""
    if _value_pieces(q, v) is None:
        return False
    return not q.is_cuda or (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256)


def _sdpa_forward(q, k, v, scale, causal):
    if _uses_flash(q, v):
        outs = []
        for v_piece in v.chunk(_value_pieces(q, v), dim=-1):  # the same scores, so the same LSE, for every piece
            out, lse = _flash_forward(q, k, v_piece, scale, causal)
            outs.append(out)
        return torch.cat(outs, dim=-1), lse
    if not q.is_cuda:
        return _eager_forward(q, k, v, scale, causal)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]]


def _sdpa_backward(grad_out, q, k, v, out, lse, scale, causal):
    if _uses_flash(q, v):
        dtype = q.dtype
        grad_q = grad_k = None
        grad_v = []
        # dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)) is a sum over V's columns, so the pieces' dQ and dK add up
        pieces = _value_pieces(q, v)
        for g, o, v_piece in zip(grad_out.to(dtype).chunk(pieces, -1), out.to(dtype).chunk(pieces, -1),
                                 v.chunk(pieces, -1)):
            dq, dk, dv = _flash_backward(g.contiguous(), q, k, v_piece, o.contiguous(), lse, scale, causal)
            grad_q = dq if grad_q is None else grad_q + dq
            grad_k = dk if grad_k is None else grad_k + dk
            grad_v.append(dv)
        return grad_q, grad_k, torch.cat(grad_v, dim=-1)
    if not q.is_cuda:
        return _eager_backward(grad_out, q, k, v, out, lse, scale, causal)
    out, grad_out = out.to(q.dtype).contiguous(), grad_out.to(q.dtype).contiguous()
    no_dropout = torch.empty((), dtype=torch.long, device=q.device)
    lse = lse.float().contiguous()
    padded = lse.new_zeros(*lse.shape[:-1], _lse_rows(q))
    padded[..., : lse.shape[-1]] = lse
    grad_q, grad_k, grad_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, padded, no_dropout, no_dropout, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return grad_q, grad_k, grad_v


def _lse_rows(q) -> int:
    """Rows of the efficient kernel's LSE: the query length rounded up to 32 (ROCm: the query length)."""
    sq = q.shape[-2]
    return sq if torch.version.hip else math.ceil(sq / 32) * 32


def _shared_documents(q_ids, k_ids):
    """The sub-blocks of a block in which queries and keys share a document: (sample, query rows, key columns), each
    one document's contiguous rows and columns (ids are non-decreasing)."""
    blocks = []
    q_ids, k_ids = q_ids.cpu(), k_ids.cpu()  # one host copy each
    for i, (q_spans, k_spans) in enumerate(zip(document_segments(q_ids), document_segments(k_ids))):
        k_by_document = {int(k_ids[i, a]): (a, e) for a, e in k_spans}
        for a, e in q_spans:
            keys = k_by_document.get(int(q_ids[i, a]))
            if keys is not None:
                blocks.append((i, slice(a, e), slice(*keys)))
    return blocks


def _one_document(q_ids, k_ids) -> bool:
    """Whether each sample's queries and keys of the block all lie in one document: then the mask changes nothing."""
    first = q_ids[:, :1]
    return bool((q_ids == first).all() and (k_ids == first).all())


def block_forward(q, k, v, scale: float, causal: bool, impl: str, q_ids=None,
                  k_ids=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale [+ causal mask])·v and its LSE (natural log, fp32 or fp64) for one map; q (b, h, sq, d),
    k (b, h, sk, d), v (b, h, sk, dv), the same heads (GQA already expanded); causal blocks are square. With the
    document ids of the queries and keys ((b, sq), (b, sk)), a query sees only keys of its document (LSE −inf and
    output 0 where it sees none): ``eager`` masks the block, ``sdpa`` runs the kernel on each shared document's
    sub-block."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"ring attention implementation {impl!r} is unknown; use one of {', '.join(IMPLEMENTATIONS)}")
    if impl == "eager":
        mask = (q_ids[:, :, None] == k_ids[:, None, :]).unsqueeze(1) if q_ids is not None else None
        return _eager_forward(q, k, v, scale, causal, mask)
    primitive = _sdpa_forward
    if q_ids is None or _one_document(q_ids, k_ids):
        return primitive(q, k, v, scale, causal)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_accumulation_dtype(q), device=q.device)
    for i, rows, cols in _shared_documents(q_ids, k_ids):
        o, l = primitive(q[i:i + 1, :, rows], k[i:i + 1, :, cols], v[i:i + 1, :, cols], scale, causal)
        out[i:i + 1, :, rows], lse[i:i + 1, :, rows] = o.to(out.dtype), l.to(lse.dtype)
    return out, lse


def block_backward(grad_out, q, k, v, out, lse, scale: float, causal: bool, impl: str, q_ids=None, k_ids=None):
    """(dq, dk, dv) of one block, given the map's merged output ``out`` and LSE over every key block: the block's
    share of the gradients of the whole attention (with document ids, as :func:`block_forward` masks)."""
    if impl == "eager":
        mask = (q_ids[:, :, None] == k_ids[:, None, :]).unsqueeze(1) if q_ids is not None else None
        return _eager_backward(grad_out, q, k, v, out, lse, scale, causal, mask)
    primitive = _sdpa_backward
    if q_ids is None or _one_document(q_ids, k_ids):
        return primitive(grad_out, q, k, v, out, lse, scale, causal)
    dtype = _accumulation_dtype(q)
    grad_q, grad_k, grad_v = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))
    for i, rows, cols in _shared_documents(q_ids, k_ids):
        dq, dk, dv = primitive(grad_out[i:i + 1, :, rows], q[i:i + 1, :, rows], k[i:i + 1, :, cols],
                               v[i:i + 1, :, cols], out[i:i + 1, :, rows], lse[i:i + 1, :, rows], scale, causal)
        grad_q[i:i + 1, :, rows] += dq
        grad_k[i:i + 1, :, cols] += dk
        grad_v[i:i + 1, :, cols] += dv
    return grad_q, grad_k, grad_v


# ------------------------------------------------------------------------------------------------------------------
# The ring
# ------------------------------------------------------------------------------------------------------------------
class ProcessGroupRing:
    """A context-parallel process group seen as a ring: this rank's place, and one step's exchange with its
    neighbours (group rank + 1 receives, group rank − 1 sends)."""

    def __init__(self, group):
        self.group = group
        self.rank = torch.distributed.get_rank(group)
        self.size = torch.distributed.get_world_size(group)

    def exchange(self, tensors: Sequence[torch.Tensor]):
        return ring_exchange(tensors, self.group)


class LoopbackRing:
    """Rank ``rank`` of a ring of ``size`` whose exchange hands the rank its own tensors back: the blocks, masks and
    kernels of that rank's schedule without a group or communication (``model.attention_backend=auto`` times a CP
    rank's attention with it on one GPU; its numbers are meaningless)."""

    def __init__(self, size: int, rank: int = 0):
        self.rank, self.size = rank, size

    def exchange(self, tensors: Sequence[torch.Tensor]):
        received = [t.clone() for t in tensors]  # a received block's own buffers, as ring_exchange allocates them

        class Received:
            def wait(self):
                return received

        return Received()


def _block_layout(step: int, rank: int, size: int, chunk: int) -> Tuple[slice, slice, bool]:
    """(local query rows, key rows of the visiting block, causal) of ring step ``step`` on ``rank``."""
    if step == 0:
        return slice(None), slice(None), True
    source = (rank - step) % size
    if source < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


def _expand_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_expand_heads``: each key head's share summed over the query heads that read it."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, rows: slice):
    """Merge a block's partial output into a map's running output on ``rows``, in place, by their LSEs."""
    old_out, old_lse = out[..., rows, :], lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    old_out.mul_(torch.exp(old_lse - new_lse)[..., None]).add_(
        block_out.to(out.dtype) * torch.exp(block_lse - new_lse)[..., None]
    )
    old_lse.copy_(new_lse)


def _ring_round(ring, tensors: Sequence[torch.Tensor], chunk: int, visit) -> None:
    """One round of the ring: at step i, ``visit(step, rows, cols, causal, block)`` with the block of rank r − i
    (this rank's own ``tensors`` at step 0) while the next block travels; ``chunk``: the positions of one chunk."""
    block = tuple(tensors)
    for step in range(ring.size):
        pending = ring.exchange(block) if step + 1 < ring.size else None  # the next block travels during this one
        visit(step, *_block_layout(step, ring.rank, ring.size, chunk), block)
        if pending is not None:
            block = tuple(pending.wait())


def _ring_round_with_gradients(ring, tensors: Sequence[torch.Tensor], chunk: int, visit) -> List[torch.Tensor]:
    """A round of the ring whose ``visit`` (as in :func:`_ring_round`) returns this rank's share of the gradients of
    the visiting block's tensors (fp32, their shapes); the shares travel with the block, each rank adding its own,
    and the gradients of this rank's ``tensors``, summed over every rank, come back at the end."""
    block = tuple(tensors)
    incoming = None  # the gradients of the visiting block, accumulated by the ranks it visited before
    for step in range(ring.size):
        pending = ring.exchange(block) if step + 1 < ring.size else None
        grads = list(visit(step, *_block_layout(step, ring.rank, ring.size, chunk), block))
        if incoming is not None:
            for grad, received in zip(grads, incoming.wait()):
                grad += received
        if pending is not None:
            block = tuple(pending.wait())
        if ring.size == 1:
            return grads
        incoming = ring.exchange(grads)  # to the next rank, which holds this block next
    return list(incoming.wait())  # this rank's own block's gradients, back from their round


def _travelling(key, value, document_ids):
    """What goes around the ring: K and V, and with document masking the keys' document ids."""
    return (key, value) if document_ids is None else (key, value, document_ids)


def _block_documents(document_ids, block, rows, cols):
    """(query ids, key ids) of a block, None without document masking; False when the block's queries and keys share
    no document (the block is skipped)."""
    if document_ids is None:
        return None
    q_ids, k_ids = document_ids[:, rows], block[2][:, cols]
    return (q_ids, k_ids) if documents_overlap(q_ids, k_ids) else False


def _ring_forward(ring, impl, scale, key_heads, key, value, queries, document_ids):
    acc = _accumulation_dtype(key)
    outs: List[Optional[torch.Tensor]] = [None] * len(queries)
    lses: List[Optional[torch.Tensor]] = [None] * len(queries)

    def visit(step, rows, cols, causal, block):
        ids = _block_documents(document_ids, block, rows, cols)
        if ids is False:
            return
        k_block, v_block = block[0][..., cols, :], block[1][..., cols, :]
        for m, q in enumerate(queries):
            k_map = k_block[:, key_heads[m]]
            groups = q.shape[1] // k_map.shape[1]
            out, lse = block_forward(q[..., rows, :], _expand_heads(k_map, groups), _expand_heads(v_block, groups),
                                     scale, causal, impl, *(ids or ()))
            if step == 0:  # the diagonal block covers every local query (each sees itself)
                outs[m], lses[m] = out.to(acc), lse.to(acc)
            else:
                _merge(outs[m], lses[m], out, lse.to(acc), rows)

    _ring_round(ring, _travelling(key, value, document_ids), key.shape[-2] // 2, visit)
    return [o.to(q.dtype) for o, q in zip(outs, queries)], lses


def _ring_backward(ring, impl, scale, key_heads, key, value, queries, outs, lses, grad_outs, document_ids):
    acc = _accumulation_dtype(key)
    grad_queries = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in queries]

    def visit(step, rows, cols, causal, block):
        grad_k = torch.zeros(key.shape, dtype=acc, device=key.device)
        grad_v = torch.zeros(value.shape, dtype=acc, device=value.device)
        ids = _block_documents(document_ids, block, rows, cols)
        if ids is False:
            return grad_k, grad_v
        k_block, v_block = block[0][..., cols, :], block[1][..., cols, :]
        for m, q in enumerate(queries):
            if grad_outs[m] is None:
                continue
            k_map = k_block[:, key_heads[m]]
            groups = q.shape[1] // k_map.shape[1]
            dq, dk, dv = block_backward(
                grad_outs[m][..., rows, :], q[..., rows, :], _expand_heads(k_map, groups),
                _expand_heads(v_block, groups), outs[m][..., rows, :], lses[m][..., rows], scale, causal, impl,
                *(ids or ()),
            )
            grad_queries[m][..., rows, :] += dq
            grad_k[:, key_heads[m]][..., cols, :] += _sum_groups(dk, groups)
            grad_v[..., cols, :] += _sum_groups(dv, groups)
        return grad_k, grad_v

    grad_k, grad_v = _ring_round_with_gradients(ring, _travelling(key, value, document_ids), key.shape[-2] // 2,
                                                visit)
    return grad_queries, grad_k, grad_v


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, impl, scale, key_heads, document_ids, key, value, *queries):
        outs, lses = _ring_forward(ring, impl, scale, key_heads, key, value, queries, document_ids)
        ctx.ring, ctx.impl, ctx.scale, ctx.key_heads, ctx.maps = ring, impl, scale, key_heads, len(queries)
        ctx.document_ids = document_ids
        ctx.save_for_backward(key, value, *queries, *outs, *lses)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        key, value, *rest = ctx.saved_tensors
        m = ctx.maps
        queries, outs, lses = rest[:m], rest[m:2 * m], rest[2 * m:]
        grad_queries, grad_k, grad_v = _ring_backward(
            ctx.ring, ctx.impl, ctx.scale, ctx.key_heads, key, value, queries, outs, lses, grad_outs, ctx.document_ids
        )
        return (None, None, None, None, None, grad_k.to(key.dtype), grad_v.to(value.dtype),
                *(g.to(q.dtype) for g, q in zip(grad_queries, queries)))


def ring_attention(
    queries: Sequence[torch.Tensor], key: torch.Tensor, value: torch.Tensor, key_heads: Sequence[slice], scale: float,
    ring, impl: str, document_ids: Optional[torch.Tensor] = None,
) -> List[torch.Tensor]:
    """Causal attention of each map over the whole sequence split across ``ring``; returns each map's output.

    ``queries[m]`` (b, heads_m, local s, d) attends with the key heads ``key[:, key_heads[m]]`` of K (b, key heads,
    local s, d) over V (b, value heads, local s, dv), the value heads shared by every map and equal in number to each
    map's key heads. The local sequence is this rank's two load-balanced chunks (:func:`context_parallel_chunks`).
    With ``document_ids`` (b, local s), this rank's tokens' documents, attention stays within each document: the ids
    travel around the ring with K and V, and a block whose queries and keys share no document is skipped."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"ring attention implementation {impl!r} is unknown; use one of {', '.join(IMPLEMENTATIONS)}")
    if key.shape[-2] % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; its {key.shape[-2]} positions are odd")
    return list(_RingAttention.apply(ring, impl, scale, tuple(key_heads), document_ids, key, value, *queries))


# ------------------------------------------------------------------------------------------------------------------
# DIFF's fused ring: the fused kernel's context-parallel pieces (kernels/diff_attn) in rounds of the same ring
# ------------------------------------------------------------------------------------------------------------------
def fused_kernel_package():
    """``kernels.diff_attn`` (the fused kernel and its context-parallel pieces), or a clear error without it."""
    try:
        import kernels.diff_attn as pieces
    except ImportError as err:
        raise ImportError(
            "model.attention_backend=triton needs the fused kernel package `kernels` (kernels/diff_attn); it could not "
            f"be imported ({err}); use model.attention_backend=sdpa"
        ) from err
    return pieces


def _query_rows(lam: torch.Tensor, rows: slice) -> torch.Tensor:
    """λ of the query rows ``rows``: V2's per token (B, s, H) sliced, V1's (one, or one per head) as it is."""
    return lam[:, rows] if lam.dim() == 3 else lam


def _piece_documents(document_ids, block, rows, cols):
    """The fused pieces' document arguments for a block (none without document masking): the queries' ids and the
    visiting keys' (the last tensor travelling with K); the kernels skip the tiles that share no document."""
    if document_ids is None:
        return {}
    return dict(q_document_ids=document_ids[:, rows], k_document_ids=block[-1][:, cols])


def _with_documents(tensors, document_ids):
    """A round's travelling tensors, the keys' document ids last with document masking."""
    return tuple(tensors) + ((document_ids,) if document_ids is not None else ())


def _differential_ring_forward(ring, pieces, scale, shared_k, q, k, v, lam, document_ids):
    chunk = k.shape[1] // 2
    options = dict(shared_k=shared_k, causal_offset=0, softmax_scale=scale)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)

    def gather_lse(step, rows, cols, causal, block):
        block_lse = pieces.diff_attn_chunk_lse(q[:, rows], block[0][:, cols], causal=causal, **options,
                                               **_piece_documents(document_ids, block, rows, cols))
        if step == 0:  # the diagonal block covers every local query
            lse.copy_(block_lse)
        else:
            lse[..., rows] = torch.logaddexp(lse[..., rows], block_lse)

    _ring_round(ring, _with_documents((k,), document_ids), chunk, gather_lse)  # round 1: K, each map's LSE
    y = torch.zeros(*q.shape[:2], q.shape[2] // 2, v.shape[3], dtype=torch.float32, device=q.device)

    def accumulate(step, rows, cols, causal, block):
        y[:, rows] += pieces.diff_attn_chunk_forward(q[:, rows], block[0][:, cols], block[1][:, cols],
                                                     _query_rows(lam, rows), lse[..., rows], causal=causal, **options,
                                                     **_piece_documents(document_ids, block, rows, cols))

    _ring_round(ring, _with_documents((k, v), document_ids), chunk, accumulate)  # round 2: each block's share of y
    return y, lse


def _differential_ring_backward(ring, pieces, scale, shared_k, q, k, v, lam, y, lse, grad_y, document_ids):
    chunk = k.shape[1] // 2
    options = dict(shared_k=shared_k, causal_offset=0, softmax_scale=scale)
    r2 = torch.zeros(q.shape[0], q.shape[2] // 2, q.shape[1], dtype=torch.float32, device=q.device)

    def gather_r2(step, rows, cols, causal, block):
        r2[..., rows] += pieces.diff_attn_chunk_r2(grad_y[:, rows], q[:, rows], block[0][:, cols], block[1][:, cols],
                                                   lse[..., rows], causal=causal, **options,
                                                   **_piece_documents(document_ids, block, rows, cols))

    _ring_round(ring, _with_documents((k, v), document_ids), chunk, gather_r2)  # round 1: r2 = rowsum(dy ∘ O2)
    delta = pieces.diff_attn_delta(grad_y, y, lam, r2)
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def gradients(step, rows, cols, causal, block):
        dq, dk, dv = pieces.diff_attn_chunk_backward(
            grad_y[:, rows], q[:, rows], block[0][:, cols], block[1][:, cols], _query_rows(lam, rows),
            lse[..., rows], delta[..., rows], causal=causal, **options,
            **_piece_documents(document_ids, block, rows, cols),
        )
        grad_q[:, rows] += dq
        grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        grad_k[:, cols], grad_v[:, cols] = dk, dv
        return grad_k, grad_v

    grad_k, grad_v = _ring_round_with_gradients(ring, _with_documents((k, v), document_ids), chunk,
                                                gradients)  # round 2: dK, dV travel back
    grad_lam = (-r2.transpose(1, 2)).sum_to_size(lam.shape)  # y = O1 − λ·O2: dλ = −r2, summed as λ is shared
    return grad_q, grad_k, grad_v, grad_lam


class _DifferentialRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, scale, shared_k, document_ids, q, k, v, lam):
        pieces = fused_kernel_package()
        y, lse = _differential_ring_forward(ring, pieces, scale, shared_k, q, k, v, lam, document_ids)
        ctx.ring, ctx.scale, ctx.shared_k, ctx.pieces = ring, scale, shared_k, pieces
        ctx.document_ids = document_ids
        ctx.save_for_backward(q, k, v, lam, y, lse)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, lam, y, lse = ctx.saved_tensors
        # the kernels' products take dy in the inputs' dtype (fp32 dy against bf16 V does not compile); δ reads the same
        grad_y = grad_y.to(q.dtype)
        grad_q, grad_k, grad_v, grad_lam = _differential_ring_backward(
            ctx.ring, ctx.pieces, ctx.scale, ctx.shared_k, q, k, v, lam, y, lse, grad_y, ctx.document_ids
        )
        return (None, None, None, None, grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype),
                grad_lam.to(lam.dtype))


def differential_ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, scale: float, ring, shared_k: bool = False,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DIFF's causal attention over the whole sequence split across ``ring``, on the fused kernel's pieces:
    y = O1 − λ·O2 (B, local s, H, Dv) in fp32, before the epilogue; differentiable in q, k, v and λ.

    q (B, s, 2H, d), k, v and λ in the layouts of ``kernels.diff_flash_attn`` (V1: k (B, s, 2Hkv, d), v (B, s, Hkv,
    2d), λ 0-dim or (H,)) or, with ``shared_k``, of ``kernels.diff_flash_attn_v2`` (k, v (B, s, Hkv, d), λ (B, s, H));
    the local sequence is this rank's two load-balanced chunks (:func:`context_parallel_chunks`). With
    ``document_ids`` (B, local s) attention stays within each document: the keys' ids travel with K (and V), and the
    kernels skip the tiles of a block whose queries and keys share no document."""
    if k.shape[1] % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; its {k.shape[1]} positions are odd")
    if document_ids is not None:
        document_ids = document_ids.to(torch.int32).contiguous()
    return _DifferentialRingAttention.apply(ring, scale, shared_k, document_ids, q, k, v, lam)
