"""megatron-core ModuleSpecs, one per attention kind, on the local (non-TransformerEngine) layer spec.

Every attention kind is a ModuleSpec chosen by ``model.attention``, so a mirrored baseline or an ablation is one
config override. A kind registers itself in ``ATTENTION_KINDS`` with its spec, the head layout megatron-core's
SelfAttention is configured with, the backends it runs on and the ablation keys it reads.

For DIFF's H differential heads of size d (hidden E = 2H·d by default) and Hkv KV groups:

| kind            | query heads x size | KV heads | core attention                                            |
|-----------------|--------------------|----------|-----------------------------------------------------------|
| `diff`          | 2H x d             | 2Hkv     | V1: pairs of maps, λ, per-head RMSNorm·(1 − λ_init)       |
| `vanilla`       | 2H x d             | 2Hkv     | softmax (the mirrored baseline)                           |
| `diff_v2`       | 2H x d             | Hkv      | V2: one attention, O[2h] − sigmoid(x·W_λ)_h·O[2h+1]; Wo from H·d |
| `vanilla_subln` | 2H x d             | 2Hkv     | softmax, per-head RMSNorm·(1 − λ_init)                    |
| `vanilla_wide`  | H x 2d             | Hkv      | softmax (the head-count control)                          |
| `topk`          | 2H x d             | 2Hkv     | softmax over each query's k largest scores                |
| `signed_mask`   | 2H x d             | 2Hkv     | softmax map times a learnable signed per-distance gate    |
| `dex`           | 2H x d             | 2Hkv     | softmax; O − λ·O·W_D on selected heads (DEX adaptation)   |
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from diff_transformer.models.attention import (
    BACKENDS,
    DexCoreAttention,
    DifferentialCoreAttention,
    DiffV2CoreAttention,
    DiffV2SelfAttention,
    SignedMaskCoreAttention,
    TopKCoreAttention,
    VanillaCoreAttention,
    VanillaSublnCoreAttention,
)
from diff_transformer.models.norms import RMSNorm

DEFAULT_TOPK = 32  # model.topk when unset


class SeededTransformerLayer(TransformerLayer):
    """A TransformerLayer whose initial weights depend only on the seed and its global layer number.

    With CPU initialisation megatron-core draws each full (unsplit) weight from the default generator and slices
    it for the local TP rank, so the weights are already independent of TP; reseeding per global layer makes them
    independent of the pipeline split too. Any TP×PP layout therefore starts from identical weights.
    """

    init_seed: int = 0

    def __init__(self, config, submodules, layer_number: int = 1, *args, vp_stage=None, **kwargs):
        global_layer = layer_number + get_transformer_layer_offset(config, vp_stage)
        if config.perform_initialization and config.use_cpu_initialization:
            torch.manual_seed(self.init_seed * 100_003 + global_layer)
        super().__init__(config, submodules, layer_number, *args, vp_stage=vp_stage, **kwargs)


def _base_spec(seed: int) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    layer_cls = type("SeededTransformerLayer", (SeededTransformerLayer,), {"init_seed": seed})
    spec.module = layer_cls
    return spec


def _with_core_attention(seed: int, module, **params) -> ModuleSpec:
    spec = _base_spec(seed)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=module, params=params)
    return spec


def resolved_backend(model_cfg) -> str:
    """``model.attention_backend``, with ``auto`` read as ``sdpa``: what a model built without the trainer's timed
    choice (``training.backend_choice``, which replaces ``auto`` before the model is built) runs on."""
    return "sdpa" if model_cfg.attention_backend == "auto" else model_cfg.attention_backend


def diff_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return _with_core_attention(
        seed, DifferentialCoreAttention,
        backend=resolved_backend(model_cfg),
        epilogue=epilogue,
        lambda_init=model_cfg.lambda_init,
        sublayer_norm=model_cfg.sublayer_norm,
        norm_eps=model_cfg.norm_eps,
        lambda_learnable=model_cfg.lambda_learnable,
    )


def vanilla_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return _with_core_attention(seed, VanillaCoreAttention, backend=resolved_backend(model_cfg))


def diff_v2_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    spec = _with_core_attention(seed, DiffV2CoreAttention, backend=resolved_backend(model_cfg), epilogue=epilogue)
    spec.submodules.self_attention.module = DiffV2SelfAttention
    return spec


def vanilla_subln_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return _with_core_attention(
        seed, VanillaSublnCoreAttention,
        backend=resolved_backend(model_cfg), lambda_init=model_cfg.lambda_init, norm_eps=model_cfg.norm_eps,
    )


def topk_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return _with_core_attention(seed, TopKCoreAttention, backend=resolved_backend(model_cfg), topk=resolved_topk(model_cfg))


def signed_mask_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return _with_core_attention(
        seed, SignedMaskCoreAttention, backend=resolved_backend(model_cfg), max_distance=model_cfg.seq_length
    )


def dex_layer_spec(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return _with_core_attention(
        seed, DexCoreAttention,
        backend=resolved_backend(model_cfg),
        heads_per_layer=None if model_cfg.dex.heads is None else [list(h) for h in model_cfg.dex.heads],
        lambda_init=model_cfg.lambda_init,
    )


def head_dim(model_cfg) -> int:
    """d: the size of DIFF's query/key heads (its value heads are 2d)."""
    return model_cfg.head_dim if model_cfg.head_dim is not None else model_cfg.hidden_size // (2 * model_cfg.num_heads)


def num_kv_heads(model_cfg) -> int:
    """Hkv: DIFF's KV groups."""
    return model_cfg.num_kv_heads if model_cfg.num_kv_heads is not None else model_cfg.num_heads


def resolved_topk(model_cfg) -> int:
    return model_cfg.topk if model_cfg.topk is not None else DEFAULT_TOPK


def _paired_heads(m) -> Tuple[int, int, int]:
    return 2 * m.num_heads, 2 * num_kv_heads(m), head_dim(m)


def _v2_heads(m) -> Tuple[int, int, int]:
    return 2 * m.num_heads, num_kv_heads(m), head_dim(m)


def _wide_heads(m) -> Tuple[int, int, int]:
    return m.num_heads, num_kv_heads(m), 2 * head_dim(m)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One value of ``model.attention``."""

    # (model_cfg, seed, epilogue) -> the transformer layer's ModuleSpec; ``epilogue`` is the DIFF epilogue's
    # implementation (models.attention.epilogue), read by the differential kinds only
    layer_spec: Callable[..., ModuleSpec]
    heads: Callable[..., Tuple[int, int, int]]  # model_cfg -> (query heads, KV heads, head size) of SelfAttention
    backends: Tuple[str, ...]
    keys: Tuple[str, ...] = ()  # the model.* ablation keys this kind reads, besides the head settings


ATTENTION_KINDS: Dict[str, AttentionKind] = {
    "diff": AttentionKind(diff_layer_spec, _paired_heads, BACKENDS, ("lambda_init", "lambda_learnable", "sublayer_norm")),
    "vanilla": AttentionKind(vanilla_layer_spec, _paired_heads, ("eager", "sdpa", "flash_attn", "flash_attn4")),
    "diff_v2": AttentionKind(diff_v2_layer_spec, _v2_heads, ("eager", "sdpa", "flash_attn", "flash_attn4", "triton")),
    "vanilla_subln": AttentionKind(vanilla_subln_layer_spec, _paired_heads,
                                   ("eager", "sdpa", "flash_attn", "flash_attn4"), ("lambda_init",)),
    "vanilla_wide": AttentionKind(vanilla_layer_spec, _wide_heads, ("eager", "sdpa", "flash_attn", "flash_attn4")),
    "topk": AttentionKind(topk_layer_spec, _paired_heads, ("eager", "sdpa"), ("topk",)),
    "signed_mask": AttentionKind(signed_mask_layer_spec, _paired_heads, ("eager", "sdpa")),
    "dex": AttentionKind(dex_layer_spec, _paired_heads, ("eager", "sdpa", "flash_attn", "flash_attn4"),
                         ("lambda_init",)),
}
# Kinds whose attention is already differential: DEX adapts only softmax attention (vanilla, or DEX itself).
DIFFERENTIAL_KINDS = ("diff", "diff_v2")

# Every ablation key with the value that means "not set"; a kind that does not read a key refuses any other value.
ABLATION_KEY_DEFAULTS = {"lambda_init": None, "lambda_learnable": True, "sublayer_norm": True, "topk": None}


def attention_kind(model_cfg) -> AttentionKind:
    try:
        return ATTENTION_KINDS[model_cfg.attention]
    except KeyError:
        raise ValueError(
            f"model.attention={model_cfg.attention!r} is unknown; use one of {', '.join(ATTENTION_KINDS)}"
        ) from None


def layer_spec_for(model_cfg, seed: int = 0, epilogue: str = "unfused") -> ModuleSpec:
    return attention_kind(model_cfg).layer_spec(model_cfg, seed, epilogue)


def attention_heads(model_cfg) -> Tuple[int, int, int]:
    """(query heads, KV heads, head size) of megatron-core's SelfAttention for this model's attention kind."""
    return attention_kind(model_cfg).heads(model_cfg)


def variant_label(model_cfg) -> str:
    """The attention kind, the ablation keys it reads that are set, and explicit head settings, e.g.
    ``diff lambda_init=0.8``, ``topk topk=32`` or ``vanilla num_kv_heads=1``: what tells runs of one sweep apart
    besides their seed."""
    kind = attention_kind(model_cfg)
    parts = [model_cfg.attention]
    for key in kind.keys:
        value = resolved_topk(model_cfg) if key == "topk" else getattr(model_cfg, key)
        if key == "topk" or value != ABLATION_KEY_DEFAULTS[key]:
            parts.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    for key in ("num_kv_heads", "head_dim"):
        if getattr(model_cfg, key) is not None:
            parts.append(f"{key}={getattr(model_cfg, key)}")
    return " ".join(parts)


def core_attention_class(model_cfg, kind: str) -> type:
    """The core-attention module class of attention kind ``kind`` (built from ``model_cfg``'s other settings)."""
    spec = ATTENTION_KINDS[kind].layer_spec(model_cfg)
    return spec.submodules.self_attention.submodules.core_attention.module


def context_parallel_kinds(model_cfg) -> Tuple[str, ...]:
    """The attention kinds with a ring-attention path for a sequence split over a context-parallel group."""
    return tuple(kind for kind in ATTENTION_KINDS if core_attention_class(model_cfg, kind).supports_context_parallel)
