"""flash-attn-4's Hopper tiles with V wider than Q·K (models/attention/flash_attn4_tiles.py): the shared-memory count
against what an H100 reported, the tiles chosen where the library's do not fit, and DIFF V1's calls taking them (the
library's stand-in, tests/flash_stand_in.py, with its sm_90 tile choices)."""

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from diff_transformer.models.attention import DifferentialCoreAttention
from diff_transformer.models.attention.flash_attn4_tiles import (
    SM90_SHARED_MEMORY,
    backward_shared_memory,
    fit_wide_v_tiles,
    forward_shared_memory,
)
from tests.flash_stand_in import installed
from tests.test_attention import make_config


@pytest.fixture
def interface():
    with installed():
        from flash_attn.cute import interface

        yield interface


def test_the_count_is_what_an_h100_refused_and_what_it_ran(interface):
    """The two launches an H100 refused (benchmarks/results/gpu_run_NVIDIA-H100-80GB-HBM3_2026-11-27.md: the bytes
    in the refusals), to the byte, and the library's tiles that ran there (the baseline at d = 96 and 128 both ways,
    DIFF's forward at (128, 256)) within an sm_90 block's shared memory."""
    fwd, bwd = interface._tile_size_fwd_sm90, interface._tile_size_bwd_sm90
    assert forward_shared_memory(96, 192, fwd(96, 192, True, False)) == 234_496
    assert backward_shared_memory(128, 256, bwd(128, 256, True, False)) == 264_192
    ran = [forward_shared_memory(d, d, fwd(d, d, True, False)) for d in (96, 128)]
    ran += [backward_shared_memory(d, d, bwd(d, d, True, False)) for d in (96, 128)]
    ran.append(forward_shared_memory(128, 256, fwd(128, 256, True, False)))
    assert max(ran) <= SM90_SHARED_MEMORY, ran


def test_wide_v_gets_tiles_that_fit_and_every_other_shape_the_librarys(interface):
    library = {name: getattr(interface, name) for name in ("_tile_size_fwd_sm90", "_tile_size_bwd_sm90")}
    assert fit_wide_v_tiles("flash_attn.cute.interface")
    fwd, bwd = interface._tile_size_fwd_sm90, interface._tile_size_bwd_sm90
    assert fit_wide_v_tiles("flash_attn.cute.interface") and interface._tile_size_fwd_sm90 is fwd  # wrapped once
    for d in (64, 96, 128):
        for name, wrapped in (("_tile_size_fwd_sm90", fwd), ("_tile_size_bwd_sm90", bwd)):
            assert wrapped(d, d, True, False) == library[name](d, d, True, False)  # equal dims: the library's
        assert forward_shared_memory(d, 2 * d, fwd(d, 2 * d, True, False)) <= SM90_SHARED_MEMORY
        assert backward_shared_memory(d, 2 * d, bwd(d, 2 * d, True, False)) <= SM90_SHARED_MEMORY
    # where the library's own tile fits, it stays; where not, the first smaller one that fits
    assert fwd(128, 256, True, False) == library["_tile_size_fwd_sm90"](128, 256, True, False)
    assert bwd(96, 192, True, False) == library["_tile_size_bwd_sm90"](96, 192, True, False)
    narrow = fwd(96, 192, True, False)
    assert (narrow.m_block_size, narrow.n_block_size, narrow.mma_pv_is_rs) == (128, 128, False)
    wide = bwd(128, 256, True, False)
    assert (wide.m_block_size, wide.n_block_size, wide.num_stages_dO, wide.num_stages_PdS, wide.dKV_swapAB) == \
        (64, 96, 1, 1, True)


def test_a_library_without_the_tile_functions_is_left_alone():
    assert not fit_wide_v_tiles("json")


@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (2, 1)], ids=["H2-Hkv2", "H2-Hkv1-gqa"])
def test_diff_calls_flash_attn4_with_tiles_that_fit(d, heads, kv_heads):
    """DIFF V1 on flash_attn4 at the 830m and 3b head dims: its calls (over the 2d-wide V, GQA repeated) find the
    library's Hopper tile choices wrapped, and every tile they get fits an sm_90 block, forward and backward."""
    torch.manual_seed(d)
    n, b = 9, 1
    module = DifferentialCoreAttention(make_config(heads, kv_heads, d), 3, AttnMaskType.causal,
                                       backend="flash_attn4")
    q = torch.randn(n, b, 2 * heads, d, requires_grad=True)
    k, v = (torch.randn(n, b, 2 * kv_heads, d, requires_grad=True) for _ in range(2))
    with installed():
        from flash_attn import _reference

        module(q, k, v, None, attn_mask_type=AttnMaskType.causal).sum().backward()
        tiles = list(_reference.TILES)
    assert len(tiles) == 2 and q.grad is not None and k.grad is not None
    for head_dim, head_dim_v, fwd, bwd in tiles:
        assert (head_dim, head_dim_v) == (d, 2 * d)
        assert forward_shared_memory(d, 2 * d, fwd) <= SM90_SHARED_MEMORY
        assert backward_shared_memory(d, 2 * d, bwd) <= SM90_SHARED_MEMORY
