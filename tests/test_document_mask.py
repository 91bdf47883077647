"""Document masking of packed samples (data.document_mask, data.reset_position_ids), against an independent
reference: every document run alone as its own sequence.

- Data: document ids and positions from the end-of-document tokens, against megatron-core's own reset masks and
  positions; a document cut by the sample's start is the sample's first document.
- Core attention, every kind and backend (fp64 for eager and sdpa): the masked output and every gradient (q, k, v,
  λ, the norm weight, V2's λ logits, DEX's W_D, the signed mask's logits) equal the per-document runs; a sample that
  is one document gives today's causal path bit for bit.
- The fused kernel (Triton's interpreter, fp32, V1 and V2, GQA, odd lengths, one-token documents, every design, and
  the launcher's GPU branch): against the fp32 reference run per document; one document bit for bit.
- Context parallelism: a ring of two threads with the mask equals one rank with the mask (eager, sdpa, the fused
  ring).
- The model: a one-document sample with reset positions gives today's losses bit for bit; a document's per-token
  losses at step 0 do not depend on which documents were packed before it.
"""

import json
import queue
import threading
import zlib

import pytest
import torch

from diff_transformer.compat import apply_cpu_patches

apply_cpu_patches()

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from data.datasets import document_ids, document_positions  # noqa: E402
from diff_transformer.models.attention import (  # noqa: E402
    DexCoreAttention,
    DiffV2CoreAttention,
    DifferentialCoreAttention,
    SignedMaskCoreAttention,
    TopKCoreAttention,
    VanillaCoreAttention,
    VanillaSublnCoreAttention,
    blockwise,
)
from diff_transformer.models.documents import PackedDocuments, document_segments  # noqa: E402
from diff_transformer.models.ring_attention import context_parallel_chunks, load_balanced_indices  # noqa: E402
from kernels import gpu_target  # noqa: E402
from kernels.diff_attn import diff_attn_naive, diff_attn_v2_naive, diff_flash_attn, diff_flash_attn_v2  # noqa: E402
from kernels.diff_attn import launch, tuning  # noqa: E402

CAUSAL = AttnMaskType.causal
EOD = 2
FP64_TOLERANCE = 1e-10  # measured: ~1e-15
FP32_ROUNDING = 1e-6  # where a kind computes in fp32 by design (measured: <= 6e-8)
# Kinds that compute in fp32 whatever the inputs: V2's λ = sigmoid(logits) (torch's vectorised and scalar fp32
# sigmoid can differ in the last bit, so a document alone may draw its λ an ulp away), the map controls' blockwise
# softmax, DEX's O·(I − λ·W_D)
FP32_BY_DESIGN = ("diff_v2", "topk", "signed_mask", "dex")
FP32_TOLERANCE = 2e-5  # tests/test_diff_attn_kernel.py's, for the fused kernel against its fp32 reference


@pytest.fixture(autouse=True)
def seed_from_node_id(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def documents_from_lengths(*lengths_per_sample):
    """(b, s) int32 document ids of samples made of documents of the given lengths."""
    rows = [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
            for lengths in lengths_per_sample]
    return torch.stack(rows)


# Odd length 37; sample 0: one-token documents at the start and in the middle; sample 1: one document.
IDS = documents_from_lengths([1, 11, 1, 24], [37])
ONE_DOCUMENT = torch.zeros(2, 37, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------
def test_document_ids_and_positions_match_megatrons_reset_mask_and_positions():
    """An EOD closes its document; the token after it starts the next. The mask same-document ∧ causal and the reset
    positions are what megatron-core's GPTDataset builds with reset_attention_mask and reset_position_ids."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.tensor([7, 8, EOD, 9, EOD, EOD, 5, 6, 6, EOD, 4])
    ids = document_ids(tokens, EOD)
    assert ids.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4]
    mask, _, positions = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False, True)
    ours = (ids[:, None] == ids[None, :]) & torch.ones(11, 11, dtype=torch.bool).tril()
    assert torch.equal(~mask[0], ours)  # megatron: True where masked
    assert torch.equal(document_positions(ids), positions)
    batch = torch.stack([tokens, tokens.flip(0)])
    assert torch.equal(document_ids(batch, EOD)[1], document_ids(tokens.flip(0), EOD))
    assert document_segments(document_ids(batch, EOD))[0] == [(0, 3), (3, 5), (5, 6), (6, 10), (10, 11)]


def test_packed_documents_dataset_adds_ids_and_resets_positions():
    """The wrapper around a megatron dataset: the same samples, with `document_ids` and positions per document; a
    document cut by the sample's start is its document 0, positions from 0."""
    from data.datasets import PackedDocumentsDataset

    samples = [{"tokens": torch.tensor([3, 3, EOD, 4, 4]), "position_ids": torch.arange(5),
                "labels": torch.zeros(5), "loss_mask": torch.ones(5)}]
    masked = PackedDocumentsDataset(samples, EOD, document_mask=True, reset_position_ids=True)
    sample = masked[0]
    assert len(masked) == 1 and sample["document_ids"].tolist() == [0, 0, 0, 1, 1]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1]
    positions_only = PackedDocumentsDataset(samples, EOD, document_mask=False, reset_position_ids=True)[0]
    assert "document_ids" not in positions_only and positions_only["position_ids"].tolist() == [0, 1, 2, 0, 1]


def test_inspect_and_accounting_count_the_work_the_mask_leaves():
    """Documents of 3 and 5 tokens in samples of 4: pieces 3 | 1 | 4, so the mask keeps (9 + 1 + 16)/(2·16) of the
    causal work. data.inspect's share from the lengths and MFU's keys a token from the batch's ids agree."""
    import numpy as np

    from data.inspect import length_distribution, masked_attention_share
    from diff_transformer.training.accounting import attention_keys_per_token

    assert masked_attention_share(np.array([3, 5]), 4) == pytest.approx(1 - 26 / 32)
    assert masked_attention_share(np.array([3]), 4) is None
    assert masked_attention_share(np.array([8, 8]), 4) == 0.0  # every sample one document
    ids = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])  # the same two samples, as the data loader gives them
    assert attention_keys_per_token(ids) == pytest.approx(26 / 2 / 8)
    assert attention_keys_per_token(torch.zeros(3, 64, dtype=torch.int32)) == 32  # the causal s/2
    assert length_distribution(np.array([1, 2, 3, 4]))["p50"] == 2.5


def test_auto_times_the_masked_candidates_on_the_first_micro_batch(tmp_path, monkeypatch):
    """model.attention_backend=auto under data.document_mask: the timing key holds the documents a sample, and the
    core attention it times (one CP rank's under context parallelism) runs with the micro-batch's documents."""
    from diff_transformer.training import backend_choice
    from tests.test_config import compose_cfg

    monkeypatch.setenv("DIFF_TRANSFORMER_CACHE_DIR", str(tmp_path / "cache"))
    cfg = compose_cfg("model=debug", "parallel.cp=2", "data.document_mask=true")
    ids = documents_from_lengths([10, 30, 24], [64], [1, 63], [32, 32])  # the debug model's 64 tokens, micro-batch 4
    key = json.loads(backend_choice.problem_key(cfg, "NVIDIA H100", torch.bfloat16, "triton", ids))
    assert key["documents_per_sample"] == 2.0
    assert "documents_per_sample" not in json.loads(backend_choice.problem_key(cfg, "NVIDIA H100", torch.bfloat16,
                                                                                "triton"))
    calls = []
    decision = backend_choice.decide_attention_backend(
        cfg, str(tmp_path / "run"), torch.bfloat16, "triton", cuda=True, device_name="NVIDIA H100",
        measure=lambda backend: calls.append(backend) or {"sdpa": 2.0, "triton": 1.0}[backend], document_ids=ids)
    assert decision["backend"] == "triton" and "documents_per_sample" in decision["key"]
    module, (q, k, v), _ = backend_choice.core_attention_problem(cfg, "sdpa", torch.float32, "unfused", device="cpu")
    documents = backend_choice.timing_documents(cfg, ids, "cpu")
    assert documents.document_ids.shape == (cfg.trainer.micro_batch_size, cfg.model.seq_length // 2)
    module(q, k, v, None, packed_seq_params=documents).sum().backward()
    assert q.grad is not None


# ------------------------------------------------------------------------------------------------------------------
# Core attention of every kind: masked == every document alone (fp64)
# ------------------------------------------------------------------------------------------------------------------
def config(q_heads, kv_heads, d, hidden=None):
    return TransformerConfig(num_layers=4, hidden_size=hidden or q_heads * d, num_attention_heads=q_heads,
                             num_query_groups=kv_heads, kv_channels=d, use_cpu_initialization=True,
                             add_bias_linear=False)


def build(kind, backend, d=8):
    """A core attention of ``kind`` in fp64 with parameters drawn away from their initial values, and its inputs'
    head counts (query, key, value heads of d) and whether it takes V2's λ logits."""
    if kind == "diff":  # H = 4 differential heads over Hkv = 2 groups (GQA)
        module = DifferentialCoreAttention(config(8, 4, d), 3, CAUSAL, backend=backend)
        heads = (8, 4, 4)
    elif kind == "diff_v2":
        module = DiffV2CoreAttention(config(8, 2, d), 2, CAUSAL, backend=backend)
        heads = (8, 2, 2)
    elif kind == "vanilla":
        module = VanillaCoreAttention(config(4, 2, d), 1, CAUSAL, backend=backend)
        heads = (4, 2, 2)
    elif kind == "vanilla_subln":
        module = VanillaSublnCoreAttention(config(4, 2, d), 2, CAUSAL, backend=backend)
        heads = (4, 2, 2)
    elif kind == "topk":
        module = TopKCoreAttention(config(4, 2, d), 1, CAUSAL, backend=backend, topk=3)
        heads = (4, 2, 2)
    elif kind == "signed_mask":
        module = SignedMaskCoreAttention(config(4, 2, d), 1, CAUSAL, backend=backend, max_distance=64)
        heads = (4, 2, 2)
    else:  # dex: W_D on heads 0 and 2, half annealed
        module = DexCoreAttention(config(4, 2, d), 1, CAUSAL, backend=backend, heads_per_layer=[[0, 2]] * 4)
        module.set_anneal_fraction(0.5)
        heads = (4, 2, 2)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module, heads, d, kind == "diff_v2"


def core_attention_run(module, tensors, grad_out, ids=None):
    """Output and the gradients of the inputs and of every parameter of one masked (or plain) call."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    module.zero_grad(set_to_none=True)
    bias = inputs[3] if len(inputs) == 4 else None
    packed = PackedDocuments(document_ids=ids) if ids is not None else None
    out = module(*inputs[:3], None, attn_mask_type=CAUSAL, attention_bias=bias, packed_seq_params=packed)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs], {n: p.grad.clone() for n, p in module.named_parameters()
                                                    if p.grad is not None}


def per_document_run(module, tensors, grad_out, ids):
    """The independent reference: each document of each sample through the module alone, unmasked; its pieces
    placed back, the parameters' gradients summed over the documents."""
    out = torch.zeros_like(grad_out)
    grads = [torch.zeros_like(t) for t in tensors]
    params = {}
    for b, spans in enumerate(document_segments(ids)):
        for a, e in spans:
            piece = [t[a:e, b:b + 1] for t in tensors]
            o, g, p = core_attention_run(module, piece, grad_out[a:e, b:b + 1])
            out[a:e, b:b + 1] = o
            for whole, part in zip(grads, g):
                whole[a:e, b:b + 1] = part
            for name, value in p.items():
                params[name] = params.get(name, 0) + value
    return out, grads, params


def kind_inputs(heads, d, with_lambda, n_heads_v2=4, s=37, b=2):
    tensors = [torch.randn(s, b, h, d, dtype=torch.float64) for h in heads]
    if with_lambda:
        tensors.append(torch.randn(s, b, n_heads_v2, dtype=torch.float64))
    return tensors


KIND_BACKENDS = [("diff", "eager"), ("diff", "sdpa"), ("diff_v2", "eager"), ("diff_v2", "sdpa"),
                 ("vanilla", "eager"), ("vanilla", "sdpa"), ("vanilla_subln", "sdpa"), ("topk", "eager"),
                 ("topk", "sdpa"), ("signed_mask", "sdpa"), ("dex", "sdpa")]


@pytest.mark.parametrize("kind,backend", KIND_BACKENDS, ids=[f"{k}-{b}" for k, b in KIND_BACKENDS])
def test_masked_core_attention_equals_every_document_alone(kind, backend, monkeypatch):
    """fp64, two samples of 37 tokens (one with one-token documents, one a single document), GQA: output and every
    gradient. The blockwise backend of the map controls runs blocks of 8 queries here, so that blocks start inside
    documents and skip the keys before them."""
    monkeypatch.setattr(blockwise, "BLOCK_QUERIES", 8)
    module, heads, d, with_lambda = build(kind, backend)
    tensors = kind_inputs(heads, d, with_lambda)
    out_width = {"diff": 4 * 2 * d, "diff_v2": 4 * d}.get(kind, 4 * d)
    grad_out = torch.randn(37, 2, out_width, dtype=torch.float64)
    out, grads, params = core_attention_run(module, tensors, grad_out, IDS)
    ref_out, ref_grads, ref_params = per_document_run(module, tensors, grad_out, IDS)
    tolerance = FP32_ROUNDING if kind in FP32_BY_DESIGN else FP64_TOLERANCE
    assert rel_err(out, ref_out) < tolerance
    for name, got, want in zip(("q", "k", "v", "lambda logits"), grads, ref_grads):
        assert rel_err(got, want) < tolerance, name
    assert set(params) == set(ref_params) and (params or kind in ("vanilla", "topk", "diff_v2")), "parameter gradients"
    for name in params:
        # besides DIFF V1's λ (in the inputs' precision), the kinds' own parameters enter in fp32 by design (the
        # subln weight's factor, the sign gate, DEX's λ and W_D): their gradients sum fp32 terms per document
        limit = FP64_TOLERANCE if kind == "diff" else FP32_ROUNDING
        assert rel_err(params[name], ref_params[name]) < limit, name


@pytest.mark.parametrize("kind,backend", [("diff", "eager"), ("diff", "sdpa"), ("diff_v2", "sdpa"),
                                          ("vanilla", "sdpa"), ("topk", "sdpa")])
def test_one_document_is_todays_causal_path_bit_for_bit(kind, backend, monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_QUERIES", 8)
    module, heads, d, with_lambda = build(kind, backend)
    tensors = kind_inputs(heads, d, with_lambda)
    out_width = {"diff": 4 * 2 * d, "diff_v2": 4 * d}.get(kind, 4 * d)
    grad_out = torch.randn(37, 2, out_width, dtype=torch.float64)
    masked = core_attention_run(module, tensors, grad_out, ONE_DOCUMENT)
    plain = core_attention_run(module, tensors, grad_out)
    assert torch.equal(masked[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(masked[1], plain[1]))
    assert all(torch.equal(masked[2][n], plain[2][n]) for n in plain[2])


# ------------------------------------------------------------------------------------------------------------------
# The fused kernel (Triton's interpreter, fp32): masked == every document alone through the fp32 reference
# ------------------------------------------------------------------------------------------------------------------
def kernel_inputs(version, batch, n, heads, groups, d, epilogue):
    q = torch.randn(batch, n, 2 * heads, d)
    if version == 1:
        k, v = torch.randn(batch, n, 2 * groups, d), torch.randn(batch, n, groups, 2 * d)
        lam = torch.rand(heads)
    else:
        k, v = torch.randn(batch, n, groups, d), torch.randn(batch, n, groups, d)
        lam = torch.sigmoid(torch.randn(batch, n, heads))
    tensors = [q, k, v, lam] + ([1.0 + 0.3 * torch.randn(2 * d)] if epilogue else [])
    return [t.requires_grad_() for t in tensors]


def kernel_call(version, tensors, plan=None, ids=None):
    epilogue = dict(norm_weight=tensors[4], output_scale=0.7) if len(tensors) == 5 else {}
    function = diff_flash_attn if version == 1 else diff_flash_attn_v2
    return function(*tensors[:4], plan=plan, document_ids=ids, **epilogue)


def reference_per_document(version, tensors, upstream, ids):
    """The fp32 reference (kernels/diff_attn/naive.py) over each document alone: output and every gradient."""
    reference = diff_attn_naive if version == 1 else diff_attn_v2_naive
    out = torch.zeros_like(upstream)
    grads = [torch.zeros_like(t) for t in tensors]
    for b, spans in enumerate(document_segments(ids)):
        for a, e in spans:
            piece = [t.detach()[b:b + 1, a:e] if t.dim() >= 3 and i < 3 or (version == 2 and i == 3)
                     else t.detach() for i, t in enumerate(tensors)]
            piece = [t.clone().requires_grad_() for t in piece]
            epilogue = dict(norm_weight=piece[4], output_scale=0.7) if len(piece) == 5 else {}
            o = reference(*piece[:4], **epilogue)
            g = torch.autograd.grad(o, piece, upstream[b:b + 1, a:e])
            out[b:b + 1, a:e] = o.detach()
            for i, (whole, part) in enumerate(zip(grads, g)):
                if i < 3 or (version == 2 and i == 3):
                    whole[b:b + 1, a:e] = part
                else:
                    whole += part
    return out, grads


D = tuning.Design
KERNEL_CASES = [  # (version, heads, kv groups, head dim, epilogue, design)
    (1, 2, 1, 16, True, D("twopass", "split")),
    (1, 4, 2, 16, False, D("onepass", "fused")),  # GQA: the dK/dV programs' head loop
    (2, 4, 2, 16, False, D("onepass", "atomic")),  # dQ by atomics inside the dK program
]


@pytest.mark.parametrize("version,heads,groups,d,epilogue,design", KERNEL_CASES,
                         ids=[f"v{c[0]}-H{c[1]}-Hkv{c[2]}-{c[5].forward}-{c[5].backward}" for c in KERNEL_CASES])
def test_fused_kernel_with_documents_equals_every_document_alone(version, heads, groups, d, epilogue, design):
    """Odd length 45 with the interpreter's blocks of 16 and 32: one-token documents, documents starting inside a
    block and spanning several, a sample that is one document; output and the gradients of q, k, v, λ and the norm
    weight."""
    ids = documents_from_lengths([1, 16, 1, 5, 22], [45])
    tensors = kernel_inputs(version, 2, 45, heads, groups, d, epilogue)
    out = kernel_call(version, tensors, tuning.Plan(design, launch._INTERPRET_CONFIGS), ids)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, tensors, upstream)
    ref_out, ref_grads = reference_per_document(version, tensors, upstream, ids)
    errors = {"out": rel_err(out, ref_out)}
    errors.update({name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "dlam", "dw"), grads, ref_grads)})
    assert all(e < FP32_TOLERANCE for e in errors.values()), errors


def test_fused_kernel_with_one_document_is_todays_kernel_bit_for_bit():
    tensors = kernel_inputs(1, 1, 40, 2, 1, 16, True)
    masked = kernel_call(1, tensors, ids=torch.zeros(1, 40, dtype=torch.int32))
    plain = kernel_call(1, tensors)
    upstream = torch.randn_like(plain)
    assert torch.equal(masked, plain)
    for a, b in zip(torch.autograd.grad(masked, tensors, upstream), torch.autograd.grad(plain, tensors, upstream)):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a GPU in the interpreter (CPU only)")
def test_fused_kernel_with_documents_through_the_gpu_branch():
    """The launcher as on an H100 (the table's design and 128-row configs for V1 at d = 64), documents inside and
    across the big tiles; the backward on another thread, as autograd runs a CUDA backward."""
    from tests.test_gpu_launch import on_another_thread

    ids = documents_from_lengths([3, 70, 1, 56])
    tensors = kernel_inputs(1, 1, 130, 2, 1, 64, True)
    with gpu_target.simulate("sm_90"):
        out = kernel_call(1, tensors, ids=ids)
        upstream = torch.randn_like(out)
        grads = on_another_thread(lambda: torch.autograd.grad(out, tensors, upstream))
    ref_out, ref_grads = reference_per_document(1, tensors, upstream, ids)
    errors = {"out": rel_err(out, ref_out)}
    errors.update({name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "dlam", "dw"), grads, ref_grads)})
    assert all(e < FP32_TOLERANCE for e in errors.values()), errors


# ------------------------------------------------------------------------------------------------------------------
# Context parallelism: a ring of two threads with the mask equals one rank with the mask
# ------------------------------------------------------------------------------------------------------------------
# 32 tokens in four chunks of 8 (rank 0: chunks 0 and 3, rank 1: chunks 1 and 2); one-token documents, documents
# across chunk edges, and in both samples rank 1's queries share no document with chunk 0, whose block is skipped.
RING_IDS = documents_from_lengths([1, 6, 1, 9, 15], [5, 3, 24])
RING_CASES = [("diff", "eager"), ("diff", "sdpa"), ("diff_v2", "sdpa"), ("vanilla", "sdpa"), ("diff", "triton"),
              ("diff_v2", "triton")]


@pytest.mark.parametrize("kind,backend", RING_CASES, ids=[f"{k}-{b}" for k, b in RING_CASES])
def test_masked_ring_of_two_equals_one_rank(kind, backend):
    """The document ids travel around the ring with K and V (and the fused ring's pieces skip tiles without a shared
    document): every rank's output, the gradients of its q, k, v (V2: λ logits) and the sum of the ranks' parameter
    gradients equal CP = 1 with the mask (fp64 for eager and sdpa; the fused kernel in the interpreter in fp32)."""
    import copy

    from tests.test_context_parallel import ThreadRing, run_threads

    module, heads, d, with_lambda = build(kind, "sdpa" if backend == "triton" else backend)
    s, ranks = 32, 2
    batch = 1 if backend == "triton" else 2  # the interpreter's time: the first sample only
    ring_ids = RING_IDS[:batch]
    tensors = kind_inputs(heads, d, with_lambda, s=s, b=batch)
    out_width = {"diff": 4 * 2 * d, "diff_v2": 4 * d}.get(kind, 4 * d)
    grad_out = torch.randn(s, batch, out_width, dtype=torch.float64)
    want = core_attention_run(module, tensors, grad_out, ring_ids)  # the fused ring: against sdpa's in fp64
    if backend == "triton":
        module = module.float()
        module.backend = "triton"
        tensors, grad_out = [t.float() for t in tensors], grad_out.float()
    mailboxes, lock, results = [queue.Queue() for _ in range(ranks)], threading.Lock(), [None] * ranks

    def rank_main(rank):
        with lock:  # the ranks take turns (Triton's interpreter is not thread-safe), each until it waits
            rank_module = copy.deepcopy(module)
            rank_module.ring = ThreadRing(mailboxes, rank, lock)
            chunks = [context_parallel_chunks(t, ranks, rank, dim=0) for t in (*tensors, grad_out)]
            ids = context_parallel_chunks(ring_ids, ranks, rank, dim=1)
            results[rank] = core_attention_run(rank_module, chunks[:-1], chunks[-1], ids)

    run_threads(ranks, rank_main)
    tolerance = FP32_TOLERANCE if backend == "triton" else (FP32_ROUNDING if kind == "diff_v2" else 1e-12)
    for rank, (out, grads, params) in enumerate(results):
        index = load_balanced_indices(s, ranks, rank)
        assert rel_err(out, want[0][index]) < tolerance, rank
        for name, got, full in zip(("q", "k", "v", "lambda logits"), grads, want[1]):
            assert rel_err(got, full[index]) < tolerance, (name, rank)
    for name in want[2]:
        assert rel_err(sum(r[2][name] for r in results), want[2][name]) < tolerance, name


# ------------------------------------------------------------------------------------------------------------------
# The model: RoPE positions per document, packing order
# ------------------------------------------------------------------------------------------------------------------
def debug_model(kind, backend, seq_length):
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.models.gpt import build_model_chunk

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "debug", "attention": kind, "attention_backend": backend, "num_layers": 2,
                  "hidden_size": 64, "num_heads": 2, "ffn_hidden_size": 176, "seq_length": seq_length},
        "trainer": {"max_steps": 1, "global_batch_size": 1},
    }))
    return build_model_chunk(cfg, vocab_size=128)


def token_losses(model, tokens, labels, document_mask, reset_position_ids):
    """Per-token losses and the parameters' gradients of their sum, through the trainer's own model inputs."""
    from diff_transformer.training.steps import model_inputs

    batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1]).expand_as(tokens)}
    ids = document_ids(tokens, EOD)
    if document_mask:
        batch["document_ids"] = ids
    if reset_position_ids:
        batch["position_ids"] = document_positions(ids)
    tokens, positions, documents = model_inputs(batch, "cpu", reset_position_ids)
    model.zero_grad(set_to_none=True)
    losses = model(tokens, positions, None, labels=labels, packed_seq_params=documents)
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["diff", "vanilla"])
def test_model_with_one_document_is_todays_model_bit_for_bit(kind, megatron_single_process):
    """A micro-batch without an EOD is one document a sample: with the mask and per-document positions the losses
    and every gradient are today's, bit for bit."""
    model = debug_model(kind, "sdpa", 24)
    tokens = torch.randint(3, 128, (2, 24))
    labels = torch.randint(3, 128, (2, 24))
    masked = token_losses(model, tokens, labels, True, True)
    plain = token_losses(model, tokens, labels, False, False)
    assert torch.equal(masked[0], plain[0])
    assert all(torch.equal(masked[1][n], plain[1][n]) for n in plain[1])
    # per-token RoPE angles at positions 0..s-1 are megatron's own; restarted ones are the restarted rows of them
    angles = model.rotary_pos_emb(24)  # [s, 1, 1, dim]
    restarted = torch.tensor([list(range(24)), list(range(10)) + list(range(14))])
    ours = model.rotary_positions(restarted)
    assert torch.equal(ours[:, :1], angles[:, 0:1, 0:1].expand(24, 1, 1, -1))
    assert torch.equal(ours[10:, 1], angles[:14, 0])


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_a_documents_losses_do_not_depend_on_what_was_packed_before_it(backend, megatron_single_process):
    """Three documents packed in two orders: with the mask and per-document positions every token of a document
    whose label lies in the same document has the same loss at step 0 (the label of an EOD is the next document's
    first token, which the order decides); without the mask they differ."""
    model = debug_model("diff", backend, 30)
    documents = [torch.randint(3, 128, (n,)) for n in (7, 12, 9)]
    orders = [(0, 1, 2), (2, 0, 1)]

    def packed(order, mask):
        stream = torch.cat([torch.cat([documents[i], torch.tensor([EOD])]) for i in order] + [torch.tensor([EOD])])
        tokens, labels = stream[:-1][None], stream[1:][None]
        losses = token_losses(model, tokens, labels, mask, mask)[0][0]
        starts = torch.tensor([0] + [len(documents[i]) + 1 for i in order]).cumsum(0)
        # per document: the losses of its tokens before the EOD (their labels are its own tokens and its EOD)
        return {i: losses[a:a + len(documents[i])] for i, a in zip(order, starts.tolist())}

    first, second = packed(orders[0], True), packed(orders[1], True)
    for i in range(3):
        assert rel_err(first[i], second[i]) < 1e-6, i
    unmasked = packed(orders[0], False), packed(orders[1], False)
    assert rel_err(unmasked[0][2], unmasked[1][2]) > 1e-3  # document 2 first in one order, last in the other


# ------------------------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): the compiled kernel with document ids in bf16, the sdpa path's variable-length flash
# ------------------------------------------------------------------------------------------------------------------
def exponential_documents(n, batch, mean, seed=0):
    """(batch, n) ids of samples packed from documents of exponentially distributed lengths (mean ``mean``)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < n * batch:
        lengths.append(max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=generator))))
    stream = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[: n * batch].view(batch, n)
    return (stream - stream[:, :1]).to(torch.int32)


GPU_KERNEL_CASES = [(1, 1, 2048, 8, 8, 128), (1, 2, 1024, 4, 2, 64), (2, 1, 2048, 8, 8, 128), (2, 2, 1024, 4, 2, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("version,batch,n,heads,groups,d", GPU_KERNEL_CASES,
                         ids=[f"v{c[0]}-B{c[1]}-N{c[2]}-H{c[3]}-Hkv{c[4]}-D{c[5]}" for c in GPU_KERNEL_CASES])
def test_fused_kernel_with_documents_on_cuda_in_bf16(version, batch, n, heads, groups, d):
    """The table's compiled kernels with document ids (mean document 300 tokens) against the fp32 reference run per
    document on the same bf16 inputs, and one document bit for bit the kernel without ids."""
    tensors = [t.detach().cuda().to(torch.bfloat16 if i < 3 or i == 4 else t.dtype).requires_grad_()
               for i, t in enumerate(kernel_inputs(version, batch, n, heads, groups, d, version == 1))]
    ids = exponential_documents(n, batch, 300).cuda()
    out = kernel_call(version, tensors, ids=ids)
    upstream = torch.randn_like(out, dtype=torch.float32)
    grads = torch.autograd.grad(out, tensors, upstream.to(out.dtype))
    reference = [t.detach().float().requires_grad_() for t in tensors]
    ref_out, ref_grads = reference_per_document(version, reference, upstream, ids.cpu())
    errors = {"out": rel_err(out, ref_out)}
    errors.update({name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "dlam", "dw"), grads, ref_grads)})
    # tests/test_diff_attn_kernel.py's bf16 tolerance
    assert all(e < 2e-2 for e in errors.values()), errors
    one = kernel_call(version, tensors, ids=torch.zeros_like(ids))
    assert torch.equal(one, kernel_call(version, tensors))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["diff", "diff_v2", "vanilla"])
def test_sdpa_with_documents_on_cuda_in_bf16_is_one_variable_length_flash_call(kind):
    """sdpa with documents on a GPU in bf16: PyTorch's variable-length FlashAttention (one launch for every
    document), GQA included, against eager with the mask in fp32 on the same inputs."""
    from diff_transformer.models.attention.base import record_sdpa_kernels

    module, heads, d, with_lambda = build(kind, "sdpa", d=32)
    eager = build(kind, "eager", d=32)[0].float().cuda()
    module = module.to(torch.bfloat16).cuda()
    eager.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    tensors = [t.cuda() for t in kind_inputs(heads, d, with_lambda, s=512)]
    ids = exponential_documents(512, 2, 60).cuda()
    grad_out = torch.randn(512, 2, 8 * d if kind == "diff" else 4 * d, device="cuda")
    with record_sdpa_kernels() as calls:
        got = core_attention_run(module, [t.to(torch.bfloat16) for t in tensors], grad_out.to(torch.bfloat16), ids)
    want = core_attention_run(eager, [t.to(torch.bfloat16).float() for t in tensors], grad_out, ids)
    assert calls and all(c.startswith("flash varlen") for c in calls), calls
    assert rel_err(got[0], want[0]) < 2e-2
    for name, a, b in zip(("q", "k", "v"), got[1], want[1]):
        assert rel_err(a, b) < 3e-2, name
