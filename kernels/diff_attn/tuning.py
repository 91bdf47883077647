"""Designs and block configs of the fused kernels: a default table, shared-memory pruning, opt-in autotuning, a cache.

A *design* (`Design`) chooses how the work is split into kernels (forward.py and backward.py explain each): the
forward in one pass or two, the backward's dK/dV in one program (fused), in two (split) or with atomic dQ (atomic,
opt-in), tensor descriptors or pointer loads, and whether a head dim that is not a power of two (96) runs as two
column blocks or one padded block. A *plan* (`Plan`) is a design and one block config for each kernel it launches.

triton.autotune is not used. It keyed on the raw sequence lengths, so every new N retuned all the kernels (on one
H200 the first call at one shape spent 17 s on the forward, 20 s on the backward preprocess, 65 s on dK/dV and had
not finished dQ after a further 8 s); it compiled each of its 20 configs before finding that some overflow shared
memory; and it forgot its choice when the process ended. Here:

- By default every call runs the table's plan for (GPU capability major, head-dim block, value-dim block)
  (`DEFAULT_DESIGNS`, `DEFAULT_CONFIGS`, `GQA_CONFIGS`), each config shrunk only if the device has less shared
  memory than it needs: one compile per kernel, and the same plan for a given shape and GPU every time, so a resumed
  run computes the same bits.
  DIFF_ATTN_DESIGN (e.g. `forward=onepass,backward=atomic`) overrides fields of the table's design.
- With DIFF_ATTN_AUTOTUNE=1 each key (GPU name, Triton version, kernel, dtype, head dims, V1/V2, causal, sequence
  lengths bucketed to powers of two, design switches) is tuned once: every candidate that fits the device's shared
  memory and registers is compiled and timed, and the fastest is written to a JSON file ($DIFF_ATTN_CACHE_DIR or
  ~/.cache/diff_transformer, file diff_attn_configs.json) that a restarted job reads instead of retuning. The choice
  is then fixed by that file: keep it (same path) for bit-exact resumes.
- Shared memory is computed from the block shapes before anything compiles (`shared_memory_bytes`); check_compile.py
  compares the formula with the compiler's own figure for every table entry, under each Triton version it runs with.

Imports nothing of the framework outside `kernels` (the package stands alone), so the atomic write is its own.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from diff_transformer.fileio import atomic_write_text

AUTOTUNE_ENV = "DIFF_ATTN_AUTOTUNE"
DESIGN_ENV = "DIFF_ATTN_DESIGN"
CACHE_DIR_ENV = "DIFF_ATTN_CACHE_DIR"
CACHE_FILE_NAME = "diff_attn_configs.json"
# Every kernel a design may launch: the one-pass forward; the two-pass forward's LSE and output passes; the backward
# preprocess; dK/dV in one program, dK alone, dV alone, dK with atomic dQ; dQ.
KERNELS = ("forward", "forward_lse", "forward_out", "preprocess", "dkdv", "dk", "dv", "dkdq", "dq")
FORWARD_DESIGNS = {"onepass": ("forward",), "twopass": ("forward_lse", "forward_out")}
BACKWARD_DESIGNS = {"fused": ("preprocess", "dkdv", "dq"), "split": ("preprocess", "dk", "dv", "dq"),
                    "atomic": ("preprocess", "dkdq", "dv")}
# Kernels that stream query blocks past a resident key block (the others stream key blocks past query blocks).
KEY_BLOCK_KERNELS = ("dkdv", "dk", "dv", "dkdq")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Sequence lengths share a tuning key up to the next power of two; below one large block the choice hardly matters.
MIN_LENGTH_BUCKET = 128
# Shared memory per block (opt-in) by compute capability, for when torch does not report it.
SHARED_MEMORY_BY_CAPABILITY = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 7): 163 * 1024}
SHARED_MEMORY_FALLBACK = 99 * 1024  # sm_86, sm_89, sm_120 and anything unknown
# Most 32-bit tile values one thread may hold (by `tile_values_per_thread`) before ptxas spills badly (of 255).
MAX_TILE_VALUES_PER_THREAD = 192
# The fused dK/dV spills in every config; on an H200 (benchmarks/results/kernel_tuning_NVIDIA-H200_2026-11-26.md) its
# fastest V1 d=128 configs sat at 216 and 240 by the estimate (2.96 and 3.29 ms against 9.6 ms for the old entry at
# 102), so autotuning times the key-block kernels' candidates up to this limit.
MAX_TILE_VALUES_PER_THREAD_DKDV = 256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockConfig:
    block_m: int  # query rows of a tile
    block_n: int  # key rows of a tile
    num_warps: int
    num_stages: int

    def launch_options(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)

    def as_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.num_warps, self.num_stages]

    def __str__(self):
        return f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} num_warps={self.num_warps} num_stages={self.num_stages}"


@dataclass(frozen=True)
class Design:
    """How the work is split into kernels, and two code-generation switches (forward.py's, backward.py's and
    tiles.py's docstrings have the detail)."""

    forward: str = "twopass"  # one of FORWARD_DESIGNS
    backward: str = "split"  # one of BACKWARD_DESIGNS; "atomic" is opt-in (non-deterministic dQ)
    descriptors: bool = False  # TMA tensor descriptors for tile loads (sm_90+), else pointer loads
    split_dims: bool = False  # a head dim that is not a power of two as two power-of-two column blocks

    def __post_init__(self):
        if self.forward not in FORWARD_DESIGNS:
            raise ValueError(f"forward={self.forward!r}; expected one of {', '.join(FORWARD_DESIGNS)}")
        if self.backward not in BACKWARD_DESIGNS:
            raise ValueError(f"backward={self.backward!r}; expected one of {', '.join(BACKWARD_DESIGNS)}")

    @property
    def kernels(self) -> tuple[str, ...]:
        return FORWARD_DESIGNS[self.forward] + BACKWARD_DESIGNS[self.backward]

    def __str__(self):
        return (f"forward={self.forward},backward={self.backward},descriptors={int(self.descriptors)},"
                f"split_dims={int(self.split_dims)}")

    def overridden(self, text: str) -> Design:
        """This design with the fields `text` names (`forward=onepass,descriptors=0`, as DIFF_ATTN_DESIGN) replaced."""
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if name in ("forward", "backward"):
                values[name] = value
            elif name in ("descriptors", "split_dims") and value in ("0", "1"):
                values[name] = value == "1"
            else:
                raise ValueError(
                    f"{DESIGN_ENV} item {item!r}; expected forward=onepass|twopass, backward=fused|split|atomic, "
                    "descriptors=0|1 or split_dims=0|1, separated by commas"
                )
        return replace(self, **values)


def padded_dim(dim: int) -> int:
    """The block a head dimension is padded to: a power of two, and at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (dim - 1).bit_length())


def dim_blocks(dim: int, split: bool) -> tuple[int, int]:
    """The column blocks a head dim runs as: (padded block, 0), or with `split` a dim that is the sum of two powers of
    two, each at least 16 (96 = 64 + 32, 192 = 128 + 64), as those two."""
    first = 1 << (dim.bit_length() - 1)
    rest = dim - first
    if split and rest >= 16 and rest & (rest - 1) == 0:
        return first, rest
    return padded_dim(dim), 0


def bucket_length(n: int) -> int:
    """The sequence length that stands for n in a tuning key: the next power of two, at least MIN_LENGTH_BUCKET."""
    return max(MIN_LENGTH_BUCKET, 1 << (n - 1).bit_length())


@dataclass(frozen=True)
class KernelProblem:
    """Everything a kernel's block config may depend on; sequence lengths are already bucketed."""

    kernel: str  # one of KERNELS
    dtype: str  # bf16, fp16 or fp32
    head_dim: int
    value_dim: int
    shared_k: bool  # V2 (both maps read one K)
    causal: bool
    n_q_bucket: int
    n_k_bucket: int
    split_dims: bool = False
    descriptors: bool = False
    gqa: bool = False  # more than one query head per KV group: the key-block kernels loop over them

    @classmethod
    def of(cls, kernel, dtype, head_dim, value_dim, shared_k, causal, n_q, n_k, split_dims=False, descriptors=False,
           gqa=False):
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
        return cls(kernel, dtype, head_dim, value_dim, bool(shared_k), bool(causal), bucket_length(n_q),
                   bucket_length(n_k), bool(split_dims), bool(descriptors), bool(gqa and kernel in KEY_BLOCK_KERNELS))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def block_widths(self) -> tuple[int, int]:
        """Columns the head-dim and value-dim blocks span together (padded, or split exactly)."""
        return sum(dim_blocks(self.head_dim, self.split_dims)), sum(dim_blocks(self.value_dim, self.split_dims))

    def cache_key(self, device: DeviceInfo, triton_version: str) -> str:
        return "|".join([
            device.name, f"sm_{device.capability[0]}{device.capability[1]}", f"triton {triton_version}", self.kernel,
            self.dtype, f"d={self.head_dim}", f"dv={self.value_dim}", "v2" if self.shared_k else "v1",
            "causal" if self.causal else "full", f"nq<={self.n_q_bucket}", f"nk<={self.n_k_bucket}",
            f"split_dims={int(self.split_dims)}", f"descriptors={int(self.descriptors)}", f"gqa={int(self.gqa)}",
        ])


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    shared_memory: int  # bytes one block may use (opt-in maximum)


@dataclass(frozen=True)
class Plan:
    """A design and the block config of each kernel it launches."""

    design: Design
    configs: dict = field(hash=False)  # kernel name -> BlockConfig, for every kernel of the design

    def __post_init__(self):
        missing = [k for k in self.design.kernels if k not in self.configs]
        if missing:
            raise ValueError(f"plan for design {self.design} has no block config for {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------------------------
# Resources a config needs, computed before compiling
# ----------------------------------------------------------------------------------------------------------------


def shared_memory_bytes(kernel: str, config: BlockConfig, block_d: int, block_dv: int, shared_k: bool,
                        dtype_bytes: int, descriptors: bool = False) -> int:
    """Shared memory one program of `kernel` needs on sm_90 (Triton 3.6 and 3.9, aligned pointers and strides).

    block_d and block_dv are the columns the head-dim and value-dim blocks span (padded, or both blocks of a split).
    Triton keeps every tile that feeds tl.dot in shared memory: the tiles a loop streams num_stages deep (its
    software pipeline), the tiles loaded once before the loop single. The key-block kernels also stream fp32 row
    vectors (LSE, and δ where dK is computed) per stage. Probability and dS tiles feed tl.dot from registers. Tensor
    descriptors add up to 1 KiB (their barriers), inside the key-block kernels' slack. check_compile.py prints this
    next to the compiler's figure and fails where it is below it.
    """
    m, n, stages = config.block_m, config.block_n, max(1, config.num_stages)
    k_tiles = 1 if shared_k else 2
    extra_bytes = 0
    if kernel in ("forward", "forward_out"):  # stream K1ᵀ (and K2ᵀ) and V per key block; Q1 and Q2 stay
        elements = stages * n * (k_tiles * block_d + block_dv) + 2 * m * block_d
    elif kernel == "forward_lse":  # streams K1ᵀ (and K2ᵀ); Q1 and Q2 stay
        elements = stages * n * k_tiles * block_d + 2 * m * block_d
    elif kernel == "preprocess":  # streams K2ᵀ and Vᵀ; Q2 and dy stay
        elements = stages * n * (block_d + block_dv) + m * (block_d + block_dv)
    elif kernel in KEY_BLOCK_KERNELS:  # stream Q1ᵀ, Q2ᵀ and dy per query block; K1 (and K2) and V stay
        resident_v = 0 if kernel == "dv" else block_dv
        elements = stages * m * (2 * block_d + block_dv) + n * (k_tiles * block_d + resident_v)
        vectors = 2 if kernel == "dv" else 4
        # The compiler rounds the row vectors to 1 KiB, and some layouts need a 4 KiB conversion buffer besides.
        extra_bytes = -(-stages * vectors * m * 4 // 1024) * 1024 + 4096
        if kernel == "dkdq":  # dSᵀ of both maps, transposed through shared memory for dQ's product
            extra_bytes += 2 * m * n * dtype_bytes
    elif kernel == "dq":  # streams K1 (and K2) and Vᵀ; Q1, Q2 and dy stay
        elements = stages * n * (k_tiles * block_d + block_dv) + m * (2 * block_d + block_dv)
    else:
        raise ValueError(f"kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    if descriptors and kernel not in KEY_BLOCK_KERNELS:
        extra_bytes += 1024
    return elements * dtype_bytes + extra_bytes


def tile_values_per_thread(kernel: str, config: BlockConfig, block_d: int, block_dv: int, shared_k: bool,
                           dtype_bytes: int) -> float:
    """32-bit registers one thread needs for its accumulators, score tiles and resident tiles (the bulk of them).

    An estimate for pruning autotuning candidates, checked against ptxas on sm_90: forward, preprocess and dQ configs
    at or below MAX_TILE_VALUES_PER_THREAD spilled at most 64 bytes, those above it up to 3 KiB; the fused dK/dV
    spills some bytes in every config, hundreds to thousands above it.
    """
    m, n = config.block_m, config.block_n
    k_tiles = 1 if shared_k else 2
    if kernel == "forward":  # acc1, acc2; S and P of both maps
        values = 2 * m * block_dv + 2 * m * n
    elif kernel == "forward_lse":  # S of both maps
        values = 2 * m * n
    elif kernel == "forward_out":  # one accumulator; S of both maps
        values = m * block_dv + 2 * m * n
    elif kernel == "preprocess":  # P2 and dP; the dy tile
        values = 2 * m * n + m * block_dv
    elif kernel in KEY_BLOCK_KERNELS:
        # accumulators: dK1 (and dK2) and/or dV; P1ᵀ, P2ᵀ (and dPᵀ); K1 (and K2) and V stay in registers too
        dk = kernel != "dv"
        dv = kernel in ("dkdv", "dv")
        accumulators = (k_tiles * block_d if dk else 0) + (block_dv if dv else 0)
        resident = n * (k_tiles * block_d + (block_dv if dk else 0))
        values = n * accumulators + (3 if dk else 2) * m * n + resident * dtype_bytes / 4
        if kernel == "dkdq":
            values += m * block_d
    elif kernel == "dq":  # dQ1 and dQ2; P1, P2 and dP
        values = 2 * m * block_d + 3 * m * n
    else:
        raise ValueError(f"kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    return values / (32 * config.num_warps)


def problem_shared_memory(problem: KernelProblem, config: BlockConfig) -> int:
    block_d, block_dv = problem.block_widths
    return shared_memory_bytes(problem.kernel, config, block_d, block_dv, problem.shared_k, problem.dtype_bytes,
                               problem.descriptors)


def fits(problem: KernelProblem, config: BlockConfig, shared_memory_limit: int) -> bool:
    """Whether `config` fits the device's shared memory and (by the estimate) its registers without heavy spilling."""
    block_d, block_dv = problem.block_widths
    values = tile_values_per_thread(problem.kernel, config, block_d, block_dv, problem.shared_k, problem.dtype_bytes)
    limit = MAX_TILE_VALUES_PER_THREAD_DKDV if problem.kernel in KEY_BLOCK_KERNELS else MAX_TILE_VALUES_PER_THREAD
    return problem_shared_memory(problem, config) <= shared_memory_limit and values <= limit


# ----------------------------------------------------------------------------------------------------------------
# The default table
# ----------------------------------------------------------------------------------------------------------------


def _entries(**by_kernel):
    return {kernel: BlockConfig(*values) for kernel, values in by_kernel.items()}


# (capability major, head-dim block, value-dim block) -> design, and kernel -> config. Head dims below 64 use the 64
# entries; d = 96 uses the 128 entries (as two column blocks where the design splits head dims).
# Hopper: chosen from sm_90 compiles under Triton 3.6 and 3.9 (kernels/diff_attn/configs_sm90.md; check_compile.py
# fails on an entry that spills 128 B or more, is not wgmma, replicates an MMA tile across warps or needs more shared
# memory than the device has) and the H200 timings of the earlier kernels (benchmarks/results/
# kernel_tuning_NVIDIA-H200_2026-11-26.md). Not timed yet: benchmarks/kernel_tuning.py times every design and the
# configs around these on a GPU. Kernels the entry's design does not launch keep configs for DIFF_ATTN_DESIGN.
# Ampere (A100: 163 KiB) and the base for architectures without entries: the earlier design (one-pass forward, fused
# dK/dV) with its configs, stages or blocks cut where the earlier kernels spilled on sm_80 (check_compile.py --arch
# 80: at most 88 bytes); the other kernels' entries there are Hopper's analogues, not compiled for sm_80.
DEFAULT_DESIGNS = {
    (9, 64, 128): Design("onepass", "split", descriptors=False, split_dims=True),  # V1 d <= 64
    (9, 128, 256): Design("twopass", "split", descriptors=False, split_dims=True),  # V1 d = 96, 128
    (9, 64, 64): Design("onepass", "split", descriptors=False, split_dims=True),  # V2 d <= 64
    (9, 128, 128): Design("onepass", "split", descriptors=False, split_dims=True),  # V2 d = 96, 128
    (8, 64, 128): Design("onepass", "fused"),
    (8, 128, 256): Design("onepass", "fused"),
    (8, 64, 64): Design("onepass", "fused"),
    (8, 128, 128): Design("onepass", "fused"),
}
DEFAULT_CONFIGS = {
    # Hopper (H100, H200): 227 KiB shared memory.
    (9, 64, 128): _entries(forward=(128, 64, 8, 3), forward_lse=(128, 64, 8, 3), forward_out=(128, 64, 8, 3),
                           preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3), dk=(32, 128, 8, 3),
                           dv=(32, 128, 8, 3), dkdq=(32, 128, 8, 3), dq=(128, 64, 8, 3)),  # V1 d <= 64
    (9, 128, 256): _entries(forward=(64, 64, 8, 2), forward_lse=(128, 64, 8, 3), forward_out=(128, 32, 8, 3),
                            preprocess=(128, 32, 8, 3), dkdv=(32, 64, 8, 3), dk=(32, 128, 8, 2), dv=(32, 128, 8, 2),
                            dkdq=(32, 128, 8, 2), dq=(128, 32, 8, 3)),  # V1 d = 96, 128
    (9, 64, 64): _entries(forward=(128, 64, 8, 3), forward_lse=(128, 64, 8, 3), forward_out=(128, 64, 8, 3),
                          preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3), dk=(32, 128, 8, 3), dv=(32, 128, 8, 3),
                          dkdq=(32, 128, 8, 3), dq=(128, 64, 8, 3)),  # V2 d <= 64
    (9, 128, 128): _entries(forward=(128, 32, 8, 3), forward_lse=(128, 64, 8, 3), forward_out=(128, 32, 8, 3),
                            preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3), dk=(32, 128, 8, 3),
                            dv=(32, 128, 8, 3), dkdq=(32, 128, 8, 3), dq=(128, 32, 8, 3)),  # V2 d = 96, 128
    (8, 64, 128): _entries(forward=(64, 64, 8, 3), forward_lse=(64, 64, 8, 3), forward_out=(64, 64, 8, 3),
                           preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3), dk=(16, 128, 8, 3),
                           dv=(16, 128, 8, 3), dkdq=(16, 128, 8, 3), dq=(128, 64, 8, 2)),
    (8, 128, 256): _entries(forward=(64, 32, 8, 3), forward_lse=(64, 64, 8, 3), forward_out=(64, 32, 8, 3),
                            preprocess=(128, 32, 8, 2), dkdv=(16, 32, 8, 3), dk=(16, 64, 8, 3), dv=(16, 64, 8, 3),
                            dkdq=(16, 64, 8, 3), dq=(64, 32, 8, 2)),
    (8, 64, 64): _entries(forward=(128, 64, 8, 3), forward_lse=(128, 64, 8, 3), forward_out=(128, 64, 8, 3),
                          preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3), dk=(16, 128, 8, 3), dv=(16, 128, 8, 3),
                          dkdq=(16, 128, 8, 3), dq=(128, 64, 8, 3)),
    (8, 128, 128): _entries(forward=(128, 32, 8, 3), forward_lse=(128, 64, 8, 3), forward_out=(128, 32, 8, 3),
                            preprocess=(128, 64, 8, 2), dkdv=(16, 128, 8, 3), dk=(16, 128, 8, 3),
                            dv=(16, 128, 8, 3), dkdq=(16, 128, 8, 3), dq=(128, 32, 8, 3)),
}
# Key-block kernels under GQA, where the loop over a group's query heads needs fewer registers than the table's entry.
GQA_CONFIGS = {
    (9, 128, 256): _entries(dk=(16, 128, 8, 2), dv=(16, 128, 8, 2), dkdq=(16, 128, 8, 2)),
}
# The design and Hopper configs the kernels ran with before this table (timed on an H200): the GPU sweep's reference.
PREVIOUS_HOPPER_CONFIGS = {
    (9, 64, 128): _entries(forward=(128, 64, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                           dq=(128, 64, 8, 3)),
    (9, 128, 256): _entries(forward=(64, 64, 8, 2), preprocess=(128, 32, 8, 3), dkdv=(32, 64, 8, 3),
                            dq=(128, 32, 8, 2)),
    (9, 64, 64): _entries(forward=(128, 64, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                          dq=(128, 64, 8, 3)),
    (9, 128, 128): _entries(forward=(128, 32, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                            dq=(128, 32, 8, 3)),
}
PREVIOUS_DESIGN = Design("onepass", "fused")
TABLE_ARCHS = sorted({major for major, _, _ in DEFAULT_CONFIGS})


def table_key(capability_major: int, head_dim: int, value_dim: int) -> tuple[int, int, int]:
    """The table key of a problem: architectures without entries use the nearest older one (or sm_80's)."""
    older = [major for major in TABLE_ARCHS if major <= capability_major]
    arch = max(older) if older else TABLE_ARCHS[0]
    return arch, max(64, padded_dim(head_dim)), max(64, padded_dim(value_dim))


def fit_to_device(problem: KernelProblem, config: BlockConfig, shared_memory_limit: int) -> BlockConfig:
    """`config`, made smaller one deterministic step at a time until it fits the shared memory: fewer stages, then a
    smaller streamed block (keys in forward, preprocess and dQ; queries in the key-block kernels), then a smaller
    resident block. Registers are not estimated here: the table's entries are checked against ptxas by
    check_compile.py."""
    streamed = "block_m" if problem.kernel in KEY_BLOCK_KERNELS else "block_n"
    resident = "block_n" if streamed == "block_m" else "block_m"
    while problem_shared_memory(problem, config) > shared_memory_limit:
        if config.num_stages > 1:
            config = BlockConfig(config.block_m, config.block_n, config.num_warps, config.num_stages - 1)
        elif getattr(config, streamed) > 16:
            config = _halve(config, streamed)
        elif getattr(config, resident) > 16:
            config = _halve(config, resident)
        else:
            raise ValueError(
                f"no block config of the {problem.kernel} kernel fits {shared_memory_limit} bytes of shared memory "
                f"at head dim {problem.head_dim}, value dim {problem.value_dim}, {problem.dtype}"
            )
    return config


def _halve(config: BlockConfig, name: str) -> BlockConfig:
    return replace(config, **{name: getattr(config, name) // 2})


def default_design(capability_major: int, head_dim: int, value_dim: int) -> Design:
    """The table's design for a problem, with DIFF_ATTN_DESIGN's fields over it."""
    design = DEFAULT_DESIGNS[table_key(capability_major, head_dim, value_dim)]
    if capability_major < 9:  # tensor descriptors (TMA) start with Hopper
        design = replace(design, descriptors=False)
    text = os.environ.get(DESIGN_ENV, "")
    return design.overridden(text) if text.strip() else design


def default_config(problem: KernelProblem, device: DeviceInfo) -> BlockConfig:
    """The table's config for `problem` on `device` (GQA's where the table has one), fitted to the device."""
    key = table_key(device.capability[0], problem.head_dim, problem.value_dim)
    entry = DEFAULT_CONFIGS[key][problem.kernel]
    if problem.gqa:
        entry = GQA_CONFIGS.get(key, {}).get(problem.kernel, entry)
    return fit_to_device(problem, entry, device.shared_memory)


# ----------------------------------------------------------------------------------------------------------------
# Autotuning (opt-in) and its disk cache
# ----------------------------------------------------------------------------------------------------------------

# Blocks autotuning tries, by kernel: dK/dV streams query blocks (BLOCK_M) past resident key blocks (BLOCK_N).
_CANDIDATE_BLOCKS = {
    "key_block": [(16, 128), (16, 64), (32, 64), (32, 128), (16, 32), (32, 32), (64, 64), (64, 128)],
    "other": [(128, 64), (128, 32), (64, 64), (64, 32), (64, 128), (128, 128)],
}


def _candidates(kernel: str) -> list[BlockConfig]:
    blocks = _CANDIDATE_BLOCKS["key_block" if kernel in KEY_BLOCK_KERNELS else "other"]
    return [BlockConfig(m, n, warps, stages) for m, n in blocks for warps in (4, 8) for stages in (2, 3)]


def candidate_configs(problem: KernelProblem, device: DeviceInfo) -> list[BlockConfig]:
    """What autotuning times: the default entry first, then every candidate that fits the device, in a fixed order."""
    first = default_config(problem, device)
    rest = [c for c in _candidates(problem.kernel) if c != first and fits(problem, c, device.shared_memory)]
    return [first] + rest


def autotune_enabled() -> bool:
    value = os.environ.get(AUTOTUNE_ENV, "0").strip().lower()
    if value not in ("", "0", "1", "false", "true"):
        raise ValueError(f"{AUTOTUNE_ENV}={value!r}; expected 0 or 1")
    return value in ("1", "true")


def default_cache_path() -> Path:
    directory = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "diff_transformer"
    return Path(directory) / CACHE_FILE_NAME


class ConfigCache:
    """Tuned configs by key in one JSON file, re-read before each write so that processes sharing it merge."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._entries: dict | None = None

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                entries = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as err:
            log.warning("ignoring unreadable diff_attn config cache %s (%s)", self.path, err)
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> BlockConfig | None:
        if self._entries is None:
            self._entries = self._read()
        values = self._entries.get(key)
        if not (isinstance(values, list) and len(values) == 4 and all(isinstance(v, int) for v in values)):
            return None
        return BlockConfig(*values)

    def put(self, key: str, config: BlockConfig) -> None:
        entries = self._read()
        entries[key] = config.as_list()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # readers see the old file or the new one, never half of one
        atomic_write_text(str(self.path), json.dumps(entries, indent=1, sort_keys=True))
        self._entries = entries


def autotune(problem: KernelProblem, device: DeviceInfo, bench: Callable[[BlockConfig], float]) -> BlockConfig:
    """The candidate with the lowest `bench` time (ms); ties go to the earlier candidate. Candidates that fail to
    compile or launch for lack of resources are skipped."""
    timings = []
    for config in candidate_configs(problem, device):
        try:
            ms = bench(config)
        except Exception as err:  # noqa: BLE001 - Triton's OutOfResources and compile errors have no common base
            log.info("diff_attn autotune %s: %s skipped (%s)", problem.kernel, config, err)
            continue
        timings.append((ms, len(timings), config))
        log.info("diff_attn autotune %s: %s %.4f ms", problem.kernel, config, ms)
    if not timings:
        raise RuntimeError(f"no block config of the {problem.kernel} kernel ran for {problem}")
    return min(timings, key=lambda t: (t[0], t[1]))[2]


def select_config(problem: KernelProblem, device: DeviceInfo, autotuning: bool, cache: ConfigCache | None,
                  bench: Callable[[BlockConfig], float] | None, triton_version: str) -> BlockConfig:
    """The config to launch: the default table's unless autotuning, then the cache's, tuning (and storing) on a miss."""
    if not autotuning:
        return default_config(problem, device)
    key = problem.cache_key(device, triton_version)
    cached = cache.get(key) if cache is not None else None
    if cached is not None:
        return cached
    config = autotune(problem, device, bench)
    if cache is not None:
        cache.put(key, config)
    log.info("diff_attn autotune %s: chose %s for %s", problem.kernel, config, key)
    return config


def device_info(device) -> DeviceInfo:
    """Name, capability and shared memory per block of a CUDA device (torch's figure, else by capability), or of the
    GPU that kernels/gpu_target.py simulates."""
    from kernels import gpu_target

    gpu = gpu_target.device_properties(device)
    shared = gpu.shared_memory or SHARED_MEMORY_BY_CAPABILITY.get(gpu.capability, SHARED_MEMORY_FALLBACK)
    return DeviceInfo(gpu.name, gpu.capability, int(shared))
