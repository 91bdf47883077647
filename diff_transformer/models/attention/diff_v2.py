"""DIFF V2: one attention of 2H query heads over shared KV heads, a per-token λ from the layer input; the only
kind that changes ``SelfAttention`` itself (its λ projection, and an output projection reading H·d)."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import build_module

from diff_transformer.models.attention.base import (
    CoreAttentionBase,
    eager_attention_probs,
    flash_attention,
    reference_dtype,
    scaled_dot_product_attention,
)
from diff_transformer.models.attention.epilogue import EPILOGUE_IMPLS, diff_epilogue, paired_halves
from diff_transformer.models.attention_maps import AttentionMaps
from diff_transformer.models.documents import documents_of
from diff_transformer.models.ring_attention import IMPLEMENTATIONS as RING_IMPLEMENTATIONS
from diff_transformer.models.ring_attention import differential_ring_attention, fused_kernel_package, ring_attention

class DiffV2CoreAttention(CoreAttentionBase):
    """Differential attention V2: one causal attention of 2H query heads of d over Hkv KV heads of d (GQA; head
    pair (2h, 2h+1) lies in one KV group because Hkv divides H), then head_h = O[2h] − λ_h,t·O[2h+1] in fp32, with
    λ_h,t = sigmoid(x_t·W_λ)_h computed by ``DiffV2SelfAttention`` and passed in as ``attention_bias`` (its logits,
    [s, b, H per rank]). No sub-layer norm. Output [s, b, H per rank · d].

    ``sdpa`` and ``flash_attn`` are one library call with equal head dims over the 2H heads; the subtraction and the
    layout are the epilogue of ``models.attention.epilogue`` (``epilogue`` picks its implementation)."""

    def __init__(self, config, layer_number, attn_mask_type, *, epilogue: str = "unfused", **protocol):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        if epilogue not in EPILOGUE_IMPLS:
            raise ValueError(f"trainer.diff_epilogue={epilogue!r} is unknown; use one of {', '.join(EPILOGUE_IMPLS)}")
        self.epilogue = epilogue

    supports_context_parallel = True
    ring_backends = RING_IMPLEMENTATIONS + ("triton",)  # the fused kernel's context-parallel pieces

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_bias is None:
            raise ValueError("DiffV2CoreAttention needs the per-token λ logits from DiffV2SelfAttention (attention_bias)")
        documents = self._check_call(attn_mask_type, None, packed_seq_params)
        s, b, two_h, d = query.shape
        if two_h % 2 or (two_h // 2) % key.shape[2]:
            raise ValueError(f"{two_h} query heads over {key.shape[2]} KV heads: head pairs must share a KV group")
        lam = torch.sigmoid(attention_bias.float()).transpose(0, 1)  # (b, s, H)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # (b, s, heads, d)
        if self.backend == "triton" and self.ring is None:
            out = self._forward_triton(q, k, v, lam, documents)
            return out.to(query.dtype).transpose(0, 1).reshape(s, b, two_h // 2 * d)
        if self.backend == "triton":  # the fused ring: y = O1 − λ·O2 (b, s, H, d) in fp32, the maps already combined
            halves = [differential_ring_attention(q, k, v, lam, self.softmax_scale, self.ring, shared_k=True,
                                                  document_ids=documents_of(documents)).unsqueeze(2)]
        else:
            forward = self._forward_ring if self.ring is not None else getattr(self, f"_forward_{self.backend}")
            halves = [paired_halves(forward(q, k, v, documents), "interleaved")]  # (b, s, 2H, d); eager's in fp32
        impl = "unfused" if self.backend == "eager" else self.epilogue
        return diff_epilogue(halves, lam, None, 0.0, 1.0, impl=impl).to(query.dtype)

    def attention_maps(self, query, key, value, attention_bias=None, rows=None, document_ids=None) -> AttentionMaps:
        if attention_bias is None:
            raise ValueError("DiffV2CoreAttention needs the per-token λ logits from DiffV2SelfAttention (attention_bias)")
        rows, logits, probs = self._softmax_maps(query, key, rows, document_ids=document_ids)
        # λ of head h at query position t: (b, H, rows, 1)
        lam = torch.sigmoid(attention_bias.float()).permute(1, 2, 0)[..., rows].unsqueeze(-1)
        a1, a2 = probs[:, 0::2], probs[:, 1::2]
        return AttentionMaps(
            components={"A1": a1, "A2": a2}, logits={"A1": logits[:, 0::2], "A2": logits[:, 1::2]},
            combined=a1 - lam * a2, rows=rows, lam=lam, document_ids=document_ids,
        )

    def _forward_ring(self, q, k, v, documents):
        """The sequence split over the context-parallel group: one map around the ring (models/ring_attention.py)."""
        (o,) = ring_attention([q.transpose(1, 2)], k.transpose(1, 2), v.transpose(1, 2), (slice(None),),
                              self.softmax_scale, self.ring, self.backend, document_ids=documents_of(documents))
        return o.transpose(1, 2)

    def _forward_eager(self, q, k, v, documents):
        groups = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        probs = eager_attention_probs(q, k, self.softmax_scale, documents_of(documents))
        return torch.matmul(probs, v.to(reference_dtype(q))).transpose(1, 2)

    def _forward_sdpa(self, q, k, v, documents):
        gqa = q.shape[2] != k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return scaled_dot_product_attention(q, k, v, self.softmax_scale, gqa, documents).transpose(1, 2)

    def _forward_flash_attn(self, q, k, v, documents):
        return flash_attention(q, k, v, self.softmax_scale, documents, self.backend)

    _forward_flash_attn4 = _forward_flash_attn  # the same call into flash-attn-4's library

    def _forward_triton(self, q, k, v, lam, documents):
        return fused_kernel_package().diff_flash_attn_v2(q, k, v, lam, causal=True, softmax_scale=self.softmax_scale,
                                                         document_ids=documents_of(documents))


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
        # While recording (logging steps): how many λ, Σλ and Σλ² over this rank's tokens and heads, in fp64 on the
        # device (no host sync in the step)
        self.lambda_sums: torch.Tensor | None = None

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("attention_bias") is not None:
            raise ValueError("DIFF V2 uses the attention_bias slot for its λ; an attention bias is not supported")
        lambda_logits, _ = self.linear_lambda(hidden_states)  # [s, b, H per rank]
        if self.lambda_sums is not None:
            lam = torch.sigmoid(lambda_logits.detach().float())
            count = torch.full((), lam.numel(), dtype=torch.float64, device=lam.device)  # a fill, not a copy
            self.lambda_sums += torch.stack([count, lam.sum(dtype=torch.float64), lam.square().sum(dtype=torch.float64)])
        kwargs["attention_bias"] = lambda_logits
        return super().forward(hidden_states, attention_mask, **kwargs)


def v2_self_attentions(model_chunks) -> list:
    """This rank's DIFF V2 attentions, in layer order."""
    found = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, DiffV2SelfAttention)]
    return sorted(found, key=lambda m: m.layer_number)


def record_lambda(model_chunks, on: bool) -> None:
    """Start (zeroed) or stop summing each V2 layer's per-token λ in its forward passes."""
    for module in v2_self_attentions(model_chunks):
        device = module.linear_lambda.weight.device
        module.lambda_sums = torch.zeros(3, dtype=torch.float64, device=device) if on else None


def recorded_lambda_sums(model_chunks) -> torch.Tensor:
    """(V2 layers of this rank, 3): how many λ, Σλ and Σλ² per layer since :func:`record_lambda` started, on the
    device; partial over TP ranks (which hold different heads) and data-parallel ranks: their sum is the whole."""
    return torch.stack([m.lambda_sums for m in v2_self_attentions(model_chunks)])


