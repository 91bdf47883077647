"""FLOP, MFU and memory accounting: what the loop logs (MFU, memory) and prints before training (memory per GPU)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from diff_transformer.models.gpt import head_dim


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


def attention_flops_per_token(cfg: Any) -> float:
    """Forward FLOPs of the attention scores and weighted sum per token (causal: half the s×s map).

    DIFF: two maps of QKᵀ (2H heads of d) and two weighted sums with 2d-wide V over H heads; the baseline: 2H heads
    of d for both. Both come to 2·2·(2H·d)·s/2 per layer per token."""
    s, L = cfg.model.seq_length, cfg.model.num_layers
    width = 2 * cfg.model.num_heads * head_dim(cfg.model)
    return L * 2 * 2 * width * s / 2


def model_flops_per_token(cfg: Any, num_non_embedding_parameters: int, padded_vocab: int) -> float:
    """Training FLOPs per token: 6 per weight of every matmul (forward 2, backward 4), the logits layer included
    (tied or not), plus 3x the forward attention FLOPs (scores and weighted sums, causal)."""
    matmul_weights = num_non_embedding_parameters + padded_vocab * cfg.model.hidden_size
    return 6 * matmul_weights + 3 * attention_flops_per_token(cfg)


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
