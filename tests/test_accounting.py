"""FLOP accounting (MFU's numerator) against counts done by hand."""

from types import SimpleNamespace

import pytest

from diff_transformer.training.accounting import attention_flops_per_token, model_flops_per_token


def debug_cfg(attention):
    model = SimpleNamespace(attention=attention, num_layers=2, hidden_size=64, num_heads=2, head_dim=None,
                            num_kv_heads=None, topk=None, seq_length=64)
    return SimpleNamespace(model=model)


@pytest.mark.parametrize("attention, per_layer", [
    # DIFF: 2 maps x 2 heads; scores over d=16 and weighted sums over 2d=32; 2 FLOPs a MAC; 32 keys on average
    ("diff", 2 * 2 * 2 * (16 + 32) * 32),
    # baseline: 1 map x 4 heads of 16, scores and weighted sums
    ("vanilla", 1 * 4 * 2 * (16 + 16) * 32),
])
def test_attention_flops_by_hand(attention, per_layer):
    assert attention_flops_per_token(debug_cfg(attention)) == 2 * per_layer


def test_model_flops_add_six_per_weight_and_the_attention_products():
    non_embedding, vocab = 100_000, 4096
    # DIFF backward per pair and layer: dV and dP over the shared 2d-wide V (2 heads x 2 x 32 MACs), dQ and dK per
    # map (2 maps x 2 heads x 2 x 16): 256 MACs, the baseline's 4 heads x 2 x (16 + 16)
    diff_backward = 2 * 2 * (2 * 2 * 32 + 2 * 2 * 2 * 16) * 32
    expected = 6 * (non_embedding + vocab * 64) + 2 * 2 * 2 * 2 * 48 * 32 + diff_backward
    assert model_flops_per_token(debug_cfg("diff"), non_embedding, vocab) == expected
    vanilla = 6 * (non_embedding + vocab * 64) + 3 * 2 * (4 * 2 * 32 * 32)
    assert model_flops_per_token(debug_cfg("vanilla"), non_embedding, vocab) == vanilla
    # attention alone: DIFF forward 1.5x the baseline's (two maps weight the 2d-wide V), backward equal, 14:12 overall
    diff_attention = model_flops_per_token(debug_cfg("diff"), 0, 0)
    assert diff_attention / model_flops_per_token(debug_cfg("vanilla"), 0, 0) == 14 / 12


def test_other_kinds_count_their_own_heads():
    cfg = debug_cfg
    # diff_v2: one map over 2H = 4 query heads of d = 16; vanilla_wide: H = 2 heads of 2d = 32
    assert attention_flops_per_token(cfg("diff_v2")) == 2 * (1 * 4 * 2 * (16 + 16) * 32)
    assert attention_flops_per_token(cfg("vanilla_wide")) == 2 * (1 * 2 * 2 * (32 + 32) * 32)
