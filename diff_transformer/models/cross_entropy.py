"""Vocab-parallel cross-entropy that reads the logits in their own dtype, once each way: ``trainer.fusions``'
cross-entropy (megatron-core's ``cross_entropy_loss_fusion`` with its native implementation, whose module global
``compat.install_fused_cross_entropy`` points here).

megatron-core's native fused cross-entropy (fusions/fused_cross_entropy.py) converts the logits to fp32, subtracts the
maximum and exponentiates in place, normalises, and saves that fp32 softmax for the backward, which rounds it to the
gradient: at the ``830m``'s vocabulary of 100,288 and 8,192 tokens a micro-batch the fp32 copy is 3.3 GB, written
three times and read three, and held from the forward to the backward (the bf16 logits are 1.6 GB). Here:

- the forward reads the logits once, in one compiled reduction: each token's maximum, the sum of exponentials
  relative to it, and the target's logit (on the rank whose vocabulary shard holds it). Tensor-parallel ranks combine
  them in two all-reduces of a value per token, as megatron-core's do: the maximum, then the sums rescaled to it with
  the target's logit. It saves the logits themselves and each token's log-sum-exp;
- the backward recomputes the softmax from them in the one pass that writes the gradient, in the logits' dtype
  (softmax − one-hot of the target, times the loss's gradient).

The same loss and gradient as megatron-core's unfused ``vocab_parallel_cross_entropy`` to fp32 rounding
(``tests/test_fusions.py``). Each piece is a ``jit_fuser`` function (megatron-core's ``torch.compile``), so that
inductor keeps the fp32 values in registers; eagerly (``TORCHDYNAMO_DISABLE=1``) the same functions run op by op.
"""

from __future__ import annotations

from typing import Tuple

import torch
from megatron.core.jit import jit_fuser
from megatron.core.tensor_parallel.utils import VocabUtility

from diff_transformer.distributed import all_reduce_tensor


@jit_fuser
def _local_statistics(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_end: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over this rank's vocabulary shard, each token's: maximum logit, sum of exp(logit − maximum), target's logit
    (0 where another shard holds the target) and the target's index in the shard (−1 there)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    maximum = x.max(dim=-1).values
    sum_exp = torch.exp(x - maximum.unsqueeze(-1)).sum(dim=-1)
    elsewhere = (target < vocab_start) | (target >= vocab_end)
    index = torch.where(elsewhere, 0, target - vocab_start)
    predicted = torch.gather(x, -1, index.unsqueeze(-1)).squeeze(-1)
    return maximum, sum_exp, torch.where(elsewhere, 0.0, predicted), torch.where(elsewhere, -1, index)


@jit_fuser
def _rescaled(sum_exp: torch.Tensor, maximum: torch.Tensor, global_maximum: torch.Tensor) -> torch.Tensor:
    return sum_exp * torch.exp(maximum - global_maximum)


@jit_fuser
def _log_sum_exp_and_loss(
    maximum: torch.Tensor, sum_exp: torch.Tensor, predicted: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    log_sum_exp = maximum + torch.log(sum_exp)
    return log_sum_exp, log_sum_exp - predicted


@jit_fuser
def _gradient(
    logits: torch.Tensor, log_sum_exp: torch.Tensor, index: torch.Tensor, grad_loss: torch.Tensor
) -> torch.Tensor:
    """(softmax − one-hot of the target) · the loss's gradient, in the logits' dtype; ``index`` −1 where the target is
    on another shard."""
    softmax = torch.exp(logits.to(log_sum_exp.dtype) - log_sum_exp.unsqueeze(-1))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    one_hot = (vocab == index.unsqueeze(-1)).to(softmax.dtype)
    return ((softmax - one_hot) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group):
        world = 1 if tp_group is None else tp_group.size()
        rank = 0 if tp_group is None else tp_group.rank()
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, world)
        maximum, sum_exp, predicted, index = _local_statistics(logits, target, start, end)
        if world > 1:
            global_maximum = all_reduce_tensor(maximum.clone(), tp_group, op="max")
            sums = all_reduce_tensor(torch.stack((_rescaled(sum_exp, maximum, global_maximum), predicted)), tp_group)
            maximum, (sum_exp, predicted) = global_maximum, sums
        log_sum_exp, loss = _log_sum_exp_and_loss(maximum, sum_exp, predicted)
        ctx.save_for_backward(logits, log_sum_exp, index)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_sum_exp, index = ctx.saved_tensors
        return _gradient(logits, log_sum_exp, index, grad_loss), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Cross-entropy of ``logits`` [s, b, vocab shard] against ``target`` [s, b] (ids over the whole vocabulary), each
    token's loss [s, b] in fp32 (fp64 for fp64 logits); ``tp_group`` the tensor-parallel group whose ranks hold the
    vocabulary's shards in order (None: the whole vocabulary here). megatron-core's
    ``fused_vocab_parallel_cross_entropy``'s signature."""
    return _CrossEntropy.apply(logits, target, tp_group)
