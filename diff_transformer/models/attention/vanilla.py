"""The vanilla family: softmax attention (the baseline, and with H heads of 2d the head-count control) and the
baseline with DIFF's sub-layer norm."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from diff_transformer.models.attention.base import (
    FLASH_LIBRARIES,
    TP_REPLICATED_ATTR,
    CoreAttentionBase,
    eager_attention_probs,
    flash_attention,
    lambda_init_for_layer,
    reference_dtype,
    scaled_dot_product_attention,
)
from diff_transformer.models.attention_maps import AttentionMaps
from diff_transformer.models.documents import documents_of
from diff_transformer.models.ring_attention import ring_attention

class VanillaCoreAttention(CoreAttentionBase):
    """Standard causal softmax attention over 2H heads of size d (GQA when there are fewer KV heads)."""

    supports_context_parallel = True

    def attention_maps(self, query, key, value, attention_bias=None, rows=None, document_ids=None) -> AttentionMaps:
        rows, logits, probs = self._softmax_maps(query, key, rows, document_ids=document_ids)
        return AttentionMaps(components={"A": probs}, logits={"A": logits}, combined=probs, rows=rows,
                             document_ids=document_ids)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        documents = self._check_call(attn_mask_type, attention_bias, packed_seq_params)
        s, b, heads, d = query.shape
        if self.ring is not None:  # the sequence split over the context-parallel group (models/ring_attention.py)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            (out,) = ring_attention([q], k, v, (slice(None),), self.softmax_scale, self.ring, self.backend,
                                    document_ids=documents_of(documents))
            return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        if self.backend in FLASH_LIBRARIES:
            q, k, v = (t.transpose(0, 1) for t in (query, key, value))
            out = flash_attention(q, k, v, self.softmax_scale, documents, self.backend)
            return out.transpose(0, 1).reshape(s, b, heads * d)
        if self.backend == "triton":
            raise ValueError(
                "model.attention_backend=triton is the fused differential kernel; the vanilla baseline uses "
                "sdpa, flash_attn, flash_attn4 or eager"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        groups = q.shape[1] // k.shape[1]
        if self.backend == "eager":
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            probs = eager_attention_probs(q, k, self.softmax_scale, documents_of(documents))
            out = torch.matmul(probs, v.to(reference_dtype(q))).to(q.dtype)
        else:
            out = scaled_dot_product_attention(q, k, v, self.softmax_scale, groups > 1, documents)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class VanillaSublnCoreAttention(VanillaCoreAttention):
    """The baseline plus DIFF's sub-layer norm: softmax attention over 2H heads of d, then each head normalised by
    RMSNorm over its d features (one affine weight shared by the heads, as DIFF shares its 2d weight) and
    multiplied by (1 − λ_init). Isolates the norm from the differential mechanism (the paper's
    "Transformer + GroupNorm" row)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        *,
        lambda_init: Optional[float] = None,
        norm_eps: float = 1e-5,
        **protocol,
    ):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        self.lambda_init = lambda_init if lambda_init is not None else lambda_init_for_layer(layer_number)
        # (1 − λ_init) as data inside a compiled layer (trainer.compile; DIFF V1's compiled_constants says why)
        self.register_buffer("compiled_output_scale", torch.tensor(1.0 - self.lambda_init), persistent=False)
        self.sublayer_norm = torch.nn.RMSNorm(
            self.head_dim, eps=norm_eps, elementwise_affine=True, dtype=config.params_dtype
        )
        for p in self.parameters():
            setattr(p, TP_REPLICATED_ATTR, True)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        out = super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        s, b, heads, d = query.shape
        # (1 − λ_init) folded into the norm weight at run time: one fused norm kernel, the parameter unchanged
        scale = self.compiled_output_scale if torch.compiler.is_compiling() else 1.0 - self.lambda_init
        weight = (self.sublayer_norm.weight.float() * scale).to(out.dtype)
        out = F.rms_norm(out.view(s, b, heads, d), (d,), weight, self.sublayer_norm.eps)
        return out.reshape(s, b, heads * d)
