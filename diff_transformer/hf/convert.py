"""State-dict and config mappings between this framework's GPT model (TP=1, PP=1) and Hugging Face Llama/DiffLlama.

Framework layout (megatron-core, local spec): ``linear_qkv.weight`` holds, for each KV head g in turn, its query
heads, then its key head, then its value head (d rows each); ``linear_fc1.weight`` is [gate; up]; RoPE rotates the
two halves of each head (not interleaved pairs), as transformers' ``rotate_half`` does; every norm is RMSNorm with
``model.norm_eps``.

- ``vanilla`` and ``vanilla_wide`` are Llama exactly.
- ``dex`` is Llama too: at inference λ is a number per layer and O·(I − λ·W_D)·Woᵀ is linear in O, so each selected
  head's block of the output projection becomes Wo_h·(I − λ·W_D,h)ᵀ.
- ``diff`` (V1) is DiffLlama. DiffLlama pairs query heads (h, h+H) and key/value heads (g, g+Hkv) where this
  framework pairs (2h, 2h+1) and (2g, 2g+1): the projections are permuted (even heads first, then odd ones), which
  keeps each differential head's 2d output columns where the output projection reads them. DiffLlama's per-head
  RMSNorm (``groupnorm``, eps = rms_norm_eps) has no weight and multiplies by (1 − λ_init(l)) with its own depth
  schedule 0.8 − 0.6·exp(−0.3·layer_idx), layer_idx = l − 1: the sub-layer norm weight and the ratio of the two
  multipliers are folded into ``o_proj``. λ is a number per layer at inference: with the depth schedule and a
  learned λ the four vectors are copied; otherwise (``model.lambda_init`` fixed, or λ frozen) they are re-encoded
  so that exp(λq1·λk1) − exp(λq2·λk2) + λ_init(l) gives the same λ.
- The other kinds have no transformers architecture (see ``export_refusal``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from diff_transformer.models.attention import dex_anneal_fraction, lambda_init_for_layer
from diff_transformer.models.layer_specs import attention_heads

LLAMA_KINDS = ("vanilla", "vanilla_wide", "dex")


def export_refusal(model: Dict[str, Any]) -> Optional[str]:
    """Why a model of this config cannot be exported as a transformers architecture, or None if it can."""
    kind = model.get("attention")
    if kind in LLAMA_KINDS:
        return None
    if kind == "diff":
        if not model.get("sublayer_norm", True):
            return (
                "model.attention=diff with model.sublayer_norm=false has no transformers architecture: DiffLlama "
                "always normalises each head"
            )
        return None
    reasons = {
        "diff_v2": "DIFF V2 (per-token sigmoid λ from W_λ, output projection from H·d)",
        "vanilla_subln": "the baseline with a per-head RMSNorm",
        "topk": "top-k sparse attention",
        "signed_mask": "signed-mask attention",
    }
    if kind in reasons:
        return (
            f"model.attention={kind} ({reasons[kind]}) has no architecture in transformers, and this framework does "
            "not ship remote code for it; export supports vanilla, vanilla_wide and dex (as LlamaForCausalLM) and "
            "diff (as DiffLlamaForCausalLM)"
        )
    return f"model.attention={kind!r} is not an attention kind this framework knows; nothing to export"


def architecture(model: Dict[str, Any]) -> str:
    return "DiffLlamaForCausalLM" if model["attention"] == "diff" else "LlamaForCausalLM"


def hf_config_kwargs(model: Any, vocab_size: int, special_ids: Dict[str, Optional[int]]) -> Dict[str, Any]:
    """Keyword arguments of transformers' LlamaConfig / DiffLlamaConfig for the framework model config ``model``."""
    query_heads, kv_heads, d = attention_heads(model)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=query_heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
        hidden_act="silu",
        max_position_embeddings=model.seq_length,
        initializer_range=model.init_std,
        rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_base)},
        tie_word_embeddings=bool(model.share_embeddings),
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=special_ids.get("bos"),
        eos_token_id=special_ids.get("eos"),
        pad_token_id=special_ids.get("pad"),
    )
    if model.attention == "diff":
        kwargs["lambda_std_dev"] = 0.1
    else:
        kwargs["mlp_bias"] = False
    return kwargs


# ------------------------------------------------------------------------------------------------------------------
# Tensor layouts
# ------------------------------------------------------------------------------------------------------------------
def split_qkv(weight: torch.Tensor, query_heads: int, kv_heads: int, d: int) -> Tuple[torch.Tensor, ...]:
    """megatron's fused QKV weight ([per KV head: its query heads, key, value] × d rows) -> q, k, v weights."""
    per = query_heads // kv_heads
    grouped = weight.view(kv_heads, (per + 2) * d, weight.shape[-1])
    q = grouped[:, : per * d].reshape(query_heads * d, -1)
    k = grouped[:, per * d : (per + 1) * d].reshape(kv_heads * d, -1)
    v = grouped[:, (per + 1) * d :].reshape(kv_heads * d, -1)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_heads: int, kv_heads: int, d: int) -> torch.Tensor:
    per = query_heads // kv_heads
    hidden = q.shape[-1]
    grouped = torch.cat(
        [q.view(kv_heads, per * d, hidden), k.view(kv_heads, d, hidden), v.view(kv_heads, d, hidden)], dim=1
    )
    return grouped.reshape(-1, hidden)


def pair_permutation(heads: int) -> List[int]:
    """Framework head index of each DiffLlama head: heads (2i, 2i+1) of a pair become (i, i + heads/2)."""
    return list(range(0, heads, 2)) + list(range(1, heads, 2))


def permute_heads(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return weight.view(heads, d, -1)[pair_permutation(heads)].reshape(heads * d, -1)


def _lambda_vectors_for(target: float, layer_number: int, d: int) -> Dict[str, torch.Tensor]:
    """λ vectors for which DiffLlama's exp(q1·k1) − exp(q2·k2) + λ_init(l) equals ``target``."""
    delta = target - lambda_init_for_layer(layer_number)
    a, b = (math.log1p(delta), 0.0) if delta >= 0 else (0.0, math.log1p(-delta))
    vectors = {}
    for name, value in (("1", a), ("2", b)):
        q, k = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        q[0], k[0] = math.sqrt(abs(value)), math.copysign(math.sqrt(abs(value)), value)
        vectors[f"lambda_q{name}"], vectors[f"lambda_k{name}"] = q, k
    return vectors


def _lambda(sd: Dict[str, torch.Tensor], prefix: str, lambda_init: float) -> float:
    dot = lambda a, b: float(torch.dot(sd[prefix + a].double(), sd[prefix + b].double()))
    return math.exp(dot("lambda_q1", "lambda_k1")) - math.exp(dot("lambda_q2", "lambda_k2")) + lambda_init


# ------------------------------------------------------------------------------------------------------------------
# Framework -> Hugging Face
# ------------------------------------------------------------------------------------------------------------------
def to_hf_state_dict(model: Any, sd: Dict[str, torch.Tensor], step: int = 0, max_steps: int = 0) -> Dict[str, torch.Tensor]:
    """The transformers state dict of the framework state dict ``sd`` (GPTModel's own keys, TP=1, PP=1). ``step``
    and ``max_steps`` give DEX's λ annealing fraction (the checkpoint's step and its run's length)."""
    refusal = export_refusal({"attention": model.attention, "sublayer_norm": model.sublayer_norm})
    if refusal:
        raise ValueError(refusal)
    query_heads, kv_heads, d = attention_heads(model)
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"]}
    if not model.share_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    for i in range(model.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        layer_number = i + 1
        q, k, v = split_qkv(sd[src + "self_attention.linear_qkv.weight"], query_heads, kv_heads, d)
        proj = sd[src + "self_attention.linear_proj.weight"]
        core = src + "self_attention.core_attention."
        if model.attention == "diff":
            q, k, v = permute_heads(q, query_heads, d), permute_heads(k, kv_heads, d), permute_heads(v, kv_heads, d)
            proj = _fold_diff_output(model, sd, core, proj, layer_number, query_heads, d)
            out.update({dst + "self_attn." + name: t for name, t in _diff_lambda(model, sd, core, layer_number, d).items()})
        elif model.attention == "dex":
            proj = _fold_dex(model, sd, core, proj, layer_number, d, step, max_steps)
        fc1 = sd[src + "mlp.linear_fc1.weight"]
        gate, up = fc1.chunk(2, dim=0)
        out.update({
            dst + "input_layernorm.weight": sd[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q,
            dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": proj,
            dst + "post_attention_layernorm.weight": sd[src + "pre_mlp_layernorm.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": sd[src + "mlp.linear_fc2.weight"],
        })
    return {k: v.contiguous() for k, v in out.items()}


def _fold_diff_output(model, sd, core, proj, layer_number, query_heads, d) -> torch.Tensor:
    """o_proj = Wo · diag(norm weight · (1 − λ_init used here) / (1 − λ_init(l) DiffLlama uses)) per head."""
    ours = 1.0 - (model.lambda_init if (model.lambda_init is not None and model.lambda_learnable)
                  else lambda_init_for_layer(layer_number))
    theirs = 1.0 - lambda_init_for_layer(layer_number)
    scale = torch.full((2 * d,), ours / theirs, dtype=torch.float64)
    if model.sublayer_norm:
        scale = scale * sd[core + "sublayer_norm.weight"].double()
    columns = scale.repeat(query_heads // 2)
    return (proj.double() * columns[None, :]).to(proj.dtype)


def _diff_lambda(model, sd, core, layer_number, d) -> Dict[str, torch.Tensor]:
    dtype = torch.float32
    if model.lambda_learnable and model.lambda_init is None:
        return {name: sd[core + name].to(dtype) for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}
    lambda_init = model.lambda_init if model.lambda_init is not None else lambda_init_for_layer(layer_number)
    target = _lambda(sd, core, lambda_init) if model.lambda_learnable else lambda_init
    return {name: t.to(dtype) for name, t in _lambda_vectors_for(target, layer_number, d).items()}


def dex_lambda(model, sd, core, layer_number, step: int, max_steps: int) -> float:
    dex = model.dex
    anneal_steps = dex.lambda_anneal_steps if dex.lambda_anneal_steps is not None else max_steps
    a = dex_anneal_fraction(step, anneal_steps, dex.lambda_anneal)
    lambda_init = model.lambda_init if model.lambda_init is not None else lambda_init_for_layer(layer_number)
    return (1.0 - a) * lambda_init + a * _lambda(sd, core, lambda_init)


def _fold_dex(model, sd, core, proj, layer_number, d, step, max_steps) -> torch.Tensor:
    heads = model.dex.heads[layer_number - 1]
    if not heads:
        return proj
    lam = dex_lambda(model, sd, core, layer_number, step, max_steps)
    folded = proj.double().clone()
    eye = torch.eye(d, dtype=torch.float64)
    for h in heads:
        w_d = sd[f"{core}w_d.{h}"].double()
        folded[:, h * d : (h + 1) * d] = folded[:, h * d : (h + 1) * d] @ (eye - lam * w_d).T
    return folded.to(proj.dtype)


# ------------------------------------------------------------------------------------------------------------------
# Hugging Face Llama -> framework
# ------------------------------------------------------------------------------------------------------------------
SUPPORTED_IMPORTS = ("LlamaForCausalLM",)


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_length: Optional[int] = None) -> Dict[str, Any]:
    """``model.*`` values (attention=vanilla) of a Llama config.json; ValueError naming what does not fit."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in SUPPORTED_IMPORTS or hf.get("model_type") != "llama":
        raise ValueError(
            f"the Hugging Face model is {arch or 'of no architecture'} (model_type {hf.get('model_type')!r}); "
            f"import supports {', '.join(SUPPORTED_IMPORTS)} (model_type 'llama')"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: the framework's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}=true: the framework's projections have no biases")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} (scaled RoPE) is not supported; the framework's RoPE is unscaled")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or hidden // heads
    if heads % 2 or kv % 2:
        raise ValueError(
            f"num_attention_heads={heads}, num_key_value_heads={kv}: the framework's softmax baseline has 2·model."
            "num_heads query heads and 2·model.num_kv_heads KV heads, so both must be even"
        )
    if heads % kv:
        raise ValueError(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    model = {
        "name": name,
        "attention": "vanilla",
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hidden,
        "num_heads": heads // 2,
        "num_kv_heads": None if kv == heads else kv // 2,
        "head_dim": None if d * heads == hidden else d,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "seq_length": seq_length or hf.get("max_position_embeddings", 2048),
        "share_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": hf.get("initializer_range", 0.02),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_base": float(theta),
    }
    return model


def from_hf_state_dict(model: Any, hf_sd: Dict[str, torch.Tensor], padded_vocab: int) -> Dict[str, torch.Tensor]:
    """The framework state dict (TP=1, PP=1) of a Llama state dict; embeddings padded with zero rows to
    ``padded_vocab``. ValueError naming the tensor whose shape does not match the config."""
    query_heads, kv_heads, d = attention_heads(model)
    hidden = model.hidden_size
    expected = {
        "model.embed_tokens.weight": (model.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not model.share_embeddings:
        expected["lm_head.weight"] = (model.vocab_size, hidden)
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (query_heads * d, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": (hidden, query_heads * d),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (model.ffn_hidden_size, hidden),
            p + "mlp.up_proj.weight": (model.ffn_hidden_size, hidden),
            p + "mlp.down_proj.weight": (hidden, model.ffn_hidden_size),
        })
    ignored = {"lm_head.weight"} if model.share_embeddings else set()
    missing = sorted(set(expected) - set(hf_sd))
    unexpected = sorted(k for k in set(hf_sd) - set(expected) - ignored if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(f"the weights do not match a Llama of this config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, shape in expected.items():
        if tuple(hf_sd[key].shape) != shape:
            what = "vocabulary" if "embed" in key or "lm_head" in key else "head layout"
            raise ValueError(
                f"{key} has shape {tuple(hf_sd[key].shape)}, the config implies {shape} ({what} mismatch)"
            )

    def padded(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == padded_vocab:
            return t
        return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], t.shape[1])])

    sd = {"embedding.word_embeddings.weight": padded(hf_sd["model.embed_tokens.weight"])}
    if not model.share_embeddings:
        sd["output_layer.weight"] = padded(hf_sd["lm_head.weight"])
    sd["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
    for i in range(model.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        sd.update({
            dst + "input_layernorm.weight": hf_sd[src + "input_layernorm.weight"],
            dst + "self_attention.linear_qkv.weight": merge_qkv(
                hf_sd[src + "self_attn.q_proj.weight"], hf_sd[src + "self_attn.k_proj.weight"],
                hf_sd[src + "self_attn.v_proj.weight"], query_heads, kv_heads, d,
            ),
            dst + "self_attention.linear_proj.weight": hf_sd[src + "self_attn.o_proj.weight"],
            dst + "pre_mlp_layernorm.weight": hf_sd[src + "post_attention_layernorm.weight"],
            dst + "mlp.linear_fc1.weight": torch.cat(
                [hf_sd[src + "mlp.gate_proj.weight"], hf_sd[src + "mlp.up_proj.weight"]]
            ),
            dst + "mlp.linear_fc2.weight": hf_sd[src + "mlp.down_proj.weight"],
        })
    return sd
