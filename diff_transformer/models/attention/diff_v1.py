"""DIFF V1: two softmax maps per head pair, λ per layer, the per-head sub-layer norm."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from diff_transformer.models.attention.base import (
    TP_REPLICATED_ATTR,
    CoreAttentionBase,
    eager_attention_probs,
    lambda_init_for_layer,
    flash_attention,
    reference_dtype,
    scaled_dot_product_attention,
)
from diff_transformer.models.attention.combined_map import combined_map_attention
from diff_transformer.models.attention.epilogue import EPILOGUE_IMPLS, diff_epilogue, paired_halves
from diff_transformer.models.attention_maps import AttentionMaps
from diff_transformer.models.documents import documents_of
from diff_transformer.models.ring_attention import IMPLEMENTATIONS as RING_IMPLEMENTATIONS
from diff_transformer.models.ring_attention import differential_ring_attention, fused_kernel_package, ring_attention


def lambda_difference(q1, k1, q2, k2) -> torch.Tensor:
    """exp(λq1·λk1) − exp(λq2·λk2) in fp32 (fp64 for fp64 vectors).

    Eager on every device: about twenty small operations forward and backward in a bf16 model, once per layer and
    micro-batch. A compiled function (one fused kernel each way) costs more host time than that: 330 µs against 210
    per call on a 2-core CPU (``torch.compile`` of this function, bf16 vectors of 96, forward and backward), and
    DIFF's step on a GPU waits on the host."""
    dtype = reference_dtype(q1)
    return torch.exp(torch.dot(q1.to(dtype), k1.to(dtype))) - torch.exp(torch.dot(q2.to(dtype), k2.to(dtype)))


def library_layout(q, k, v):
    """DIFF V1's work laid out for library attention kernels, every call with equal query, key and value head dims.

    q (b, s, 2H, d), k and v (b, s, 2G, d) as megatron's projections give them (value heads 2g, 2g+1 are the two
    d-wide halves of the 2d-wide V of group g). Returns (q, k, [v_a, v_b], pairs, gqa): two calls of 2H query heads,
    one per half of V, each the size of the baseline's attention call; call c gives map m of head h at query head
    2h + m (``pairs="interleaved"``) or m·H + h (``"grouped"``).

    - G = H (no GQA): q and k are the projections themselves (views, no copies); v_c repeats half c of every group
      once per head of the pair (head 2g + m), so query head 2h + m meets key head 2h + m and V_c of group h.
    - G < H (GQA): q and k are copied into map-major order (heads m·H + h and m·G + g) and v_c repeated per map
      (head m·G + g), so the library's GQA (query head i reads KV head i // (H/G)) pairs them as DIFF does.

    Both halves come from one copy of V, half-major (v_a and v_b are its two contiguous halves), so the backward
    gathers V's gradient in one stack and one sum, where a slice per half would zero-fill and scatter a V-sized
    gradient per half and add them.
    """
    two_h, two_g = q.shape[2], k.shape[2]
    halves = v.unflatten(2, (two_g // 2, 2)).permute(3, 0, 1, 2, 4)  # (2, b, s, G, d): half c of every group
    if two_h == two_g:
        return q, k, list(halves.repeat_interleave(2, dim=3).unbind(0)), "interleaved", False
    q = q.unflatten(2, (two_h // 2, 2)).transpose(2, 3).flatten(2, 3)
    k = k.unflatten(2, (two_g // 2, 2)).transpose(2, 3).flatten(2, 3)
    return q, k, list(halves.repeat(1, 1, 1, 2, 1).unbind(0)), "grouped", True


class DifferentialCoreAttention(CoreAttentionBase):
    """Differential attention V1: (softmax(Q1K1ᵀ·s) − λ·softmax(Q2K2ᵀ·s))·V per head, then per-head RMSNorm·(1−λ_init).

    λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, one set of four d-vectors per layer shared by its heads.
    ``lambda_init`` fixes λ_init (default: the depth schedule). ``lambda_learnable=False`` (ablation) drops the four
    vectors: λ is the constant λ_init, and the output multiplier stays (1 − λ_init(l)) of the depth schedule, because
    (1 − λ) would zero the attention output when λ is frozen at 1 (pure cancellation).

    ``combined`` (``models.attention.combined_map``) forms the combined map once and applies the epilogue in the same
    autograd node: the fastest on a CPU at short sequences. Every other backend but ``triton`` returns the two maps'
    outputs apart, and one epilogue (``models.attention.epilogue``;
    ``epilogue`` picks its implementation, ``eager`` always the unfused reference) forms O1 − λ·O2 in fp32, the norm
    and the output factor in megatron-core's layout. ``sdpa`` and ``flash_attn`` make two library calls with equal
    head dims (``library_layout``), so that flash and cuDNN kernels are eligible, as for the baseline;
    ``flash_attn4`` (flash-attn-4, whose V may be wider than Q·K) one call over the 2d-wide V.
    """

    supports_context_parallel = True
    ring_backends = RING_IMPLEMENTATIONS + ("triton",)  # the fused kernel's context-parallel pieces

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
        epilogue: str = "unfused",
        **protocol,
    ):
        super().__init__(config, layer_number, attn_mask_type, **protocol)
        if epilogue not in EPILOGUE_IMPLS:
            raise ValueError(f"trainer.diff_epilogue={epilogue!r} is unknown; use one of {', '.join(EPILOGUE_IMPLS)}")
        self.epilogue = epilogue
        d = self.head_dim
        self.lambda_init = lambda_init if lambda_init is not None else lambda_init_for_layer(layer_number)
        self.lambda_learnable = lambda_learnable
        self.output_scale = 1.0 - (self.lambda_init if lambda_learnable else lambda_init_for_layer(layer_number))
        self._lambda_constants = {}  # a frozen λ per device (lambda_full)
        # λ_init and the output factor as data inside a compiled layer (trainer.compile), where a module's Python floats
        # are guards: one recompilation per layer, and eager after dynamo's recompile limit (8); buffers are inputs
        self.register_buffer("compiled_constants", torch.tensor([self.lambda_init, self.output_scale]),
                             persistent=False)
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

    def lambda_full(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The layer's λ as a 0-dim fp32 tensor (fp64 in an fp64 model; differentiable when learnable), computed once
        per forward. A frozen λ is a constant made once per device (``device``, default the CPU): a tensor made per
        call would be copied to the GPU in every call, and a copy from pageable memory waits for the GPU."""
        if torch.compiler.is_compiling():  # λ_init as data (compiled_constants): one graph for every layer
            init = self.compiled_constants[0]
            return lambda_difference(*self.lambda_parameters()) + init if self.lambda_learnable else init
        if self.lambda_learnable:
            return lambda_difference(*self.lambda_parameters()) + self.lambda_init
        device = torch.device(device if device is not None else "cpu")
        constant = self._lambda_constants.get(device)
        if constant is None:
            constant = torch.tensor(self.lambda_init, dtype=torch.float32, device=device)
            self._lambda_constants[device] = constant
        return constant

    def attention_maps(self, query, key, value, attention_bias=None, rows=None, document_ids=None) -> AttentionMaps:
        # the pairs are split before the key heads are repeated: query head 2h pairs with key head 2g, g its group
        maps = [
            self._softmax_maps(query[:, :, i::2], key[:, :, i::2], rows, document_ids=document_ids) for i in (0, 1)
        ]
        (rows, logits1, a1), (_, logits2, a2) = maps
        lam = self.lambda_full(a1.device).detach()
        return AttentionMaps(
            components={"A1": a1, "A2": a2}, logits={"A1": logits1, "A2": logits2}, combined=a1 - lam * a2,
            rows=rows, lam=lam, document_ids=document_ids,
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
        documents = self._check_call(attn_mask_type, attention_bias, packed_seq_params)
        s, b, two_h, d = query.shape
        two_g = key.shape[2]
        if two_h % 2 or two_g % 2:
            raise ValueError(f"query heads ({two_h}) and key heads ({two_g}) per rank must be even (head pairs)")
        lam = self.lambda_full(query.device)
        output_scale = self.compiled_constants[1] if torch.compiler.is_compiling() else self.output_scale
        if self.backend == "combined" and self.ring is None:
            return combined_map_attention(query, key, value, lam, *self._own_epilogue_norm(query.dtype),
                                          self.softmax_scale, output_scale, documents_of(documents))
        # (s, b, heads, d) -> (b, s, heads, d): the layout every backend below starts from.
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        if self.backend == "triton" and self.ring is None:
            # (b, s, H, 2d): the fused kernel applies the epilogue (norm, weight, output scale) itself
            out = self._forward_triton(q, k, v.reshape(b, s, two_g // 2, 2 * d), lam, documents)
            return out.transpose(0, 1).reshape(s, b, two_h * d)
        # two (b, s, 2, H, d): maps 1 and 2 of each d-wide half of V (or the maps already combined)
        forward = self._forward_ring if self.ring is not None else getattr(self, f"_forward_{self.backend}")
        halves = forward(q, k, v, lam, documents)
        norm = self.sublayer_norm
        out = diff_epilogue(
            halves, lam, norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0,
            output_scale, impl="unfused" if self.backend == "eager" else self.epilogue,
        )
        return out.to(query.dtype)  # eager's halves are fp32 (fp64): round once, at the end

    def _own_epilogue_norm(self, dtype: torch.dtype):
        """(weight or None, eps) of the sub-layer norm for the backends that apply the epilogue themselves
        (``triton``, ``combined``); without an eps of its own, the dtype's."""
        norm = self.sublayer_norm
        if norm is None:
            return None, torch.finfo(dtype).eps
        return norm.weight, norm.eps if norm.eps is not None else torch.finfo(dtype).eps

    def _split_pairs(self, q, k):
        """(b, s, 2H, d) and (b, s, 2G, d) -> q1, q2 (b, H, s, d) and k1, k2 (b, G, s, d)."""
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        return q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]

    def _forward_ring(self, q, k, v, lam, documents):
        """The sequence split over the context-parallel group: both maps merged by their own LSEs around the ring
        (models/ring_attention.py); returns the halves of V for the epilogue, (b, s, 2, H, d) each. The fused ring
        (``triton``) returns y = O1 − λ·O2 itself, the maps already combined, one part as wide as V: (b, s, 1, H, 2d)."""
        b, s, two_g, d = v.shape
        if self.backend == "triton":
            y = differential_ring_attention(q, k, v.reshape(b, s, two_g // 2, 2 * d), lam, self.softmax_scale,
                                            self.ring, document_ids=documents_of(documents))
            return [y.unsqueeze(2)]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, s, two_g // 2, 2 * d).transpose(1, 2)
        o1, o2 = ring_attention([q[:, 0::2], q[:, 1::2]], k, v, (slice(0, None, 2), slice(1, None, 2)),
                                self.softmax_scale, self.ring, self.backend, document_ids=documents_of(documents))
        maps = torch.stack([o1, o2], dim=2).transpose(1, 3)  # (b, H, 2, s, 2d) -> (b, s, 2, H, 2d)
        return [maps[..., :d], maps[..., d:]]

    def _forward_eager(self, q, k, v, lam, documents):
        """The combined map A1 − λ·A2 materialised in fp32 (fp64 for fp64 inputs), weighting the 2d-wide V: the
        reference. Returns the halves already combined, (b, s, 1, H, d) each."""
        b, s, two_g, d = v.shape
        q1, q2, k1, k2 = self._split_pairs(q, k)
        groups = q1.shape[1] // k1.shape[1]
        k1, k2 = (t.repeat_interleave(groups, dim=1) for t in (k1, k2))
        vh = v.reshape(b, s, two_g // 2, 2 * d).transpose(1, 2).to(reference_dtype(q))
        vh = vh.repeat_interleave(groups, dim=1)  # (b, H, s, 2d)
        a1 = eager_attention_probs(q1, k1, self.softmax_scale, documents_of(documents))
        a2 = eager_attention_probs(q2, k2, self.softmax_scale, documents_of(documents))
        out = torch.matmul(a1 - lam.to(a1.dtype) * a2, vh).transpose(1, 2).unsqueeze(2)  # (b, s, 1, H, 2d)
        return [out[..., :d], out[..., d:]]

    def _forward_sdpa(self, q, k, v, lam, documents):
        q, k, values, pairs, gqa = library_layout(q, k, v)
        qh, kh = q.transpose(1, 2), k.transpose(1, 2)
        return [
            paired_halves(
                scaled_dot_product_attention(qh, kh, vc.transpose(1, 2), self.softmax_scale, gqa, documents)
                .transpose(1, 2),
                pairs,
            )
            for vc in values
        ]

    def _forward_flash_attn(self, q, k, v, lam, documents):
        q, k, values, pairs, _ = library_layout(q, k, v)  # flash-attn's GQA pairs heads as SDPA's does
        return [paired_halves(flash_attention(q, k, vc, self.softmax_scale, documents, "flash_attn"), pairs)
                for vc in values]

    def _forward_flash_attn4(self, q, k, v, lam, documents):
        """flash-attn-4 takes V wider than Q·K (d, 2d): one call over all 2H query heads as megatron's projections lay
        them out (head 2h + m is map m of head h), each against its own key head (K_m of its group) and the whole
        2d-wide V of its group, repeated per query head. Each Q·Kᵀ is computed once (1.5× the baseline's attention
        FLOPs, against 2× for the two equal-dims calls), and the library's per-call host time is paid once a layer.
        With GQA the key heads are repeated to the query heads too: flash-attn-4's Hopper backward takes GQA only
        with equal head dims. Returns the halves of V, (b, s, 2, H, d) each."""
        b, s, two_g, d = v.shape
        group = q.shape[2] // two_g  # query heads per KV head
        v = v.reshape(b, s, two_g // 2, 2 * d).repeat_interleave(2 * group, dim=2)  # (b, s, 2H, 2d)
        if group > 1:  # K_m of group g for query head 2h + m, g = h // group
            k = k.unflatten(2, (two_g // 2, 2)).repeat_interleave(group, dim=2).flatten(2, 3)
        out = flash_attention(q, k, v, self.softmax_scale, documents, "flash_attn4")  # (b, s, 2H, 2d)
        maps = paired_halves(out, "interleaved")  # (b, s, 2, H, 2d), a view
        return [maps[..., :d], maps[..., d:]]

    def _forward_triton(self, q, k, v, lam, documents):
        diff_flash_attn = fused_kernel_package().diff_flash_attn
        norm_weight, norm_eps = self._own_epilogue_norm(q.dtype)
        # The DIFF epilogue inside the kernel: RMSNorm over each head's 2d columns, its weight, and (1 − λ_init).
        return diff_flash_attn(q, k, v, lam, causal=True, softmax_scale=self.softmax_scale, norm_weight=norm_weight,
                               norm_eps=norm_eps, output_scale=self.output_scale, document_ids=documents_of(documents))
