"""A stand-in for flash-attn-4's ``flash_attn.cute.interface``: its sm_90 tile choices, as 4.0.0b36 makes them for
causal attention at q/k head dims 64, 96 and 128 (by the q/k head dim alone; its FwdConfig and BwdConfig fields),
which ``diff_transformer.models.attention.flash_attn4_tiles`` wraps. The stand-in's calls look them up here at every
call, through this module, as the library does, and record them (``_reference.TILES``)."""

from dataclasses import dataclass

from flash_attn._reference import fa4_backward as _flash_attn_bwd  # noqa: F401


@dataclass(frozen=True)
class FwdConfig:
    m_block_size: int
    n_block_size: int
    mma_pv_is_rs: bool
    intra_wg_overlap: bool
    q_stage: int = 1
    num_splits: int = 1


@dataclass(frozen=True)
class BwdConfig:
    m_block_size: int
    n_block_size: int
    num_stages_Q: int
    num_stages_dO: int
    num_stages_PdS: int
    SdP_swapAB: bool
    dKV_swapAB: bool
    dQ_swapAB: bool
    AtomLayoutMSdP: int
    AtomLayoutNdKV: int
    AtomLayoutMdQ: int
    num_wg: int = 2
    dQ_single_wg: bool = False


def _tile_size_fwd_sm90(head_dim, head_dim_v, is_causal, is_local, sparse_block_size_q=None):
    assert is_causal and not is_local and head_dim <= 128, (head_dim, is_causal, is_local)
    if head_dim <= 64:
        return FwdConfig(192, 128, True, True)
    if head_dim <= 96:
        return FwdConfig(192, 128, False, True)
    return FwdConfig(128, 128, True, True)


def _tile_size_bwd_sm90(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
    assert causal and not local and head_dim <= 128, (head_dim, causal, local)
    if head_dim <= 64:
        return BwdConfig(128, 128, 2, 2, 2, True, False, False, 1, 2, 2)
    if head_dim <= 96:
        return BwdConfig(64, 128, 2, 2, 2, True, False, False, 1, 2, 1, dQ_single_wg=True)
    return BwdConfig(64, 128, 2, 2, 2, True, False, False, 1, 2, 1)
