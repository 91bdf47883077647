"""megatron-core ModuleSpecs, one per attention kind, on the local (non-TransformerEngine) layer spec.

Every attention kind is a ModuleSpec chosen by ``model.attention``, so a mirrored baseline or an ablation is one
config override. New kinds (V2, DEX, ablations) register themselves in ``ATTENTION_KINDS``.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from diff_transformer.models.attention import DifferentialCoreAttention, VanillaCoreAttention
from diff_transformer.models.norms import RMSNorm


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


def diff_layer_spec(model_cfg, seed: int = 0) -> ModuleSpec:
    spec = _base_spec(seed)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=DifferentialCoreAttention,
        params={
            "backend": model_cfg.attention_backend,
            "lambda_init": model_cfg.lambda_init,
            "sublayer_norm": model_cfg.sublayer_norm,
            "norm_eps": model_cfg.norm_eps,
        },
    )
    return spec


def vanilla_layer_spec(model_cfg, seed: int = 0) -> ModuleSpec:
    spec = _base_spec(seed)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=VanillaCoreAttention, params={"backend": model_cfg.attention_backend}
    )
    return spec


ATTENTION_KINDS: Dict[str, Callable[..., ModuleSpec]] = {
    "diff": diff_layer_spec,
    "vanilla": vanilla_layer_spec,
}


def layer_spec_for(model_cfg, seed: int = 0) -> ModuleSpec:
    try:
        build = ATTENTION_KINDS[model_cfg.attention]
    except KeyError:
        raise ValueError(
            f"model.attention={model_cfg.attention!r} is unknown; use one of {', '.join(ATTENTION_KINDS)}"
        ) from None
    return build(model_cfg, seed)
