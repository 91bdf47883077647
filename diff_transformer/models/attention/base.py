"""What every core attention shares: megatron-core's core-attention protocol (``CoreAttentionBase``), the backend
names, λ_init's depth schedule, the causal mask and the fp32 reference softmax.

Every kind plugs into megatron-core's ``SelfAttention`` as its ``core_attention`` submodule. ``SelfAttention`` owns the
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

import contextlib
import importlib
import importlib.util
import math
from typing import Iterator, List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from diff_transformer.models.attention.flash_attn4_op import flash_attn4_causal
from diff_transformer.models.attention.flash_attn4_tiles import fit_tiles_for
from diff_transformer.models.attention_maps import AttentionMaps, causal_logits, query_rows
from diff_transformer.models.documents import PackedDocuments, documents_of, same_document
from diff_transformer.models.ring_attention import IMPLEMENTATIONS as RING_IMPLEMENTATIONS
from diff_transformer.models.ring_attention import ProcessGroupRing

BACKENDS = ("eager", "sdpa", "flash_attn", "flash_attn4", "triton", "combined")
# the backends whose forward and backward are torch operations dynamo traces (library calls through torch's SDPA or
# flash-attn-4's custom operators, the materialised maps, DIFF V1's combined map with its written-out backward): under
# trainer.compile they stay in the layer's graph (models.gpt.core_attention_traceable)
TRACEABLE_BACKENDS = ("sdpa", "eager", "combined", "flash_attn4")
# the FlashAttention libraries, by backend: (the module of its entry points, how to install it). flash-attn 2 (CUDA
# C++, built against the GPU's torch; flash-attn-4 installs a flash_attn package too, so its own module says it is
# there) and flash-attn-4 (CuTe DSL, pure Python, compiled at the first call of a shape; Hopper and Blackwell), whose
# q/k and v head dims may differ: DIFF V1 runs on it as one call over the 2d-wide V
FLASH_LIBRARIES = {
    "flash_attn": ("flash_attn.flash_attn_interface",
                   "the flash-attn package (GPU only: pip install flash-attn --no-build-isolation)"),
    "flash_attn4": ("flash_attn.cute", "the flash-attn-4 package (GPU only, Hopper or Blackwell: pip install "
                                       "flash-attn-4; benchmarks/README.md for a machine without network)"),
}

# Set on parameters that every tensor-parallel rank holds a full copy of and whose gradient each rank computes
# only from its own heads: those gradients must be summed over the TP group (see ``finalize_model_grads``).
TP_REPLICATED_ATTR = "tp_replicated_partial_grad"


def lambda_init_for_layer(layer_number: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·(l−1)) for the global 1-based layer number l."""
    if layer_number < 1:
        raise ValueError(f"layer_number={layer_number} must be the global 1-based layer number")
    return 0.8 - 0.6 * math.exp(-0.3 * (layer_number - 1))


def require_causal(attn_mask_type) -> None:
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"attention mask type {attn_mask_type} is not supported; pretraining uses causal masks")


def flash_library_installed(backend: str) -> bool:
    """Whether ``backend``'s FlashAttention library is importable here (without importing it)."""
    try:
        return importlib.util.find_spec(FLASH_LIBRARIES[backend][0]) is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


def load_flash_attn_func(varlen: bool = False, backend: str = "flash_attn"):
    """``flash_attn_func`` of ``backend``'s library (``flash_attn_varlen_func`` with ``varlen``: documents of packed
    samples); see FLASH_LIBRARIES."""
    module_name, package = FLASH_LIBRARIES[backend]
    try:
        module = importlib.import_module(module_name)
        return module.flash_attn_varlen_func if varlen else module.flash_attn_func
    except (ImportError, AttributeError) as err:
        raise ImportError(f"model.attention_backend={backend} needs {package}; use model.attention_backend=sdpa "
                          f"instead ({type(err).__name__}: {err})") from err


def flash_attention(q, k, v, scale: float, documents: Optional[PackedDocuments], backend: str = "flash_attn"):
    """Causal attention by ``backend``'s FlashAttention library in its layout, q, k, v and the output (b, s, heads,
    d) (v's head dim may differ from q's under flash-attn-4; fewer KV heads than query heads: GQA, query head h
    reading KV head h // (heads / KV heads)); with ``documents``, over every document of the micro-batch at once (the
    variable-length entry, over the same ``cu_seqlens`` as the ``sdpa`` path's variable-length kernel). The calls
    take keywords only past q, k, v: the two libraries share those names (flash-attn-4's fourth positional argument
    is ``qv``), and flash-attn-4 returns (out, lse). A v wider than q under flash-attn-4 gets Hopper tiles that fit
    its shared memory (``flash_attn4_tiles``). flash-attn-4 without documents is a custom operator
    (``flash_attn4_op``), so that compiled layers keep it in their graph."""
    if backend == "flash_attn4" and documents is None:
        if not torch.compiler.is_compiling():
            load_flash_attn_func(False, backend)  # the clear error where the library is missing
        return flash_attn4_causal(q, k, v, scale)[0]
    if backend == "flash_attn4":
        fit_tiles_for(q, v)
    if documents is None:
        out = load_flash_attn_func(False, backend)(q, k, v, softmax_scale=scale, causal=True)
    else:
        b, s = q.shape[:2]
        cu_seqlens, longest = documents.cu_seqlens()
        out = load_flash_attn_func(True, backend)(
            q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:]),
            cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
            softmax_scale=scale, causal=True,
        )
    out = out[0] if isinstance(out, tuple) else out
    return out.view(q.shape[0], q.shape[1], *out.shape[-2:])


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Boolean mask, True where attention is allowed; aligned to the bottom right when sq < sk."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)


# SDPBackend's values as torch._fused_sdp_choice returns them (torch/nn/attention/__init__.py), by name
SDPA_KERNELS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_sdpa_choices: Optional[List[str]] = None


def sdpa_kernel_choice(q, k, v, is_causal: bool = True, scale: Optional[float] = None, enable_gqa: bool = False) -> str:
    """The kernel torch's scaled_dot_product_attention runs for these inputs on this machine (``flash``, ``cudnn``,
    ``efficient``, ``math``): torch's own dispatch decision (``torch._fused_sdp_choice``), under the backends
    enabled where it is called. On a CPU, ``flash`` is torch's CPU flash kernel (equal q/k/v head dims) and ``math``
    the materialised map."""
    choice = torch._fused_sdp_choice(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return SDPA_KERNELS.get(int(choice), str(choice))


@contextlib.contextmanager
def record_sdpa_kernels() -> Iterator[List[str]]:
    """Inside the block, every call through :func:`scaled_dot_product_attention` appends the kernel torch chose
    (``sdpa_kernel_choice``) and the call's shapes to the yielded list. For benchmarks and logs; off otherwise."""
    global _sdpa_choices
    outer, _sdpa_choices = _sdpa_choices, []
    try:
        yield _sdpa_choices
    finally:
        _sdpa_choices = outer


class _GradInOutputLayout(torch.autograd.Function):
    """The identity, whose backward hands the gradient on in the output's own memory layout.

    The library kernel's output follows the query's stride order (megatron's [s, b, heads, d]); a gradient that
    arrives in another order (DIFF's unfused epilogue gives (b, s, heads, d)) made cuDNN's attention backward wrong on
    an H100 (torch 2.11: 5.6e-1 relative error in DIFF's gradients, benchmarks/results/core_attention_d128_*). One copy,
    only when the orders differ: strides that differ only along dimensions of size 1 (a micro-batch of one) address
    the same memory, and the gradient is handed on as a view with the output's strides exactly."""

    @staticmethod
    def forward(ctx, out):
        ctx.layout = out.shape, out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, stride = ctx.layout
        if grad.stride() == stride:
            return grad
        if all(g == o for g, o, size in zip(grad.stride(), stride, shape) if size > 1):
            return grad.as_strided(shape, stride, grad.storage_offset())
        return torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def scaled_dot_product_attention(q, k, v, scale: float, enable_gqa: bool = False,
                                 documents: Optional[PackedDocuments] = None) -> torch.Tensor:
    """Causal ``F.scaled_dot_product_attention`` on (b, heads, s, d) inputs, the one call every kind's ``sdpa``
    backend makes (so that :func:`record_sdpa_kernels` sees them all); its backward receives the gradient in the
    output's layout. With ``documents`` carrying ids, causal within each document (:func:`document_attention`)."""
    if documents is not None and documents.document_ids is not None and not documents.single_document():
        return document_attention(q, k, v, scale, enable_gqa, documents)
    if _sdpa_choices is not None:
        kernel = sdpa_kernel_choice(q, k, v, True, scale, enable_gqa)
        _sdpa_choices.append(
            f"{kernel}: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} {str(q.dtype).replace('torch.', '')}"
            f"{' gqa' if enable_gqa else ''}"
        )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    return _GradInOutputLayout.apply(out) if out.requires_grad else out


def _varlen_flash_usable(q, k, v) -> bool:
    """PyTorch's own FlashAttention kernel takes variable-length batches: CUDA, fp16/bf16, equal head dims <= 256."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] == v.shape[-1]
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0)


class _VarlenFlashAttention(torch.autograd.Function):
    """PyTorch's FlashAttention-2 over packed documents (``aten._flash_attention_forward`` with ``cu_seqlens``, the op
    behind nested-tensor SDPA): every document of the micro-batch in one causal launch, no mask tensor at all."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, longest, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.longest, ctx.scale = longest, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.longest, ctx.longest, 0.0, True,
            rng_state, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _document_call(q, k, v, scale: float, enable_gqa: bool) -> torch.Tensor:
    """One document's causal library call, its backward handed the gradient in its output's layout."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    return _GradInOutputLayout.apply(out) if out.requires_grad else out


def document_attention(q, k, v, scale: float, enable_gqa: bool, documents: PackedDocuments) -> torch.Tensor:
    """Causal attention within each document of a packed micro-batch, on (b, heads, s, d) inputs. On a GPU in
    fp16/bf16 one variable-length FlashAttention launch over every document (:class:`_VarlenFlashAttention`);
    elsewhere one library call per document, each the document run alone (the work the mask leaves, Σ L², and no
    mask tensor). Not FlexAttention: torch 2.13 has no FlexAttention backward on a CPU, so CI could never check its
    gradients, and it compiles once per shape."""
    if _varlen_flash_usable(q, k, v):
        b, heads, s, d = q.shape
        cu_seqlens, longest = documents.cu_seqlens()
        flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3]) for t in (q, k, v)]
        if _sdpa_choices is not None:
            _sdpa_choices.append(f"flash varlen: {len(cu_seqlens) - 1} documents q {tuple(q.shape)} k "
                                 f"{tuple(k.shape)} {str(q.dtype).replace('torch.', '')}")
        out = _VarlenFlashAttention.apply(*flat, cu_seqlens, longest, scale)
        return out.view(b, s, heads, v.shape[-1]).transpose(1, 2)
    segments = documents.segments()
    if _sdpa_choices is not None:
        _sdpa_choices.append(f"{sdpa_kernel_choice(q, k, v, True, scale, enable_gqa)} per document: "
                             f"{sum(map(len, segments))} calls q {tuple(q.shape)} {str(q.dtype).replace('torch.', '')}")
    samples = []
    # unbind and split (not slicing): their backward stacks and concatenates the pieces' gradients in one copy; the
    # pieces' outputs (kept in the query's (s, heads, d) order by the kernel) are joined along s and stacked along b
    # as [s, b, heads, d], megatron's layout, so that the caller's permute back to it copies nothing
    for spans, qi, ki, vi in zip(segments, q.unbind(0), k.unbind(0), v.unbind(0)):
        lengths = [e - a for a, e in spans]
        pieces = zip(*(t.split(lengths, dim=1) for t in (qi, ki, vi)))
        samples.append(torch.cat([_document_call(qd[None], kd[None], vd[None], scale, enable_gqa)[0].transpose(0, 1)
                                  for qd, kd, vd in pieces], dim=0))
    return torch.stack(samples, dim=1).permute(1, 2, 0, 3)


def heads_first(query: torch.Tensor, key: torch.Tensor):
    """megatron's [s, b, heads, d] query and key -> (b, heads, s, d), the key heads repeated to one per query head
    (GQA)."""
    q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
    return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def reference_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the precision of the reference (eager) paths."""
    return torch.promote_types(x.dtype, torch.float32)


def eager_attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float,
                          document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + causal mask) in fp32 (fp64 for fp64 inputs); q (b, h, sq, d), k (b, h, sk, d).
    Materialises the map. With ``document_ids`` (b, sk), a query sees only keys of its own document (the queries are
    the last sq positions)."""
    dtype = reference_dtype(q)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    visible = causal_mask(q.shape[-2], k.shape[-2], q.device)
    if document_ids is not None:
        visible = visible & same_document(document_ids[:, -q.shape[-2]:], document_ids)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1)


class CoreAttentionBase(MegatronModule):
    """Shared constructor of megatron-core's core-attention protocol (megatron passes its arguments by keyword;
    subclasses add their own keywords and hand the protocol's on as ``**protocol``)."""

    # A kind whose forward has a ring-attention path (``self.ring``: models/ring_attention.py) for a sequence split
    # over a context-parallel group; the others refuse parallel.cp > 1. Its ring runs on these backends.
    supports_context_parallel = False
    # trainer.compile may keep the forward in the compiled layer's graph (models.gpt.core_attention_traceable) on a
    # traceable backend: no per-layer or per-step Python values that dynamo would guard on (per-layer constants go in
    # buffers), no host reads
    traceable = True
    ring_backends = RING_IMPLEMENTATIONS

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
        require_causal(attn_mask_type)
        self.backend = backend
        self.ring = self._context_parallel_ring(config, pg_collection)
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def _context_parallel_ring(self, config: TransformerConfig, pg_collection) -> Optional[ProcessGroupRing]:
        """The context-parallel group as a ring, or None without context parallelism."""
        if config.context_parallel_size == 1:
            return None
        if not self.supports_context_parallel:
            raise ValueError(f"{type(self).__name__} has no ring-attention path for context parallelism (parallel.cp > 1)")
        if self.backend not in self.ring_backends:
            raise ValueError(
                f"model.attention_backend={self.backend} has no ring-attention path for context parallelism; use "
                f"{' or '.join(self.ring_backends)}"
            )
        group = getattr(pg_collection, "cp", None)
        return ProcessGroupRing(group if group is not None else parallel_state.get_context_parallel_group())

    def _check_call(self, attn_mask_type, attention_bias, packed_seq_params) -> Optional[PackedDocuments]:
        """The micro-batch's documents to mask with (None: plain causal attention)."""
        require_causal(attn_mask_type)
        if attention_bias is not None:
            raise ValueError(f"{type(self).__name__} does not support attention bias")
        return packed_seq_params if documents_of(packed_seq_params) is not None else None

    def attention_maps(self, query, key, value, attention_bias=None, rows=None, document_ids=None) -> AttentionMaps:
        """This layer's maps for the query positions ``rows`` (the protocol of ``models.attention_maps``), within each
        document with ``document_ids``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not expose its attention maps; implement attention_maps "
            "(diff_transformer/models/attention_maps.py) so that the analysis tools can read it"
        )

    def _softmax_maps(self, query, key, rows, score_transform=None, document_ids=None):
        """(rows, logits, probs) of plain causal softmax heads, probs after ``score_transform`` of the logits; with
        ``document_ids`` (b, keys) a row sees only its own document."""
        q, k = heads_first(query, key)
        rows = query_rows(q.shape[-2], k.shape[-2], rows, q.device)
        logits = causal_logits(q, k, self.softmax_scale, rows, document_ids)
        scores = score_transform(logits) if score_transform is not None else logits
        return rows, logits, torch.softmax(scores, dim=-1)
