"""The map protocol of every attention kind: the weights a kind exposes (``combined``) applied to V reproduce its
forward, components are causal distributions, a subset of query rows equals the same rows of the full maps, and the
capture hooks see every layer of a built model without changing its output."""

import pytest
import torch

from diff_transformer.compat import apply_cpu_patches

apply_cpu_patches()

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from diff_transformer.models.attention import (  # noqa: E402
    CoreAttentionBase,
    DifferentialCoreAttention,
    DiffV2CoreAttention,
    SignedMaskCoreAttention,
    TopKCoreAttention,
    VanillaCoreAttention,
    VanillaSublnCoreAttention,
)
from diff_transformer.models.attention_maps import capture_attention  # noqa: E402

CAUSAL = AttnMaskType.causal
B, N, D = 2, 11, 8


def config(q_heads, kv_heads, d=D):
    return TransformerConfig(num_layers=3, hidden_size=q_heads * d, num_attention_heads=q_heads,
                             num_query_groups=kv_heads, kv_channels=d, use_cpu_initialization=True,
                             add_bias_linear=False)


def tensors(q_heads, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, B, h, D, generator=g) for h in (q_heads, kv_heads, kv_heads)]


def apply_to_values(weights, value, value_group):
    """weights (b, heads, s, s) applied to the value head ``value_group(h)`` of each head h -> (s, b, heads, dv)."""
    v = value.permute(1, 2, 0, 3).float()  # (b, kv, s, dv)
    out = torch.stack([weights[:, h] @ v[:, value_group(h)] for h in range(weights.shape[1])], dim=1)
    return out.permute(2, 0, 1, 3)


def softmax_kind(name):
    heads, kv = 4, 2
    cfg = config(heads, kv)
    module = {
        "vanilla": lambda: VanillaCoreAttention(cfg, 1, CAUSAL, backend="eager"),
        "vanilla_subln": lambda: VanillaSublnCoreAttention(cfg, 2, CAUSAL, backend="eager"),
        "topk": lambda: TopKCoreAttention(cfg, 1, CAUSAL, backend="eager", topk=3),
        "signed_mask": lambda: SignedMaskCoreAttention(cfg, 1, CAUSAL, backend="eager", max_distance=16),
    }[name]()
    if name == "signed_mask":
        with torch.no_grad():
            module.mask_logits.normal_(0.0, 2.0)
    return module, heads, kv


@pytest.mark.parametrize("name", ["vanilla", "vanilla_subln", "topk", "signed_mask"])
def test_softmax_kinds_expose_the_weights_they_apply(name):
    module, heads, kv = softmax_kind(name)
    q, k, v = tensors(heads, kv)
    maps = module.attention_maps(q, k, v)
    assert set(maps.components) == {"A"} and maps.lam is None and not maps.differential
    out = apply_to_values(maps.combined, v, lambda h: h // (heads // kv))
    if name == "vanilla_subln":
        out = module.sublayer_norm(out) * (1 - module.lambda_init)
    expected = module(q, k, v, None, attn_mask_type=CAUSAL)
    torch.testing.assert_close(out.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)
    check_causal_distributions(maps)


@pytest.mark.parametrize("kv_groups", [2, 1], ids=["MHA", "GQA"])
def test_diff_exposes_a1_minus_lambda_a2(kv_groups):
    heads = 2  # differential heads: 4 softmax heads
    module = DifferentialCoreAttention(config(2 * heads, 2 * kv_groups), 3, CAUSAL, backend="eager")
    q, k, v = tensors(2 * heads, 2 * kv_groups)
    maps = module.attention_maps(q, k, v)
    assert maps.differential and maps.combined.shape == (B, heads, N, N)
    lam = module.lambda_full()
    torch.testing.assert_close(maps.combined, maps.components["A1"] - lam * maps.components["A2"])
    # V of group g is the value heads 2g and 2g+1 side by side (2d wide)
    v_wide = v.reshape(N, B, kv_groups, 2 * D)
    out = apply_to_values(maps.combined, v_wide, lambda h: h // (heads // kv_groups))
    out = module.sublayer_norm(out) * module.output_scale
    expected = module(q, k, v, None, attn_mask_type=CAUSAL)
    torch.testing.assert_close(out.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)
    check_causal_distributions(maps)


def test_diff_v2_exposes_per_token_lambda():
    q_heads, kv = 4, 1
    module = DiffV2CoreAttention(config(q_heads, kv), 1, CAUSAL, backend="eager")
    q, k, v = tensors(q_heads, kv)
    bias = torch.randn(N, B, q_heads // 2, generator=torch.Generator().manual_seed(5))
    maps = module.attention_maps(q, k, v, attention_bias=bias)
    assert maps.differential and maps.lam.shape == (B, q_heads // 2, N, 1)
    out = apply_to_values(maps.combined, v, lambda h: 2 * h // (q_heads // kv))
    expected = module(q, k, v, None, attn_mask_type=CAUSAL, attention_bias=bias)
    torch.testing.assert_close(out.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)
    check_causal_distributions(maps)


def check_causal_distributions(maps):
    future = ~maps.key_mask()
    for probs in maps.components.values():
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
        assert (probs >= 0).all() and (probs[..., future] == 0).all()
    for logits in maps.logits.values():
        assert torch.isneginf(logits[..., future]).all() and torch.isfinite(logits[..., ~future]).all()
    assert (maps.combined[..., future] == 0).all()


@pytest.mark.parametrize("name", ["diff", "vanilla", "topk", "signed_mask"])
def test_a_subset_of_rows_equals_those_rows_of_the_full_maps(name):
    if name == "diff":
        module, heads, kv = DifferentialCoreAttention(config(4, 2), 2, CAUSAL, backend="eager"), 4, 2
    else:
        module, heads, kv = softmax_kind(name)
    q, k, v = tensors(heads, kv, seed=1)
    full = module.attention_maps(q, k, v)
    rows = torch.tensor([0, 4, 10])
    part = module.attention_maps(q, k, v, rows=rows)
    assert part.rows.tolist() == [0, 4, 10]
    torch.testing.assert_close(part.combined, full.combined[:, :, rows])
    for name_ in full.components:
        torch.testing.assert_close(part.components[name_], full.components[name_][:, :, rows])


def test_a_kind_without_the_protocol_says_so():
    class Plain(VanillaCoreAttention):
        attention_maps = CoreAttentionBase.attention_maps

    module = Plain(config(4, 2), 1, CAUSAL, backend="eager")
    with pytest.raises(NotImplementedError, match="Plain does not expose its attention maps"):
        module.attention_maps(*tensors(4, 2))


@pytest.mark.parametrize("kind", ["diff", "vanilla", "diff_v2", "vanilla_subln", "vanilla_wide", "topk", "signed_mask"])
def test_capture_sees_every_layer_and_leaves_the_forward_unchanged(kind, megatron_single_process):
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.models.gpt import build_model_chunk

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "debug", "attention": kind, "attention_backend": "eager", "num_layers": 2, "hidden_size": 64,
                  "num_heads": 2, "ffn_hidden_size": 176, "seq_length": 16},
        "trainer": {"max_steps": 1, "global_batch_size": 1},
    }))
    model = build_model_chunk(cfg, vocab_size=128).eval()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        plain = model(tokens, positions, None)
        seen = []
        with capture_attention([model], lambda layer, maps_for: seen.append((layer, maps_for()))):
            captured = model(tokens, positions, None)
        after = model(tokens, positions, None)
    assert torch.equal(plain, captured) and torch.equal(plain, after)
    assert [layer for layer, _ in seen] == [1, 2]
    for _, maps in seen:
        assert maps.combined.shape[0] == 2 and maps.combined.shape[-2:] == (16, 16)
        assert maps.differential == (kind in ("diff", "diff_v2"))
