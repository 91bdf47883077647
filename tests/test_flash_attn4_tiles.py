"""flash-attn-4's Hopper tiles with V wider than Q·K (models/attention/flash_attn4_tiles.py): the shared-memory count
against the compiler's and what an H100 refused, the tiles a wide V gets, and DIFF V1's calls taking them (the
library's stand-in, tests/flash_stand_in.py, with its sm_90 tile choices)."""

import importlib.metadata
import os
import subprocess
import sys

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


# shared memory of flash-attn-4's sm_90 kernels, bytes: (q/k head dim, v head dim) -> (forward, backward), with the
# library's tiles and with the fitted ones for a wide V; the DSL's own count, compiled for sm_90a on a CPU
# (benchmarks/results/fa4_compile_sm90_2026-11-27.md); an H100 refused 234,496 and 264,192 at launch
LIBRARY = {(64, 64): (91_136, 199_680), (64, 128): (123_904, 248_832), (96, 96): (185_344, 157_696),
           (96, 192): (234_496, 206_848), (128, 128): (164_864, 198_656), (128, 256): (230_400, 264_192)}
FITTED = {(64, 128): (103_424, 111_616), (96, 192): (183_296, 177_152), (128, 256): (205_824, 197_632)}


def test_the_count_is_the_compilers_and_what_an_h100_refused(interface):
    """The shared-memory count equals the CuTe DSL's for every kernel of the compile record, the library's tiles and
    the fitted ones; among them the two launches an H100 refused, to the byte."""
    fwd, bwd = interface._tile_size_fwd_sm90, interface._tile_size_bwd_sm90
    for (d, dv), want in LIBRARY.items():
        got = (forward_shared_memory(d, dv, fwd(d, dv, True, False)),
               backward_shared_memory(d, dv, bwd(d, dv, True, False)))
        assert got == want, (d, dv, got)
    assert fit_wide_v_tiles("flash_attn.cute.interface")
    fwd, bwd = interface._tile_size_fwd_sm90, interface._tile_size_bwd_sm90
    for (d, dv), want in FITTED.items():
        got = (forward_shared_memory(d, dv, fwd(d, dv, True, False)),
               backward_shared_memory(d, dv, bwd(d, dv, True, False)))
        assert got == want and max(got) <= SM90_SHARED_MEMORY, (d, dv, got)


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
    # a wide V: flash-attn-4's own tiles for a V wider than 128 (fit and spill nothing at these shapes: the compile
    # record), P from registers or shared memory as the library chose
    for d, rs in ((96, False), (128, True)):
        tile = fwd(d, 2 * d, True, False)
        assert (tile.m_block_size, tile.n_block_size, tile.mma_pv_is_rs) == (128, 112, rs)
        wide = bwd(d, 2 * d, True, False)
        assert (wide.m_block_size, wide.n_block_size, wide.num_stages_dO, wide.num_stages_PdS, wide.dKV_swapAB,
                wide.dQ_single_wg) == (64, 96, 1, 1, True, False)


def test_a_library_without_the_tile_functions_is_left_alone():
    assert not fit_wide_v_tiles("json")


@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (2, 1)], ids=["H2-Hkv2", "H2-Hkv1-gqa"])
def test_diff_calls_flash_attn4_with_tiles_that_fit(d, heads, kv_heads):
    """DIFF V1 on flash_attn4 at the 830m and 3b head dims: its call (over the 2d-wide V, GQA repeated) finds the
    library's Hopper tile choices wrapped, and the tiles it gets fit an sm_90 block, forward and backward."""
    torch.manual_seed(d)
    n, b = 9, 1
    module = DifferentialCoreAttention(make_config(heads, kv_heads, d), 3, AttnMaskType.causal,
                                       backend="flash_attn4")
    q = torch.randn(n, b, 2 * heads, d, requires_grad=True)
    k, v = (torch.randn(n, b, 2 * kv_heads, d, requires_grad=True) for _ in range(2))
    with installed():
        from flash_attn import _reference

        module(q, k, v, None, attn_mask_type=AttnMaskType.causal).sum().backward()
        tiles, backward = list(_reference.TILES), list(_reference.BACKWARD)
    # the forward's call and the backward's (the custom operator's, models/attention/flash_attn4_op.py), each looking
    # the tiles up as the library does
    assert len(tiles) == 2 and len(backward) == 1 and q.grad is not None and k.grad is not None
    for head_dim, head_dim_v, fwd, bwd in tiles:
        assert (head_dim, head_dim_v) == (d, 2 * d)
        assert forward_shared_memory(d, 2 * d, fwd) <= SM90_SHARED_MEMORY
        assert backward_shared_memory(d, 2 * d, bwd) <= SM90_SHARED_MEMORY


def test_the_compile_record_without_flash_attn4_is_one_error_line(tmp_path):
    """benchmarks/fa4_compile.py where flash-attn-4 is not installed (CI): one ``error:`` line naming what is missing,
    exit status 2, nothing written."""
    try:
        importlib.metadata.version("flash-attn-4")
        pytest.skip("flash-attn-4 is installed here: the script would compile")
    except importlib.metadata.PackageNotFoundError:
        pass
    from tests.train_runs import REPO

    proc = subprocess.run([sys.executable, "benchmarks/fa4_compile.py", "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "flash-attn-4 is not installed" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
