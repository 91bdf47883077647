"""FLOP accounting (MFU's numerator) against counts done by hand."""

from types import SimpleNamespace

import pytest

from diff_transformer.training.accounting import attention_flops_per_token, model_flops_per_token


def debug_cfg(attention):
    model = SimpleNamespace(attention=attention, num_layers=2, hidden_size=64, num_heads=2, head_dim=None,
                            seq_length=64)
    return SimpleNamespace(model=model)


@pytest.mark.parametrize("attention, per_layer", [
    # DIFF: 2 maps x 2 heads; scores over d=16 and weighted sums over 2d=32; 2 FLOPs a MAC; 32 keys on average
    ("diff", 2 * 2 * 2 * (16 + 32) * 32),
    # baseline: 1 map x 4 heads of 16, scores and weighted sums
    ("vanilla", 1 * 4 * 2 * (16 + 16) * 32),
])
def test_attention_flops_by_hand(attention, per_layer):
    assert attention_flops_per_token(debug_cfg(attention)) == 2 * per_layer


def test_model_flops_add_six_per_weight_and_three_times_attention():
    cfg = debug_cfg("diff")
    non_embedding, vocab = 100_000, 4096
    expected = 6 * (non_embedding + vocab * 64) + 3 * 2 * (2 * 2 * 2 * 48 * 32)
    assert model_flops_per_token(cfg, non_embedding, vocab) == expected
    # DIFF's attention costs 1.5x the baseline's at the same width: the 2d-wide V is weighted by two maps
    assert attention_flops_per_token(cfg) == 1.5 * attention_flops_per_token(debug_cfg("vanilla"))
