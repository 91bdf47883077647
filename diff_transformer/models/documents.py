"""The documents of packed samples, as the model sees them: which document each token belongs to (the attention stays
within it) and, optionally, each token's RoPE position within its document.

A micro-batch's documents travel as :class:`PackedDocuments`, megatron-core's ``PackedSeqParams`` slot (GPTModel hands
it to every layer's SelfAttention and on to the core attention) in the ``sbhd`` layout: the tensors keep their
[s, b, ...] shape and only the per-token ids say where documents start. Ids are non-decreasing along a sample (a
document's tokens are contiguous), which every kernel relies on: the keys a query sees are one contiguous run, from
its document's first token to itself.

What each backend makes of the ids (never an N×N mask at long N):

- ``eager`` and the blockwise map controls: the mask of their materialised (block of the) map, same document and
  causal;
- ``sdpa``: one causal library call per document (:func:`document_segments`), each exactly the document run alone;
  on a GPU in fp16/bf16 PyTorch's variable-length FlashAttention over all documents at once (``cu_seqlens``);
- ``flash_attn`` and ``flash_attn4``: the library's variable-length entry over the same ``cu_seqlens``;
- ``triton``: the fused kernel reads the ids per tile and skips key and query blocks outside the documents;
- the context-parallel ring: each chunk's ids travel with its K and V; a block with no document in common is skipped.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclasses.dataclass
class PackedDocuments(PackedSeqParams):
    """This rank's tokens of a micro-batch of packed samples: ``document_ids`` (b, s) int32, the document of each token
    within its sample (None: attention crosses documents), and ``position_ids`` (b, s), RoPE positions restarting
    with each document (None: megatron's positions from the sample start). ``max_seqlen_q``/``max_seqlen_kv`` hold
    the whole sequence's length, from which megatron-core sizes RoPE before splitting it over context parallelism."""

    qkv_format: str = "sbhd"
    document_ids: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    _segments: Optional[List[List[Tuple[int, int]]]] = dataclasses.field(default=None, repr=False)
    _cu_seqlens: Optional[Tuple[torch.Tensor, int]] = dataclasses.field(default=None, repr=False)

    def segments(self) -> List[List[Tuple[int, int]]]:
        """Per sample, the [start, end) of each document among this rank's tokens (one host sync, then cached for
        every layer of the micro-batch)."""
        if self._segments is None:
            self._segments = document_segments(self.document_ids)
        return self._segments

    def single_document(self) -> bool:
        """Whether every sample is one document: then the mask changes nothing and the unmasked path runs."""
        return all(len(spans) == 1 for spans in self.segments())

    def cu_seqlens(self) -> Tuple[torch.Tensor, int]:
        """(cumulative document lengths over the flattened (b·s) tokens, int32 on the ids' device; the longest
        document): the variable-length kernels' description of the micro-batch."""
        if self._cu_seqlens is None:
            s = self.document_ids.shape[1]
            ends = [0] + [b * s + end for b, spans in enumerate(self.segments()) for _, end in spans]
            lengths = [e - a for spans in self.segments() for a, e in spans]
            self._cu_seqlens = (torch.tensor(ends, dtype=torch.int32, device=self.document_ids.device), max(lengths))
        return self._cu_seqlens


def packed_documents(document_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                     seq_length: int) -> Optional[PackedDocuments]:
    """The micro-batch's :class:`PackedDocuments` (None when neither ids nor reset positions are given);
    ``seq_length`` is the whole sequence's, before any context-parallel split."""
    if document_ids is None and position_ids is None:
        return None
    return PackedDocuments(document_ids=document_ids, position_ids=position_ids, max_seqlen_q=seq_length,
                           max_seqlen_kv=seq_length)


def documents_of(packed_seq_params) -> Optional[torch.Tensor]:
    """The document ids a core attention masks with: None without document masking (or no packed parameters); any
    other packed format is refused."""
    if packed_seq_params is None:
        return None
    if not isinstance(packed_seq_params, PackedDocuments):
        raise ValueError(f"packed sequences in the {packed_seq_params.qkv_format!r} format are not supported; the "
                         "framework passes PackedDocuments (data.document_mask, data.reset_position_ids)")
    return packed_seq_params.document_ids


def document_segments(document_ids: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """Per row of ``document_ids`` (b, s), the [start, end) of each run of equal ids."""
    ids = document_ids.detach().cpu()
    changes = (ids[:, 1:] != ids[:, :-1]).nonzero().tolist()
    starts: List[List[int]] = [[0] for _ in range(ids.shape[0])]
    for row, position in changes:
        starts[row].append(position + 1)
    s = ids.shape[1]
    return [list(zip(row, row[1:] + [s])) for row in starts]


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) int64: the index of the first token of each token's document."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand(document_ids.shape)
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return torch.where(first, index, torch.zeros_like(index)).cummax(dim=-1).values


def same_document(q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, sq, sk) bool, True where query and key lie in one document: for the paths that materialise the map (or
    a block of it) anyway."""
    return (q_ids[:, :, None] == k_ids[:, None, :]).unsqueeze(1)


def documents_overlap(q_ids: torch.Tensor, k_ids: torch.Tensor) -> bool:
    """Whether any sample's queries and keys can share a document (ids are non-decreasing, so comparing the ranges
    is enough; a false 'yes' only costs a block of masked work)."""
    return bool(((q_ids.max(dim=1).values >= k_ids.min(dim=1).values)
                 & (k_ids.max(dim=1).values >= q_ids.min(dim=1).values)).any())
