"""``model.attention_backend=auto``: the attention backend a run uses, decided once and kept.

Rank 0 decides, in this order, and every rank follows (``distributed.broadcast_object``):

1. a resumed run keeps the backend its checkpoint trained with (its saved config), else the one recorded in the run
   directory (``attention_backend.json``): a resume computes with the same kernels, so a bit-exact GPU resume stays
   possible; unless the run's layout cannot run it (a resume at ``parallel.cp`` > 1 of a run trained on a backend
   without a ring path: ``combined``, ``flash_attn``, ``flash_attn4``; or of a FlashAttention backend whose
   library is missing here): then the steps below decide, and the log says why;
2. without a GPU, by rule (reproducible: two CPU runs of one config compute alike): DIFF V1 takes ``combined``, its
   combined map in one autograd node (``models.attention.combined_map``), at per-rank sequences up to
   ``combined_map.MAX_SEQ`` tokens whose maps fit ``combined_map.MAP_BYTES_LIMIT``, where it beats torch's CPU flash
   kernel, which computes each Q·Kᵀ twice in the library layout (``benchmarks/core_attention.py --v1-backends
   combined sdpa``); every other case ``sdpa``;
3. a kind with one candidate (the map controls: ``sdpa``; the softmax kinds without flash-attn 2 or 4 installed;
   under context parallelism the kind's backends with a ring path: ``sdpa`` for the baselines) takes it;
4. otherwise the fastest candidate for the run's per-rank shape, forward and backward of one layer's core attention
   (a few milliseconds each), timed once per (GPU, torch, Triton, kind, shape, dtype, epilogue, CP) and set of
   candidates, and cached in
   ``$DIFF_TRANSFORMER_CACHE_DIR/attention_backends.json`` (default ``~/.cache/diff_transformer``). Under context
   parallelism (``parallel.cp`` > 1) the candidates are the kind's ring backends (DIFF V1 and V2: ``sdpa`` and
   ``triton``), each timed as one CP rank's ring attention over its s/cp tokens, all of the rank's blocks computed
   around a ring that hands the rank its own K and V back (``models.ring_attention.LoopbackRing``): the kernels of
   a real rank, without the transfers, which the ring overlaps with them. With document masking
   (``data.document_mask``) the candidates are timed masked, on the document ids of the run's first training
   micro-batch, and the key holds its documents a sample. Under ``trainer.compile`` where the compiled layers keep
   the core attention in their graph (:func:`attention_in_compiled_graph`: one context-parallel rank, no selective
   recomputation, no document masking, a kind that allows it), the candidates are the backends that stay in the
   graph (``TRACEABLE_BACKENDS``: ``sdpa``, and ``flash_attn4`` where installed): a core attention timed eagerly
   cannot show what the compiled layer takes off the host and fuses around it. On one H100 (``830m``, 2026-11-27)
   DIFF on ``sdpa`` in the compiled graph gave 0.866 of the baseline's tokens/s where the eagerly timed choice
   (``triton``, 3.3 against 5.0 ms a layer) gave 0.794 eagerly, and the fused kernel's attention kernels took longer
   than the two cuDNN calls' (272 against 241 ms a step).

The decision, how it was reached and the timings go to the log and to ``<run dir>/attention_backend.json``. An
explicit ``model.attention_backend`` is never replaced.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from diff_transformer.fileio import atomic_write_json
from diff_transformer.models.attention import combined_map
from diff_transformer.models.attention.base import FLASH_LIBRARIES, TRACEABLE_BACKENDS, flash_library_installed
from diff_transformer.models.layer_specs import attention_kind, core_attention_class, head_dim, num_kv_heads

RECORD_FILE = "attention_backend.json"
CACHE_FILE = "attention_backends.json"
# backends never timed: eager materialises every map (the numerics reference, never the fast one), and so does DIFF
# V1's combined map, the CPU's choice at short sequences (flash kernels keep no map)
NOT_CANDIDATES = ("eager", "combined")


def cache_path() -> str:
    root = os.environ.get("DIFF_TRANSFORMER_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "diff_transformer"))
    return os.path.join(root, CACHE_FILE)


def installed(backend: str) -> bool:
    """Whether a backend's library is importable here (sdpa, eager and combined are torch's)."""
    if backend in FLASH_LIBRARIES:
        return flash_library_installed(backend)
    return backend != "triton" or importlib.util.find_spec("triton") is not None


def layout_backends(model: Any, cp: int = 1) -> Tuple[str, ...]:
    """The backends the kind runs on at context-parallel size ``cp`` (above 1: those with a ring path)."""
    return core_attention_class(model, model.attention).ring_backends if cp > 1 else attention_kind(model).backends


def candidates(model: Any, cp: int = 1, in_graph: bool = False) -> List[str]:
    """The backends ``auto`` chooses among for this attention kind: the kind's (under context parallelism, ``cp`` > 1,
    those with a ring path), minus eager, minus those whose library is missing; with ``in_graph`` (compiled layers
    that keep the core attention in their graph) those that stay in the graph; ``sdpa`` first (the choice when timing
    cannot separate them)."""
    found = [b for b in layout_backends(model, cp) if b not in NOT_CANDIDATES and installed(b)
             and (not in_graph or b in TRACEABLE_BACKENDS)]
    return sorted(found, key=lambda b: b != "sdpa")


def attention_in_compiled_graph(cfg: Any) -> bool:
    """Whether this run's compiled layers keep the core attention in their graph on a backend that allows it
    (``models.gpt.core_attention_traceable``'s conditions, read from the config): ``trainer.compile`` with TorchDynamo
    on, one context-parallel rank, no selective recomputation, no document masking, a kind whose core attention
    allows it (not DEX)."""
    from diff_transformer.models.gpt import dynamo_disabled  # megatron-core's model: imported where needed

    m, t = cfg.model, cfg.trainer
    return (bool(t.compile) and not dynamo_disabled() and (cfg.parallel.cp or 1) == 1 and t.recompute != "selective"
            and not cfg.data.document_mask and getattr(core_attention_class(m, m.attention), "traceable", False))


def cpu_backend(cfg: Any) -> Dict[str, str]:
    """The backend a run takes without a GPU, by rule (the module docstring's step 2): {"backend", "how"}."""
    m, p = cfg.model, cfg.parallel
    cp = p.cp or 1
    seq = m.seq_length // cp
    if cp > 1 or "combined" not in attention_kind(m).backends:
        return {"backend": "sdpa", "how": "no GPU"}
    if seq > combined_map.MAX_SEQ:
        return {"backend": "sdpa", "how": f"no GPU; {seq} tokens a rank, over the combined map's {combined_map.MAX_SEQ}"}
    maps = combined_map.map_bytes(cfg.trainer.micro_batch_size, m.num_heads // p.tp, seq) * (m.num_layers // p.pp)
    if maps > combined_map.MAP_BYTES_LIMIT:
        return {"backend": "sdpa", "how": f"no GPU; the combined maps of a stage's layers would take "
                                          f"{maps / 2**30:.1f} GiB, over {combined_map.MAP_BYTES_LIMIT / 2**30:.0f}"}
    return {"backend": "combined", "how": f"no GPU; {seq} tokens a rank, at most {combined_map.MAX_SEQ}"}


def problem_key(cfg: Any, device_name: str, dtype: torch.dtype, epilogue: str,
                document_ids: Optional[torch.Tensor] = None) -> str:
    """What a timing depends on: the GPU, torch and Triton, the kind and its per-rank shape, dtype and epilogue (and
    with document masking, the documents a sample of the micro-batch timed)."""
    m, p = cfg.model, cfg.parallel
    triton_version = None
    if installed("triton"):
        import triton

        triton_version = triton.__version__
    key = {
        "gpu": device_name, "torch": torch.__version__, "triton": triton_version, "kind": m.attention,
        "micro_batch": cfg.trainer.micro_batch_size, "seq": m.seq_length, "heads": m.num_heads // p.tp,
        "kv_heads": num_kv_heads(m) // p.tp, "head_dim": head_dim(m), "dtype": str(dtype).replace("torch.", ""),
        "epilogue": epilogue,
    }
    if (p.cp or 1) > 1:  # the ring's timings (without CP the key is what it always was: cached timings stay valid)
        key["cp"] = p.cp
    if attention_in_compiled_graph(cfg):  # the candidates of a compiled graph (as above: other keys stay valid)
        key["in_graph"] = True
    if document_ids is not None:
        runs = sum(len(torch.unique_consecutive(row)) for row in document_ids)
        key["documents_per_sample"] = round(runs / document_ids.shape[0], 1)
    return json.dumps(key, sort_keys=True)


def choose(options: List[str], measure: Callable[[str], float]) -> Dict[str, Any]:
    """Time each option (``measure`` returns milliseconds and may raise); the fastest wins, ties to the first.
    Returns {"backend", "timings_ms" (None where it failed), "errors"}."""
    timings: Dict[str, Optional[float]] = {}
    errors: Dict[str, str] = {}
    for option in options:
        try:
            timings[option] = float(measure(option))
        except Exception as err:  # a backend that fails here (no kernel for this GPU, say) is not chosen
            timings[option], errors[option] = None, f"{type(err).__name__}: {err}"
    timed = [o for o in options if timings[o] is not None and math.isfinite(timings[o])]
    if not timed:
        raise RuntimeError(f"model.attention_backend=auto: no candidate ran ({errors}); set model.attention_backend")
    return {"backend": min(timed, key=lambda o: timings[o]), "timings_ms": timings, "errors": errors}


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def saved_backend(checkpoint_config: Optional[Dict[str, Any]]) -> Optional[str]:
    backend = ((checkpoint_config or {}).get("model") or {}).get("attention_backend")
    return backend if backend not in (None, "auto") else None


def why_not_here(cfg: Any, backend: str) -> Optional[str]:
    """Why the run cannot take ``backend`` (its kind does not run on it in the run's layout, or its library is missing
    here), or None when it can."""
    cp = cfg.parallel.cp or 1
    if backend not in layout_backends(cfg.model, cp):
        return f"parallel.cp={cp}: {' or '.join(layout_backends(cfg.model, cp))}"
    if not installed(backend):
        return "its library is not installed here"
    return None


def decide_attention_backend(
    cfg: Any,
    run_dir: str,
    dtype: torch.dtype,
    epilogue: str,
    checkpoint_config: Optional[Dict[str, Any]] = None,
    cuda: Optional[bool] = None,
    device_name: Optional[str] = None,
    measure: Optional[Callable[[str], float]] = None,
    record: bool = True,
    document_ids: Optional[torch.Tensor] = None,
) -> Dict[str, Any]:
    """Rank 0's decision for ``auto`` (see the module docstring); writes the run directory's record and returns it:
    {"backend", "how", "timings_ms", "key"}. ``checkpoint_config`` is the saved config of the checkpoint being
    resumed; ``cuda``, ``device_name`` and ``measure`` default to this machine's (tests inject them). ``record``
    false: the caller writes the record (:func:`write_record`) once the run directory may be written.
    ``document_ids`` (micro-batch, s): with document masking, the documents the candidates are timed with."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    record_path = os.path.join(run_dir, RECORD_FILE)
    recorded = _read_json(record_path)
    decision: Dict[str, Any] = {"timings_ms": None, "key": None}
    saved = saved_backend(checkpoint_config)
    kept, kept_how = (saved, "the resumed checkpoint's") if saved else (recorded.get("backend"),
                                                                        f"recorded in {RECORD_FILE}")
    unusable = why_not_here(cfg, kept) if kept else None
    if kept and unusable is None:
        decision.update(backend=kept, how=kept_how)
        if not saved:
            decision.update(timings_ms=recorded.get("timings_ms"), key=recorded.get("key"))
    elif not cuda:
        decision.update(cpu_backend(cfg))
    else:
        in_graph = attention_in_compiled_graph(cfg)
        options = candidates(cfg.model, cfg.parallel.cp or 1, in_graph)
        if len(options) == 1:
            decision.update(backend=options[0], how="the only candidate" + (
                " that trainer.compile keeps in the layers' graphs" if in_graph else ""))
        else:
            device_name = device_name or torch.cuda.get_device_name()
            key = problem_key(cfg, device_name, dtype, epilogue, document_ids)
            cache = _read_json(cache_path())
            # a cached timing holds while it timed these candidates (a library installed or removed since: afresh)
            if key in cache and set(cache[key]["timings_ms"]) == set(options):
                decision.update(backend=cache[key]["backend"], how="cached timing", timings_ms=cache[key]["timings_ms"],
                                key=key)
            else:
                measure = measure or (lambda backend: time_core_attention(cfg, backend, dtype, epilogue,
                                                                          document_ids=document_ids))
                chosen = choose(options, measure)
                decision.update(backend=chosen["backend"], how="timed" + (
                    " among the backends trainer.compile keeps in the layers' graphs" if in_graph else ""),
                    timings_ms=chosen["timings_ms"], key=key)
                if chosen["errors"]:
                    decision["errors"] = chosen["errors"]
                cache[key] = {"backend": chosen["backend"], "timings_ms": chosen["timings_ms"]}
                os.makedirs(os.path.dirname(cache_path()), exist_ok=True)
                atomic_write_json(cache_path(), cache)
    if kept and decision["backend"] != kept:
        decision["how"] += f"; not {kept} ({kept_how}), which this run cannot take ({unusable})"
    if record:
        write_record(run_dir, decision)
    return decision


def write_record(run_dir: str, decision: Dict[str, Any]) -> None:
    """The run directory's record of the decision, which a later start of the run reads."""
    os.makedirs(run_dir, exist_ok=True)
    atomic_write_json(os.path.join(run_dir, RECORD_FILE), decision)


def describe(decision: Dict[str, Any]) -> str:
    timings = decision.get("timings_ms") or {}
    shown = ", ".join(f"{b} {t:.3f} ms" if t is not None else f"{b} failed" for b, t in timings.items())
    return f"{decision['backend']} ({decision['how']}{'; forward+backward of one layer: ' + shown if shown else ''})"


# ------------------------------------------------------------------------------------------------------------------
# Timing on the GPU
# ------------------------------------------------------------------------------------------------------------------
def _rank_local_model(cfg: Any, backend: str) -> Any:
    """The run's model config with this rank's heads and tokens (s/cp) and one process: the core attention this rank
    computes."""
    local = copy.deepcopy(cfg)
    m, tp = local.model, cfg.parallel.tp
    m.seq_length //= cfg.parallel.cp or 1
    m.head_dim = head_dim(cfg.model)
    m.num_heads //= tp
    m.num_kv_heads = num_kv_heads(cfg.model) // tp
    m.hidden_size = 2 * m.num_heads * m.head_dim
    m.attention_backend = backend
    local.parallel.tp, local.parallel.pp, local.parallel.cp, local.parallel.sequence_parallel = 1, 1, 1, False
    return local


def core_attention_problem(cfg: Any, backend: str, dtype: torch.dtype, epilogue: str, device: str = "cuda"):
    """One layer's core attention of the run's kind with ``backend`` and this rank's heads, and inputs at the run's
    micro-batch and this rank's share of the sequence: (module, (q, k, v) requiring gradients, attention_bias or
    None). Under context parallelism the module rings around a :class:`LoopbackRing` of the CP size."""
    from megatron.core.transformer.enums import AttnMaskType

    from diff_transformer.models.attention import DiffV2CoreAttention, DifferentialCoreAttention, VanillaCoreAttention
    from diff_transformer.models.gpt import transformer_config
    from diff_transformer.models.layer_specs import attention_heads
    from diff_transformer.models.ring_attention import LoopbackRing

    local = _rank_local_model(cfg, backend)
    config = transformer_config(local, dtype)
    kind = cfg.model.attention
    if kind == "diff":
        module = DifferentialCoreAttention(config, 1, AttnMaskType.causal, backend=backend, epilogue=epilogue)
    elif kind == "diff_v2":
        module = DiffV2CoreAttention(config, 1, AttnMaskType.causal, backend=backend, epilogue=epilogue)
    else:  # every other kind's attention call is the baseline's (the controls have one candidate and are not timed)
        module = VanillaCoreAttention(config, 1, AttnMaskType.causal, backend=backend)
    module = module.to(device)
    if (cfg.parallel.cp or 1) > 1:
        module.ring = LoopbackRing(cfg.parallel.cp)
    query_heads, kv_heads, size = attention_heads(local.model)
    s, b = local.model.seq_length, local.trainer.micro_batch_size
    make = lambda heads: torch.randn(s, b, heads, size, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    bias = torch.randn(s, b, query_heads // 2, device=device, dtype=dtype) if kind == "diff_v2" else None
    return module, (make(query_heads), make(kv_heads), make(kv_heads)), bias


def timing_documents(cfg: Any, document_ids: Optional[torch.Tensor], device: str = "cuda"):
    """The packed documents a timed core attention masks with: ``document_ids`` (micro-batch, s), CP rank 0's chunks
    under context parallelism; None without."""
    from diff_transformer.models.documents import packed_documents
    from diff_transformer.models.ring_attention import context_parallel_chunks

    if document_ids is None:
        return None
    ids = context_parallel_chunks(document_ids[:cfg.trainer.micro_batch_size], cfg.parallel.cp or 1, 0, dim=1)
    return packed_documents(ids.to(device), None, cfg.model.seq_length)


def time_core_attention(cfg: Any, backend: str, dtype: torch.dtype, epilogue: str, iters: int = 5,
                        document_ids: Optional[torch.Tensor] = None) -> float:
    """Median milliseconds of one forward and backward of one layer's core attention (the run's kind, per-rank heads,
    micro-batch and sequence, ``dtype``; masked by ``document_ids``' documents when given) with ``backend`` on the
    current GPU; the first two calls (compilation, autotuning) are not timed."""
    module, (q, k, v), bias = core_attention_problem(cfg, backend, dtype, epilogue)
    documents = timing_documents(cfg, document_ids)
    times = []
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = module(q, k, v, None, attention_bias=bias, packed_seq_params=documents)
        out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
        q.grad = k.grad = v.grad = None
    return statistics.median(times)
