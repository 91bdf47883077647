"""Known answers of the attention metrics (diff_transformer/attention_metrics.py)."""

import math

import pytest
import torch

from diff_transformer import attention_metrics as am

M = 16


def uniform_causal(n):
    mask = am.causal_key_mask(n, n)
    return mask.float() / mask.sum(-1, keepdim=True), mask


def test_uniform_rows_have_entropy_log_m_and_gini_zero():
    maps = torch.full((3, 5, M), 1.0 / M)
    torch.testing.assert_close(am.entropy(maps), torch.full((3, 5), math.log(M)))
    torch.testing.assert_close(am.gini(maps), torch.zeros(3, 5), atol=1e-6, rtol=0)
    torch.testing.assert_close(am.top_fraction_mass(maps, 0.25), torch.full((3, 5), 0.25))


def test_one_hot_rows_have_entropy_zero_and_gini_one_minus_one_over_m():
    maps = torch.zeros(2, 4, M)
    maps[..., 3] = 1.0
    torch.testing.assert_close(am.entropy(maps), torch.zeros(2, 4))
    torch.testing.assert_close(am.gini(maps), torch.full((2, 4), 1 - 1 / M))
    torch.testing.assert_close(am.top_k_mass(maps, 1), torch.ones(2, 4))
    torch.testing.assert_close(am.top_fraction_mass(maps, 0.01), torch.ones(2, 4))


def test_gini_of_a_known_row():
    # x = (0, 0, 1, 3): G = sum_i (2i - n - 1) x_(i) / (n sum x) = ((1)*1 + (3)*3) / (4 * 4) = 10/16
    row = torch.tensor([[3.0, 0.0, 1.0, 0.0]]) / 4
    torch.testing.assert_close(am.gini(row), torch.tensor([10 / 16]))


def test_causal_masking_is_respected():
    maps, mask = uniform_causal(M)
    # row i is uniform over its i + 1 visible keys: entropy log(i + 1), Gini 0 over the visible keys only
    torch.testing.assert_close(am.entropy(maps), torch.log(torch.arange(1, M + 1).float()))
    torch.testing.assert_close(am.gini(maps, mask), torch.zeros(M), atol=1e-6, rtol=0)
    assert am.gini(maps)[0] > 0.9  # without the mask the future keys would count as zeros
    # the top 50% of row i's visible keys hold ceil((i + 1) / 2) / (i + 1) of its mass
    n = torch.arange(1, M + 1).float()
    torch.testing.assert_close(am.top_fraction_mass(maps, 0.5, mask), torch.ceil(n / 2) / n)
    shifted = maps.clone()
    shifted[~mask] = -1.0  # mass on future keys would be counted without the mask
    assert (am.negative_entries(shifted, mask)["fraction"] == 0).all()


def test_all_mass_on_the_first_token_is_a_sink_in_every_head():
    maps = torch.zeros(2, 3, 8, 8)
    maps[..., 0] = 1.0
    assert am.sink_rate(maps).item() == 1.0
    assert am.sink_heads(maps).all()
    # uniform causal rows: the mean first-token mass over 8 rows is H_8 / 8 = 0.34 (row 0 sees only key 0), a sink
    # by this definition at 8 tokens but not at 64 (H_64 / 64 = 0.07); a uniform map over all keys never is
    uniform8, uniform64 = uniform_causal(8)[0], uniform_causal(64)[0]
    torch.testing.assert_close(am.first_token_mass(uniform8).mean(), torch.tensor(sum(1 / i for i in range(1, 9)) / 8))
    assert am.sink_rate(uniform8.expand(2, 3, 8, 8)).item() == 1.0
    assert am.sink_rate(uniform64.expand(1, 2, 64, 64)).item() == 0.0
    assert am.sink_rate(torch.full((1, 2, 8, 8), 1 / 8)).item() == 0.0


def test_rank_r_matrix_has_effective_rank_r():
    g = torch.Generator().manual_seed(0)
    for r in (1, 2, 5):
        u, _ = torch.linalg.qr(torch.randn(32, r, generator=g))
        v, _ = torch.linalg.qr(torch.randn(24, r, generator=g))
        assert am.effective_rank(u @ v.T).item() == pytest.approx(r, rel=1e-4)
    # unequal singular values: between 1 and the rank
    x = torch.randn(20, 3, generator=g) @ torch.randn(3, 20, generator=g)
    assert 1 < am.effective_rank(x).item() < 3 + 1e-4
    assert am.effective_rank(torch.eye(10)).item() == pytest.approx(10, rel=1e-5)
    assert am.effective_rank(torch.zeros(4, 4)).item() == 0


def test_similarity_of_rows_on_a_key_subset():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    relevant = torch.tensor([True, True, False, False])
    torch.testing.assert_close(am.row_cosine(p, q, relevant), torch.tensor([1.0]))  # same direction on the subset
    torch.testing.assert_close(am.row_kl(p, q, relevant), torch.tensor([0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(am.row_kl(p, q), torch.tensor([math.log(2)]))
    assert math.isnan(am.row_kl(p, q, ~relevant).item())  # p has no mass there
    torch.testing.assert_close(am.row_cosine(p, p), torch.tensor([1.0]))


def test_negative_entries_of_a_differential_map():
    a1 = torch.tensor([[0.6, 0.3, 0.1]])
    a2 = torch.tensor([[0.2, 0.2, 0.6]])
    w = a1 - 0.5 * a2  # 0.5, 0.2, -0.2
    neg = am.negative_entries(w)
    torch.testing.assert_close(neg["fraction"], torch.tensor([1 / 3]))
    torch.testing.assert_close(neg["mass"], torch.tensor([0.2]))
    torch.testing.assert_close(neg["relative_mass"], torch.tensor([0.2 / 0.9]))
    torch.testing.assert_close(am.normalized_magnitude(w), torch.tensor([[0.5, 0.2, 0.2]]) / 0.9)


def test_magnitude_profile():
    x = torch.cat([torch.full((200,), 1.0), torch.tensor([-50.0, 7.0, float("-inf")])])
    profile = am.magnitude_profile(x, ks=(1, 2, 10))
    assert profile == {"top1": 50.0, "top2": 7.0, "top10": 1.0, "median": 1.0}


def test_metrics_take_low_precision_maps_and_return_fp32():
    maps = torch.full((2, 8), 1 / 8, dtype=torch.bfloat16)
    assert am.entropy(maps).dtype == torch.float32 and am.gini(maps).dtype == torch.float32
