"""Build the GPT model (DIFF, its mirrored baseline, or any other attention kind) on megatron-core from the typed config."""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads as megatron_finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from diff_transformer import compat
from diff_transformer.distributed import all_reduce_tensor
from diff_transformer.models.attention import (
    SIGNED_MASK_BUCKETS,
    TP_REPLICATED_ATTR,
    DexCoreAttention,
    DifferentialCoreAttention,
    dex_anneal_fraction,
)
from diff_transformer.models.attention.base import TRACEABLE_BACKENDS
from diff_transformer.models.cross_entropy import vocab_parallel_cross_entropy
from diff_transformer.models.layer_specs import head_dim  # noqa: F401  (re-exported: accounting reads it here)
from diff_transformer.models.layer_specs import attention_heads, layer_spec_for, num_kv_heads, resolved_backend
from diff_transformer.models.norms import RMSNorm
from diff_transformer.models import weight_gradient
from diff_transformer.models.rope import fused_apply_rotary_pos_emb


def resolve_precision(precision: str) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


# Backends whose kernel keeps no attention map and recomputes it in its backward: selective recomputation of the core
# attention would only run the kernel's forward a second time, so it is left off for them.
FUSED_ATTENTION_BACKENDS = ("triton", "flash_attn", "flash_attn4")


def fusions_enabled(cfg: Any, device: Optional[str] = None) -> bool:
    """``trainer.fusions``: auto is on with CUDA (the kernels are compiled there) and off on a CPU, where compiling
    costs more than it saves; ``on`` forces them anywhere (on a CPU the Triton epilogue needs TRITON_INTERPRET=1).
    ``device`` (cuda or cpu): the machine to decide for (default: this one)."""
    mode = getattr(cfg.trainer, "fusions", "off")
    if mode == "auto":
        return device == "cuda" if device is not None else torch.cuda.is_available()
    return mode == "on"


def epilogue_impl(cfg: Any) -> str:
    """The DIFF epilogue the model runs: ``trainer.diff_epilogue`` with fusions on, else the unfused definition."""
    return cfg.trainer.diff_epilogue if fusions_enabled(cfg) else "unfused"


# the kinds whose core attention ends in the DIFF epilogue (models.attention.epilogue), and the backends that, without
# context parallelism, apply it themselves (eager: the unfused reference)
EPILOGUE_KINDS = ("diff", "diff_v2")
OWN_EPILOGUE_BACKENDS = ("triton", "combined")


def fusions_summary(cfg: Any) -> str:
    """What the setup log says of ``trainer.fusions``: off, or on with the DIFF epilogue the attention runs."""
    if not fusions_enabled(cfg):
        return "off"
    if cfg.model.attention not in EPILOGUE_KINDS:
        return "on"
    backend = resolved_backend(cfg.model)
    if backend == "eager":
        return "on (eager's unfused DIFF epilogue)"
    if backend in OWN_EPILOGUE_BACKENDS and cfg.parallel.cp == 1:
        return f"on (the DIFF epilogue inside the {backend} backend)"
    return f"on ({epilogue_impl(cfg)} DIFF epilogue)"


def recompute_settings(cfg: Any) -> Dict[str, Any]:
    """TransformerConfig fields for ``trainer.recompute``: megatron-core's selective recomputation of the core
    attention (DIFF's whole differential core: both maps, λ and the sub-layer norm) or full recomputation of whole
    layers (``uniform``: every layer of a stage, in groups of N; ``block``: the first N layers of each stage)."""
    t = cfg.trainer
    mode = t.recompute
    if mode == "selective" and resolved_backend(cfg.model) not in FUSED_ATTENTION_BACKENDS:
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if mode == "full":
        layers_per_stage = cfg.model.num_layers // cfg.parallel.pp
        n = t.recompute_layers
        if n is None:
            n = 1 if t.recompute_method == "uniform" else layers_per_stage
        return {"recompute_granularity": "full", "recompute_method": t.recompute_method, "recompute_num_layers": n}
    return {}


def gradient_accumulation_fusion_enabled(cfg: Any, device: Optional[str] = None) -> bool:
    """``trainer.grad_accumulation_fusion``: megatron-core accumulates each weight gradient into the fp32 main
    gradient in its GEMM (APEX's ``fused_weight_gradient_mlp_cuda`` where installed, else
    ``models.weight_gradient``); off, the GEMM writes the gradient and DDP adds it. auto is on with CUDA and off on a
    CPU; ``device`` (cuda or cpu): the machine to decide for (default: this one)."""
    mode = getattr(cfg.trainer, "grad_accumulation_fusion", "off")
    if mode == "auto":
        return device == "cuda" if device is not None else torch.cuda.is_available()
    return mode == "on"


def transformer_config(
    cfg: Any, dtype: torch.dtype = torch.float32, perform_init: bool = True, grad_accumulation_fusion: bool = False
) -> TransformerConfig:
    """The megatron-core TransformerConfig of the model; the attention kinds differ only in the head layout of
    SelfAttention (``layer_specs.attention_heads``) and in their layer spec.

    DIFF and its baseline use 2H query heads and 2Hkv key/value heads of size d; DIFF pairs them up.
    ``grad_accumulation_fusion`` needs megatron-core DDP's fp32 ``main_grad`` (the trainer's model).
    """
    m, p = cfg.model, cfg.parallel
    bf16 = dtype == torch.bfloat16
    query_heads, kv_heads, head_size = attention_heads(m)
    # trainer.fusions: megatron-core's own fused SwiGLU (torch.compile'd, no TransformerEngine needed), and our fused
    # cross-entropy and RoPE in its native cross-entropy's and TransformerEngine's hooks
    fused = fusions_enabled(cfg)
    if grad_accumulation_fusion:
        compat.install_weight_gradient_accumulation(weight_gradient.APEX_COMPATIBLE)
        compat.skip_tied_embedding_dummy_gradient()  # the fusion's zero-filled dummy for the tied embedding
    if fused:
        compat.install_fused_rope(fused_apply_rotary_pos_emb)
        compat.install_fused_cross_entropy(vocab_parallel_cross_entropy)
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=query_heads,
        num_query_groups=kv_heads,
        kv_channels=head_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,  # the core attentions' ring path, RoPE's positions of each rank's chunks
        # refused at TP=1 by config validation; a saved config rebuilt at TP=1 (checkpoint convert) drops it
        sequence_parallel=bool(getattr(p, "sequence_parallel", False)) and p.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        # Full weights drawn on the CPU then sliced: identical initial weights for every TP layout (unless
        # trainer.init_on_gpu trades that for speed).
        use_cpu_initialization=not (getattr(cfg.trainer, "init_on_gpu", False) and torch.cuda.is_available()),
        perform_initialization=perform_init,
        bias_activation_fusion=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=fused,
        cross_entropy_loss_fusion=fused,
        cross_entropy_fusion_impl="native",
        gradient_accumulation_fusion=grad_accumulation_fusion,
        persist_layer_norm=False,
        batch_p2p_sync=False,
        finalize_model_grads_func=finalize_model_grads,
        **recompute_settings(cfg),
    )


class PackedGPTModel(GPTModel):
    """megatron-core's GPTModel whose RoPE takes each token's position from the micro-batch's
    :class:`PackedDocuments` when it carries positions restarting per document (``data.reset_position_ids``);
    otherwise exactly GPTModel (megatron's RoPE ignores ``position_ids``)."""

    def _preprocess(self, *args, packed_seq_params=None, **kwargs):
        output = super()._preprocess(*args, packed_seq_params=packed_seq_params, **kwargs)
        positions = getattr(packed_seq_params, "position_ids", None)
        if positions is None or output[1] is None:
            return output
        return (output[0], self.rotary_positions(positions), *output[2:])

    def rotary_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """RoPE's angles [s, b, 1, dim] for positions (b, s) of this rank's tokens, as megatron-core's
        ``RotaryEmbedding.get_emb`` computes them for 0..s−1 (the rotate-half layout: the angles twice)."""
        rope = self.rotary_pos_emb
        inv_freq = rope.inv_freq.to(position_ids.device)
        positions = position_ids.to(inv_freq.dtype)
        if rope.seq_len_interpolation_factor is not None:
            positions = positions * (1 / rope.seq_len_interpolation_factor)
        angles = positions.transpose(0, 1)[..., None] * inv_freq  # [s, b, dim/2]
        return torch.cat((angles, angles), dim=-1)[:, :, None, :]


def build_model_chunk(
    cfg: Any, vocab_size: int, dtype: torch.dtype = torch.float32, perform_init: bool = True,
    grad_accumulation_fusion: bool = False,
) -> GPTModel:
    """This rank's pipeline stage of the model. ``vocab_size`` is the padded model vocabulary."""
    config = transformer_config(cfg, dtype, perform_init, grad_accumulation_fusion)
    if perform_init:
        torch.manual_seed(cfg.seed)
    layer_spec = layer_spec_for(cfg.model, seed=cfg.seed, epilogue=epilogue_impl(cfg))
    block_spec = TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=RMSNorm  # RMSNorm: the final norm
    )
    return PackedGPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.model.share_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.model.rope_base),
    )


def core_attention_traceable(attention: torch.nn.Module, document_mask: bool) -> bool:
    """Whether a layer's SelfAttention can keep its core attention in the compiled layer's graph: a kind that allows
    it (``traceable``: not DEX, whose annealing fraction changes every step) on a traceable backend
    (``TRACEABLE_BACKENDS``), no context-parallel ring (collectives), no selective recomputation (megatron's
    checkpoint saves and restores RNG states) and no document masking (its variable-length kernel takes the longest
    document as a host integer)."""
    core = attention.core_attention
    return (getattr(core, "traceable", False) and getattr(core, "backend", None) in TRACEABLE_BACKENDS
            and getattr(core, "ring", None) is None and not attention.checkpoint_core_attention and not document_mask)


def compile_layers(chunk: torch.nn.Module, document_mask: bool = False, mode: Optional[str] = None) -> int:
    """``trainer.compile``: each TransformerLayer of ``chunk`` under ``torch.compile`` in place (regional compilation,
    torchtitan's approach: identical layers share one compiled graph, so compiling costs one layer's worth), so that
    inductor fuses the norms, RoPE, SwiGLU and the residual adds around the projections' matmuls. The core attention
    stays in the layer's graph where dynamo traces it (``core_attention_traceable``: ``sdpa``, ``flash_attn4`` and
    DIFF V1's ``combined`` outside context parallelism, selective recomputation and document masking), so that its
    elementwise work (DIFF's λ, layouts and epilogue) fuses too and the layer is one graph each way: the host issues a
    compiled layer's kernels from one wrapper, where eagerly each torch operation pays the dispatcher and autograd.
    Otherwise it runs eagerly, out of the graph (``compat.call_core_attention_eagerly``): the fused kernel's launchers
    choose configs in Python, flash-attn 2 and the context-parallel ring call libraries and collectives. Returns how
    many layers it compiled.

    Only training forwards run compiled; the others (validation, the attention diagnostics' probe, anything in eval
    mode) run the layer eagerly: dynamo does not guard on module hooks (``torch._dynamo.config.
    skip_nnmodule_hook_guards``), so a capture hook registered after compilation would be skipped without a word,
    and the core attention's eager call is wired into the training branch of megatron's forward. Call before DDP
    wraps the chunk. Compiles nothing (returns 0) when TorchDynamo is off for the process. ``mode``: torch.compile's
    (``reduce-overhead`` for ``trainer.cuda_graphs``, training.cuda_graphs)."""
    if dynamo_disabled():
        return 0
    compat.resolve_default_tp_group_quietly()
    layers = [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        if not core_attention_traceable(layer.self_attention, document_mask):
            compat.call_core_attention_eagerly(layer.self_attention)
        # sets the module's _compiled_call_impl, which nn.Module.__call__ runs
        layer.compile(dynamic=False, **({"mode": mode} if mode else {}))
        layer._compiled_call_impl = functools.partial(_compiled_when_training, layer, layer._compiled_call_impl)
    return len(layers)


def core_attention_in_graph(chunk: torch.nn.Module) -> int:
    """How many of ``chunk``'s compiled layers keep their core attention in the graph (``compile_layers``)."""
    return sum(1 for m in chunk.modules() if isinstance(m, TransformerLayer) and m._compiled_call_impl is not None
               and not getattr(m.self_attention, "_core_attention_eager", False))


def dynamo_disabled() -> bool:
    """TorchDynamo is off for this process (``TORCHDYNAMO_DISABLE=1``, which makes ``torch.compile`` return what it
    is given, or ``TORCH_COMPILE_DISABLE=1``)."""
    return bool(torch._dynamo.config.disable) or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"


def _compiled_when_training(layer: torch.nn.Module, compiled, *args, **kwargs):
    return compiled(*args, **kwargs) if layer.training else layer._call_impl(*args, **kwargs)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens=None, pg_collection=None, **kwargs):
    """megatron-core's finalize_model_grads, then the TP sum of gradients of TP-replicated parameters.

    λ vectors and the sub-layer norm weight are replicated on TP ranks, but each rank's gradient only covers its
    own heads; megatron-core reduces such gradients only for sequence-parallel norms, so we sum them here. The core
    attention sees the whole sequence (its heads are split, not the sequence), so with sequence parallelism these
    gradients are still partial over heads and still need exactly this one sum; a parameter that is also marked
    ``sequence_parallel`` has had it from megatron-core already and is skipped, so none is summed twice. Over context
    parallelism (each rank a part of the sequence, every parameter whole) DDP has averaged them with every gradient.
    """
    megatron_finalize_model_grads(model, num_tokens=num_tokens, pg_collection=pg_collection, **kwargs)
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    summed_by_megatron = bool(model[0].config.sequence_parallel)
    grads = [
        p.main_grad if hasattr(p, "main_grad") else p.grad
        for chunk in model
        for p in chunk.parameters()
        if getattr(p, TP_REPLICATED_ATTR, False) and p.requires_grad
        and not (summed_by_megatron and getattr(p, "sequence_parallel", False))
    ]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_tensor(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def diff_attention_modules(model_chunks) -> List[DifferentialCoreAttention]:
    return [
        m for chunk in model_chunks for m in chunk.modules() if isinstance(m, DifferentialCoreAttention)
    ]


@torch.no_grad()
def lambda_values(model_chunks) -> List[float]:
    """Per-layer λ of this rank's DIFF (or DEX) layers, in layer order (empty for the baseline): one read to the host
    for all of them."""
    mods = sorted(diff_attention_modules(model_chunks) + dex_attention_modules(model_chunks), key=lambda m: m.layer_number)
    if not mods:
        return []
    values = [m.lambda_full() for m in mods]
    return torch.stack([v.to(values[0].device, torch.float64) for v in values]).tolist()


def dex_attention_modules(model_chunks) -> List[DexCoreAttention]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, DexCoreAttention)]


def dex_parameter_keys(chunk: torch.nn.Module) -> List[str]:
    """State-dict keys of the parameters DEX adds to a pretrained model (W_D of the selected heads, λ vectors)."""
    return [
        f"{name}.{own}" if name else own
        for name, module in chunk.named_modules()
        if isinstance(module, DexCoreAttention)
        for own in module.own_parameter_names()
    ]


def freeze_all_but_dex(chunk: torch.nn.Module) -> int:
    """model.dex.train_base=false: only DEX's own parameters train. Returns how many parameters stay trainable."""
    own = set(dex_parameter_keys(chunk))
    trainable = 0
    for name, p in chunk.named_parameters():
        p.requires_grad_(name in own)
        trainable += p.numel() if name in own else 0
    return trainable


def set_dex_anneal(model_chunks, dex_cfg, step: int, max_steps: int) -> float:
    """Set every DEX layer's λ annealing fraction for the optimizer step about to run (``step`` steps done)."""
    steps = dex_cfg.lambda_anneal_steps if dex_cfg.lambda_anneal_steps is not None else max_steps
    fraction = dex_anneal_fraction(step, steps, dex_cfg.lambda_anneal)
    for m in dex_attention_modules(model_chunks):
        m.set_anneal_fraction(fraction)
    return fraction


def parameter_numel(p: torch.nn.Parameter) -> int:
    """Elements of the whole parameter, also when DeepSpeed ZeRO-3 holds a partition of it (``ds_numel``)."""
    return getattr(p, "ds_numel", p.numel())


def count_parameters(model_chunks, exclude_embeddings: bool = False) -> int:
    """Parameters of this rank's chunks (shared embedding counted once)."""
    seen = set()
    total = 0
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if exclude_embeddings and ("embedding" in name or "output_layer" in name):
                continue
            total += parameter_numel(p)
    return total


def attention_parameters_per_layer(model: Any) -> int:
    """Parameters of one layer's attention (projections and the kind's own parameters), over all TP ranks.

    Matches the built model (tests/test_config.py); used to state the count of a model that is not built."""
    query_heads, kv_heads, d = attention_heads(model)
    E = model.hidden_size
    output_width = query_heads * d // 2 if model.attention == "diff_v2" else query_heads * d
    count = E * (query_heads * d + 2 * kv_heads * d) + output_width * E
    if model.attention == "diff":
        count += (4 * d if model.lambda_learnable else 0) + (2 * d if model.sublayer_norm else 0)
    elif model.attention == "diff_v2":
        count += E * model.num_heads  # W_λ
    elif model.attention == "vanilla_subln":
        count += d
    elif model.attention == "signed_mask":
        count += query_heads * SIGNED_MASK_BUCKETS
    elif model.attention == "dex":  # λ vectors; W_D (d² per selected head) differs by layer: see dex_parameters
        count += 4 * d
    return count


def dex_parameters(model: Any) -> int:
    """Parameters of DEX's W_D matrices over all layers (d² per selected head); 0 before the selection is made."""
    if model.attention != "dex" or model.dex.heads is None:
        return 0
    d = attention_heads(model)[2]
    return sum(len(h) for h in model.dex.heads) * d * d


def v2_baseline(model: Any) -> Tuple[Optional[Any], str]:
    """DIFF V2's baseline: the standard Transformer with the same hidden size, the same 2H query heads of d and the
    same Hkv KV heads, i.e. ``model.attention=vanilla model.num_kv_heads=Hkv/2`` (vanilla has 2·num_kv_heads KV
    heads). V2 has the same Q, K and V projections, an output projection from H·d instead of 2H·d, and W_λ.

    Returns (the baseline's model config, its overrides), or (None, why not) when Hkv is odd."""
    kv = num_kv_heads(model)
    if kv % 2:
        return None, (
            f"V2's baseline needs {kv} KV heads, but model.attention=vanilla has 2*model.num_kv_heads; "
            "use an even model.num_kv_heads"
        )
    baseline = copy.copy(model)
    baseline.attention, baseline.num_kv_heads = "vanilla", kv // 2
    baseline.lambda_init, baseline.lambda_learnable, baseline.sublayer_norm, baseline.topk = None, True, True, None
    return baseline, f"model.attention=vanilla model.num_kv_heads={kv // 2}"
