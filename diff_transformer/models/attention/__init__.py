"""Core attention modules of every attention kind, one module per kind over a shared base, with pluggable backends.

- ``DifferentialCoreAttention`` (``diff_v1``): DIFF V1 (also with λ frozen, ``lambda_learnable=False``);
- ``VanillaCoreAttention`` (``vanilla``): softmax attention, the baseline (and, with H heads of 2d, the head-count
  control); ``VanillaSublnCoreAttention``: the baseline plus DIFF's per-head RMSNorm and (1 − λ_init) multiplier;
- ``TopKCoreAttention`` (``topk``): softmax over each query's k largest causal scores;
- ``SignedMaskCoreAttention`` (``signed_mask``): one softmax map gated by a learnable signed per-head, per-distance
  factor (both controls share the blockwise backend of ``blockwise``);
- ``DiffV2SelfAttention`` + ``DiffV2CoreAttention`` (``diff_v2``): DIFF V2 (the only kind that changes
  ``SelfAttention`` itself: its λ comes from the layer input and its output projection reads H·d);
- ``DexCoreAttention`` (``dex``): DEX, the baseline's softmax attention with O − λ·O·W_D on selected heads
  (adapting a pretrained model);
- ``diff_epilogue`` (``epilogue``): DIFF V1's and V2's O1 − λ·O2, norm and layout after library attention kernels
  (unfused, a fused Triton kernel from ``kernels.diff_epilogue``, or torch.compile).

What they share (the core-attention protocol, head layout, backends, λ_init's schedule) is in ``base``. A new kind is a
new module here plus its entry in ``models.layer_specs.ATTENTION_KINDS``.
"""

from diff_transformer.models.attention.base import (
    BACKENDS,
    TP_REPLICATED_ATTR,
    CoreAttentionBase,
    eager_attention_probs,
    lambda_init_for_layer,
)
from diff_transformer.models.attention.blockwise import BLOCK_QUERIES, MapControlCoreAttention, blockwise_attention
from diff_transformer.models.attention.dex import DEX_ANNEAL_SCHEDULES, DexCoreAttention, dex_anneal_fraction
from diff_transformer.models.attention.diff_v1 import DifferentialCoreAttention
from diff_transformer.models.attention.diff_v2 import DiffV2CoreAttention, DiffV2SelfAttention
from diff_transformer.models.attention.epilogue import EPILOGUE_IMPLS, diff_epilogue
from diff_transformer.models.attention.signed_mask import (
    SIGNED_MASK_BUCKETS,
    SIGNED_MASK_INIT,
    SignedMaskCoreAttention,
    relative_position_bucket,
)
from diff_transformer.models.attention.topk import TopKCoreAttention, keep_top_k
from diff_transformer.models.attention.vanilla import VanillaCoreAttention, VanillaSublnCoreAttention

__all__ = [
    "BACKENDS", "BLOCK_QUERIES", "DEX_ANNEAL_SCHEDULES", "EPILOGUE_IMPLS", "SIGNED_MASK_BUCKETS", "SIGNED_MASK_INIT",
    "TP_REPLICATED_ATTR",
    "CoreAttentionBase", "DexCoreAttention", "DiffV2CoreAttention", "DiffV2SelfAttention", "DifferentialCoreAttention",
    "MapControlCoreAttention", "SignedMaskCoreAttention", "TopKCoreAttention", "VanillaCoreAttention",
    "VanillaSublnCoreAttention", "blockwise_attention", "dex_anneal_fraction", "diff_epilogue", "eager_attention_probs",
    "keep_top_k",
    "lambda_init_for_layer", "relative_position_bucket",
]
