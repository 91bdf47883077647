"""The differential epilogue of DIFF V1 and V2: from the two maps' outputs to the core attention's output.

    x_h = O1_h − λ·O2_h (fp32), then V1's per-head RMSNorm over 2d with its weight times (1 − λ_init), in
    megatron-core's [s, b, H·n·d] layout

Three implementations of the same function (``trainer.diff_epilogue`` picks one when ``trainer.fusions`` is on):

- ``unfused``: the plain PyTorch definition (``kernels.diff_epilogue.naive``), about ten kernels and fp32 tensors of
  the whole output each way; the numerics reference and the path on a CPU;
- ``triton``: one Triton kernel each way with its own backward (``kernels.diff_epilogue``): x in fp32 registers, the
  output factor folded into the norm weight at run time (parameters and checkpoints unchanged), one rounding, no
  layout copies, only rstd saved;
- ``compile``: ``torch.compile`` of the definition (inductor fuses it; AOTAutograd derives the backward).

All take the maps' outputs as ``halves``: one or two tensors (B, N, 2, H, d), ``[:, :, 0]`` map 1 and ``[:, :, 1]``
map 2 of each d-wide part of V, as views of whatever the attention kernels returned; or (B, N, 1, H, ·), the maps
already combined into O1 − λ·O2 (the eager reference; DIFF's fused ring under context parallelism, one part as wide
as V), which the epilogue normalises and lays out without λ.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from kernels.diff_epilogue.naive import diff_epilogue_naive

EPILOGUE_IMPLS = ("unfused", "triton", "compile")


@functools.lru_cache(maxsize=None)
def _compiled_epilogue():
    return torch.compile(diff_epilogue_naive, dynamic=False)


def diff_epilogue(
    halves: Sequence[torch.Tensor],
    lam: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    scale: float,
    impl: str = "unfused",
) -> torch.Tensor:
    """(N, B, H·n·d) in the halves' dtype (see the module docstring); differentiable in halves, lam and weight. Inside
    a compiled region (``trainer.compile`` with the core attention in the layer's graph) always the definition,
    which inductor fuses with the work around it."""
    if torch.compiler.is_compiling():
        return diff_epilogue_naive(halves, lam, weight, eps, scale)
    with torch.profiler.record_function("diff_epilogue"):
        if impl == "unfused":
            return diff_epilogue_naive(halves, lam, weight, eps, scale)
        if impl == "triton":
            from kernels.diff_epilogue import diff_epilogue as fused_epilogue

            return fused_epilogue(halves, lam, weight, eps, scale)
        if impl == "compile":
            # The output factor (1 - λ_init) differs per layer: as a Python float it is a guard of the compiled graph
            # (one recompilation per layer, eager after torch._dynamo's cache limit); folded into the weight it is data.
            if weight is not None:
                return _compiled_epilogue()(list(halves), lam, weight * scale, eps, 1.0)
            out = _compiled_epilogue()(list(halves), lam, None, eps, 1.0)
            return out if scale == 1.0 else out * scale
    raise ValueError(f"trainer.diff_epilogue={impl!r} is unknown; use one of {', '.join(EPILOGUE_IMPLS)}")


def paired_halves(out: torch.Tensor, pairs: str) -> torch.Tensor:
    """A library kernel's output (B, N, 2H, d) as (B, N, 2, H, d), a view: ``interleaved`` heads 2h + m (the head
    layout of megatron's projections) or ``grouped`` heads m·H + h."""
    batch, seq, two_h, d = out.shape
    if pairs == "interleaved":
        return out.unflatten(2, (two_h // 2, 2)).transpose(2, 3)
    return out.unflatten(2, (2, two_h // 2))
