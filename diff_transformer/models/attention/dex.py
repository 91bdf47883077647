"""DEX: differential attention added to a pretrained softmax-attention model (Kong et al., arXiv 2505.16333)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size

from diff_transformer.models.attention.base import TP_REPLICATED_ATTR, eager_attention_probs, lambda_init_for_layer
from diff_transformer.models.attention.vanilla import VanillaCoreAttention
from diff_transformer.models.documents import documents_of, same_document

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

    supports_context_parallel = False  # the head calibration reads whole attention maps
    traceable = False  # the annealing fraction changes every step, and the calibration reads statistics to the host


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
            raise ValueError("model.attention=dex keeps the pretrained softmax attention; use sdpa, flash_attn, "
                             "flash_attn4 or eager")
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
            out = self._record_statistics(query, key, out.view(s, b, heads, d), documents_of(packed_seq_params))
            out = out.reshape(s, b, heads * d)
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
    def _accumulate_entropy(self, query, key, document_ids=None) -> None:
        """Σ over queries of the entropy of each head's causal map divided by log(visible keys) (1: uniform over the
        causal prefix, 0: one key), skipping the first query (of each document, with ``document_ids``), which sees
        one key."""
        s, b, heads, d = query.shape
        q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)  # (b, heads, s, d)
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        probs = eager_attention_probs(q, k, self.softmax_scale, document_ids)  # (b, heads, s, s) fp32
        entropy = -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(-1)  # (b, heads, s)
        if document_ids is not None:
            causal = torch.ones(s, s, dtype=torch.bool, device=probs.device).tril()
            visible = (causal & same_document(document_ids, document_ids)).sum(-1).to(probs.dtype)  # (b, 1, s)
            seen = visible > 1
            normalised = torch.where(seen, entropy / torch.log(visible.clamp_min(2)), 0.0)
            self.entropy_sum += normalised.sum(dim=(0, 2)).double().cpu()
            self.entropy_count += int(seen.sum())
            return
        visible = torch.arange(1, s + 1, device=probs.device, dtype=probs.dtype) + (k.shape[-2] - s)
        normalised = entropy[..., 1:] / torch.log(visible[1:])
        self.entropy_sum += normalised.sum(dim=(0, 2)).double().cpu()
        self.entropy_count += b * (s - 1)

    def _record_statistics(self, query, key, o, document_ids=None):
        self._accumulate_entropy(query, key, document_ids)
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
