"""FLOP, MFU and memory accounting: what the loop logs (MFU, memory), the estimate of memory per GPU it prints
before training (for either engine: megatron-core, or DeepSpeed at its ZeRO stage and offload), and the memory plan
that refuses a launch which cannot fit, naming the switches that would make it fit (recomputation, sequence
parallelism, the distributed optimizer or a higher ZeRO stage and offload, micro-batch size, TP, PP)."""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from diff_transformer.models.attention import SIGNED_MASK_BUCKETS
from diff_transformer.models.gpt import (
    FUSED_ATTENTION_BACKENDS,
    attention_parameters_per_layer,
    fusions_enabled,
    head_dim,
    num_kv_heads,
)
from diff_transformer.models.layer_specs import (
    attention_heads,
    context_parallel_kinds,
    core_attention_class,
    resolved_backend,
)


GIB = 2**30
# Share of a device's memory the plan lets the estimate fill: the CUDA context, NCCL's buffers, the allocator's
# fragmentation and the transient tensors of the backward pass take the rest.
USABLE_MEMORY_FRACTION = 0.9


# ------------------------------------------------------------------------------------------------------------------
# Parameters per rank (analytic, so that the plan needs no model)
# ------------------------------------------------------------------------------------------------------------------
def layer_parameters(model: Any, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank: projections and MLP split over TP; the two norms and the
    attention kind's replicated parameters (DIFF's λ vectors and sub-layer norm, ``vanilla_subln``'s norm,
    ``signed_mask``'s logits) whole on every rank."""
    h, f = model.hidden_size, model.ffn_hidden_size
    attention = attention_parameters_per_layer(model)
    replicated = attention_replicated_parameters(model)
    split = (attention - replicated) + h * 2 * f + f * h
    return split // tp + replicated + 2 * h


def attention_replicated_parameters(model: Any) -> int:
    """The attention parameters of one layer that every TP rank holds whole."""
    query_heads, _, d = attention_heads(model)
    if model.attention == "diff":
        return (4 * d if model.lambda_learnable else 0) + (2 * d if model.sublayer_norm else 0)
    if model.attention == "vanilla_subln":
        return d
    if model.attention == "signed_mask":
        return query_heads * SIGNED_MASK_BUCKETS
    if model.attention == "dex":  # λ vectors (W_D, d² per selected head, lives with its head: negligible here)
        return 4 * d
    return 0


def parameters_per_stage(cfg: Any, padded_vocab: int) -> Dict[str, int]:
    """Parameters on one rank of the first and of the last pipeline stage (the same rank when pp = 1): the first
    holds the embedding, the last the final norm and the output layer (with tied embeddings, its own copy of the
    embedding when pp > 1)."""
    m, p = cfg.model, cfg.parallel
    layers = (m.num_layers // p.pp) * layer_parameters(m, p.tp)
    embedding = padded_vocab * m.hidden_size // p.tp
    output = 0 if (m.share_embeddings and p.pp == 1) else embedding
    if p.pp == 1:
        whole = layers + embedding + m.hidden_size + output
        return {"first": whole, "last": whole}
    return {"first": layers + embedding, "last": layers + m.hidden_size + output}


# ------------------------------------------------------------------------------------------------------------------
# Activations: what the backward pass needs, per micro-batch, per layer, on one rank
# ------------------------------------------------------------------------------------------------------------------
def context_parallel_size(cfg: Any) -> int:
    """parallel.cp, 1 while it is still to be chosen (null)."""
    return getattr(cfg.parallel, "cp", 1) or 1


def core_attention_bytes_per_token(
    model: Any, backend: str, device: str, a: int, fused_epilogue: bool = False, cp: int = 1
) -> Tuple[float, bool]:
    """(bytes per token the core attention keeps beyond its output, whether it keeps its inputs q, k, v among them):
    what selective recomputation drops (it keeps the inputs itself). ``a``: bytes of an activation element.

    - context parallelism (``cp`` > 1, models/ring_attention.py): the ring keeps no map (each block's is recomputed in
      the backward), only each softmax map's merged output and its fp32 LSE (DIFF: two maps over H heads of 2d);
      DIFF's fused ring (``triton``) keeps y = O1 − λ·O2 in fp32 and both maps' fp32 LSE instead, and its epilogue,
      unfused, x and x·rstd in fp32 (with the sub-layer norm);
    - maps: ``eager`` keeps fp32 softmax maps of s keys per head (DIFF: A1, A2 and A1 − λA2 over H heads; the
      baseline one over 2H); DIFF's ``combined`` A1 and A2 (its combined map is recomputed), with fp32 copies of q and
      k in its batched layout and x, its epilogue's input, in fp32; the library kernels (sdpa's flash, cuDNN and memory-efficient kernels, on a CPU torch's
      flash kernel, all with equal head dims) and ``triton`` keep none;
    - DIFF on library kernels (``library_layout``) keeps the two halves of V repeated per head pair and the two calls'
      outputs (with GQA also the map-major copies of q and k); on ``flash_attn4`` (one call over the 2d-wide V) its
      output over 2H heads of 2d and V repeated to them (with GQA also the key heads repeated); eager its combined
      output in fp32; ``triton`` the pre-norm output its epilogue normalised;
    - DIFF's epilogue: the fused one keeps one rstd per head (nothing here); the unfused one x and x·rstd in fp32 (with
      the sub-layer norm) and, for a bf16 model, the fp32 copy of map 2's output that λ's gradient reads.
    """
    h_heads, d, s = model.num_heads, head_dim(model), model.seq_length
    hq = 2 * h_heads * d  # query width = output width (DIFF: H heads of 2d)
    hkv = 2 * num_kv_heads(model) * d
    diff = model.attention == "diff"
    maps = copies = 0
    if cp > 1 and backend == "triton":  # V1: H heads of 2d; V2: H heads of d
        norm = 2 * hq * 4 if diff and model.sublayer_norm and not fused_epilogue else 0
        return (hq if diff else hq // 2) * 4 + 2 * h_heads * 4 + norm, True
    if cp > 1:  # the ring: each map's merged output and its fp32 LSE, no map
        copies = 2 * hq * a + 2 * h_heads * 4 if diff else hq * a + 2 * h_heads * 4
        backend = "ring"
    elif backend == "eager":
        maps = 3 * h_heads * s * 4 if diff else 2 * h_heads * s * 4
        copies = 3 * hq * 4 if a == 2 else 0  # q, k, v cast to fp32
    if not diff:
        return maps + copies, True
    if backend == "triton":  # the kernel's epilogue keeps the pre-norm output (and per-row LSEs and rstd)
        return hq * a, True
    if backend == "combined":  # both maps over H heads, fp32 q and k batched (k per query head), x in fp32
        return 2 * h_heads * s * 4 + 2 * hq * 4 + (hkv * 4 if a == 2 else 0) + hq * 4, True
    if backend == "eager":
        kept = hq * 4  # (A1 − λ·A2)·V in fp32
    elif backend == "flash_attn4":  # its output over 2H heads of 2d (the epilogue's halves are views) and V repeated
        kept = 4 * hq * a + (hq * a if hkv < hq else 0)  # to them; with GQA the key heads repeated too
    else:
        gqa = (hq + hkv) * a if hkv < hq else 0
        # the ring's two maps stacked as the epilogue's halves; the library layout's halves of V and outputs
        kept = 2 * hq * a if backend == "ring" else 2 * hkv * a + 2 * hq * a + gqa
    if not fused_epilogue:
        kept += (2 * hq * 4 if model.sublayer_norm else 0) + (hq * 4 if a == 2 and backend != "eager" else 0)
    return maps + copies + kept, True


def ring_bytes_per_token(model: Any, backend: str, device: str, a: int, cp: int) -> float:
    """Bytes per local token that one layer's ring attention holds while it runs (then frees), at its backward's peak:
    the K and V in flight (the block computed and the one arriving), the visiting block's dK and dV accumulating in
    fp32 and the ones arriving, the block's K and V repeated to the query heads (GQA), and with ``eager`` (or on a
    CPU) a block's fp32 scores, probabilities and their gradient, over the at most s/cp keys of a block. DIFF's fused
    ring (``triton``) repeats nothing and keeps no scores; its kernels return a block's dQ, dK and dV in fp32, and dQ
    accumulates in fp32."""
    if cp == 1:
        return 0.0
    query_heads, kv_heads, d = attention_heads(model)
    kv_width = 4 * num_kv_heads(model) * d if model.attention == "diff" else 2 * kv_heads * d  # K and V together
    if backend == "triton":
        return 2 * kv_width * a + 3 * kv_width * 4 + 2 * query_heads * d * 4
    maps = 2 * model.num_heads if model.attention == "diff" else query_heads  # softmax rows per token
    value = 2 * d if model.attention == "diff" else d
    expanded = maps * (d + value) * a
    scores = 3 * maps * (model.seq_length // cp) * 4 if backend == "eager" or device == "cpu" else 0
    return 2 * kv_width * a + 2 * kv_width * 4 + expanded + scores


def activation_bytes_per_layer(cfg: Any, a: int, device: str) -> Dict[str, float]:
    """Bytes one layer keeps for its backward for one micro-batch on one rank: ``full`` without recomputation,
    ``selective`` with the core attention recomputed (its inputs kept, its internals dropped), ``core`` the
    internals that recomputation brings back for one layer at a time, ``input`` the layer's input (all that full
    recomputation keeps), ``working`` the largest gradient its backward allocates, ``ring`` what context
    parallelism's ring attention holds while one layer's attention runs. Under context parallelism a rank holds
    model.seq_length / parallel.cp tokens of each sequence."""
    m, p = cfg.model, cfg.parallel
    cp = context_parallel_size(cfg)
    tokens = m.seq_length // cp * cfg.trainer.micro_batch_size
    h, f, d = m.hidden_size, m.ffn_hidden_size, head_dim(m)
    hq, hkv = 2 * m.num_heads * d, 2 * num_kv_heads(m) * d
    seq_split = p.tp if p.sequence_parallel else 1
    # each RMSNorm keeps its input and its output (the next linear's input); torch's CPU rms_norm also x·rstd
    norms = 2 * (3 if device == "cpu" else 2) * h * a / seq_split
    # SwiGLU: fc1's output (2f), its linear half plus offset, silu, and their product (fc2's input)
    mlp = 5 * f * a / p.tp
    out = hq * a / p.tp  # the core attention's output: linear_proj's input
    # q, k, v: the QKV output (V stays a view of it) and q and k after RoPE
    inputs = (2 * hq + 3 * hkv) * a / p.tp
    fused_epilogue = fusions_enabled(cfg, device) and cfg.model.attention == "diff"
    core, keeps_inputs = core_attention_bytes_per_token(m, resolved_backend(m), device, a, fused_epilogue, cp)
    core /= p.tp
    if getattr(cfg.data, "document_mask", False) and resolved_backend(m) == "eager":
        # the eager maps' same-document mask, one bool per key and map call on every TP rank, kept for the backward
        # (the other backends keep none: library calls per document, the kernels' tiles; the ids: 4 bytes a token)
        core += attention_maps(m)[0] * (m.seq_length // cp)
    return {
        "ring": tokens * ring_bytes_per_token(m, m.attention_backend, device, a, cp) / p.tp,
        "full": tokens * (norms + mlp + out + core + (inputs if keeps_inputs else 0)),
        "selective": tokens * (norms + mlp + out + inputs),
        "core": tokens * core,
        "input": tokens * h * a / seq_split,
        "working": tokens * 2 * f * a / p.tp,  # the gradient of fc1's output, the largest in a layer's backward
    }


def logits_bytes(cfg: Any, padded_vocab: int, a: int, device: str) -> float:
    """The last stage's logits over its vocabulary shard, and what its cross entropy adds. megatron-core's
    (``trainer.fusions`` off) keeps an fp32 softmax (computed in place of the logits in fp32; from a bf16 copy that
    is alive at the same time in bf16). ``trainer.fusions``' (``models.cross_entropy``) keeps the logits, and its
    backward writes their gradient beside them (its fp32 values stay in the compiled kernels' registers)."""
    tokens = cfg.model.seq_length // context_parallel_size(cfg) * cfg.trainer.micro_batch_size
    per_logit = 2 * a if fusions_enabled(cfg, device) else 4 + (a if a != 4 else 0)
    return tokens * padded_vocab / cfg.parallel.tp * per_logit


def activation_bytes_per_stage(cfg: Any, a: int, device: str, in_flight: int) -> Tuple[float, float]:
    """(stored, transient) activation bytes of a pipeline stage with ``in_flight`` micro-batches between their
    forward and backward (1F1B: up to pp on the first stage). ``stored`` is what the forward passes keep under
    ``trainer.recompute``; ``transient`` what recomputation brings back during the backward, once per stage (one
    layer's core attention, or one group of fully recomputed layers), and the ring's buffers of one layer."""
    stored, transient = _stored_and_recomputed(cfg, a, device, in_flight)
    return stored, transient + activation_bytes_per_layer(cfg, a, device)["ring"]


def _stored_and_recomputed(cfg: Any, a: int, device: str, in_flight: int) -> Tuple[float, float]:
    t = cfg.trainer
    layers = cfg.model.num_layers // cfg.parallel.pp
    per = activation_bytes_per_layer(cfg, a, device)
    if t.recompute == "selective" and resolved_backend(cfg.model) not in FUSED_ATTENTION_BACKENDS:
        # one layer's core attention, recomputed after its MLP's backward (which frees about as much as the core's
        # own gradients then need)
        return in_flight * layers * per["selective"], per["core"]
    if t.recompute == "full":
        n = t.recompute_layers
        recomputed = per["full"] + per["working"]  # a layer brought back, and its backward's largest gradient
        if t.recompute_method == "uniform":
            n = n or 1
            return in_flight * (layers // n) * per["input"], (n - 1) * per["full"] + recomputed
        n = layers if n is None else n
        # block recomputes the first n layers of the stage, whose backward comes after the later layers' has freed
        # theirs
        transient = max(0.0, recomputed - (layers - n) * per["full"]) if n else 0.0
        return in_flight * (n * per["input"] + (layers - n) * per["full"]), transient
    return in_flight * layers * per["full"], 0.0


def estimate_memory_per_gpu(
    cfg: Any, dtype: torch.dtype, world_size: int, padded_vocab: int, device: Optional[str] = None
) -> Dict[str, float]:
    """GiB per device on its most loaded rank: weights, fp32 gradient buffer, optimizer state (fp32 main copy in
    bf16 and Adam's two moments; split over data-parallel ranks by the distributed optimizer), activations (see
    :func:`activation_bytes_per_stage`; 1F1B keeps pp micro-batches in flight on the first stage, one on the last)
    and the last stage's logits. The peak comes either at the end of a forward pass (everything stored, and the
    logits) or during the backward (everything stored, and what recomputation brings back, once the logits are
    freed): ``activations`` holds the stored part plus whatever the recomputed part exceeds the logits by.

    ``device``: ``cuda`` or ``cpu`` (default: this machine's), for the few kernels whose saved tensors differ.

    With ``engine=deepspeed`` the weights, gradients and optimizer state are DeepSpeed's at its ZeRO stage
    (:func:`deepspeed_state_bytes`); what offload moves off the device is reported as ``host``."""
    p, t = cfg.parallel, cfg.trainer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = 2 if dtype == torch.bfloat16 else 4
    cp = context_parallel_size(cfg)
    dp = world_size // (p.tp * p.pp * cp)
    main = 4 if dtype == torch.bfloat16 else 0
    optim_bytes = (main + 8) / (dp * cp if p.distributed_optimizer else 1)  # sharded over DP×CP
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    params = parameters_per_stage(cfg, padded_vocab)
    stages = [(params["first"], min(p.pp, microbatches),
               0.0 if p.pp > 1 else logits_bytes(cfg, padded_vocab, a, device))]
    if p.pp > 1:
        stages.append((params["last"], 1, logits_bytes(cfg, padded_vocab, a, device)))
    best = None
    deepspeed = getattr(getattr(cfg, "engine", None), "name", "megatron") == "deepspeed"
    for n, in_flight, logits in stages:
        stored, transient = activation_bytes_per_stage(cfg, a, device, in_flight)
        if deepspeed:
            state = deepspeed_state_bytes(cfg, n, a, dp)
        else:
            state = {"weights": n * a, "grads": n * 4, "optimizer": n * optim_bytes, "host": 0.0}
        out = {
            "weights": state["weights"] / GIB,
            "grads": state["grads"] / GIB,
            "optimizer": state["optimizer"] / GIB,
            "activations": (stored + max(0.0, transient - logits)) / GIB,
            "logits": logits / GIB,
        }
        out["total"] = sum(out.values())
        out["host"] = state["host"] / GIB  # offloaded: host memory, not in the device total
        if best is None or out["total"] > best["total"]:
            best = out
    return best


# DeepSpeed's defaults (zero_optimization.reduce_bucket_size, stage3_prefetch_bucket_size), in elements
DEEPSPEED_REDUCE_BUCKET = 5e8
DEEPSPEED_PREFETCH_BUCKET = 5e7


def deepspeed_state_bytes(cfg: Any, n: int, a: int, dp: int) -> Dict[str, float]:
    """Bytes of weights, gradients and optimizer state of ``n`` parameters on one device under DeepSpeed ZeRO
    (``a``: bytes of the model's dtype), and what offload keeps on the host instead:

    - stage 0: the whole model and its gradients, plus the flat copy its all-reduce makes of them (bf16: also
      DeepSpeed's fp32 gradient accumulation); in fp32 torch AdamW's moments on the parameters themselves, in bf16
      DeepSpeed's optimizer splits the fp32 master copy and the moments over data-parallel ranks;
    - stages 1–3: an fp32 master partition, Adam's two moments and an fp32 gradient partition, each 4 bytes a
      parameter over ``dp`` (also in fp32: ZeRO keeps its own flat master copy), and the reduction bucket it
      allocates whole (``zero_optimization.reduce_bucket_size`` elements of the model's dtype, 5e8 by default;
      twice with ``overlap_comm`` at stages 1–2); stage 1 keeps whole gradients in the model's dtype, stage 2
      partitions them, stage 3 partitions the weights too and holds gathered the parameters of the layer it
      computes and the prefetch bucket's;
    - ``offload_optimizer``: the master partition, the moments and the fp32 gradient partition on the host, and at
      stages 2–3 the partitioned gradients too;
      ``offload_param`` (stage 3): the weight partitions on the host, only the gathered ones on the device.
    """
    e = cfg.engine
    zero = dict(e.extra.get("zero_optimization", {})) if e.extra else {}
    stage = e.zero_stage
    if stage == 0:
        if a == 4:
            return {"weights": n * 4, "grads": n * 8, "optimizer": n * 8, "host": 0.0}
        return {"weights": n * a, "grads": n * (2 * a + 4), "optimizer": n * 12 / dp, "host": 0.0}
    optimizer = n * 12 / dp  # fp32 master partition and the two moments
    grads = n * 4 / dp  # the fp32 gradient partition the step reads
    host = 0.0
    if e.offload_optimizer != "none":
        host, optimizer, grads = optimizer + grads, 0.0, 0.0
    buffers = 2 if stage < 3 and zero.get("overlap_comm", False) else 1
    bucket = buffers * float(zero.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET)) * a
    if stage == 1:
        return {"weights": n * a, "grads": grads + n * a + bucket, "optimizer": optimizer, "host": host}
    if e.offload_optimizer != "none":  # the partitioned gradients accumulate on the host
        host += n * a / dp
    else:
        grads += n * a / dp
    if stage == 2:
        return {"weights": n * a, "grads": grads + bucket, "optimizer": optimizer, "host": host}
    prefetch = min(float(zero.get("stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_BUCKET)), n)
    weights = (layer_parameters(cfg.model, cfg.parallel.tp) + prefetch) * a  # gathered
    if e.offload_param != "none":
        host += n * a / dp
    else:
        weights += n * a / dp
    return {"weights": weights, "grads": grads + bucket, "optimizer": optimizer, "host": host}


# ------------------------------------------------------------------------------------------------------------------
# The memory plan: refuse a launch that cannot fit, naming the switches that would make it fit
# ------------------------------------------------------------------------------------------------------------------
def _with(cfg: Any, **changes: Any) -> Any:
    """A copy of ``cfg`` with ``changes`` (``"group.key": value``) applied."""
    new = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        group, key = dotted.split(".")
        setattr(getattr(new, group), key, value)
    return new


def _divides(n: int, m: int) -> bool:
    return m > 0 and n % m == 0


def memory_switches(cfg: Any, world_size: int) -> List[Dict[str, Any]]:
    """The switches that lower memory and apply to ``cfg`` at this world size, cheapest first, each as
    ``{"group.key": value}`` overrides (a switch that needs another carries both)."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    cp = context_parallel_size(cfg)
    dp = world_size // (p.tp * p.pp * cp)
    out: List[Dict[str, Any]] = []
    deepspeed = getattr(getattr(cfg, "engine", None), "name", "megatron") == "deepspeed"
    if deepspeed:
        e = cfg.engine
        for stage in range(e.zero_stage + 1, 4):
            if dp > 1:
                out.append({"engine.zero_stage": stage})
        if e.offload_optimizer == "none":
            out.append({"engine.zero_stage": max(e.zero_stage, 1), "engine.offload_optimizer": "cpu"})
        if e.offload_param == "none":
            out.append({"engine.zero_stage": 3, "engine.offload_optimizer": "cpu", "engine.offload_param": "cpu"})
    elif not p.distributed_optimizer and dp > 1:
        out.append({"parallel.distributed_optimizer": True})
    if p.tp > 1 and not p.sequence_parallel and _divides(m.seq_length, p.tp):
        out.append({"parallel.sequence_parallel": True})
    if t.recompute == "none" and resolved_backend(m) not in FUSED_ATTENTION_BACKENDS:
        out.append({"trainer.recompute": "selective"})
    if t.recompute != "full":
        out.append(
            {"trainer.recompute": "full", "trainer.recompute_method": "uniform", "trainer.recompute_layers": None}
        )
    mbs = t.micro_batch_size // 2
    while mbs >= 1:
        if _divides(t.global_batch_size, mbs * dp):
            out.append({"trainer.micro_batch_size": mbs})
        mbs //= 2
    if not deepspeed and (m.attention in context_parallel_kinds(m) and _divides(m.seq_length, 4 * cp)
                          and _fits_layout(cfg, world_size, cfg.parallel.tp, p.pp, 2 * cp)):
        # the sequence split over twice as many ranks (ring attention), on a backend with a ring path
        ring_backend = m.attention_backend in core_attention_class(m, m.attention).ring_backends + ("auto",)
        backend = {} if ring_backend else {"model.attention_backend": "sdpa"}
        out.append({"parallel.cp": 2 * cp, **backend})
    tp = p.tp * 2
    if (_divides(m.num_heads, tp) and _divides(num_kv_heads(m), tp) and _fits_layout(cfg, world_size, tp, p.pp, cp)):
        # with sequence parallelism, which more TP makes worth its while
        out.append({"parallel.tp": tp, **({"parallel.sequence_parallel": True} if _divides(m.seq_length, tp) else {})})
    pp = p.pp * 2
    if not deepspeed and _divides(m.num_layers, pp) and _fits_layout(cfg, world_size, p.tp, pp, cp):
        out.append({"parallel.pp": pp})
    return out


def _fits_layout(cfg: Any, world_size: int, tp: int, pp: int, cp: int) -> bool:
    """Whether the world splits into tp·pp·cp model-parallel ranks and a data-parallel rest that the global batch
    divides into micro-batches."""
    t = cfg.trainer
    return _divides(world_size, tp * pp * cp) and _divides(
        t.global_batch_size, t.micro_batch_size * (world_size // (tp * pp * cp))
    )


def _describe(changes: Dict[str, Any]) -> str:
    def value(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    shown = {k: v for k, v in changes.items() if not (k.startswith("trainer.recompute_") and v in (None, "uniform"))}
    return " ".join(f"{k}={value(v)}" for k, v in shown.items())


def device_memory_gib(cfg: Any) -> Optional[float]:
    """The plan's budget: ``trainer.gpu_memory_gib``, else this process's GPU's total memory, else None (CPU)."""
    if cfg.trainer.gpu_memory_gib is not None:
        return float(cfg.trainer.gpu_memory_gib)
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return torch.cuda.get_device_properties(index).total_memory / GIB
    return None


def memory_plan_problem(
    cfg: Any, dtype: torch.dtype, world_size: int, padded_vocab: int, budget_gib: float,
    device: Optional[str] = None,
) -> Optional[str]:
    """None when the estimate of ``cfg`` fits the usable share of ``budget_gib``; otherwise what exceeds it, with each
    switch that alone would make it fit and its estimate, or else the first combination (cheapest switches first)
    that does."""
    estimate = estimate_memory_per_gpu(cfg, dtype, world_size, padded_vocab, device)
    usable = USABLE_MEMORY_FRACTION * budget_gib
    if estimate["total"] <= usable:
        return None

    def total(changes: Dict[str, Any]) -> float:
        return estimate_memory_per_gpu(_with(cfg, **changes), dtype, world_size, padded_vocab, device)["total"]

    parts = ", ".join(f"{k} {estimate[k]:.1f}" for k in ("weights", "grads", "optimizer", "activations", "logits"))
    head = (
        f"estimated memory per GPU {estimate['total']:.1f} GiB ({parts}) exceeds the {usable:.1f} GiB usable of "
        f"{budget_gib:g} GiB ({USABLE_MEMORY_FRACTION:.0%}; trainer.gpu_memory_gib sets the budget)"
    )
    switches = memory_switches(cfg, world_size)
    fitting, smaller_batch_named = [], False
    for changes in switches:
        gib = total(changes)
        if gib > usable:
            continue
        if "trainer.micro_batch_size" in changes:  # the largest micro-batch that fits is enough to name
            if smaller_batch_named:
                continue
            smaller_batch_named = True
        fitting.append(f"{_describe(changes)} ({gib:.1f} GiB)")
    if fitting:
        return f"{head}; each of these fits: " + ", ".join(fitting)
    combined: Dict[str, Any] = {}
    steps: Dict[str, str] = {}  # by the switch's first key: full recompute replaces selective, a smaller micro-batch
    for changes in switches:
        combined.update(changes)
        gib = total(combined)
        steps.pop(next(iter(changes)), None)
        steps[next(iter(changes))] = f"{_describe(changes)} ({gib:.1f} GiB)"
        if gib <= usable:
            return f"{head}; no single switch fits, these together do (each estimate with those before it): " + (
                ", ".join(steps.values())
            )
    tried = ", ".join(steps.values()) or "none apply"
    return (
        f"{head}; not even all switches together fit at {world_size} GPUs ({tried}): launch more GPUs (for more "
        "tensor or pipeline parallelism) or train a smaller model"
    )


def least_recomputation(
    cfg: Any, dtype: torch.dtype, world_size: int, padded_vocab: int, budget_gib: float,
    device: Optional[str] = None,
) -> Tuple[Dict[str, Any], float]:
    """The ``trainer.recompute*`` overrides that recompute the fewest forward FLOPs among those whose estimate fits the
    usable share of ``budget_gib``, and that estimate (GiB): none, selective (where the backend keeps maps to drop),
    block recomputation of the first N layers of each stage, full. ``cfg``'s own recompute settings are ignored.
    Raises ValueError naming the budget and what would fit (:func:`memory_plan_problem` at full recomputation) when
    none does."""
    m = cfg.model
    layers = m.num_layers // cfg.parallel.pp
    attention = attention_flops_per_token(cfg) / m.num_layers / cfg.parallel.tp  # one layer's, per rank
    layer = 2 * layer_parameters(m, cfg.parallel.tp) + attention  # one layer's forward FLOPs a token, per rank
    full = {"trainer.recompute": "full", "trainer.recompute_method": "uniform", "trainer.recompute_layers": None}
    candidates = [(0.0, {"trainer.recompute": "none", "trainer.recompute_method": "uniform",
                         "trainer.recompute_layers": None})]
    if resolved_backend(m) not in FUSED_ATTENTION_BACKENDS:
        candidates.append((layers * attention, {**candidates[0][1], "trainer.recompute": "selective"}))
    candidates += [(n * layer, {**full, "trainer.recompute_method": "block", "trainer.recompute_layers": n})
                   for n in range(1, layers)]
    candidates.append((layers * layer, full))
    usable = USABLE_MEMORY_FRACTION * budget_gib
    for _, changes in sorted(candidates, key=lambda c: c[0]):
        gib = estimate_memory_per_gpu(_with(cfg, **changes), dtype, world_size, padded_vocab, device)["total"]
        if gib <= usable:
            return changes, gib
    raise ValueError(f"no recomputation fits {budget_gib:g} GiB: "
                     + memory_plan_problem(_with(cfg, **full), dtype, world_size, padded_vocab, budget_gib, device))


def recompute_label(cfg: Any) -> str:
    """``trainer.recompute`` in a table cell: none, selective, full, or ``block N/L`` (the first N of a stage's L)."""
    t = cfg.trainer
    layers = cfg.model.num_layers // cfg.parallel.pp
    if t.recompute == "full" and t.recompute_method == "block":
        n = layers if t.recompute_layers is None else t.recompute_layers
        return f"block {n}/{layers}"
    if t.recompute == "full" and (t.recompute_layers or 1) > 1:
        return f"full (groups of {t.recompute_layers})"
    return t.recompute


def choose_context_parallel(
    cfg: Any, dtype: torch.dtype, world_size: int, padded_vocab: int, device: Optional[str] = None,
    budget_gib: Optional[float] = None,
) -> int:
    """``parallel.cp=null``: the smallest context parallelism whose memory estimate fits ``budget_gib`` (default:
    :func:`device_memory_gib`; 1 without a budget), among those the world, the sequence and the batch allow; the
    largest of them when none fits (the plan then refuses it, naming what else would fit). ``device`` as in
    :func:`estimate_memory_per_gpu`."""
    m, p = cfg.model, cfg.parallel
    rest = world_size // (p.tp * p.pp)
    allowed = [cp for cp in range(1, rest + 1) if _fits_layout(cfg, world_size, p.tp, p.pp, cp)
               and (cp == 1 or _divides(m.seq_length, 2 * cp))]
    budget = budget_gib if budget_gib is not None else device_memory_gib(cfg)
    if not allowed or budget is None:
        return 1
    for cp in allowed:
        estimate = estimate_memory_per_gpu(_with(cfg, **{"parallel.cp": cp}), dtype, world_size, padded_vocab, device)
        if estimate["total"] <= USABLE_MEMORY_FRACTION * budget:
            return cp
    return allowed[-1]


def check_memory_plan(
    cfg: Any, dtype: torch.dtype, world_size: int, padded_vocab: int, budget_gib: Optional[float] = None,
    device: Optional[str] = None,
) -> Optional[Dict[str, float]]:
    """Before any process group starts (train.py), or before a job is queued (``launch.slurm submit``, which gives the
    budget of the GPUs it asks for and ``device``): raise ValueError (see :func:`memory_plan_problem`) when the
    estimate exceeds ``budget_gib`` (default: :func:`device_memory_gib`); returns the estimate, or None when there is
    no budget (CPU). A ``parallel.cp`` still to be chosen (null) is judged at the value
    :func:`choose_context_parallel` gives it."""
    budget = budget_gib if budget_gib is not None else device_memory_gib(cfg)
    if budget is None:
        return None
    if getattr(cfg.parallel, "cp", 1) is None:
        cp = choose_context_parallel(cfg, dtype, world_size, padded_vocab, device, budget)
        cfg = _with(cfg, **{"parallel.cp": cp})
    problem = memory_plan_problem(cfg, dtype, world_size, padded_vocab, budget, device)
    if problem:
        raise ValueError(problem)
    return estimate_memory_per_gpu(cfg, dtype, world_size, padded_vocab, device)


def attention_maps(model: Any) -> Tuple[int, int, int, int]:
    """(maps, heads per map, query/key head size, value head size) of one layer's attention, before TP.

    DIFF V1 has two softmax maps over H heads of size d, each weighting the 2d-wide V (a fused kernel must keep the
    two weighted sums apart until both softmaxes are normalised); every other kind one map over the query heads of
    its megatron-core SelfAttention (V2: 2H heads of d; the subtraction after it is negligible)."""
    if model.attention == "diff":
        d = head_dim(model)
        return 2, model.num_heads, d, 2 * d
    query_heads, _, size = attention_heads(model)
    return 1, query_heads, size, size


def attention_flops_per_token(cfg: Any, keys: Optional[float] = None) -> float:
    """Forward FLOPs per token of the attention scores (Q·Kᵀ) and weighted sums (A·V) of every map, all layers:
    2 FLOPs a multiply-add, over s/2 keys on average (causal), or over ``keys`` a token (document masking: what the
    mask leaves, :func:`attention_keys_per_token`).

    debug (H=2, d=16, s=64, 2 layers): DIFF 2·2·(2·16 + 2·32)·32 per layer = 12,288, 24,576 in all; the baseline
    1·4·(16 + 16)·2·32 = 8,192 per layer."""
    maps, heads, qk, v = attention_maps(cfg.model)
    keys = cfg.model.seq_length / 2 if keys is None else keys
    return cfg.model.num_layers * maps * heads * 2 * (qk + v) * keys


def attention_keys_per_token(document_ids: torch.Tensor) -> float:
    """The keys a token attends to on average under document masking, on the causal map's s/2 convention: Σ L²/2
    over the documents of each sample (lengths L among its tokens), over the tokens. s/2 for one document a sample."""
    lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in document_ids.reshape(
        -1, document_ids.shape[-1])])
    return float((lengths.double() ** 2).sum() / 2 / document_ids.numel())


def attention_backward_flops_per_token(cfg: Any, keys: Optional[float] = None) -> float:
    """Backward FLOPs per token of the attention products, all layers (no recomputation: model FLOPs).

    A single map needs dQ, dK (over the query/key size) and dP = dO·Vᵀ, dV (over the value size): twice its forward.
    DIFF's two maps share V, so dP = dO·Vᵀ and dV = (A1 − λA2)ᵀ·dO are one product each over the 2d-wide V, while
    dQ and dK are per map: 2·H·(2d + 2d) + 2·2·H·(d + d) per (query, key) pair and layer, the 8·H·d MACs of the
    2H-head baseline."""
    maps, heads, qk, v = attention_maps(cfg.model)
    keys = cfg.model.seq_length / 2 if keys is None else keys
    if cfg.model.attention == "diff":
        macs = heads * 2 * v + maps * heads * 2 * qk
    else:
        macs = maps * heads * 2 * (qk + v)
    return cfg.model.num_layers * 2 * macs * keys


def model_flops_per_token(cfg: Any, num_non_embedding_parameters: int, padded_vocab: int,
                          keys: Optional[float] = None) -> float:
    """Training FLOPs per token: 6 per weight of every matmul (forward 2, backward 4), the logits layer included
    (tied or not), plus the attention products forward and backward for the model's attention kind (causal; with
    ``keys``, over that many keys a token: document masking counts only the blocks the mask leaves). These are model
    FLOPs (what MFU divides), not what a given backend executes (recomputation is not counted)."""
    matmul_weights = num_non_embedding_parameters + padded_vocab * cfg.model.hidden_size
    return 6 * matmul_weights + attention_flops_per_token(cfg, keys) + attention_backward_flops_per_token(cfg, keys)


# bf16 dense peak of one device, by CUDA device name (vendor datasheets)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def peak_flops_per_device(cfg: Any) -> Optional[float]:
    """logging.peak_tflops_per_device when set, else the datasheet value of a known GPU; None on CPU."""
    if getattr(cfg.logging, "peak_tflops_per_device", None):
        return cfg.logging.peak_tflops_per_device * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def memory_gib() -> float:
    """Peak GPU memory allocated by this process, or its resident memory on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class PeakMemory:
    """The peak of bytes allocated on this process's device while the block runs, above what was allocated when it
    started, and what is still allocated at its end: ``torch.cuda`` allocator statistics on a GPU. A CPU keeps no
    such statistics; ``cpu_method`` picks one of two stand-ins:

    - ``profiler``: the running sum of every allocation and free that torch's profiler records. Exact, but only for
      this thread: a tensor that a collective frees on one of gloo's threads looks alive forever, so use it where
      nothing is reduced (one process, the model alone);
    - ``heap``: glibc's in-use heap bytes (``mallinfo2``: arenas and mmapped chunks, every thread, everything the
      process allocates, tensors by far the largest part), sampled every millisecond by a background thread, so a
      peak shorter than that can be missed. For multi-process runs.

        with PeakMemory() as peak:
            loss.backward()
        peak.bytes, peak.end_bytes
    """

    def __init__(self, cpu_method: str = "profiler"):
        if cpu_method not in ("profiler", "heap"):
            raise ValueError(f"cpu_method={cpu_method!r}; use profiler or heap")
        self.cpu_method = cpu_method

    def __enter__(self) -> "PeakMemory":
        self.bytes = self.end_bytes = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self._start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        elif self.cpu_method == "heap":
            import threading

            self._start = self._peak = _heap_in_use()
            self._stop = threading.Event()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, _heap_in_use())

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._start
            self.end_bytes = torch.cuda.memory_allocated() - self._start
            return
        if self.cpu_method == "heap":
            self._stop.set()
            self._sampler.join()
            end = _heap_in_use()
            self.bytes, self.end_bytes = max(self._peak, end) - self._start, end - self._start
            return
        self._profile.__exit__(*exc)
        events = [
            e for e in self._profile.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type().name == "CPU"
        ]
        running = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            running += event.nbytes()
            peak = max(peak, running)
        self.bytes, self.end_bytes = peak, running


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back: in-use arena chunks plus mmapped chunks."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


# Above this share of the parameters in the embeddings, the tokenizer, not the layers, decides the model's size.
EMBEDDING_SHARE_WARNING = 0.5


def embedding_share_warning(num_parameters: int, num_non_embedding_parameters: int, vocab_size: int,
                            hidden_size: int) -> str | None:
    """A warning when the (input and output) embeddings hold most of the model, else None."""
    share = 1 - num_non_embedding_parameters / max(1, num_parameters)
    if share <= EMBEDDING_SHARE_WARNING:
        return None
    return (f"the embeddings are {share:.0%} of the model's {num_parameters:,} parameters (vocabulary {vocab_size:,} x "
            f"hidden size {hidden_size}): the layers being compared are the small part; a smaller tokenizer "
            "(data.bundled_vocab_size, or python -m data.tokenizer train with a smaller vocabulary) or a wider model "
            "leaves more of the budget to them")
