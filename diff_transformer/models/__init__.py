"""The model: attention kinds (core attention modules), their megatron-core layer specs, and GPT model building.

Imports nothing from ``diff_transformer.training`` or ``diff_transformer.analysis``; the fused kernels come from
``kernels``. A new attention kind is a core-attention module in ``attention.py`` and one entry in
``layer_specs.ATTENTION_KINDS``.
"""
