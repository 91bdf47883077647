"""The protocol through which every attention kind exposes its maps, and the hooks that capture them.

A core attention module of any kind implements ``attention_maps(query, key, value, attention_bias=None, rows=None,
document_ids=None)``:
from the same inputs its ``forward`` receives (megatron's ``[s, b, heads, d]`` query, key and value after RoPE, and
``attention_bias``, DIFF V2's λ logits), it returns an :class:`AttentionMaps` for this rank's heads, computed eagerly
in fp32. ``rows`` (a 1-D tensor of query positions) restricts the maps to those query rows, so that a caller can
bound memory by walking the rows in blocks or look only at the rows it cares about. ``document_ids`` (b, keys), the
documents of packed samples (document masking), keeps each row within its own document.

:func:`capture_attention` registers forward pre-hooks that call it for the duration of a ``with`` block, whatever the
module's backend is (the maps are recomputed from q and k; the forward itself runs unchanged). Outside the block no
hook exists, so the training path pays nothing. A new attention kind plugs into every analysis by implementing
``attention_maps``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, Iterator, Optional, Sequence

import torch


@dataclasses.dataclass
class AttentionMaps:
    """One layer's attention maps for this rank's heads, fp32, each ``(b, heads, rows, keys)``.

    ``components``: the softmax maps the kind computes, named ``A`` for a single map and ``A1``, ``A2`` for
    differential kinds (A1 of head h from query/key heads 2h, A2 from 2h+1); rows sum to 1 over the visible keys.
    ``logits``: the pre-softmax scores q·kᵀ·scale of each component, −inf where masked (before any top-k or gate).
    ``combined``: the weights the kind applies to V: A for softmax kinds, A1 − λA2 for differential ones, A ⊙ G for
    the signed mask; rows need not sum to 1 and may be negative. ``lam``: λ broadcastable to ``combined`` (a 0-dim
    tensor for DIFF V1, ``(b, heads, rows, 1)`` for DIFF V2's per-token λ), None for softmax kinds. ``rows``: the
    absolute query position of each row. ``document_ids``: (b, keys) under document masking (a row sees only its own
    document), else None.
    """

    components: Dict[str, torch.Tensor]
    logits: Dict[str, torch.Tensor]
    combined: torch.Tensor
    rows: torch.Tensor
    lam: Optional[torch.Tensor] = None
    document_ids: Optional[torch.Tensor] = None

    @property
    def differential(self) -> bool:
        return "A1" in self.components and "A2" in self.components

    @property
    def num_keys(self) -> int:
        return self.combined.shape[-1]

    def key_mask(self, sample: int = 0) -> torch.Tensor:
        """(rows, keys) bool: True where the row's query sees the key (causal; under document masking only the keys
        of its own document in sample ``sample``)."""
        cols = torch.arange(self.num_keys, device=self.rows.device)
        visible = cols[None, :] <= self.rows[:, None]
        if self.document_ids is not None:
            ids = self.document_ids[sample].to(self.rows.device)
            visible = visible & (ids[self.rows][:, None] == ids[None, :])
        return visible


def query_rows(num_queries: int, num_keys: int, rows: Optional[torch.Tensor], device) -> torch.Tensor:
    """Absolute positions of the query rows asked for (default all; queries are the last ``num_queries`` positions)."""
    if rows is None:
        return torch.arange(num_keys - num_queries, num_keys, device=device)
    return rows.to(device)


def causal_logits(q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor,
                  document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q·kᵀ·scale in fp32 with −inf on future keys (and, with ``document_ids`` (b, sk), on other documents' keys).
    q (b, h, n, d) holds every query (n positions ending at the last key), k (b, h, sk, d); returns
    (b, h, len(rows), sk) for the query positions ``rows``."""
    offset = k.shape[-2] - q.shape[-2]
    q = q.index_select(-2, rows - offset)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    cols = torch.arange(k.shape[-2], device=q.device)
    scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    if document_ids is not None:
        ids = document_ids.to(q.device)
        scores = scores.masked_fill((ids[:, rows][:, :, None] != ids[:, None, :])[:, None], float("-inf"))
    return scores


def attention_modules(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every module of ``model`` that implements the protocol (the core attention of each layer)."""
    return (m for m in model.modules() if callable(getattr(m, "attention_maps", None)))


@contextlib.contextmanager
def capture_attention(
    models: Sequence[torch.nn.Module],
    on_maps: Callable[[int, Callable[[Optional[torch.Tensor]], AttentionMaps]], None],
):
    """Within the block, every core attention's forward first calls ``on_maps(layer_number, maps_for)``, where
    ``maps_for(rows)`` returns that layer's :class:`AttentionMaps` for the query positions ``rows`` (None: all), so
    the callback decides how many rows to materialise at once (``maps_for.num_queries`` and ``maps_for.num_keys``
    give the sizes). ``layer_number`` is the global 1-based layer number.
    Runs under ``torch.no_grad``; the hooks are removed on exit."""
    handles = []

    def hook(module, args, kwargs):
        query, key, value = args[:3]
        bias = kwargs.get("attention_bias")
        document_ids = getattr(kwargs.get("packed_seq_params"), "document_ids", None)  # document masking

        def maps_for(rows: Optional[torch.Tensor] = None) -> AttentionMaps:
            with torch.no_grad():
                return module.attention_maps(query, key, value, attention_bias=bias, rows=rows,
                                             document_ids=document_ids)

        maps_for.num_queries, maps_for.num_keys = query.shape[0], key.shape[0]
        on_maps(module.layer_number, maps_for)

    for model in models:
        for module in attention_modules(model):
            if getattr(module, "ring", None) is not None:
                raise ValueError("attention maps need every key on one rank; context parallelism (parallel.cp > 1) "
                                 "splits the sequence over ranks: capture maps of a model built without it")
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    if not handles:
        raise ValueError("the model has no attention module implementing attention_maps")
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_layer_outputs(models: Sequence[torch.nn.Module], layer_type: type,
                          on_output: Callable[[int, torch.Tensor], None]):
    """Within the block, ``on_output(layer_number, hidden_states)`` receives each ``layer_type`` module's output
    hidden states ([s, b, hidden]) as the forward produces them."""
    handles = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        on_output(module.layer_number, hidden.detach())

    for model in models:
        for module in model.modules():
            if isinstance(module, layer_type):
                handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
