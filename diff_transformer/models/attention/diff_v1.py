"""DIFF V1: two softmax maps per head pair, λ per layer, the per-head sub-layer norm."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from diff_transformer.models.attention.base import (
    TP_REPLICATED_ATTR,
    CoreAttentionBase,
    eager_attention_probs,
    load_flash_attn_func,
    lambda_init_for_layer,
    subtract_in_fp32,
)
from diff_transformer.models.attention_maps import AttentionMaps

class DifferentialCoreAttention(CoreAttentionBase):
    """Differential attention V1: (softmax(Q1K1ᵀ·s) − λ·softmax(Q2K2ᵀ·s))·V per head, then per-head RMSNorm·(1−λ_init).

    λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one set of four d-vectors per layer shared by its heads.
    ``lambda_init`` fixes λ_init (default: the depth schedule). ``lambda_learnable=False`` (ablation) drops the four
    vectors: λ is the constant λ_init, and the output multiplier stays (1 − λ_init(l)) of the depth schedule, because
    (1 − λ) would zero the attention output when λ is frozen at 1 (pure cancellation).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        *,
        lambda_init: Optional[float] = None,
        sublayer_norm: bool = True,
        lambda_std: float = 0.1,
        norm_eps: float = 1e-5,
        lambda_learnable: bool = True,
        **protocol,
    ):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        d = self.head_dim
        self.lambda_init = lambda_init if lambda_init is not None else lambda_init_for_layer(layer_number)
        self.lambda_learnable = lambda_learnable
        self.output_scale = 1.0 - (self.lambda_init if lambda_learnable else lambda_init_for_layer(layer_number))
        if lambda_learnable:
            # In the model's dtype like every other weight (the mixed-precision optimizer keeps the fp32 main copy, and
            # megatron-core's optimizer checkpoint maps state to parameters assuming no fp32 weight in a bf16 model);
            # λ itself is computed from them in fp32 (`lambda_full`).
            self.lambda_q1 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
            self.lambda_k1 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
            self.lambda_q2 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
            self.lambda_k2 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
        self.sublayer_norm = (
            torch.nn.RMSNorm(2 * d, eps=norm_eps, elementwise_affine=True, dtype=config.params_dtype)
            if sublayer_norm
            else None
        )
        if config.perform_initialization:
            for p in self.lambda_parameters():
                torch.nn.init.normal_(p, mean=0.0, std=lambda_std)
        for p in self.parameters():
            setattr(p, TP_REPLICATED_ATTR, True)

    def lambda_parameters(self):
        if not self.lambda_learnable:
            return ()
        return (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)

    def lambda_full(self) -> torch.Tensor:
        """The layer's λ as a 0-dim fp32 tensor (differentiable when learnable)."""
        if not self.lambda_learnable:
            return torch.tensor(self.lambda_init, dtype=torch.float32)
        lambda_1 = torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
        lambda_2 = torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
        return lambda_1 - lambda_2 + self.lambda_init

    def attention_maps(self, query, key, value, attention_bias=None, rows=None) -> AttentionMaps:
        # the pairs are split before the key heads are repeated: query head 2h pairs with key head 2g, g its group
        maps = [
            self._softmax_maps(query[:, :, i::2], key[:, :, i::2], rows) for i in (0, 1)
        ]
        (rows, logits1, a1), (_, logits2, a2) = maps
        lam = self.lambda_full().detach().to(a1.device)
        return AttentionMaps(
            components={"A1": a1, "A2": a2}, logits={"A1": logits1, "A2": logits2}, combined=a1 - lam * a2,
            rows=rows, lam=lam,
        )

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
        self._check_call(attn_mask_type, attention_bias, packed_seq_params)
        s, b, two_h, d = query.shape
        two_g = key.shape[2]
        if two_h % 2 or two_g % 2:
            raise ValueError(f"query heads ({two_h}) and key heads ({two_g}) per rank must be even (head pairs)")
        lam = self.lambda_full().to(query.device)
        # (s, b, heads, d) -> (b, s, heads, d): the layout every backend below starts from.
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        v = v.reshape(b, s, two_g // 2, 2 * d)
        out = getattr(self, f"_forward_{self.backend}")(q, k, v, lam)  # (b, s, H, 2d)
        if self.backend != "triton":  # the fused kernel applies the norm and the output scale itself
            if self.sublayer_norm is not None:
                out = self.sublayer_norm(out)
            out = out * self.output_scale
        return out.transpose(0, 1).reshape(s, b, two_h * d)

    def _split_pairs(self, q, k):
        """(b, s, 2H, d) and (b, s, 2G, d) -> q1, q2 (b, H, s, d) and k1, k2 (b, G, s, d)."""
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        return q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]

    def _forward_eager(self, q, k, v, lam):
        q1, q2, k1, k2 = self._split_pairs(q, k)
        groups = q1.shape[1] // k1.shape[1]
        k1, k2 = (t.repeat_interleave(groups, dim=1) for t in (k1, k2))
        vh = v.transpose(1, 2).float().repeat_interleave(groups, dim=1)  # (b, H, s, 2d)
        a1 = eager_attention_probs(q1, k1, self.softmax_scale)
        a2 = eager_attention_probs(q2, k2, self.softmax_scale)
        out = torch.matmul(a1 - lam * a2, vh)
        return out.to(q.dtype).transpose(1, 2)

    def _forward_sdpa(self, q, k, v, lam):
        q1, q2, k1, k2 = self._split_pairs(q, k)
        vh = v.transpose(1, 2)
        gqa = q1.shape[1] != k1.shape[1]
        o1 = F.scaled_dot_product_attention(q1, k1, vh, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
        o2 = F.scaled_dot_product_attention(q2, k2, vh, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
        return subtract_in_fp32(o1, lam, o2).transpose(1, 2)

    def _forward_flash_attn(self, q, k, v, lam):
        flash_attn = load_flash_attn_func()
        q1, q2, k1, k2 = q[:, :, 0::2], q[:, :, 1::2], k[:, :, 0::2], k[:, :, 1::2]
        # flash-attn needs equal q/v head sizes: attend to the two halves of the 2d-wide V separately.
        va, vb = v.chunk(2, dim=-1)
        kw = dict(causal=True, softmax_scale=self.softmax_scale)
        o1 = torch.cat([flash_attn(q1, k1, va, **kw), flash_attn(q1, k1, vb, **kw)], dim=-1)
        o2 = torch.cat([flash_attn(q2, k2, va, **kw), flash_attn(q2, k2, vb, **kw)], dim=-1)
        return subtract_in_fp32(o1, lam, o2)

    def _forward_triton(self, q, k, v, lam):
        try:
            from kernels import diff_flash_attn
        except ImportError as err:
            raise ImportError(
                "model.attention_backend=triton needs the fused kernel package `kernels` (kernels/diff_attn); "
                f"it could not be imported ({err}); use model.attention_backend=sdpa"
            ) from err
        norm = self.sublayer_norm
        # The DIFF epilogue inside the kernel: RMSNorm over each head's 2d columns, its weight, and (1 − λ_init).
        return diff_flash_attn(q, k, v, lam, causal=True, softmax_scale=self.softmax_scale,
                               norm_weight=norm.weight if norm is not None else None,
                               norm_eps=norm.eps if norm is not None and norm.eps is not None
                               else torch.finfo(q.dtype).eps,
                               output_scale=self.output_scale)
