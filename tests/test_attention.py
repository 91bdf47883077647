"""Differential attention numerics: the module against a transcription of the paper's equations, and backends."""

import math

import pytest
import torch

from diff_transformer.models.attention import DifferentialCoreAttention, VanillaCoreAttention, lambda_init_for_layer
from diff_transformer.compat import apply_cpu_patches

apply_cpu_patches()

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_config(heads, kv_heads, d):
    return TransformerConfig(
        num_layers=4, hidden_size=2 * heads * d, num_attention_heads=2 * heads, num_query_groups=2 * kv_heads,
        kv_channels=d, use_cpu_initialization=True,
    )


def paper_reference(q, k, v, lq1, lk1, lq2, lk2, lambda_init, norm_weight, eps=1e-5, output_scale=None):
    """The paper's equations, one differential head at a time, in float64.

    q (B, N, 2H, d), k (B, N, 2Hkv, d), v (B, N, Hkv, 2d); head h uses (Q1, Q2) = q heads (2h, 2h+1) and
    (K1, K2) = k heads (2g, 2g+1), V = v head g, with g = h // (H / Hkv). Each head is multiplied by
    ``output_scale`` (default 1 − λ_init). Differentiable in q, k, v and the norm weight.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, N, two_h, d = q.shape
    H, Hkv = two_h // 2, v.shape[2]
    output_scale = 1 - lambda_init if output_scale is None else output_scale
    lam = (
        math.exp(float(torch.dot(lq1.detach().double(), lk1.detach().double())))
        - math.exp(float(torch.dot(lq2.detach().double(), lk2.detach().double())))
        + lambda_init
    )
    mask = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        a1 = torch.softmax(q[:, :, 2 * h] @ k[:, :, 2 * g].transpose(-1, -2) / math.sqrt(d) + mask, dim=-1)
        a2 = torch.softmax(q[:, :, 2 * h + 1] @ k[:, :, 2 * g + 1].transpose(-1, -2) / math.sqrt(d) + mask, dim=-1)
        head = (a1 - lam * a2) @ v[:, :, g]  # (B, N, 2d)
        head = head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
        heads.append(head * output_scale)
    return torch.cat(heads, dim=-1)  # (B, N, H * 2d)


def as_megatron_inputs(q, k, v):
    """(B, N, heads, d) -> megatron's [s, b, heads, d]; V's (Hkv, 2d) heads become 2Hkv heads of d."""
    B, N, hkv, two_d = v.shape
    return q.transpose(0, 1), k.transpose(0, 1), v.reshape(B, N, 2 * hkv, two_d // 2).transpose(0, 1)


@pytest.mark.parametrize("layer", [1, 2, 7])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["H2-Hkv2", "H4-Hkv2"])
def test_diff_eager_matches_paper_equations(layer, heads, kv_heads):
    torch.manual_seed(layer * 10 + heads)
    B, N, d = 2, 24, 16
    attn = DifferentialCoreAttention(make_config(heads, kv_heads, d), layer, AttnMaskType.causal, backend="eager")
    with torch.no_grad():
        attn.sublayer_norm.weight.uniform_(0.5, 1.5)
    q = torch.randn(B, N, 2 * heads, d)
    k = torch.randn(B, N, 2 * kv_heads, d)
    v = torch.randn(B, N, kv_heads, 2 * d)
    out = attn(*as_megatron_inputs(q, k, v), None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (N, B, heads * 2 * d)
    ref = paper_reference(
        q, k, v, attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2,
        lambda_init_for_layer(layer), attn.sublayer_norm.weight.detach(),
    )
    assert rel_err(out.transpose(0, 1), ref) < 1e-5
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * (layer - 1)))


@pytest.mark.parametrize("lambda_init", [1.0, 0.5, None], ids=["lambda1", "lambda0.5", "schedule"])
def test_frozen_lambda_is_the_constant_with_the_schedules_multiplier(lambda_init):
    """model.lambda_learnable=false: no λ parameters, λ = λ_init (1.0: pure cancellation A1 − A2), and the output
    multiplier stays 1 − λ_init(l) of the depth schedule; outputs and gradients against the paper's equations."""
    torch.manual_seed(5)
    heads, kv_heads, B, N, d, layer = 4, 2, 2, 12, 8, 3
    attn = DifferentialCoreAttention(make_config(heads, kv_heads, d), layer, AttnMaskType.causal, backend="eager",
                                     lambda_init=lambda_init, lambda_learnable=False)
    assert [name for name, _ in attn.named_parameters()] == ["sublayer_norm.weight"]
    lam = lambda_init if lambda_init is not None else lambda_init_for_layer(layer)
    assert float(attn.lambda_full()) == pytest.approx(lam)
    with torch.no_grad():
        attn.sublayer_norm.weight.uniform_(0.5, 1.5)
    q = torch.randn(B, N, 2 * heads, d, requires_grad=True)
    k = torch.randn(B, N, 2 * kv_heads, d, requires_grad=True)
    v = torch.randn(B, N, kv_heads, 2 * d, requires_grad=True)
    grad_out = torch.randn(B, N, heads * 2 * d)
    out = attn(*as_megatron_inputs(q, k, v), None, attn_mask_type=AttnMaskType.causal).transpose(0, 1)
    out.backward(grad_out)
    got = [t.grad.clone() for t in (q, k, v)] + [attn.sublayer_norm.weight.grad.clone()]
    zero = torch.zeros(d)
    weight = attn.sublayer_norm.weight.detach().double().requires_grad_(True)
    q.grad = k.grad = v.grad = None
    ref = paper_reference(q, k, v, zero, zero, zero, zero, lam, weight,
                          output_scale=1 - lambda_init_for_layer(layer))  # exp(0) − exp(0) + λ_init = λ_init
    ref.backward(grad_out.double())
    assert rel_err(out, ref) < 1e-6
    for g, want in zip(got, [q.grad, k.grad, v.grad, weight.grad]):
        assert rel_err(g, want) < 1e-6


def test_lambda_init_schedule():
    assert lambda_init_for_layer(1) == pytest.approx(0.2)
    assert lambda_init_for_layer(2) == pytest.approx(0.8 - 0.6 * math.exp(-0.3))
    assert lambda_init_for_layer(40) == pytest.approx(0.8, abs=1e-5)
    with pytest.raises(ValueError, match="1-based"):
        lambda_init_for_layer(0)


def test_lambda_reparameterisation_and_init():
    torch.manual_seed(0)
    attn = DifferentialCoreAttention(make_config(2, 2, 32), 3, AttnMaskType.causal)
    stds = torch.stack([p.detach() for p in attn.lambda_parameters()]).std()
    assert 0.07 < float(stds) < 0.13  # normal(0, 0.1)
    expected = (
        torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
        + lambda_init_for_layer(3)
    )
    assert float(attn.lambda_full()) == pytest.approx(float(expected), rel=1e-6)
    assert all(p.dtype == torch.float32 and p.shape == (32,) for p in attn.lambda_parameters())


def test_frozen_lambda_is_made_once_per_device():
    """model.lambda_learnable=false: λ is one constant per device, not a tensor made (and, on a GPU, copied from
    pageable memory, which waits for the GPU) in every call."""
    attn = DifferentialCoreAttention(make_config(2, 2, 8), 2, AttnMaskType.causal, lambda_learnable=False)
    first = attn.lambda_full(torch.device("cpu"))
    assert attn.lambda_full(torch.device("cpu")) is first and attn.lambda_full() is first
    meta = attn.lambda_full(torch.device("meta"))
    assert meta.device.type == "meta" and attn.lambda_full(torch.device("meta")) is meta
    assert first.dtype == torch.float32 and float(first) == pytest.approx(lambda_init_for_layer(2))


def _run(module, q, k, v):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    generator = torch.Generator(device=out.device).manual_seed(3)  # fp32 draws, so every dtype gets the same
    grad_out = torch.randn(out.shape, generator=generator, device=out.device).to(out.dtype)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in (q, k, v)], [p.grad.clone() for p in module.parameters()]


def assert_backend_matches_eager(cls, backend, heads, kv_heads, N, B, layer, tol):
    """Same weights and inputs through ``backend`` and ``eager``: outputs and every gradient agree within ``tol``.
    Returns the eager parameter gradients."""
    d = 16
    config = make_config(heads, kv_heads, d)
    eager = cls(config, layer, AttnMaskType.causal, backend="eager")
    other = cls(config, layer, AttnMaskType.causal, backend=backend)
    other.load_state_dict(eager.state_dict())
    q = torch.randn(N, B, 2 * heads, d)
    k = torch.randn(N, B, 2 * kv_heads, d)
    v = torch.randn(N, B, 2 * kv_heads, d)
    out_e, grads_e, pgrads_e = _run(eager, q, k, v)
    out_o, grads_o, pgrads_o = _run(other, q, k, v)
    assert rel_err(out_o, out_e) < tol
    for got, want in zip(grads_o + pgrads_o, grads_e + pgrads_e):
        assert rel_err(got, want) < tol
    return pgrads_e


@pytest.mark.parametrize("kind", ["diff", "vanilla"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["H2-Hkv2", "H4-Hkv2"])
def test_sdpa_matches_eager_values_and_grads(kind, heads, kv_heads):
    torch.manual_seed(1)
    cls = DifferentialCoreAttention if kind == "diff" else VanillaCoreAttention
    pgrads = assert_backend_matches_eager(cls, "sdpa", heads, kv_heads, N=40, B=2, layer=2, tol=1e-5)
    if kind == "diff":
        assert len(pgrads) == 5 and all(g.abs().sum() > 0 for g in pgrads)


def test_unknown_backend_and_missing_flash_attn():
    from diff_transformer.training.backend_choice import installed

    config = make_config(2, 2, 16)
    with pytest.raises(ValueError, match="attention_backend='cudnn'.*eager, sdpa, flash_attn, flash_attn4, triton"):
        DifferentialCoreAttention(config, 1, AttnMaskType.causal, backend="cudnn")
    # the FlashAttention libraries are GPU-only; without one its backend names the package and the fix
    for backend, package in (("flash_attn", "the flash-attn package"), ("flash_attn4", "the flash-attn-4 package")):
        if not installed(backend):
            attn = VanillaCoreAttention(config, 1, AttnMaskType.causal, backend=backend)
            q = torch.randn(8, 1, 4, 16)
            with pytest.raises(ImportError, match=f"attention_backend={backend} needs {package}.*use "
                                                  "model.attention_backend=sdpa"):
                attn(q, q, q, None, attn_mask_type=AttnMaskType.causal)


@pytest.fixture
def flash_libraries():
    from tests.flash_stand_in import installed

    with installed() as calls:
        yield calls


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn4"])
@pytest.mark.parametrize("kind", ["diff", "diff_v2", "vanilla"])
@pytest.mark.parametrize("heads,kv_heads,documents", [(2, 2, False), (4, 1, False), (4, 2, True)],
                         ids=["H2-Hkv2", "H4-Hkv1-gqa", "H4-Hkv2-gqa-documents"])
def test_flash_backends_equal_eager_in_fp64(kind, backend, heads, kv_heads, documents, flash_libraries):
    """Each kind's calls into the FlashAttention libraries (their stand-ins here, tests/flash_stand_in.py: the
    libraries' entry points, layouts and GQA pairing over the materialised map) equal eager in fp64, outputs and every
    gradient, with GQA and with documents (the variable-length entry). DIFF V1 makes two calls on flash-attn 2, of 2H
    query heads with equal head dims, one per half of V; one on flash-attn-4, 2H query heads against the whole 2d-wide
    V (with GQA, K and V repeated to the query heads: flash-attn-4's Hopper backward takes GQA only with equal head
    dims, and its stand-in refuses it too)."""
    from diff_transformer.models.attention import DiffV2CoreAttention
    from diff_transformer.models.documents import PackedDocuments

    torch.manual_seed(heads * 10 + kv_heads)
    d, n, b = 8, 19, 2
    if kind == "diff_v2":
        config = TransformerConfig(num_layers=2, hidden_size=2 * heads * d, num_attention_heads=2 * heads,
                                   num_query_groups=kv_heads, kv_channels=d, use_cpu_initialization=True)
        make = lambda backend: DiffV2CoreAttention(config, 1, AttnMaskType.causal, backend=backend)  # noqa: E731
        shapes = (2 * heads, kv_heads, kv_heads)
    else:
        cls = DifferentialCoreAttention if kind == "diff" else VanillaCoreAttention
        config = make_config(heads, kv_heads, d)
        make = lambda backend: cls(config, 3, AttnMaskType.causal, backend=backend)  # noqa: E731
        shapes = (2 * heads, 2 * kv_heads, 2 * kv_heads)
    eager, flash = make("eager").double(), make(backend).double()
    if kind == "diff":
        with torch.no_grad():
            eager.sublayer_norm.weight.uniform_(0.5, 1.5)
    flash.load_state_dict(eager.state_dict())
    # q, k and v as megatron-core's fused QKV projection leaves them: views of one buffer, per KV head its query
    # heads, its key and its value head, so that K's and V's heads lie apart
    groups = shapes[2]
    per_group = shapes[0] // groups
    qkv = torch.randn(n, b, groups, per_group + 2, d, dtype=torch.float64)
    lambda_logits = torch.randn(n, b, heads, dtype=torch.float64)  # V2's
    ids = torch.tensor([[0] * 7 + [1] * 12, [0] * 3 + [1] * 9 + [2] * 7], dtype=torch.int32)
    packed = PackedDocuments(document_ids=ids) if documents else None

    def run(module):
        buffer, logits = qkv.clone().requires_grad_(True), lambda_logits.clone().requires_grad_(True)
        q = buffer[:, :, :, :per_group].reshape(n, b, shapes[0], d)
        k, v = buffer[:, :, :, per_group], buffer[:, :, :, per_group + 1]
        out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal,
                     attention_bias=logits if kind == "diff_v2" else None, packed_seq_params=packed)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
        grads = [buffer.grad] + ([logits.grad] if kind == "diff_v2" else [])
        return [out.detach()] + grads + [p.grad for p in module.parameters()]

    want = run(eager)
    assert not flash_libraries
    got = run(flash)
    assert len(got) == len(want) >= 2
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        assert rel_err(g, w) < 1e-12
    entry = "varlen" if documents else "func"
    calls = [(library, e) for library, e, *_ in flash_libraries]
    assert set(calls) == {(backend, entry)}, flash_libraries
    if kind == "diff":
        assert len(calls) == (1 if backend == "flash_attn4" else 2)
        q_shape, k_shape, v_shape = flash_libraries[0][2:]
        tokens = (b * n,) if documents else (b, n)
        if backend == "flash_attn4":  # with GQA, K and V repeated to the query heads (the library's Hopper backward)
            assert q_shape == k_shape == tokens + (2 * heads, d) and v_shape == tokens + (2 * heads, 2 * d)
        else:
            assert q_shape == tokens + (2 * heads, d) and v_shape[-1] == d


@pytest.mark.parametrize("kv_heads,head_dim_v", [(4, 8), (2, 8), (4, 16)], ids=["equal", "gqa", "wide-v"])
def test_flash_attn4_custom_operator_passes_opcheck(kv_heads, head_dim_v, flash_libraries):
    """flash-attn-4 as torch custom operators (models/attention/flash_attn4_op.py, its stand-in's library under
    them): torch.library.opcheck's checks of the schema, the autograd registration, the declared output shapes and
    strides against the real call's, and AOT autograd's trace of forward and backward (what trainer.compile's graph
    records), on megatron-core's strided q; and the gradients equal the materialised map's in fp64."""
    from diff_transformer.models.attention.flash_attn4_op import flash_attn4_causal
    from flash_attn import _reference

    torch.manual_seed(kv_heads + head_dim_v)
    b, s, heads, d = 2, 11, 4, 8
    buffer = torch.randn(b, s, heads + kv_heads, d, dtype=torch.float64)
    q = buffer[:, :, :heads].requires_grad_(True)  # a strided view, as megatron's QKV projection leaves it
    k = buffer[:, :, heads:].clone().requires_grad_(True)
    v = torch.randn(b, s, kv_heads, head_dim_v, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(flash_attn4_causal, (q, k, v, 0.3))

    out, lse = flash_attn4_causal(q, k, v, 0.3)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert _reference.BACKWARD and all(g.is_contiguous() for g in got)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(heads // kv_heads, dim=2)) * 0.3
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    want_out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(heads // kv_heads, dim=2))
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    assert lse.dtype == torch.float32 and rel_err(lse, scores.logsumexp(-1).float()) < 1e-7
    assert rel_err(out, want_out) < 1e-12
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12


def test_flash_attn4_custom_operator_compiles_with_inductor(flash_libraries):
    """Inductor (the C++ backend here) compiles the operators into a graph with elementwise work on both sides, on
    megatron-core's strided q and DIFF V1's wide V, and gives eager's output and gradients: the declared output
    layouts are the ones inductor's generated code reads."""
    from diff_transformer.models.attention.flash_attn4_op import flash_attn4_causal
    from flash_attn import _reference

    def layer(buffer, v, scale):
        q, k = buffer[:, :, :4] * scale, buffer[:, :, 4:]  # 4 query heads against 2 key heads
        out, _ = flash_attn4_causal(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), 0.25)
        return (out[..., :8] - 0.3 * out[..., 8:]).square().sum(-1)

    torch.manual_seed(0)
    buffer = torch.randn(2, 13, 6, 8, requires_grad=True)
    v, scale = torch.randn(2, 13, 2, 16, requires_grad=True), torch.rand(8, requires_grad=True)
    grad = torch.randn(2, 13, 4)
    want_out = layer(buffer, v, scale)
    want = torch.autograd.grad(want_out, (buffer, v, scale), grad)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    got_out = compiled(buffer, v, scale)
    got = torch.autograd.grad(got_out, (buffer, v, scale), grad)
    assert len(_reference.BACKWARD) == 2  # eager's backward and the compiled graph's
    # measured: output 8.1e-8, gradients 0, 0 and 2.3e-7 (the scale's, a sum over every output) in fp32
    assert rel_err(got_out, want_out) < 1e-6
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-6
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)], ids=["H2-Hkv2", "H4-Hkv2-gqa", "H4-Hkv1-gqa"])
def test_library_layout_equals_eager_in_fp64(kind, heads, kv_heads):
    """DIFF's sdpa path (two calls of 2H query heads with equal head dims, V's halves repeated per head pair; GQA in
    map-major order) and V2's one call equal the materialised maps in fp64: outputs and every gradient, q, k, v,
    λ's vectors, the norm weight and V2's λ logits."""
    from diff_transformer.models.attention import DiffV2CoreAttention

    torch.manual_seed(heads * 10 + kv_heads)
    d, n, b = 8, 19, 2
    if kind == "diff":
        config = make_config(heads, kv_heads, d)
        make = lambda backend: DifferentialCoreAttention(config, 3, AttnMaskType.causal, backend=backend)  # noqa
        shapes = (2 * heads, 2 * kv_heads, 2 * kv_heads)
    else:
        config = TransformerConfig(num_layers=2, hidden_size=2 * heads * d, num_attention_heads=2 * heads,
                                   num_query_groups=kv_heads, kv_channels=d, use_cpu_initialization=True)
        make = lambda backend: DiffV2CoreAttention(config, 1, AttnMaskType.causal, backend=backend)  # noqa
        shapes = (2 * heads, kv_heads, kv_heads)
    eager, sdpa = make("eager").double(), make("sdpa").double()
    if kind == "diff":
        with torch.no_grad():
            eager.sublayer_norm.weight.uniform_(0.5, 1.5)
    sdpa.load_state_dict(eager.state_dict())
    tensors = [torch.randn(n, b, h, d, dtype=torch.float64) for h in shapes]
    if kind == "diff_v2":
        tensors.append(torch.randn(n, b, heads, dtype=torch.float64))  # λ's logits

    def run(module):
        inputs = [t.clone().requires_grad_(True) for t in tensors]
        bias = inputs[3] if kind == "diff_v2" else None
        out = module(*inputs[:3], None, attn_mask_type=AttnMaskType.causal, attention_bias=bias)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
        return [out.detach()] + [t.grad for t in inputs] + [p.grad for p in module.parameters()]

    got, want = run(sdpa), run(eager)
    assert len(got) == len(want) >= 4
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        assert rel_err(g, w) < 1e-12


def test_sdpa_calls_have_equal_head_dims_and_run_the_flash_kernel():
    """What torch's dispatcher picks for each SDPA call (torch._fused_sdp_choice): DIFF makes two calls of the
    baseline's shape (2H query heads of d, V d wide) and the baseline one; on a CPU both run torch's flash kernel,
    which needs equal head dims (DIFF's former calls with a 2d-wide V ran the materialising math kernel)."""
    from diff_transformer.models.attention.base import record_sdpa_kernels

    heads, d, n, b = 2, 16, 32, 2
    config = make_config(heads, heads, d)
    q, k, v = (torch.randn(n, b, 2 * heads, d) for _ in range(3))
    with record_sdpa_kernels() as diff_calls:
        DifferentialCoreAttention(config, 1, AttnMaskType.causal, backend="sdpa")(q, k, v, None)
    with record_sdpa_kernels() as vanilla_calls:
        VanillaCoreAttention(config, 1, AttnMaskType.causal, backend="sdpa")(q, k, v, None)
    shape = f"q {(b, 2 * heads, n, d)} k {(b, 2 * heads, n, d)} v {(b, 2 * heads, n, d)} float32"
    assert vanilla_calls == [f"flash: {shape}"]
    assert diff_calls == [f"flash: {shape}"] * 2


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["H2-Hkv2", "H4-Hkv2-gqa"])
def test_library_layout_gathers_v_grad_without_zero_fills(heads, kv_heads):
    """DIFF's library layout takes both halves of V from one copy, so its backward gathers V's gradient with one
    stack and one sum: no slice's backward (a zero-filled V-sized tensor and a scatter per half, then an add, which on
    an H100 were two memsets a layer in the profile's idle gaps), and the halves each call sees are contiguous."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from diff_transformer.models.attention.diff_v1 import library_layout

    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    d, n, b = 8, 5, 2
    v = torch.randn(b, n, 2 * kv_heads, d, requires_grad=True)
    q, k = torch.randn(b, n, 2 * heads, d), torch.randn(b, n, 2 * kv_heads, d)
    with Ops() as ops:
        _, _, values, pairs, _ = library_layout(q, k, v)
        (values[0] * 2 + values[1] * 3).sum().backward()
    assert all(t.is_contiguous() and t.shape == (b, n, 2 * kv_heads, d) for t in values)
    assert not {"slice_backward", "zeros", "zero_", "fill_"} & set(ops.seen), ops.seen
    # half c of group g at head 2g + m (interleaved) or m·G + g (grouped); V's gradient sums each head's share
    group_heads = [(g, m) for g in range(kv_heads) for m in range(2)] if pairs == "interleaved" else \
        [(g, m) for m in range(2) for g in range(kv_heads)]
    for head, (g, _) in enumerate(group_heads):
        for c in (0, 1):
            assert torch.equal(values[c][:, :, head], v[:, :, 2 * g + c])
    assert torch.equal(v.grad, torch.tensor([4.0, 6.0]).repeat(kv_heads).view(1, 1, -1, 1).expand_as(v))


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["H2-Hkv2", "H4-Hkv2"])
def test_fused_epilogue_in_the_model_matches_eager(heads, kv_heads):
    """DIFF's sdpa path with the fused Triton epilogue (Triton's interpreter on CPU) against eager, fp32."""
    torch.manual_seed(9)
    d, n, b = 16, 24, 2
    config = make_config(heads, kv_heads, d)
    eager = DifferentialCoreAttention(config, 2, AttnMaskType.causal, backend="eager")
    fused = DifferentialCoreAttention(config, 2, AttnMaskType.causal, backend="sdpa", epilogue="triton")
    with torch.no_grad():
        eager.sublayer_norm.weight.uniform_(0.5, 1.5)
    fused.load_state_dict(eager.state_dict())
    q, k, v = torch.randn(n, b, 2 * heads, d), torch.randn(n, b, 2 * kv_heads, d), torch.randn(n, b, 2 * kv_heads, d)
    out_e, grads_e, pgrads_e = _run(eager, q, k, v)
    out_f, grads_f, pgrads_f = _run(fused, q, k, v)
    assert out_f.is_contiguous()
    for got, want in zip([out_f] + grads_f + pgrads_f, [out_e] + grads_e + pgrads_e):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["H2-Hkv2", "H4-Hkv2"])
def test_triton_backend_matches_eager_values_and_grads(heads, kv_heads):
    """The fused kernel as the model's backend (Triton's interpreter on CPU)."""
    torch.manual_seed(4)
    assert_backend_matches_eager(DifferentialCoreAttention, "triton", heads, kv_heads, N=20, B=1, layer=3, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["diff", "vanilla"])
@pytest.mark.parametrize("backend", ["sdpa", "triton", "flash_attn", "flash_attn4", "combined"])
def test_gpu_backends_in_bf16_match_eager_in_fp32(kind, backend):
    """On a GPU, each backend in bf16 against the fp32 eager map on the same (bf16-rounded) inputs and weights."""
    from diff_transformer.training.backend_choice import installed

    if backend.startswith("flash_attn") and not installed(backend):
        pytest.skip(f"{backend}'s library is not installed")
    if kind == "vanilla" and backend in ("triton", "combined"):
        pytest.skip(f"{backend} is differential attention only")
    torch.manual_seed(5)
    heads, kv_heads, d, n, b = 4, 2, 64, 257, 2  # GQA, an odd N
    cls = DifferentialCoreAttention if kind == "diff" else VanillaCoreAttention
    config = make_config(heads, kv_heads, d)
    eager = cls(config, 2, AttnMaskType.causal, backend="eager").cuda()
    other = cls(config, 2, AttnMaskType.causal, backend=backend).cuda()
    other.load_state_dict(eager.state_dict())
    q = torch.randn(n, b, 2 * heads, d, device="cuda").bfloat16()
    k = torch.randn(n, b, 2 * kv_heads, d, device="cuda").bfloat16()
    v = torch.randn(n, b, 2 * kv_heads, d, device="cuda").bfloat16()
    out_e, grads_e, _ = _run(eager, q.float(), k.float(), v.float())
    out_o, grads_o, _ = _run(other, q, k, v)
    assert out_o.dtype == torch.bfloat16
    # the CPU sdpa path in bf16 measured 3.5e-3 (output) and at most 4.8e-3 (gradients) here: 4-6x room for GPU kernels
    assert rel_err(out_o, out_e) < 2e-2
    for got, want in zip(grads_o, grads_e):
        assert rel_err(got, want) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["diff", "vanilla"])
def test_gpu_flash_attn4_compiled_matches_its_eager_run(kind):
    """On a GPU, the core attention on flash_attn4 under torch.compile (inductor, the library's custom operators in
    the graph, DIFF's layout and epilogue fused around them) against the same module eagerly, bf16, forward and
    backward: the same library kernels, so only the fused elementwise work differs."""
    from diff_transformer.training.backend_choice import installed

    if not installed("flash_attn4"):
        pytest.skip("flash_attn4's library is not installed")
    torch.manual_seed(6)
    heads, d, n, b = 4, 64, 257, 2
    cls = DifferentialCoreAttention if kind == "diff" else VanillaCoreAttention
    module = cls(make_config(heads, heads, d), 2, AttnMaskType.causal, backend="flash_attn4").cuda().bfloat16()
    q, k, v = (torch.randn(n, b, 2 * heads, d, device="cuda").bfloat16() for _ in range(3))
    out_e, grads_e, _ = _run(module, q, k, v)
    torch._dynamo.reset()
    out_c, grads_c, _ = _run(torch.compile(module, fullgraph=True), q, k, v)
    torch._dynamo.reset()
    assert rel_err(out_c, out_e) < 1e-2  # bf16 roundings of the fused epilogue against eager's
    for got, want in zip(grads_c, grads_e):
        assert rel_err(got, want) < 2e-2


def test_output_layout_gradient_copies_only_a_different_memory_layout():
    """dO is handed on in O's strides: as it came when they are equal, as a view when they differ only along a
    dimension of size 1 (the micro-batch of one: the same memory, no copy), copied when the memory order differs."""
    from types import SimpleNamespace

    from diff_transformer.models.attention.base import _GradInOutputLayout

    out = torch.randn(16, 1, 4, 8).permute(1, 2, 0, 3)  # (b, heads, s, d) in megatron's [s, b, heads, d] order
    ctx = SimpleNamespace(layout=(out.shape, out.stride()))
    same_memory = torch.randn(1, 16, 4, 8).permute(0, 2, 1, 3)  # b's stride differs, b = 1
    assert same_memory.stride() != out.stride()
    handed = _GradInOutputLayout.backward(ctx, same_memory)
    assert handed.stride() == out.stride() and handed.data_ptr() == same_memory.data_ptr()
    assert torch.equal(handed, same_memory)
    other_order = torch.randn(1, 4, 16, 8)  # (b, heads, s, d) contiguous: s and heads swapped in memory
    copied = _GradInOutputLayout.backward(ctx, other_order)
    assert copied.stride() == out.stride() and copied.data_ptr() != other_order.data_ptr()
    assert torch.equal(copied, other_order)
    assert _GradInOutputLayout.backward(ctx, handed) is handed


@pytest.mark.parametrize("kind,epilogue", [("diff", "unfused"), ("diff", "compile"), ("diff_v2", "unfused")])
def test_sdpa_backward_receives_its_gradient_in_the_output_layout(kind, epilogue, monkeypatch):
    """Every library attention call's backward gets dO in O's memory layout (O follows megatron's [s, b, heads, d]
    order): the unfused and compiled DIFF epilogues hand it on in (b, s, heads, d) order, with which cuDNN's
    backward computed wrong gradients on an H100 (benchmarks/results/core_attention_d128_NVIDIA-H100-80GB-HBM3_*)."""
    import torch.nn.functional as F

    from diff_transformer.models.attention import base
    from tests.test_context_parallel import differential_core_attention

    layouts = []
    library_call = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        out = library_call(q, k, v, **kwargs)
        out.register_hook(lambda grad, stride=out.stride(): layouts.append((stride, grad.stride())))
        return out

    monkeypatch.setattr(base.F, "scaled_dot_product_attention", recording)
    module = differential_core_attention(kind, "sdpa", epilogue)
    s, b = 24, 2
    heads = (4, 4, 4) if kind == "diff" else (4, 2, 2)
    tensors = [torch.randn(s, b, h, 16, requires_grad=True) for h in heads]
    bias = torch.randn(s, b, 2) if kind == "diff_v2" else None
    out = module(*tensors, None, attention_bias=bias)
    out.backward(torch.randn_like(out))
    assert layouts and all(out_stride == grad_stride for out_stride, grad_stride in layouts), layouts
