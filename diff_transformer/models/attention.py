"""Core attention modules of every attention kind, with pluggable backends.

- ``DifferentialCoreAttention``: DIFF V1 (also with λ frozen, ``lambda_learnable=False``);
- ``VanillaCoreAttention``: softmax attention, the baseline (and, with H heads of 2d, the head-count control);
- ``VanillaSublnCoreAttention``: the baseline plus DIFF's per-head RMSNorm and (1 − λ_init) multiplier;
- ``TopKCoreAttention``: softmax over each query's k largest causal scores;
- ``SignedMaskCoreAttention``: one softmax map gated by a learnable signed per-head, per-distance factor;
- ``DiffV2SelfAttention`` + ``DiffV2CoreAttention``: DIFF V2 (the only kind that changes ``SelfAttention`` itself:
  its λ comes from the layer input and its output projection reads H·d);
- ``DexCoreAttention``: DEX, the baseline's softmax attention with O − λ·O·W_D on selected heads (adapting a
  pretrained model).

All plug into megatron-core's ``SelfAttention`` as its ``core_attention`` submodule. ``SelfAttention`` owns the
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

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size

from diff_transformer.models.attention_maps import AttentionMaps, causal_logits, query_rows

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


def _heads_first(query: torch.Tensor, key: torch.Tensor):
    """megatron's [s, b, heads, d] query and key -> (b, heads, s, d), the key heads repeated to one per query head
    (GQA)."""
    q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
    return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def eager_attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale + causal mask) in fp32; q (b, h, sq, d), k (b, h, sk, d). Materialises the map."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.softmax(scores, dim=-1)


class _CoreAttentionBase(MegatronModule):
    """Shared constructor of megatron-core's core-attention protocol (megatron passes its arguments by keyword;
    subclasses add their own keywords and hand the protocol's on as ``**protocol``)."""

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

    def attention_maps(self, query, key, value, attention_bias=None, rows=None) -> AttentionMaps:
        """This layer's maps for the query positions ``rows`` (the protocol of ``models.attention_maps``)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not expose its attention maps; implement attention_maps "
            "(diff_transformer/models/attention_maps.py) so that the analysis tools can read it"
        )

    def _softmax_maps(self, query, key, rows, score_transform=None):
        """(rows, logits, probs) of plain causal softmax heads, probs after ``score_transform`` of the logits."""
        q, k = _heads_first(query, key)
        rows = query_rows(q.shape[-2], k.shape[-2], rows, q.device)
        logits = causal_logits(q, k, self.softmax_scale, rows)
        scores = score_transform(logits) if score_transform is not None else logits
        return rows, logits, torch.softmax(scores, dim=-1)


class DifferentialCoreAttention(_CoreAttentionBase):
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

    def attention_maps(self, query, key, value, attention_bias=None, rows=None) -> AttentionMaps:
        rows, logits, probs = self._softmax_maps(query, key, rows)
        return AttentionMaps(components={"A": probs}, logits={"A": logits}, combined=probs, rows=rows)

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
        self.sublayer_norm = torch.nn.RMSNorm(
            self.head_dim, eps=norm_eps, elementwise_affine=True, dtype=config.params_dtype
        )
        for p in self.parameters():
            setattr(p, TP_REPLICATED_ATTR, True)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        out = super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        s, b, heads, d = query.shape
        out = self.sublayer_norm(out.view(s, b, heads, d)) * (1.0 - self.lambda_init)
        return out.reshape(s, b, heads * d)


# ------------------------------------------------------------------------------------------------------------------
# Controls that change the attention map itself: no fused kernel exists, so `eager` materialises the map and `sdpa`
# (the default backend) runs the same math one block of queries at a time, recomputing each block in the backward.
# ------------------------------------------------------------------------------------------------------------------
BLOCK_QUERIES = 128  # rows of the map alive at once in the blockwise backend: BLOCK_QUERIES x N per head


def _attention_block(q, k, v, first_query: int, scale: float, score_transform, prob_transform):
    """Causal softmax attention of one block of queries, in fp32. q (b, h, m, d) holds queries first_query ..
    first_query + m − 1; k, v (b, h, n, ·) the keys 0 .. n − 1."""
    rows = torch.arange(first_query, first_query + q.shape[-2], device=q.device)
    cols = torch.arange(k.shape[-2], device=q.device)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    if score_transform is not None:
        scores = score_transform(scores)
    probs = torch.softmax(scores, dim=-1)
    if prob_transform is not None:
        probs = prob_transform(probs, rows, cols)
    return torch.matmul(probs, v.float())


def blockwise_attention(q, k, v, scale: float, score_transform=None, prob_transform=None,
                        block: Optional[int] = BLOCK_QUERIES) -> torch.Tensor:
    """Causal attention with a transform of the scores before the softmax and of the probabilities after it.

    q (b, h, sq, d), k and v (b, h, sk, ·) with matching heads; returns fp32 (b, h, sq, ·). With ``block`` set, one
    block of queries is materialised at a time and recomputed in the backward (activation checkpointing), so memory
    is O(block·sk) per head instead of O(sq·sk); ``block=None`` materialises the whole map (the eager backend).
    """
    sq, sk = q.shape[-2], k.shape[-2]
    offset = sk - sq  # bottom-right alignment, as everywhere else
    if block is None or block >= sq:
        return _attention_block(q, k, v, offset, scale, score_transform, prob_transform)
    outs = []
    for start in range(0, sq, block):
        stop = min(start + block, sq)
        visible = stop + offset  # keys the block's last query sees; later keys are masked for the whole block
        args = (q[:, :, start:stop], k[:, :, :visible], v[:, :, :visible])
        fn = functools.partial(_attention_block, first_query=start + offset, scale=scale,
                               score_transform=score_transform, prob_transform=prob_transform)
        if torch.is_grad_enabled():
            outs.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return torch.cat(outs, dim=-2)


def keep_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Scores outside each row's k largest become −inf (masked scores are −inf already, so a row with k or fewer
    visible keys keeps them all; ties with the k-th score are kept too)."""
    if k >= scores.shape[-1]:
        return scores
    kth = scores.detach().topk(k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


class _MapControlCoreAttention(_CoreAttentionBase):
    """Shared forward of the controls that transform the softmax map: 2H heads of d, GQA over 2Hkv KV heads."""

    SUPPORTED_BACKENDS = ("eager", "sdpa")

    def __init__(self, config, layer_number, attn_mask_type, **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        # This rank's heads are the tp_rank-th slice of all heads (None outside a SelfAttention: rank 0).
        self.tp_rank = get_pg_rank(getattr(protocol.get("pg_collection"), "tp", None))
        if self.backend not in self.SUPPORTED_BACKENDS:
            raise ValueError(
                f"model.attention_backend={self.backend} has no {type(self).__name__} (no fused kernel transforms the map); "
                "use sdpa (blockwise) or eager"
            )

    def transforms(self, first_head: int, num_heads: int):
        """(score_transform, prob_transform) for this rank's heads first_head .. first_head + num_heads − 1."""
        raise NotImplementedError

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        self._check_call(attn_mask_type, attention_bias, packed_seq_params)
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        groups = heads // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        score_transform, prob_transform = self.transforms(self.tp_rank * heads, heads)
        out = blockwise_attention(q, k, v, self.softmax_scale, score_transform, prob_transform,
                                  block=None if self.backend == "eager" else BLOCK_QUERIES)
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(s, b, heads * d)


class TopKCoreAttention(_MapControlCoreAttention):
    """Softmax attention where each query keeps only its k largest causal scores (the sparsity control):
    softmax(topk_k(Q·Kᵀ·s + causal mask))·V, scores outside the k largest set to −inf before the softmax."""

    def __init__(self, config, layer_number, attn_mask_type, *, topk: int = 32, **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        if topk < 1:
            raise ValueError(f"model.topk={topk} must be >= 1")
        self.topk = topk

    def transforms(self, first_head, num_heads):
        return functools.partial(keep_top_k, k=self.topk), None

    def attention_maps(self, query, key, value, attention_bias=None, rows=None) -> AttentionMaps:
        rows, logits, probs = self._softmax_maps(query, key, rows, functools.partial(keep_top_k, k=self.topk))
        return AttentionMaps(components={"A": probs}, logits={"A": logits}, combined=probs, rows=rows)


SIGNED_MASK_BUCKETS = 32
SIGNED_MASK_INIT = -3.0  # 1 − 2·sigmoid(−3) = 0.905: training starts close to plain softmax attention


def relative_position_bucket(distance: torch.Tensor, max_distance: int, num_buckets: int = SIGNED_MASK_BUCKETS):
    """T5's causal buckets of the distance i − j >= 0: one bucket per distance below num_buckets/2, then
    logarithmically wider buckets up to max_distance (farther distances share the last bucket)."""
    exact = num_buckets // 2
    max_distance = max(max_distance, 2 * exact)
    distance = distance.clamp(min=0)
    log_ratio = torch.log(distance.float().clamp(min=exact) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(distance < exact, distance, large)


class SignedMaskCoreAttention(_MapControlCoreAttention):
    """One softmax map with a learnable signed gate on its weights (the single-map control):
    out = (A ⊙ G)·V with A = softmax(Q·Kᵀ·s + causal mask) and G[h, i, j] = 1 − 2·sigmoid(m[h, bucket(i − j)]),
    m a learnable logit per head and per relative-distance bucket (``relative_position_bucket``). G lies in
    (−1, 1), so a weight can be subtracted without a second map.

    m holds every head's logits on every tensor-parallel rank (each rank uses its heads' rows); its gradient is
    summed over the TP group like DIFF's λ.
    """

    def __init__(self, config, layer_number, attn_mask_type, *, max_distance: int = 2048, **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        self.max_distance = max_distance
        self.mask_logits = torch.nn.Parameter(
            torch.full((config.num_attention_heads, SIGNED_MASK_BUCKETS), SIGNED_MASK_INIT, dtype=config.params_dtype)
        )
        setattr(self.mask_logits, TP_REPLICATED_ATTR, True)

    def gate(self, rows: torch.Tensor, cols: torch.Tensor, first_head: int, num_heads: int) -> torch.Tensor:
        """G for query positions ``rows`` and key positions ``cols``: (num_heads, len(rows), len(cols)), fp32."""
        buckets = relative_position_bucket(rows[:, None] - cols[None, :], self.max_distance)
        logits = self.mask_logits[first_head : first_head + num_heads].float()
        return 1.0 - 2.0 * torch.sigmoid(logits[:, buckets])

    def transforms(self, first_head, num_heads):
        def apply_gate(probs, rows, cols):
            return probs * self.gate(rows, cols, first_head, num_heads)

        return None, apply_gate

    def attention_maps(self, query, key, value, attention_bias=None, rows=None) -> AttentionMaps:
        rows, logits, probs = self._softmax_maps(query, key, rows)
        heads = probs.shape[1]
        cols = torch.arange(probs.shape[-1], device=probs.device)
        gate = self.gate(rows, cols, self.tp_rank * heads, heads).detach()
        return AttentionMaps(components={"A": probs}, logits={"A": logits}, combined=probs * gate, rows=rows)


# ------------------------------------------------------------------------------------------------------------------
# DIFF V2
# ------------------------------------------------------------------------------------------------------------------
class DiffV2CoreAttention(_CoreAttentionBase):
    """Differential attention V2: one causal attention of 2H query heads of d over Hkv KV heads of d (GQA; head
    pair (2h, 2h+1) lies in one KV group because Hkv divides H), then head_h = O[2h] − λ_h,t·O[2h+1] in fp32, with
    λ_h,t = sigmoid(x_t·W_λ)_h computed by ``DiffV2SelfAttention`` and passed in as ``attention_bias`` (its logits,
    [s, b, H per rank]). No sub-layer norm. Output [s, b, H per rank · d]."""

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_bias is None:
            raise ValueError("DiffV2CoreAttention needs the per-token λ logits from DiffV2SelfAttention (attention_bias)")
        self._check_call(attn_mask_type, None, packed_seq_params)
        s, b, two_h, d = query.shape
        if two_h % 2 or (two_h // 2) % key.shape[2]:
            raise ValueError(f"{two_h} query heads over {key.shape[2]} KV heads: head pairs must share a KV group")
        lam = torch.sigmoid(attention_bias.float()).transpose(0, 1)  # (b, s, H)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # (b, s, heads, d)
        if self.backend == "triton":
            out = self._forward_triton(q, k, v, lam)
        else:
            o = getattr(self, f"_forward_{self.backend}")(q, k, v).float()  # (b, s, 2H, d)
            out = o[:, :, 0::2] - lam.unsqueeze(-1) * o[:, :, 1::2]
        return out.to(query.dtype).transpose(0, 1).reshape(s, b, two_h // 2 * d)

    def attention_maps(self, query, key, value, attention_bias=None, rows=None) -> AttentionMaps:
        if attention_bias is None:
            raise ValueError("DiffV2CoreAttention needs the per-token λ logits from DiffV2SelfAttention (attention_bias)")
        rows, logits, probs = self._softmax_maps(query, key, rows)
        # λ of head h at query position t: (b, H, rows, 1)
        lam = torch.sigmoid(attention_bias.float()).permute(1, 2, 0)[..., rows].unsqueeze(-1)
        a1, a2 = probs[:, 0::2], probs[:, 1::2]
        return AttentionMaps(
            components={"A1": a1, "A2": a2}, logits={"A1": logits[:, 0::2], "A2": logits[:, 1::2]},
            combined=a1 - lam * a2, rows=rows, lam=lam,
        )

    def _forward_eager(self, q, k, v):
        groups = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        return torch.matmul(eager_attention_probs(q, k, self.softmax_scale), v.float()).transpose(1, 2)

    def _forward_sdpa(self, q, k, v):
        gqa = q.shape[2] != k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
        return o.transpose(1, 2)

    def _forward_flash_attn(self, q, k, v):
        return _flash_attn_func()(q, k, v, causal=True, softmax_scale=self.softmax_scale)

    def _forward_triton(self, q, k, v, lam):
        try:
            from kernels import diff_flash_attn_v2
        except ImportError as err:
            raise ImportError(
                "model.attention_backend=triton needs the fused kernel package `kernels` (kernels/diff_attn); "
                f"it could not be imported ({err}); use model.attention_backend=sdpa"
            ) from err
        return diff_flash_attn_v2(q, k, v, lam, causal=True, softmax_scale=self.softmax_scale)


class DiffV2SelfAttention(SelfAttention):
    """megatron-core's SelfAttention for DIFF V2, configured with 2H query heads and Hkv KV groups of size d.

    Adds W_λ (hidden → H, no bias, column-parallel: a rank holds the λ of its own head pairs) and gives the core
    attention λ's logits x·W_λ through its ``attention_bias`` argument, the one tensor SelfAttention passes through;
    the output projection reads H·d, since each pair of query heads leaves one head after the subtraction.
    """

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection)
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size // 2,
            self.config.hidden_size,
            config=self.config,
            init_method=self.config.output_layer_init_method,
            bias=self.config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=self.pg_collection.tp,
        )
        self.linear_lambda = ColumnParallelLinear(
            self.config.hidden_size,
            self.config.num_attention_heads // 2,
            config=self.config,
            init_method=self.config.init_method,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
            is_expert=False,
            tp_group=self.pg_collection.tp,
        )

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("attention_bias") is not None:
            raise ValueError("DIFF V2 uses the attention_bias slot for its λ; an attention bias is not supported")
        lambda_logits, _ = self.linear_lambda(hidden_states)  # [s, b, H per rank]
        kwargs["attention_bias"] = lambda_logits
        return super().forward(hidden_states, attention_mask, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# DEX: differential attention added to a pretrained softmax-attention model (Kong et al., arXiv 2505.16333)
# ------------------------------------------------------------------------------------------------------------------
DEX_ANNEAL_SCHEDULES = ("linear", "cosine")


def dex_anneal_fraction(step: int, anneal_steps: int, schedule: str = "linear") -> float:
    """How far λ has moved from λ_init to its learned value after ``step`` optimizer steps: 0 at step 0, 1 from
    ``anneal_steps`` on (``anneal_steps`` 0: learned from the start)."""
    if schedule not in DEX_ANNEAL_SCHEDULES:
        raise ValueError(f"model.dex.lambda_anneal={schedule!r} is unknown; use one of {', '.join(DEX_ANNEAL_SCHEDULES)}")
    if anneal_steps <= 0:
        return 1.0
    x = min(max(step, 0) / anneal_steps, 1.0)
    return x if schedule == "linear" else 0.5 * (1.0 - math.cos(math.pi * x))


class DexCoreAttention(VanillaCoreAttention):
    """DEX: the pretrained softmax attention, unchanged, over 2H heads of d; on the selected heads of the layer the
    head's output O (tokens × d) becomes O' = O − λ·O·W_D before the output projection, i.e. O·(I − λ·W_D).

    - W_D is one d×d matrix per selected head (``w_d[str(global head)]``), zero-initialised, so the adapted model
      starts exactly equal to the pretrained one; it lives on the tensor-parallel rank that holds its head, and it
      is saved under its global head index (``sharded_state_dict``), so checkpoints reshard across TP and PP.
    - λ = (1 − a)·λ_init + a·λ_learned with DIFF's re-parameterisation λ_learned = exp(λq1·λk1) − exp(λq2·λk2) +
      λ_init (four d-vectors per layer, TP-replicated like DIFF's), λ_init the depth schedule (or ``lambda_init``),
      and a ∈ [0, 1] the annealing fraction the trainer sets each step (``set_anneal_fraction``).
    - ``calibrating``: the forward also accumulates, per local head, the attention entropy of its map and the
      gradient importance of its output (Michel et al. 2019: |Σ_t O_h·∂L/∂O_h| per sequence), which the head
      selection of ``training.dex`` reads (``head_statistics``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        *,
        heads_per_layer=None,
        lambda_init: Optional[float] = None,
        lambda_std: float = 0.1,
        **protocol,
    ):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        if self.backend == "triton":
            raise ValueError("model.attention=dex keeps the pretrained softmax attention; use sdpa, flash_attn or eager")
        if heads_per_layer is None or len(heads_per_layer) < layer_number:
            raise ValueError(
                f"model.dex.heads gives no head list for layer {layer_number}; the trainer resolves it (calibration, "
                "all, none) before the model is built, or give one list per layer with model.dex.select=list"
            )
        tp_group = getattr(protocol.get("pg_collection"), "tp", None)
        tp_size = get_pg_size(tp_group)
        self.tp_rank = get_pg_rank(tp_group)
        self.num_local_heads = config.num_attention_heads // tp_size
        first = self.tp_rank * self.num_local_heads
        selected = sorted(int(h) for h in heads_per_layer[layer_number - 1])
        self.global_heads = [h for h in selected if first <= h < first + self.num_local_heads]
        self.register_buffer(
            "local_head_index", torch.tensor([h - first for h in self.global_heads], dtype=torch.long), persistent=False
        )
        d = self.head_dim
        self.w_d = torch.nn.ParameterDict(
            {str(h): torch.nn.Parameter(torch.zeros(d, d, dtype=config.params_dtype)) for h in self.global_heads}
        )
        for p in self.w_d.values():
            # one copy in the whole TP group (its head's rank): megatron counts it once in grad norms, never summed
            setattr(p, "tensor_model_parallel", True)
            setattr(p, "partition_dim", 0)
            setattr(p, "partition_stride", 1)
        self.lambda_init = lambda_init if lambda_init is not None else lambda_init_for_layer(layer_number)
        self.lambda_q1 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
        self.lambda_k1 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
        self.lambda_q2 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
        self.lambda_k2 = torch.nn.Parameter(torch.empty(d, dtype=config.params_dtype))
        for p in self.lambda_parameters():
            if config.perform_initialization:
                torch.nn.init.normal_(p, mean=0.0, std=lambda_std)
            setattr(p, TP_REPLICATED_ATTR, True)
        self.anneal_fraction = 0.0
        self.calibrating = False
        self.reset_statistics()

    def lambda_parameters(self):
        return (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)

    def own_parameter_names(self):
        """Names (relative to this module) of the parameters DEX adds to the pretrained model."""
        return [f"w_d.{h}" for h in self.w_d] + ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]

    def set_anneal_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"the λ annealing fraction must lie in [0, 1], got {fraction}")
        self.anneal_fraction = float(fraction)

    def lambda_full(self) -> torch.Tensor:
        """The layer's λ as a 0-dim fp32 tensor: λ_init moved towards its learned value by the annealing fraction."""
        learned = (
            torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
            - torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
            + self.lambda_init
        )
        a = self.anneal_fraction
        return (1.0 - a) * self.lambda_init + a * learned

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        out = super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        s, b, heads, d = query.shape
        if self.calibrating:
            out = self._record_statistics(query, key, out.view(s, b, heads, d)).reshape(s, b, heads * d)
        if not self.global_heads:
            return out
        o = out.view(s, b, heads, d)
        idx = self.local_head_index.to(o.device)
        selected = o.index_select(2, idx).float()  # (s, b, n, d)
        w_d = torch.stack([self.w_d[str(h)] for h in self.global_heads]).float()  # (n, d, d)
        lam = self.lambda_full().to(o.device)
        # O·(I − λ W_D) in fp32, rounded once: with W_D = 0 every element is returned bit for bit
        adapted = selected - lam * torch.einsum("sbnd,nde->sbne", selected, w_d)
        return o.index_copy(2, idx, adapted.to(o.dtype)).reshape(s, b, heads * d)

    # -- calibration ---------------------------------------------------------------------------------------------
    def reset_statistics(self) -> None:
        n = self.num_local_heads
        self.entropy_sum = torch.zeros(n, dtype=torch.float64)
        self.entropy_count = 0
        self.importance_sum = torch.zeros(n, dtype=torch.float64)
        self.importance_count = 0

    @torch.no_grad()
    def _accumulate_entropy(self, query, key) -> None:
        """Σ over queries of the entropy of each head's causal map divided by log(visible keys) (1: uniform over the
        causal prefix, 0: one key), skipping the first query, which sees one key."""
        s, b, heads, d = query.shape
        q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)  # (b, heads, s, d)
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        probs = eager_attention_probs(q, k, self.softmax_scale)  # (b, heads, s, s) fp32
        entropy = -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(-1)  # (b, heads, s)
        visible = torch.arange(1, s + 1, device=probs.device, dtype=probs.dtype) + (k.shape[-2] - s)
        normalised = entropy[..., 1:] / torch.log(visible[1:])
        self.entropy_sum += normalised.sum(dim=(0, 2)).double().cpu()
        self.entropy_count += b * (s - 1)

    def _record_statistics(self, query, key, o):
        self._accumulate_entropy(query, key)
        if torch.is_grad_enabled() and o.requires_grad:
            o = o.clone()  # the hooked tensor: the importance is the derivative of the loss by a gate ξ_h = 1 on O_h
            detached = o.detach()

            def importance_hook(grad):
                per_sequence = (detached.float() * grad.float()).sum(dim=(0, 3)).abs()  # (b, heads)
                self.importance_sum += per_sequence.sum(0).double().cpu()
                self.importance_count += per_sequence.shape[0]

            o.register_hook(importance_hook)
        return o

    def head_statistics(self):
        """{global head: (mean normalised entropy, mean importance)} of this rank's heads; None where no data."""
        first = self.tp_rank * self.num_local_heads
        stats = {}
        for i in range(self.num_local_heads):
            entropy = float(self.entropy_sum[i]) / self.entropy_count if self.entropy_count else None
            importance = float(self.importance_sum[i]) / self.importance_count if self.importance_count else None
            stats[first + i] = (entropy, importance)
        return stats

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """W_D of head h in layer l is its own tensor ``w_d.layer_<l>.head_<h>``, saved by the one rank that holds it
        (replica (0, 0, dp rank)) and not stacked over layers like the other layer tensors (layers select different
        heads), so any TP/PP layout finds it by name; λ vectors are TP-replicated as usual."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_rank = get_pg_rank(metadata["dp_cp_group"])
        for name, param in self.w_d.items():
            key = f"{prefix}w_d.layer_{self.layer_number}.head_{name}"
            sharded[f"{prefix}w_d.{name}"] = make_sharded_tensor_for_checkpoint(param, key, replica_id=(0, 0, dp_rank))
        return sharded
