"""The per-micro-batch pieces every engine and pass shares: the masked language-model loss and the forward step
megatron-core's schedules call (also DEX's calibration pass)."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, Optional

import torch

from diff_transformer.distributed import all_reduce_tensor
from diff_transformer.models.documents import packed_documents
from diff_transformer.models.ring_attention import context_parallel_chunks
from diff_transformer.training.cuda_graphs import new_micro_batch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
# per token too, split like the others under context parallelism; present with data.document_mask
DOCUMENT_KEY = "document_ids"


# ------------------------------------------------------------------------------------------------------------------
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, cp_group: Optional[Any] = None):
    """The mean loss over the micro-batch's unmasked tokens; with ``cp_group`` (context parallelism) over the tokens of
    the whole sequence, which the group's ranks hold in chunks."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    if cp_group is None:
        loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
        # clone: the schedule divides the returned loss in place by the number of micro-batches
        return loss, {"lm loss": loss.detach().clone()}
    local_sum = torch.sum(losses * mask)
    totals = all_reduce_tensor(torch.stack([local_sum.detach(), mask.sum()]), group=cp_group)
    count = totals[1].clamp(min=1)
    # megatron-core's schedule multiplies the returned loss by the CP size and DDP averages gradients over DP×CP: each
    # rank's summed loss over the whole sequence's token count makes the ranks' gradients add up to the sequence's
    return local_sum / count, {"lm loss": totals[0] / count}


def context_parallel_batch(batch: dict) -> tuple:
    """This context-parallel rank's two load-balanced chunks of each of the batch's [b, s] tensors
    (models/ring_attention.py), and the CP group (None without context parallelism)."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return batch, None
    rank = parallel_state.get_context_parallel_rank()
    chunks = {k: context_parallel_chunks(v, cp, rank, dim=1) if k in BATCH_KEYS + (DOCUMENT_KEY,) else v
              for k, v in batch.items()}
    return chunks, parallel_state.get_context_parallel_group()


def model_inputs(batch: dict, device, reset_position_ids: bool = False, cp: int = 1) -> tuple:
    """(tokens, position_ids, packed documents or None) of a (context-parallel rank's) micro-batch on ``device``: the
    documents carry the batch's ``document_ids`` (data.document_mask) and, with ``reset_position_ids``, the positions
    restarting per document for RoPE; ``cp`` sizes the whole sequence they belong to."""
    tokens, position_ids = (batch[k].to(device, non_blocking=True) for k in ("tokens", "position_ids"))
    ids = batch.get(DOCUMENT_KEY)
    documents = packed_documents(ids.to(device, non_blocking=True) if ids is not None else None,
                                 position_ids if reset_position_ids else None, tokens.shape[1] * cp)
    return tokens, position_ids, documents


def forward_step(data_iterator: Iterator, model: torch.nn.Module, reset_position_ids: bool = False,
                 new_graph_generation: bool = False):
    """megatron-core's forward step (``functools.partial`` binds ``reset_position_ids``, data.reset_position_ids, and
    ``new_graph_generation``: trainer.cuda_graphs' training micro-batches, each a new generation of the graph trees)."""
    from megatron.core import parallel_state

    if new_graph_generation:
        new_micro_batch()

    batch, cp_group = context_parallel_batch(next(data_iterator))
    device = next(model.parameters()).device
    tokens, position_ids, documents = model_inputs(batch, device, reset_position_ids,
                                                   parallel_state.get_context_parallel_world_size())
    labels, loss_mask = (batch[k].to(device, non_blocking=True) for k in ("labels", "loss_mask"))
    output = model(tokens, position_ids, None, labels=labels, packed_seq_params=documents)
    return output, partial(loss_func, loss_mask, cp_group=cp_group)
