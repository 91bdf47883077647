"""The DIFF epilogue (O1 − λ·O2 in fp32, the per-head RMSNorm and its output factor, megatron-core's layout): one fused
Triton kernel each way, and its plain PyTorch reference."""

from kernels.diff_epilogue.fused import DiffEpilogueFunction, diff_epilogue
from kernels.diff_epilogue.naive import diff_epilogue_naive

__all__ = ["DiffEpilogueFunction", "diff_epilogue", "diff_epilogue_naive"]
