"""flash-attn-4 on Hopper with V wider than Q·K: tiles that fit a thread block's shared memory.

DIFF V1 runs on flash-attn-4 as one call a map over the 2d-wide V (head dims (d, 2d)). flash-attn-4 4.0.0b36 picks its
sm_90 tiles by the q/k head dim alone (``flash_attn.cute.interface._tile_size_fwd_sm90`` and ``_tile_size_bwd_sm90``),
and with V twice as wide two of its choices ask for more shared memory than a block may have. On an H100
(benchmarks/results/gpu_run_NVIDIA-H100-80GB-HBM3_2026-11-27.md) the launch was refused:

- forward at (96, 192), tile 192×128 with P in shared memory: 234,496 bytes;
- backward at (128, 256), tile 64×128, two stages of Q, dO, P and dS: 264,192 bytes;

of the 232,448 an sm_90 block may use. :func:`fit_wide_v_tiles` wraps the two functions once: where v's head dim
exceeds q's and the library's tile would not fit, it takes the first smaller tile that does, by
:func:`forward_shared_memory` and :func:`backward_shared_memory` (the kernels' shared-storage structs, counted from
flash_fwd_sm90.py and flash_bwd_sm90.py and checked against the two refusals above). Every other shape keeps the
library's own choice. A library without those two functions (another version) is left as it is.
"""

from __future__ import annotations

import dataclasses
import importlib

SM90_SHARED_MEMORY = 232_448  # bytes of shared memory one thread block may use on sm_90 (227 KiB)
_ALIGN = 1024  # the kernels align each buffer to 1 KiB
_BF16 = 2  # bytes of q, k, v, O, dO (bf16 or fp16)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def forward_shared_memory(head_dim: int, head_dim_v: int, cfg, stages: int = 2) -> int:
    """Bytes of shared memory flash-attn-4's sm_90 forward asks for with ``cfg`` (its FwdConfig): the barriers, Q,
    ``stages`` of K and of V, and P where the P·V product reads it from shared memory (``mma_pv_is_rs`` false)."""
    hdim, hdim_v = _round_up(head_dim, 16), _round_up(head_dim_v, 16)
    m, n = cfg.m_block_size, cfg.n_block_size
    barriers = (2 + 4 * stages) * 8
    buffers = [n * hdim_v * stages, m * hdim, n * hdim * stages, 0 if cfg.mma_pv_is_rs else m * n]
    return _round_up(barriers, _ALIGN) + sum(_round_up(b * _BF16, _ALIGN) for b in buffers)


def backward_shared_memory(head_dim: int, head_dim_v: int, cfg) -> int:
    """Bytes of shared memory flash-attn-4's sm_90 backward asks for with ``cfg`` (its BwdConfig): the barriers, the
    fp32 LSE and dPsum rows, the Q and dO stages, K, V, P (unless dV's product reads P from registers), the dS
    stages, and the fp32 dQ accumulator."""
    multiple = 64 if cfg.dKV_swapAB else 16
    hdim, hdim_v = _round_up(head_dim, multiple), _round_up(head_dim_v, multiple)
    m, n = cfg.m_block_size, cfg.n_block_size
    mma_wgs = getattr(cfg, "num_wg", 2)
    p_from_registers = (cfg.AtomLayoutMSdP == 1 and cfg.AtomLayoutNdKV == mma_wgs and cfg.SdP_swapAB
                        and not cfg.dKV_swapAB)
    offset = (2 * cfg.num_stages_Q + 2 * cfg.num_stages_dO) * 8  # the barriers
    for rows in (_round_up(m, 64) * cfg.num_stages_Q, _round_up(m, 64) * cfg.num_stages_dO):  # LSE, dPsum
        offset = _round_up(offset, 128) + rows * 4
    pds = m * n * cfg.num_stages_PdS
    buffers = [m * hdim * cfg.num_stages_Q * _BF16, n * hdim_v * _BF16, n * hdim * _BF16,
               m * hdim_v * cfg.num_stages_dO * _BF16, 0 if p_from_registers else pds * _BF16, pds * _BF16,
               m * hdim * 4]
    for size in buffers:
        offset = _round_up(offset, _ALIGN) + size
    return offset


def forward_candidates(cfg):
    """The library's forward tile, then smaller ones: 128 query rows (the library's own tile at head dims ≤ 96 where
    192 rows do not divide its blocks), then fewer keys."""
    yield cfg
    for m, n in ((128, cfg.n_block_size), (128, 96), (128, 64)):
        if m <= cfg.m_block_size and n <= cfg.n_block_size:
            yield dataclasses.replace(cfg, m_block_size=m, n_block_size=n)


def backward_candidates(cfg):
    """The library's backward tile, then its tile for a V wider than 128 at q/k head dims 129-192 (64×96, one stage
    of dO and of P/dS, dK and dV with the head dim on the MMA's M axis), then the same with 64 keys."""
    yield cfg
    wide = dataclasses.replace(cfg, m_block_size=64, n_block_size=96, num_stages_Q=2, num_stages_dO=1,
                               num_stages_PdS=1, SdP_swapAB=False, dKV_swapAB=True, dQ_swapAB=False,
                               AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)
    if hasattr(cfg, "dQ_single_wg"):
        wide = dataclasses.replace(wide, dQ_single_wg=False, num_wg=2)
    yield wide
    yield dataclasses.replace(wide, n_block_size=64)


def fitted(cfg, shared_memory, candidates):
    """The first of ``candidates(cfg)`` whose ``shared_memory`` fits an sm_90 block (``cfg`` itself if none does:
    the library's refusal then names the bytes)."""
    return next((c for c in candidates(cfg) if shared_memory(c) <= SM90_SHARED_MEMORY), cfg)


def fit_wide_v_tiles(module_name: str = "flash_attn.cute.interface") -> bool:
    """Wrap the library's sm_90 tile choices (once) so that a V wider than Q·K gets tiles that fit; returns whether
    the library has them to wrap."""
    interface = importlib.import_module(module_name)
    fwd, bwd = (getattr(interface, name, None) for name in ("_tile_size_fwd_sm90", "_tile_size_bwd_sm90"))
    if fwd is None or bwd is None:
        return False
    if getattr(fwd, "fits_wide_v", False):
        return True

    def tile_size_fwd_sm90(head_dim, head_dim_v, *args, **kwargs):
        cfg = fwd(head_dim, head_dim_v, *args, **kwargs)
        if head_dim_v <= head_dim or kwargs.get("sparse_block_size_q") is not None:
            return cfg
        return fitted(cfg, lambda c: forward_shared_memory(head_dim, head_dim_v, c), forward_candidates)

    def tile_size_bwd_sm90(head_dim, head_dim_v, *args, **kwargs):
        cfg = bwd(head_dim, head_dim_v, *args, **kwargs)
        if head_dim_v <= head_dim or kwargs.get("sparse_block_size_q") is not None:
            return cfg
        return fitted(cfg, lambda c: backward_shared_memory(head_dim, head_dim_v, c), backward_candidates)

    tile_size_fwd_sm90.fits_wide_v = tile_size_bwd_sm90.fits_wide_v = True
    interface._tile_size_fwd_sm90, interface._tile_size_bwd_sm90 = tile_size_fwd_sm90, tile_size_bwd_sm90
    return True

