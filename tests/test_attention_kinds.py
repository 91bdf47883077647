"""Every attention kind against an independent plain-PyTorch transcription of its definition (fp64 loops over heads and
rows, small shapes), outputs and every gradient; backends against each other; the blockwise backend's memory."""

import math
from types import SimpleNamespace

import pytest
import torch

from diff_transformer.compat import apply_cpu_patches

apply_cpu_patches()

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from diff_transformer.models import attention  # noqa: E402
from diff_transformer.models.attention import (  # noqa: E402
    DiffV2CoreAttention,
    SignedMaskCoreAttention,
    TopKCoreAttention,
    VanillaCoreAttention,
    VanillaSublnCoreAttention,
    lambda_init_for_layer,
)
from diff_transformer.models.layer_specs import diff_v2_layer_spec  # noqa: E402

CAUSAL = AttnMaskType.causal


def rel_err(a, b):
    """Relative RMS error; exact zeros on both sides (top-1's score gradients) count as equal."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def make_config(q_heads, kv_heads, d, hidden=None):
    return TransformerConfig(
        num_layers=4, hidden_size=hidden or q_heads * d, num_attention_heads=q_heads, num_query_groups=kv_heads,
        kv_channels=d, use_cpu_initialization=True, add_bias_linear=False,
    )


def causal_softmax(scores):
    """softmax over the keys j <= i of a (N, N) score matrix."""
    n = scores.shape[-1]
    return torch.softmax(scores + torch.full((n, n), float("-inf"), dtype=scores.dtype).triu(1), dim=-1)


def run_with_grads(fn, tensors, params=(), seed=3):
    """fn(*tensors) with an upstream gradient from a fixed generator: (out, grads of tensors, grads of params)."""
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    for p in params:
        p.grad = None
    out = fn(*tensors)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    return out.detach(), [t.grad for t in tensors], [p.grad.clone() for p in params]


def megatron_layout(q, k, v):
    """(B, N, heads, d) -> megatron's [s, b, heads, d]."""
    return tuple(t.transpose(0, 1) for t in (q, k, v))


def inputs(B, N, q_heads, kv_heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, h, d, generator=g) for h in (q_heads, kv_heads, kv_heads)]


def assert_matches_reference(module, reference, tensors, params, tol=1e-6):
    """Module (megatron layout, fp32) and reference (fp64, (B, N, ...) layout): outputs and every gradient."""
    out, grads, pgrads = run_with_grads(
        lambda q, k, v: module(*megatron_layout(q, k, v), None, attn_mask_type=CAUSAL).transpose(0, 1),
        tensors, params,
    )
    ref_params = [p.detach().double().requires_grad_(True) for p in params]
    ref_out, ref_grads, _ = run_with_grads(
        lambda q, k, v: reference(q, k, v, *ref_params), [t.double() for t in tensors]
    )
    assert rel_err(out, ref_out.reshape(out.shape)) < tol
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < tol
    for got, want in zip(pgrads, [p.grad for p in ref_params]):
        assert rel_err(got, want) < tol
    return out


# ------------------------------------------------------------------------------------------------------------------
# vanilla_subln: softmax heads, each RMSNorm'd over d, times (1 − λ_init)
# ------------------------------------------------------------------------------------------------------------------
def subln_reference(q, k, v, norm_weight, lambda_init, eps=1e-5):
    B, N, heads, d = q.shape
    group = heads // k.shape[2]
    out = []
    for h in range(heads):
        a = causal_softmax(q[:, :, h] @ k[:, :, h // group].transpose(-1, -2) / math.sqrt(d))
        head = a @ v[:, :, h // group]
        out.append(head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + eps) * norm_weight * (1 - lambda_init))
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("lambda_init", [None, 0.5], ids=["schedule", "fixed"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_vanilla_subln_matches_its_definition(backend, lambda_init):
    torch.manual_seed(0)
    heads, kv_heads, d, layer = 4, 2, 8, 3
    module = VanillaSublnCoreAttention(make_config(heads, kv_heads, d), layer, CAUSAL, backend=backend,
                                       lambda_init=lambda_init)
    with torch.no_grad():
        module.sublayer_norm.weight.uniform_(0.5, 1.5)
    li = lambda_init if lambda_init is not None else lambda_init_for_layer(layer)
    assert_matches_reference(
        module, lambda q, k, v, w: subln_reference(q, k, v, w, li), inputs(2, 12, heads, kv_heads, d),
        [module.sublayer_norm.weight],
    )


# ------------------------------------------------------------------------------------------------------------------
# topk: each query's k largest causal scores, softmax over them
# ------------------------------------------------------------------------------------------------------------------
def topk_reference(q, k, v, topk):
    B, N, heads, d = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(B, N, heads, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(heads):
            kh, vh = k[b, :, h // group], v[b, :, h // group]
            for i in range(N):
                scores = q[b, i, h] @ kh[: i + 1].T / math.sqrt(d)  # the keys query i sees
                kept = scores >= torch.sort(scores, descending=True).values[min(topk, i + 1) - 1]
                probs = torch.softmax(scores.masked_fill(~kept, float("-inf")), dim=-1)
                out[b, i, h] = probs @ vh[: i + 1]
    return out.flatten(2)


@pytest.mark.parametrize("backend,block", [("eager", None), ("sdpa", 5)], ids=["eager", "blockwise"])
@pytest.mark.parametrize("topk", [1, 4])
def test_topk_matches_its_definition(backend, block, topk, monkeypatch):
    if block is not None:
        monkeypatch.setattr(attention.blockwise, "BLOCK_QUERIES", block)  # several blocks, recomputed in the backward
    heads, kv_heads, d = 4, 2, 8
    module = TopKCoreAttention(make_config(heads, kv_heads, d), 1, CAUSAL, backend=backend, topk=topk)
    assert_matches_reference(module, lambda q, k, v: topk_reference(q, k, v, topk), inputs(2, 13, heads, kv_heads, d), [])


def test_topk_at_or_beyond_the_sequence_equals_vanilla():
    heads, kv_heads, d, N = 4, 2, 8, 16
    tensors = megatron_layout(*inputs(2, N, heads, kv_heads, d))
    vanilla = VanillaCoreAttention(make_config(heads, kv_heads, d), 1, CAUSAL, backend="eager")(*tensors, None)
    for topk in (N, N + 100):
        out = TopKCoreAttention(make_config(heads, kv_heads, d), 1, CAUSAL, backend="sdpa", topk=topk)(*tensors, None)
        assert rel_err(out, vanilla) < 1e-6
    with pytest.raises(ValueError, match="model.topk=0 must be >= 1"):
        TopKCoreAttention(make_config(heads, kv_heads, d), 1, CAUSAL, topk=0)


# ------------------------------------------------------------------------------------------------------------------
# signed_mask: (A ⊙ (1 − 2σ(m[h, bucket(i − j)])))·V
# ------------------------------------------------------------------------------------------------------------------
def t5_causal_bucket(distance, max_distance, num_buckets=32):
    """T5's unidirectional relative-position bucket, written out for one integer distance."""
    exact = num_buckets // 2
    if distance < exact:
        return distance
    max_distance = max(max_distance, 2 * exact)
    bucket = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(bucket, num_buckets - 1)


def signed_mask_reference(q, k, v, logits, max_distance):
    B, N, heads, d = q.shape
    group = heads // k.shape[2]
    buckets = torch.tensor([[t5_causal_bucket(max(i - j, 0), max_distance) for j in range(N)] for i in range(N)])
    out = []
    for h in range(heads):
        a = causal_softmax(q[:, :, h] @ k[:, :, h // group].transpose(-1, -2) / math.sqrt(d))
        gate = 1 - 2 * torch.sigmoid(logits[h][buckets])
        out.append((a * gate) @ v[:, :, h // group])
    return torch.cat(out, dim=-1)


def test_relative_position_buckets():
    distances = torch.arange(0, 300)
    got = attention.relative_position_bucket(distances, max_distance=128).tolist()
    assert got == [t5_causal_bucket(int(r), 128) for r in distances]
    assert got[:16] == list(range(16)) and got[-1] == 31 and sorted(got) == got


@pytest.mark.parametrize("backend,block", [("eager", None), ("sdpa", 4)], ids=["eager", "blockwise"])
def test_signed_mask_matches_its_definition(backend, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(attention.blockwise, "BLOCK_QUERIES", block)
    heads, kv_heads, d, N = 4, 2, 8, 40  # distances up to 39: exact and logarithmic buckets
    module = SignedMaskCoreAttention(make_config(heads, kv_heads, d), 1, CAUSAL, backend=backend, max_distance=64)
    assert module.mask_logits.shape == (heads, 32)
    assert torch.allclose(module.gate(torch.arange(3), torch.arange(3), 0, heads), torch.tensor(1 - 2 / (1 + math.e**3)))
    with torch.no_grad():
        module.mask_logits.normal_(0.0, 2.0)  # signs of both kinds
    assert_matches_reference(
        module, lambda q, k, v, m: signed_mask_reference(q, k, v, m, 64), inputs(1, N, heads, kv_heads, d),
        [module.mask_logits],
    )


@pytest.mark.parametrize("cls", [TopKCoreAttention, SignedMaskCoreAttention])
def test_map_controls_refuse_fused_backends(cls):
    with pytest.raises(ValueError, match="use sdpa \\(blockwise\\) or eager"):
        cls(make_config(4, 2, 8), 1, CAUSAL, backend="flash_attn")


def test_blockwise_backend_keeps_one_block_of_the_map_at_4k():
    """At N=4096 no tensor of the forward or backward holds more than one block of queries x N scores per head."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    N, d = 4096, 4
    module = TopKCoreAttention(make_config(2, 2, d), 1, CAUSAL, backend="sdpa", topk=32)
    q, k, v = (torch.randn(N, 1, 2, d, requires_grad=True) for _ in range(3))
    with LargestTensor() as mode:
        module(q, k, v, None).sum().backward()
    heads = 2
    assert mode.largest <= heads * attention.BLOCK_QUERIES * N, mode.largest
    assert mode.largest < heads * N * N // 16
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ------------------------------------------------------------------------------------------------------------------
# diff_v2: the whole SelfAttention (λ_t from x, GQA pairing, output projection from H·d)
# ------------------------------------------------------------------------------------------------------------------
def v2_reference(x, w_qkv, w_lambda, w_o, heads, kv_heads, d):
    """x (s, b, E); megatron's fused QKV weight holds, per KV group g, its 2H/Hkv query heads, then K_g, then V_g."""
    per_group = 2 * heads // kv_heads
    qkv = (x @ w_qkv.T).unflatten(-1, (kv_heads, per_group + 2, d))  # (s, b, Hkv, 2H/Hkv + 2, d)
    q = qkv[..., :per_group, :].flatten(2, 3)  # (s, b, 2H, d), query head n in group n // (2H/Hkv)
    k, v = qkv[..., per_group, :], qkv[..., per_group + 1, :]
    lam = torch.sigmoid(x @ w_lambda.T)  # (s, b, H): per token and per head pair
    heads_out = []
    for h in range(heads):
        g1, g2 = (2 * h) // per_group, (2 * h + 1) // per_group
        assert g1 == g2, "a head pair shares its KV group"
        qk = lambda n: q[:, :, n].transpose(0, 1) @ k[:, :, g1].transpose(0, 1).transpose(-1, -2) / math.sqrt(d)
        o1 = causal_softmax(qk(2 * h)) @ v[:, :, g1].transpose(0, 1)  # (b, s, d)
        o2 = causal_softmax(qk(2 * h + 1)) @ v[:, :, g1].transpose(0, 1)
        heads_out.append(o1 - lam[:, :, h].transpose(0, 1).unsqueeze(-1) * o2)
    return (torch.cat(heads_out, dim=-1) @ w_o.T).transpose(0, 1)  # (s, b, E)


def build_v2_attention(heads, kv_heads, d, hidden, backend):
    config = make_config(2 * heads, kv_heads, d, hidden=hidden)
    model_cfg = SimpleNamespace(attention_backend=backend)
    spec = diff_v2_layer_spec(model_cfg).submodules.self_attention
    return build_module(spec, config=config, layer_number=1)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)], ids=["H2-Hkv2", "H4-Hkv2", "H4-Hkv1"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_diff_v2_layer_matches_its_definition(heads, kv_heads, backend, megatron_single_process):
    torch.manual_seed(heads + kv_heads)
    d, hidden = 8, 24
    module = build_v2_attention(heads, kv_heads, d, hidden, backend)
    assert module.linear_qkv.weight.shape == ((2 * heads + 2 * kv_heads) * d, hidden)
    assert module.linear_lambda.weight.shape == (heads, hidden)
    assert module.linear_proj.weight.shape == (hidden, heads * d)  # from H·d
    with torch.no_grad():
        module.linear_lambda.weight.normal_(0.0, 0.5)  # λ_t visibly differs between tokens and heads
    params = [module.linear_qkv.weight, module.linear_lambda.weight, module.linear_proj.weight]
    x = torch.randn(10, 2, hidden)
    out, (grad_x,), pgrads = run_with_grads(lambda x: module(x, None)[0], [x], params)
    ref_params = [p.detach().double().requires_grad_(True) for p in params]
    ref, (ref_grad_x,), _ = run_with_grads(
        lambda x: v2_reference(x, *ref_params, heads, kv_heads, d), [x.double()]
    )
    assert rel_err(out, ref) < 1e-6 and rel_err(grad_x, ref_grad_x) < 1e-6
    for got, want in zip(pgrads, [p.grad for p in ref_params]):
        assert rel_err(got, want) < 1e-6


def test_diff_v2_core_attention_needs_lambda_and_refuses_a_bias(megatron_single_process):
    core = DiffV2CoreAttention(make_config(4, 1, 8), 1, CAUSAL)
    q = torch.randn(6, 1, 4, 8)
    with pytest.raises(ValueError, match="per-token λ logits"):
        core(q, q[:, :, :1], q[:, :, :1], None, attn_mask_type=CAUSAL)
    module = build_v2_attention(2, 1, 8, 16, "sdpa")
    with pytest.raises(ValueError, match="attention bias is not supported"):
        module(torch.randn(6, 1, 16), None, attention_bias=torch.zeros(1))


def test_diff_v2_records_its_per_token_lambda_only_when_asked(megatron_single_process):
    """The sums a logging step reads (count, Σλ, Σλ² over tokens and heads, two micro-batches) against sigmoid(x·W_λ)
    computed here; nothing is recorded outside a recording."""
    from diff_transformer.models.attention.diff_v2 import record_lambda, recorded_lambda_sums

    torch.manual_seed(5)
    module = build_v2_attention(2, 2, 8, 24, "sdpa")
    with torch.no_grad():
        module.linear_lambda.weight.normal_(0.0, 0.5)
    xs = [torch.randn(10, 2, 24), torch.randn(10, 3, 24)]
    module(xs[0], None)
    assert module.lambda_sums is None
    record_lambda([module], True)
    with torch.no_grad():
        for x in xs:
            module(x, None)
    (sums,) = recorded_lambda_sums([module]).tolist()
    record_lambda([module], False)
    lam = torch.cat([torch.sigmoid(x.double() @ module.linear_lambda.weight.double().T).flatten() for x in xs])
    assert sums[0] == lam.numel() == 2 * (10 * 2 + 10 * 3)
    assert sums[1] == pytest.approx(lam.sum().item(), rel=1e-6)
    assert sums[2] == pytest.approx(lam.square().sum().item(), rel=1e-6)
    module(xs[0], None)
    assert module.lambda_sums is None


def _v2_core_outputs(backend, q, k, v, lam_logits):
    core = DiffV2CoreAttention(make_config(q.shape[2], k.shape[2], q.shape[3]), 1, CAUSAL, backend=backend)
    return run_with_grads(lambda q, k, v, lam: core(q, k, v, None, attn_mask_type=CAUSAL, attention_bias=lam),
                          [q, k, v, lam_logits])


@pytest.mark.parametrize("backend,tol", [("sdpa", 1e-5), ("triton", 1e-4)])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["H2-Hkv2", "H4-Hkv2"])
def test_diff_v2_backends_match_eager(backend, tol, heads, kv_heads):
    """One attention over 2H heads then the paired subtraction (sdpa), or the fused kernel (Triton's interpreter
    on CPU), against the eager map: output and gradients of q, k, v and λ's logits."""
    g = torch.Generator().manual_seed(7)
    N, B, d = 20, 1, 16
    q, k, v = (torch.randn(N, B, h, d, generator=g) for h in (2 * heads, kv_heads, kv_heads))
    lam_logits = torch.randn(N, B, heads, generator=g)
    out_e, grads_e, _ = _v2_core_outputs("eager", q, k, v, lam_logits)
    out_o, grads_o, _ = _v2_core_outputs(backend, q, k, v, lam_logits)
    assert out_o.shape == (N, B, heads * d)
    assert rel_err(out_o, out_e) < tol
    for got, want in zip(grads_o, grads_e):
        assert rel_err(got, want) < tol
