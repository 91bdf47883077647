"""RMSNorm for megatron-core's local layer spec, in place of its ``WrappedTorchNorm``.

megatron-core's torch norm builds ``torch.nn.RMSNorm`` with an fp32 weight whatever the model's dtype, so in bf16
torch warns "Mismatch dtype between input and weight" and falls back to the unfused path; it also refuses sequence
parallelism because it cannot mark its weight. This norm keeps its weight in ``config.params_dtype`` (the optimizer
holds the fp32 main copy), computes in the input's dtype, and marks the weight ``sequence_parallel`` when the model
is, so megatron-core all-reduces its gradient over the TP group. Same parameter name (``weight``) and the same math
as ``torch.nn.RMSNorm``, so checkpoints and fp32 results are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight over the last dimension; megatron-core's norm constructor protocol."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
