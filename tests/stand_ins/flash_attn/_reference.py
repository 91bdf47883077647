"""The stand-ins' computation: the entry points of flash-attn 2 and flash-attn-4 that this project calls, with the
libraries' argument order, layouts, GQA pairing, bottom-right causal mask, return values and refusals (flash-attn 2:
equal head dims; flash-attn-4: GQA only with equal head dims, as its Hopper backward asserts; both: a unit stride in
the last dim), from the materialised map in the inputs' dtype. Every call appends (library, entry, q, k, v shapes) to
CALLS; every flash-attn-4 call also appends (q/k head dim, v head dim, forward tile, backward tile) to TILES, the sm_90
tiles its interface module chooses (cute/interface.py) at the time of the call."""

import math

import torch

CALLS = []
TILES = []
# flash-attn-4's backward calls (the custom operator's, diff_transformer/models/attention/flash_attn4_op.py)
BACKWARD = []


def _attention(q, k, v, softmax_scale, causal):
    """One sequence: q (s_q, h, d), k (s_k, hk, d), v (s_k, hk, dv) -> (s_q, h, dv), lse (h, s_q)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the last dimension of q, k and v must be contiguous")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads or v.shape[1] != kv_heads:
        raise ValueError(f"{heads} query heads against {kv_heads} key and {v.shape[1]} value heads")
    k, v, scores, _ = _scores(q, k, v, softmax_scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v), lse


def _scores(q, k, v, softmax_scale, causal):
    """k and v repeated to the query heads (query head h reads KV head h // group), the scaled and masked scores
    (h, s_q, s_k) and the scale."""
    heads, kv_heads = q.shape[1], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        s_q, s_k = q.shape[0], k.shape[0]
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(diagonal=s_k - s_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    return k, v, scores, scale


def _attention_backward(q, k, v, dout, softmax_scale, causal):
    """The gradients of one sequence's attention (q, k, v and dout as in ``_attention``), written out from the map: a
    custom operator's backward runs where autograd records nothing."""
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    kr, vr, scores, scale = _scores(q, k, v, softmax_scale, causal)
    probs = torch.softmax(scores, dim=-1)
    dv = torch.einsum("hqk,qhd->khd", probs, dout)
    dprobs = torch.einsum("qhd,khd->hqk", dout, vr)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True)) * scale
    dq = torch.einsum("hqk,khd->qhd", dscores, kr)
    dk = torch.einsum("hqk,qhd->khd", dscores, q)
    return dq, dk.unflatten(1, (kv_heads, group)).sum(2), dv.unflatten(1, (kv_heads, group)).sum(2)


def _batched(q, k, v, softmax_scale, causal):
    outs, lses = zip(*(_attention(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    outs, lses = [], []
    for i in range(len(cu_seqlens_q) - 1):
        (a, e), (ka, ke) = cu_seqlens_q[i:i + 2].tolist(), cu_seqlens_k[i:i + 2].tolist()
        out, lse = _attention(q[a:e], k[ka:ke], v[ka:ke], softmax_scale, causal)
        outs.append(out), lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


# flash-attn 2 (flash_attn/flash_attn_interface.py): equal head dims, returns the output alone
def fa2_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **unused):
    CALLS.append(("flash_attn", "func", q.shape, k.shape, v.shape))
    assert dropout_p == 0.0 and not unused, unused
    if v.shape[-1] != q.shape[-1]:
        raise RuntimeError("FlashAttention forward only supports head dimension equal for q, k and v")
    return _batched(q, k, v, softmax_scale, causal)[0]


def fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, **unused):
    CALLS.append(("flash_attn", "varlen", q.shape, k.shape, v.shape))
    assert dropout_p == 0.0 and not unused, unused
    if v.shape[-1] != q.shape[-1]:
        raise RuntimeError("FlashAttention forward only supports head dimension equal for q, k and v")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)[0]


# flash-attn-4 (flash_attn/cute/interface.py): q/k and v head dims may differ; returns (out, lse)
def _fa4_checks(q, k, v, causal):
    if k.shape[-2] != q.shape[-2] and v.shape[-1] != q.shape[-1]:  # flash_bwd_sm90.py's assertion
        raise AssertionError("GQA backward requires head_dim == head_dim_v")
    from flash_attn.cute import interface  # looked up at each call, as the library does

    TILES.append((q.shape[-1], v.shape[-1], interface._tile_size_fwd_sm90(q.shape[-1], v.shape[-1], causal, False),
                  interface._tile_size_bwd_sm90(q.shape[-1], v.shape[-1], causal, False)))


def fa4_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, return_lse=False,
             **unused):
    CALLS.append(("flash_attn4", "func", q.shape, k.shape, v.shape))
    assert qv is None and gather_kv_indices is None and not unused, unused
    _fa4_checks(q, k, v, causal)
    out, lse = _batched(q, k, v, softmax_scale, causal)
    return out, lse.float()  # with or without return_lse, as the library: its LSE in fp32


def fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False, **unused):
    """flash-attn-4's ``interface._flash_attn_bwd`` as this project calls it: (dq, dk, dv)."""
    BACKWARD.append(("flash_attn4", q.shape, k.shape, v.shape))
    assert not unused, unused
    _fa4_checks(q, k, v, causal)
    return tuple(torch.stack(g) for g in zip(*(_attention_backward(q[b], k[b], v[b], dout[b], softmax_scale, causal)
                                                for b in range(q.shape[0]))))


def fa4_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
               softmax_scale=None, causal=False, **unused):
    CALLS.append(("flash_attn4", "varlen", q.shape, k.shape, v.shape))
    assert qv is None and cu_seqlens_q is not None and cu_seqlens_k is not None and not unused, unused
    _fa4_checks(q, k, v, causal)
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out, lse.float()
