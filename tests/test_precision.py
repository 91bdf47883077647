"""bf16 the megatron way: every weight and activation in bf16 (the optimizer keeps fp32 main weights), λ and the λ·A2
subtraction computed in fp32, every norm's weight in the activations' dtype (no "Mismatch dtype between input and
weight" fallback)."""

import warnings

import pytest
import torch

from diff_transformer.models.attention import DifferentialCoreAttention
from diff_transformer.models.gpt import build_model_chunk
from diff_transformer.models.layer_specs import ATTENTION_KINDS
from diff_transformer.models.norms import RMSNorm
from tests.test_config import compose_cfg


@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
def test_a_bf16_model_has_only_bf16_weights_and_computes_lambda_in_fp32(megatron_single_process, kind):
    """megatron-core's mixed-precision optimizer maps its checkpointed state to the model's bf16 weights only: one
    fp32 weight in a bf16 model (λ once was) breaks the first checkpoint save on a GPU."""
    dex = ["model.dex.select=list", "model.dex.heads=[[0],[1]]"] if kind == "dex" else []
    cfg = compose_cfg("model=debug", "model.vocab_size=256", f"model.attention={kind}", *dex)
    model = build_model_chunk(cfg, 256, torch.bfloat16)
    assert {name: p.dtype for name, p in model.named_parameters() if p.dtype != torch.bfloat16} == {}
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, torch.nn.RMSNorm))]
    # per layer: input and pre-MLP; the final norm; the sub-layer norms of the kinds that have them
    assert len(norms) >= 2 * 2 + 1
    assert {m.weight.dtype for m in norms} == {torch.bfloat16}
    if kind == "diff":
        attn = [m for m in model.modules() if isinstance(m, DifferentialCoreAttention)]
        assert attn and all(m.lambda_full().dtype == torch.float32 for m in attn)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(tokens, positions, None)
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)]  # torch's unfused fallback
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_sdpa_subtracts_in_fp32(megatron_single_process):
    """bf16 inputs: the sdpa backend's bf16 outputs (each d-wide half of V in its own call) are combined as
    o1 − λ·o2 and multiplied by (1 − λ_init) in fp32, and rounded once."""
    import torch.nn.functional as F

    cfg = compose_cfg("model=debug")
    model = build_model_chunk(cfg, 128, torch.float32)
    attn = next(m for m in model.modules() if isinstance(m, DifferentialCoreAttention))
    attn.sublayer_norm = None  # compare the difference itself
    attn.lambda_init = 0.9  # λ = 0.9 is no bf16 number: a bf16 λ·o2 would be off by 0.2% of o2 before subtracting
    attn.output_scale = 1 - 0.9
    for p in attn.lambda_parameters():
        p.data.zero_()
    g = torch.Generator().manual_seed(0)
    s, b, heads, d = 32, 2, 4, 16
    q, k, v = (torch.randn(s, b, heads, d, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        out = attn(q, k, v)
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # value heads 2g, 2g+1: the halves of group g's V
        o1, o2 = (
            torch.cat([F.scaled_dot_product_attention(qh[:, i::2], kh[:, i::2], vh[:, c::2], is_causal=True)
                       for c in (0, 1)], dim=-1)
            for i in (0, 1)
        )
    expected = ((o1.float() - 0.9 * o2.float()) * (1 - 0.9)).bfloat16()  # DIFF's (1 − λ_init) before the rounding
    expected = expected.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
