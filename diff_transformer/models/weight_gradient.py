"""The weight gradient of a linear layer accumulated into its fp32 main gradient in one GEMM call, without Apex.

megatron-core's ``gradient_accumulation_fusion`` calls Apex's ``fused_weight_gradient_mlp_cuda`` for
``main_grad += grad_outputᵀ · input`` (``compat.install_weight_gradient_accumulation`` puts this module there when
Apex is missing). Without it each linear layer's backward writes a bf16 weight gradient and megatron's DDP hook adds
it to ``main_grad`` in a separate kernel: one more launch and a round trip through memory per weight and
micro-batch, and the gradient rounded to bf16 before the add.

Here it is one call: ``torch.addmm(main_grad, grad_outputᵀ, input, out=main_grad)`` (cuBLAS with β = 1), with
``out_dtype=float32`` where the inputs are bf16/fp16 (torch's mixed-dtype GEMM on CUDA: bf16 products, fp32
accumulation, fp32 output, no bf16 rounding). Where torch has no such kernel (its CPU backend, or a torch that refuses
an fp32 ``self``) the inputs are upcast and added in the same one fp32 GEMM on a CPU, and on CUDA the GEMM's fp32
output is added (two calls, said once in the log).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

# by device type: whether torch.addmm takes bf16/fp16 matrices with out_dtype=float32 into an fp32 self and out
_MIXED_ADDMM = {}


def _mixed_addmm(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> bool:
    """One mixed-dtype addmm into ``main_grad``; False (nothing written) where torch refuses it."""
    device = main_grad.device.type
    if device != "cuda":
        return False
    if _MIXED_ADDMM.get(device) is False:
        return False
    try:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    except (RuntimeError, NotImplementedError, TypeError) as err:  # checked before any write
        _MIXED_ADDMM[device] = False
        logger.warning("weight gradients: torch %s has no mixed-dtype addmm into the fp32 main gradient (%s); the "
                       "GEMM's fp32 output is added instead (two calls)", torch.__version__, str(err).splitlines()[0])
        return False
    _MIXED_ADDMM[device] = True
    return True


def accumulate_weight_gradient(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_outputᵀ · total_input``: total_input (tokens, in), grad_output (tokens, out), main_grad
    (out, in); Apex's ``wgrad_gemm_accum_fp32`` / ``_fp16`` signature and arithmetic (fp32 accumulation)."""
    if total_input.dtype == main_grad.dtype:
        torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)
    elif _mixed_addmm(main_grad, grad_output, total_input):
        pass
    elif main_grad.device.type == "cuda":
        main_grad.add_(torch.mm(grad_output.t(), total_input, out_dtype=main_grad.dtype))
    else:  # a CPU: the same arithmetic (bf16 values, products and sums in fp32) in one fp32 GEMM
        torch.addmm(main_grad, grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype), out=main_grad)


# what megatron-core's tensor_parallel/layers.py calls as ``fused_weight_gradient_mlp_cuda``
APEX_COMPATIBLE = SimpleNamespace(wgrad_gemm_accum_fp32=accumulate_weight_gradient,
                                  wgrad_gemm_accum_fp16=accumulate_weight_gradient)


def unfuse_weight_gradients(chunk: torch.nn.Module) -> int:
    """The linear layers inside ``chunk``'s TransformerLayers without megatron-core's gradient_accumulation_fusion:
    its autograd function writes ``main_grad`` in its backward, a side effect that breaks the compiled layer's graph
    at every linear layer (dynamo: "HOP: Unsafe side effect"); without it the weight gradients are the graph's
    outputs, added into ``main_grad`` by DDP's hook. The output layer keeps the fusion. Returns how many changed.
    The trainer calls it under ``trainer.compile``: the fusion then serves the linear layers outside the graphs."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    changed = 0
    for layer in (m for m in chunk.modules() if isinstance(m, TransformerLayer)):
        for module in layer.modules():
            if getattr(module, "gradient_accumulation_fusion", False) is True:
                module.gradient_accumulation_fusion = False
                changed += 1
    return changed
