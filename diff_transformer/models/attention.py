"""Core attention modules: differential attention (DIFF V1) and the vanilla baseline, with pluggable backends.

Both plug into megatron-core's ``SelfAttention`` as its ``core_attention`` submodule. ``SelfAttention`` owns the
QKV and output projections and RoPE; for DIFF it is configured with 2H query heads and 2Hkv key/value heads of
size d, exactly like the mirrored baseline, so the two have the same projection parameters:

- query heads 2h and 2h+1 are (Q1, Q2) of differential head h; key heads 2g and 2g+1 are (K1, K2) of KV group g;
- value heads 2g and 2g+1 of size d, concatenated, are V of group g with size 2d (the same columns of Wv as
  viewing V as (Hkv, 2d));
- RoPE has already been applied to all 2H query and 2Hkv key heads by ``SelfAttention``.

The inputs arrive as ``[s, b, heads_per_tp_rank, d]`` and the output leaves as ``[s, b, heads_per_tp_rank * d]``.
A head pair never straddles tensor-parallel ranks because the number of differential heads and of KV groups are
both divisible by the TP size (checked in the config).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

BACKENDS = ("eager", "sdpa", "flash_attn", "triton")

# Set on parameters that every tensor-parallel rank holds a full copy of and whose gradient each rank computes
# only from its own heads: those gradients must be summed over the TP group (see ``finalize_model_grads``).
TP_REPLICATED_ATTR = "tp_replicated_partial_grad"


def lambda_init_for_layer(layer_number: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·(l−1)) for the global 1-based layer number l."""
    if layer_number < 1:
        raise ValueError(f"layer_number={layer_number} must be the global 1-based layer number")
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_number - 1))


def _require_causal(attn_mask_type) -> None:
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"attention mask type {attn_mask_type} is not supported; pretraining uses causal masks")


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise ImportError(
            "model.attention_backend=flash_attn needs the flash-attn package (GPU only: pip install flash-attn "
            "--no-build-isolation); use model.attention_backend=sdpa instead"
        ) from err
    return flash_attn_func


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Boolean mask, True where attention is allowed; aligned to the bottom right when sq < sk."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)


def _subtract_in_fp32(o1: torch.Tensor, lam: torch.Tensor, o2: torch.Tensor) -> torch.Tensor:
    """o1 − λ·o2 computed in fp32 (in bf16 the difference of two close outputs loses most of its bits), returned in
    the outputs' dtype."""
    return (o1.float() - lam.float() * o2.float()).to(o1.dtype)


def eager_attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale + causal mask) in fp32; q (b, h, sq, d), k (b, h, sk, d). Materialises the map."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.softmax(scores, dim=-1)


class _CoreAttentionBase(MegatronModule):
    """Shared constructor of megatron-core's core-attention protocol."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: str = "sdpa",
    ):
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"model.attention_backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism is not supported by this attention module yet")
        _require_causal(attn_mask_type)
        self.backend = backend
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def _check_call(self, attn_mask_type, attention_bias, packed_seq_params) -> None:
        _require_causal(attn_mask_type)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(f"{type(self).__name__} does not support packed sequences or attention bias")


class DifferentialCoreAttention(_CoreAttentionBase):
    """Differential attention V1: (softmax(Q1K1ᵀ·s) − λ·softmax(Q2K2ᵀ·s))·V per head, then per-head RMSNorm·(1−λ_init).

    λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one set of four d-vectors per layer shared by its heads.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: str = "sdpa",
        lambda_init: Optional[float] = None,
        sublayer_norm: bool = True,
        lambda_std: float = 0.1,
        norm_eps: float = 1e-5,
    ):
        super().__init__(
            config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
            cp_comm_type, pg_collection, backend,
        )
        d = self.head_dim
        self.lambda_init = lambda_init if lambda_init is not None else lambda_init_for_layer(layer_number)
        self.lambda_q1 = torch.nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k1 = torch.nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_q2 = torch.nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k2 = torch.nn.Parameter(torch.empty(d, dtype=torch.float32))
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
        return (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)

    def lambda_full(self) -> torch.Tensor:
        """The layer's λ as a 0-dim fp32 tensor (differentiable)."""
        lambda_1 = torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
        lambda_2 = torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
        return lambda_1 - lambda_2 + self.lambda_init

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
        lam = self.lambda_full()
        # (s, b, heads, d) -> (b, s, heads, d): the layout every backend below starts from.
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        v = v.reshape(b, s, two_g // 2, 2 * d)
        out = getattr(self, f"_forward_{self.backend}")(q, k, v, lam)  # (b, s, H, 2d)
        if self.sublayer_norm is not None:
            out = self.sublayer_norm(out)
        out = out * (1.0 - self.lambda_init)
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
        return _subtract_in_fp32(o1, lam, o2).transpose(1, 2)

    def _forward_flash_attn(self, q, k, v, lam):
        flash_attn_func = _flash_attn_func()
        q1, q2, k1, k2 = q[:, :, 0::2], q[:, :, 1::2], k[:, :, 0::2], k[:, :, 1::2]
        # flash-attn needs equal q/v head sizes: attend to the two halves of the 2d-wide V separately.
        va, vb = v.chunk(2, dim=-1)
        kw = dict(causal=True, softmax_scale=self.softmax_scale)
        o1 = torch.cat([flash_attn_func(q1, k1, va, **kw), flash_attn_func(q1, k1, vb, **kw)], dim=-1)
        o2 = torch.cat([flash_attn_func(q2, k2, va, **kw), flash_attn_func(q2, k2, vb, **kw)], dim=-1)
        return _subtract_in_fp32(o1, lam, o2)

    def _forward_triton(self, q, k, v, lam):
        try:
            from kernels import diff_flash_attn
        except ImportError as err:
            raise ImportError(
                "model.attention_backend=triton needs the fused kernel package `kernels` (kernels/diff_attn); "
                f"it could not be imported ({err}); use model.attention_backend=sdpa"
            ) from err
        return diff_flash_attn(q, k, v, lam, causal=True, softmax_scale=self.softmax_scale)


class VanillaCoreAttention(_CoreAttentionBase):
    """Standard causal softmax attention over 2H heads of size d (GQA when there are fewer KV heads)."""

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
        s, b, heads, d = query.shape
        if self.backend == "flash_attn":
            out = _flash_attn_func()(
                query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                causal=True, softmax_scale=self.softmax_scale,
            )
            return out.transpose(0, 1).reshape(s, b, heads * d)
        if self.backend == "triton":
            raise ValueError(
                "model.attention_backend=triton is the fused differential kernel; the vanilla baseline uses "
                "sdpa, flash_attn or eager"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        groups = q.shape[1] // k.shape[1]
        if self.backend == "eager":
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            out = torch.matmul(eager_attention_probs(q, k, self.softmax_scale), v.float()).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=groups > 1
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
