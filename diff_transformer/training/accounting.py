"""FLOP, MFU and memory accounting: what the loop logs (MFU, memory) and prints before training (memory per GPU)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from diff_transformer.models.layer_specs import attention_heads, head_dim


def estimate_memory_per_gpu(cfg: Any, params_on_rank: int, dtype: torch.dtype, dp: int) -> Dict[str, float]:
    """Rough GiB per GPU: weights, fp32 gradients, optimizer state (sharded with the distributed optimizer), and
    activations without recomputation (Korthikanti et al. 2022, ~34·s·b·h bytes a layer with fused attention)."""
    w = 2 if dtype == torch.bfloat16 else 4
    main = 4 if dtype == torch.bfloat16 else 0  # fp32 master copy
    optim_bytes = (main + 8) / (dp if cfg.parallel.distributed_optimizer else 1)
    gib = 1024**3
    s, b, h = cfg.model.seq_length, cfg.trainer.micro_batch_size, cfg.model.hidden_size
    layers_on_rank = cfg.model.num_layers // cfg.parallel.pp
    act = 34 * s * b * h * layers_on_rank / cfg.parallel.tp * (cfg.parallel.pp if cfg.parallel.pp > 1 else 1)
    out = {
        "weights": params_on_rank * w / gib,
        "grads": params_on_rank * 4 / gib,
        "optimizer": params_on_rank * optim_bytes / gib,
        "activations": act / gib,
    }
    out["total"] = sum(out.values())
    return out


def attention_maps(model: Any) -> Tuple[int, int, int, int]:
    """(maps, heads per map, query/key head size, value head size) of one layer's attention, before TP.

    DIFF V1 has two softmax maps over H heads of size d, each weighting the 2d-wide V (a fused kernel must keep the
    two weighted sums apart until both softmaxes are normalised); every other kind one map over the query heads of
    its megatron-core SelfAttention (V2: 2H heads of d; the subtraction after it is negligible)."""
    if model.attention == "diff":
        d = head_dim(model)
        return 2, model.num_heads, d, 2 * d
    query_heads, _, size = attention_heads(model)
    return 1, query_heads, size, size


def attention_flops_per_token(cfg: Any) -> float:
    """Forward FLOPs per token of the attention scores (Q·Kᵀ) and weighted sums (A·V) of every map, all layers:
    2 FLOPs a multiply-add, over s/2 keys on average (causal).

    debug (H=2, d=16, s=64, 2 layers): DIFF 2·2·(2·16 + 2·32)·32 per layer = 12,288, 24,576 in all; the baseline
    1·4·(16 + 16)·2·32 = 8,192 per layer."""
    maps, heads, qk, v = attention_maps(cfg.model)
    keys = cfg.model.seq_length / 2
    return cfg.model.num_layers * maps * heads * 2 * (qk + v) * keys


def attention_backward_flops_per_token(cfg: Any) -> float:
    """Backward FLOPs per token of the attention products, all layers (no recomputation: model FLOPs).

    A single map needs dQ, dK (over the query/key size) and dP = dO·Vᵀ, dV (over the value size): twice its forward.
    DIFF's two maps share V, so dP = dO·Vᵀ and dV = (A1 − λA2)ᵀ·dO are one product each over the 2d-wide V, while
    dQ and dK are per map: 2·H·(2d + 2d) + 2·2·H·(d + d) per (query, key) pair and layer, the 8·H·d MACs of the
    2H-head baseline."""
    maps, heads, qk, v = attention_maps(cfg.model)
    keys = cfg.model.seq_length / 2
    if cfg.model.attention == "diff":
        macs = heads * 2 * v + maps * heads * 2 * qk
    else:
        macs = maps * heads * 2 * (qk + v)
    return cfg.model.num_layers * 2 * macs * keys


def model_flops_per_token(cfg: Any, num_non_embedding_parameters: int, padded_vocab: int) -> float:
    """Training FLOPs per token: 6 per weight of every matmul (forward 2, backward 4), the logits layer included
    (tied or not), plus the attention products forward and backward for the model's attention kind (causal). These
    are model FLOPs (what MFU divides), not what a given backend executes (recomputation is not counted)."""
    matmul_weights = num_non_embedding_parameters + padded_vocab * cfg.model.hidden_size
    return 6 * matmul_weights + attention_flops_per_token(cfg) + attention_backward_flops_per_token(cfg)


# bf16 dense peak of one device, by CUDA device name (vendor datasheets)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def peak_flops_per_device(cfg: Any) -> Optional[float]:
    """logging.peak_tflops_per_device when set, else the datasheet value of a known GPU; None on CPU."""
    if getattr(cfg.logging, "peak_tflops_per_device", None):
        return cfg.logging.peak_tflops_per_device * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def memory_gib() -> float:
    """Peak GPU memory allocated by this process, or its resident memory on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30
