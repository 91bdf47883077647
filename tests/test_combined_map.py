"""DIFF V1's ``combined`` backend (models/attention/combined_map.py): its hand-written backward against autograd over
the eager reference (which tests/test_attention.py holds to the paper's equations), and the CPU rule by which
``model.attention_backend=auto`` takes it."""

import pytest
import torch

from diff_transformer.compat import apply_cpu_patches
from diff_transformer.models.attention import DifferentialCoreAttention
from diff_transformer.models.attention import combined_map
from diff_transformer.models.documents import packed_documents
from tests.test_config import compose_cfg

apply_cpu_patches()

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(backend, heads, kv_heads, dtype, documents=False, rounded=None, **options):
    """Output and every gradient (q, k, v, then the parameters) of one layer-3 DIFF core attention, fixed seeds;
    ``rounded``: the parameters, inputs and output gradient rounded to that dtype first."""
    d, s, b = 8, 24, 2
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=2 * heads * d, num_attention_heads=2 * heads,
                               num_query_groups=2 * kv_heads, kv_channels=d, use_cpu_initialization=True)
    module = DifferentialCoreAttention(config, 3, AttnMaskType.causal, backend=backend, **options)
    if module.sublayer_norm is not None:
        with torch.no_grad():
            module.sublayer_norm.weight.uniform_(0.5, 1.5)
    rounded = rounded or dtype
    module = module.to(rounded).to(dtype)  # the same parameters in every dtype
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, b, heads, d, generator=g).to(rounded).to(dtype).requires_grad_(True)
               for heads in (2 * heads, 2 * kv_heads, 2 * kv_heads))
    # three documents a sample, at other places in each
    ids = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * 11 + [1] * 2 + [2] * 11]) if documents else None
    out = module(q, k, v, None, packed_seq_params=packed_documents(ids, None, s) if documents else None)
    out.backward(torch.randn(out.shape, generator=g).to(rounded).to(dtype))
    return out.detach(), [q.grad, k.grad, v.grad] + [p.grad for p in module.parameters()]


CASES = {
    "H2-Hkv2": dict(heads=2, kv_heads=2),
    "H4-Hkv2-gqa": dict(heads=4, kv_heads=2),
    "H4-Hkv1-gqa-documents": dict(heads=4, kv_heads=1, documents=True),
    "no-sublayer-norm": dict(heads=2, kv_heads=2, sublayer_norm=False),
    "fixed-lambda": dict(heads=2, kv_heads=2, lambda_learnable=False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_combined_equals_eager_in_fp64_and_fp32(case):
    """fp64: at rounding (measured at most 1.7e-15 relative over the output and every gradient); fp32 against the
    fp64 reference: measured at most 8.8e-7."""
    want_out, want = run("eager", dtype=torch.float64, **case)
    assert len(want) == 3 + 4 * case.get("lambda_learnable", True) + case.get("sublayer_norm", True)
    assert all(g.abs().sum() > 0 for g in want)
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 3e-6)):
        got_out, got = run("combined", dtype=dtype, **case)
        assert got_out.dtype == dtype and rel_err(got_out, want_out) < tol
        for i, (x, y) in enumerate(zip(got, want)):
            assert x.dtype == dtype and rel_err(x, y) < tol, (dtype, i)


def test_combined_in_bf16_returns_bf16_computed_in_fp32():
    """bf16 inputs and weights: the map in fp32, the output and gradients rounded once to bf16 (measured 1.9e-3
    relative at most against fp64 on the same rounded values)."""
    want_out, want = run("eager", heads=4, kv_heads=2, dtype=torch.float64, rounded=torch.bfloat16)
    got_out, got = run("combined", heads=4, kv_heads=2, dtype=torch.bfloat16)
    assert got_out.dtype == torch.bfloat16 and rel_err(got_out, want_out) < 8e-3
    for x, y in zip(got, want):
        assert x.dtype == torch.bfloat16 and rel_err(x, y) < 8e-3


def test_auto_without_a_gpu_takes_combined_for_diff_at_short_sequences():
    from diff_transformer.training.backend_choice import cpu_backend

    chosen = cpu_backend(compose_cfg("model=debug"))
    assert chosen == {"backend": "combined", "how": f"no GPU; 64 tokens a rank, at most {combined_map.MAX_SEQ}"}
    longer = cpu_backend(compose_cfg("model=debug", f"model.seq_length={2 * combined_map.MAX_SEQ}"))
    assert longer["backend"] == "sdpa" and "over the combined map's" in longer["how"]
    # per rank: context parallelism has no combined ring (sdpa's), and a stage's maps must stay small
    assert cpu_backend(compose_cfg("model=debug", "parallel.cp=2"))["backend"] == "sdpa"
    huge = cpu_backend(compose_cfg("model=debug", "trainer.micro_batch_size=16384", "trainer.global_batch_size=16384"))
    assert huge["backend"] == "sdpa" and "GiB" in huge["how"]
    for kind in ("vanilla", "diff_v2", "dex"):  # every other kind: sdpa, as before
        assert cpu_backend(compose_cfg("model=debug", f"model.attention={kind}")) == {"backend": "sdpa",
                                                                                      "how": "no GPU"}


def test_combined_is_diff_v1s_alone_and_never_timed_on_a_gpu():
    from diff_transformer.config import validate
    from diff_transformer.training import backend_choice

    validate(compose_cfg("model=debug", "model.attention_backend=combined"), 1)
    with pytest.raises(ValueError, match="model.attention=diff_v2 does not run on model.attention_backend=combined"):
        validate(compose_cfg("model=debug", "model.attention=diff_v2", "model.attention_backend=combined"), 1)
    assert "combined" not in backend_choice.candidates(compose_cfg("model=debug").model)


def test_memory_plan_counts_the_maps_combined_keeps():
    from diff_transformer.training.accounting import core_attention_bytes_per_token

    model = compose_cfg("model=debug").model  # 2 heads of 2d = 32, 64 tokens
    kept, _ = core_attention_bytes_per_token(model, "combined", "cpu", 4)
    # A1 and A2 of 2 heads over 64 keys, q and k (4 heads of 16) copied, x (2 heads of 32), in fp32
    assert kept == (2 * 2 * 64 + 2 * 64 + 64) * 4


def test_compiled_combined_keeps_what_eager_keeps():
    """Under trainer.compile the layer's graph keeps for the backward what the eager autograd node keeps (the plan
    above): the backward's combined map is its own expression, so AOT autograd does not merge it with the forward's
    and keep that map too (a third fp32 map a layer: 69.6 GiB peak against 60.2 planned for 830m on an H100,
    benchmarks/results/train_throughput_830m_combined_compile-on_NVIDIA-H100-80GB-HBM3_2026-11-27c.md). AOT
    autograd's default partition (aot_eager) keeps what the backward reads; inductor's, the same here."""
    heads, d, s, b = 4, 16, 128, 2
    config = TransformerConfig(num_layers=4, hidden_size=2 * heads * d, num_attention_heads=2 * heads,
                               num_query_groups=2 * heads, kv_channels=d, use_cpu_initialization=True)
    module = DifferentialCoreAttention(config, 2, AttnMaskType.causal, backend="combined")

    def kept_bytes(fn):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        torch.manual_seed(0)
        q, k, v = (torch.randn(s, b, 2 * heads, d, requires_grad=True) for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        return sum(storages.values())

    eager = kept_bytes(module)
    torch._dynamo.reset()
    compiled = kept_bytes(torch.compile(module, backend="aot_eager"))
    torch._dynamo.reset()
    one_map = b * heads * s * s * 4
    # measured: 1,577,356 bytes eager, 1,577,368 compiled (2,101,656 with the forward's addcmul in the backward)
    assert compiled - eager < one_map // 8, (compiled, eager, one_map)
