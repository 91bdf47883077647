"""The fused kernels' pieces for context parallelism (ring attention), no autograd.

The two-pass forward splits over key chunks without rescaling: the LSE of every chunk merges into the full LSE
(logsumexp over chunks), and with the full LSE each chunk's (P1 − λ·P2)·V is its exact share of y, so the shares
add. The backward's r2 and dq add over key chunks the same way, dk and dv over query chunks; δ needs the whole r2.
A chunk of queries starting at global position a against a chunk of keys starting at b is causal with
causal_offset = a − b (query i sees key j when j <= i + causal_offset); rows that see no key of a chunk get an
LSE of −inf and contribute nothing. With document masking each piece takes the chunks' own document ids
(`q_document_ids`, `k_document_ids`, (B, N) each); a row sees only keys of its document, and blocks of a chunk
pair that share no document are skipped inside the kernels.
"""

import torch

from kernels.diff_attn import tuning
from kernels.diff_attn.function import (
    _check_common,
    _check_v1_shapes,
    _check_v2_shapes,
    _documents,
    _softmax_scale,
    _unit_stride_last,
)
from kernels.diff_attn.launch import (
    _design,
    _diff_attn_forward,
    _diff_attn_grads,
    _diff_attn_lse,
    _diff_attn_preprocess,
    _lam_rows,
)


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
