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

import functools
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


@torch.library.custom_op("diff_transformer::accumulate_weight_gradient", mutates_args=("main_grad",))
def accumulate_weight_gradient_op(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
                                  ) -> None:
    """:func:`accumulate_weight_gradient` as a torch operator that declares its write to ``main_grad``: dynamo records
    it in a compiled layer's backward graph as one opaque call, where the same write from Python is a side effect
    that breaks the graph."""
    accumulate_weight_gradient(total_input, grad_output, main_grad)


@accumulate_weight_gradient_op.register_fake
def _(main_grad, grad_output, total_input):
    return None


class GraphLinear(torch.autograd.Function):
    """megatron-core's linear layer at one tensor-parallel rank (``linear_with_grad_accumulation_and_async_allreduce``
    without communication) with its weight gradient accumulated into ``main_grad`` through
    :func:`accumulate_weight_gradient_op`, so that a compiled layer keeps it in its graph. The weight's own gradient
    is megatron's dummy (an uninitialised tensor: no memset), which DDP's hook drops once ``grad_added_to_main_grad``
    says the gradient is in ``main_grad`` already (:func:`fuse_weight_gradients_in_graphs` sets it)."""

    @staticmethod
    def forward(ctx, total_input, weight, bias, main_grad):
        ctx.save_for_backward(total_input, weight)
        # not saved: it is a view of DDP's gradient buffer, whose every write (another layer's) bumps the version
        # counter that saved tensors are checked against
        ctx.main_grad = main_grad
        ctx.use_bias = bias is not None
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        total_input, weight = ctx.saved_tensors
        main_grad = ctx.main_grad
        grad_input = grad_output.matmul(weight)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        accumulate_weight_gradient_op(main_grad, grad_output, total_input.reshape(-1, total_input.shape[-1]))
        grad_weight = torch.empty(weight.shape, dtype=total_input.dtype, device=weight.device)
        return grad_input, grad_weight, grad_output.sum(dim=0) if ctx.use_bias else None, None


def _graph_linear(module, input, weight, bias=None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
                  sequence_parallel=False, **unused):
    """A linear module's ``_forward_impl`` (megatron's keyword arguments) at one tensor-parallel rank."""
    if not weight.requires_grad:  # a frozen weight (DEX's base): megatron's own path
        return type(module)._forward_impl(module, input, weight, bias=bias,
                                          gradient_accumulation_fusion=gradient_accumulation_fusion,
                                          allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                          **unused)
    if allreduce_dgrad or sequence_parallel:
        raise RuntimeError("GraphLinear runs at tensor-parallel size 1 only (no gradient all-reduce or sequence "
                           "parallelism); unfuse_weight_gradients serves larger sizes")
    return GraphLinear.apply(input, weight, bias, weight.main_grad)


def fuse_weight_gradients_in_graphs(chunk: torch.nn.Module) -> int:
    """The linear layers inside ``chunk``'s TransformerLayers keep megatron-core's gradient_accumulation_fusion in a
    compiled layer's graph: each computes through :class:`GraphLinear` (tensor-parallel size 1), and a forward
    pre-hook of ``chunk`` tells DDP's hook, before each micro-batch, that their gradients are in ``main_grad`` (its
    ``zero_grad_buffer`` clears the flag every step). Call before DDP wraps ``chunk``. Returns how many changed."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    modules = [module for layer in chunk.modules() if isinstance(layer, TransformerLayer)
               for module in layer.modules() if getattr(module, "gradient_accumulation_fusion", False) is True]
    for module in modules:
        module._forward_impl = functools.partial(_graph_linear, module)
    weights = [module.weight for module in modules if getattr(module, "weight", None) is not None]

    def in_main_grad(_module, _args):
        for weight in weights:
            weight.grad_added_to_main_grad = True

    if modules:
        chunk.register_forward_pre_hook(in_main_grad)
    return len(modules)


def unfuse_weight_gradients(chunk: torch.nn.Module) -> int:
    """The linear layers inside ``chunk``'s TransformerLayers without megatron-core's gradient_accumulation_fusion:
    its autograd function writes ``main_grad`` in its backward, a side effect that breaks the compiled layer's graph
    at every linear layer (dynamo: "HOP: Unsafe side effect"); without it the weight gradients are the graph's
    outputs, added into ``main_grad`` by DDP's hook. The output layer keeps the fusion. Returns how many changed.
    The trainer calls it under ``trainer.cuda_graphs`` and under ``trainer.compile`` at tensor-parallel sizes above 1
    (else :func:`fuse_weight_gradients_in_graphs`)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    changed = 0
    for layer in (m for m in chunk.modules() if isinstance(m, TransformerLayer)):
        for module in layer.modules():
            if getattr(module, "gradient_accumulation_fusion", False) is True:
                module.gradient_accumulation_fusion = False
                changed += 1
    return changed
