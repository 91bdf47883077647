"""The per-micro-batch pieces every engine and pass shares: the masked language-model loss and the forward step
megatron-core's schedules call (also DEX's calibration pass)."""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch


# ------------------------------------------------------------------------------------------------------------------
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    device = next(model.parameters()).device
    tokens = tokens.to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)
