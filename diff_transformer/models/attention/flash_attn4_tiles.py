"""flash-attn-4 on Hopper with V wider than Q·K: tiles that fit a thread block's shared memory and spill nothing.

DIFF V1 runs on flash-attn-4 as one call over the 2d-wide V (head dims (d, 2d)). flash-attn-4 4.0.0b36 picks its
sm_90 tiles by the q/k head dim alone (``flash_attn.cute.interface._tile_size_fwd_sm90`` and ``_tile_size_bwd_sm90``),
and with V twice as wide its choices ask for more shared memory than a block may have or spill registers. On an H100
(benchmarks/results/gpu_run_NVIDIA-H100-80GB-HBM3_2026-11-27.md) two launches were refused: the forward at (96, 192)
asked for 234,496 bytes, the backward at (128, 256) for 264,192, of the 232,448 an sm_90 block may use. Compiled for
sm_90a on a CPU (``benchmarks/fa4_compile.py``, ``benchmarks/results/fa4_compile_sm90_2026-11-27.md``), the two that
fit spill: the backward at (96, 192) 200 bytes a thread, the forward at (128, 256) 48.

:func:`fit_wide_v_tiles` wraps the two functions once: where v's head dim exceeds q's, they return the tiles
flash-attn-4 itself gives a V wider than 128 at q/k head dims 129-192: forward 128×112 (the library's own choice of
P from registers or shared memory kept), backward 64×96 with one stage of dO and of P/dS, dK and dV with the head dim
on the MMA's M axis. At (96, 192) and (128, 256) those fit and spill nothing (the compile record). Where one would not
fit (by :func:`forward_shared_memory` and :func:`backward_shared_memory`, the kernels' shared-storage structs, equal
to the DSL's own count at every shape of the record), a smaller one is taken. Every other shape keeps the library's
choice; a library without those two functions (another version) is left as it is.
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
    """Forward tiles for a V wider than Q·K, in order: 128×112 (flash-attn-4's own for a V wider than 128), then
    fewer keys. ``cfg``'s choice of P from registers or shared memory is kept."""
    for n in (112, 96, 64):
        yield dataclasses.replace(cfg, m_block_size=128, n_block_size=n)


def backward_candidates(cfg):
    """Backward tiles for a V wider than Q·K, in order: flash-attn-4's own for a V wider than 128 at q/k head dims
    129-192 (64×96, one stage of dO and of P/dS, dK and dV with the head dim on the MMA's M axis, two MMA warp
    groups), then the same with 64 keys."""
    wide = dataclasses.replace(cfg, m_block_size=64, n_block_size=96, num_stages_Q=2, num_stages_dO=1,
                               num_stages_PdS=1, SdP_swapAB=False, dKV_swapAB=True, dQ_swapAB=False,
                               AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=1)
    if hasattr(cfg, "dQ_single_wg"):
        wide = dataclasses.replace(wide, dQ_single_wg=False, num_wg=2)
    yield wide
    yield dataclasses.replace(wide, n_block_size=64)


def fitted(cfg, shared_memory, candidates):
    """The first of ``candidates(cfg)`` whose ``shared_memory`` fits an sm_90 block (``cfg``, the library's own, if
    none does: its refusal then names the bytes)."""
    return next((c for c in candidates(cfg) if shared_memory(c) <= SM90_SHARED_MEMORY), cfg)


def _fitting_wide_v(library_choice, shared_memory, candidates):
    """``library_choice`` (the library's forward or backward tile function) with a V wider than Q·K given the first of
    ``candidates`` that fits by ``shared_memory``."""
    def tile_size_sm90(head_dim, head_dim_v, *args, **kwargs):
        cfg = library_choice(head_dim, head_dim_v, *args, **kwargs)
        if head_dim_v <= head_dim or kwargs.get("sparse_block_size_q") is not None:
            return cfg
        return fitted(cfg, lambda c: shared_memory(head_dim, head_dim_v, c), candidates)

    tile_size_sm90.fits_wide_v = True
    return tile_size_sm90


def fit_tiles_for(q, v) -> None:
    """:func:`fit_wide_v_tiles` where ``v``'s head dim exceeds ``q``'s (DIFF V1's call over the 2d-wide V)."""
    if v.shape[-1] > q.shape[-1]:
        fit_wide_v_tiles()


def fit_wide_v_tiles(module_name: str = "flash_attn.cute.interface") -> bool:
    """Wrap the library's sm_90 tile choices (once) so that a V wider than Q·K gets the tiles above; returns whether
    the library has them to wrap."""
    interface = importlib.import_module(module_name)
    fwd, bwd = (getattr(interface, name, None) for name in ("_tile_size_fwd_sm90", "_tile_size_bwd_sm90"))
    if fwd is None or bwd is None:
        return False
    if not getattr(fwd, "fits_wide_v", False):
        interface._tile_size_fwd_sm90 = _fitting_wide_v(fwd, forward_shared_memory, forward_candidates)
        interface._tile_size_bwd_sm90 = _fitting_wide_v(bwd, backward_shared_memory, backward_candidates)
    return True
