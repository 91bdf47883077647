"""Block configs of the fused kernels: a default table, shared-memory pruning, opt-in autotuning, a disk cache.

triton.autotune is not used. It keyed on the raw sequence lengths, so every new N retuned all four kernels (on one
H200 the first call at one shape spent 17 s on the forward, 20 s on the backward preprocess, 65 s on dK/dV and had
not finished dQ after a further 8 s); it compiled each of its 20 configs before finding that some overflow shared
memory; and it forgot its choice when the process ended. Here:

- By default every kernel launches with the entry of DEFAULT_CONFIGS for (GPU capability major, kernel, head-dim
  block, value-dim block), shrunk only if the device has less shared memory than the entry needs: one compile per
  kernel, and the same config for a given shape and GPU every time, so a resumed run computes the same bits.
- With DIFF_ATTN_AUTOTUNE=1 each key (GPU name, Triton version, kernel, dtype, head dims, V1/V2, causal, sequence
  lengths bucketed to powers of two) is tuned once: every candidate that fits the device's shared memory and
  registers is compiled and timed, and the fastest is written to a JSON file ($DIFF_ATTN_CACHE_DIR or
  ~/.cache/diff_transformer, file diff_attn_configs.json) that a restarted job reads instead of retuning. The choice
  is then fixed by that file: keep it (same path) for bit-exact resumes.
- Shared memory is computed from the block shapes before anything compiles (`shared_memory_bytes`); check_compile.py
  compares the formula with the compiler's own figure for every table entry.

Imports nothing of the framework outside `kernels` (the package stands alone), so the atomic write is its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diff_transformer.fileio import atomic_write_text

AUTOTUNE_ENV = "DIFF_ATTN_AUTOTUNE"
CACHE_DIR_ENV = "DIFF_ATTN_CACHE_DIR"
CACHE_FILE_NAME = "diff_attn_configs.json"
KERNELS = ("forward", "preprocess", "dkdv", "dq")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Sequence lengths share a tuning key up to the next power of two; below one large block the choice hardly matters.
MIN_LENGTH_BUCKET = 128
# Shared memory per block (opt-in) by compute capability, for when torch does not report it.
SHARED_MEMORY_BY_CAPABILITY = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 7): 163 * 1024}
SHARED_MEMORY_FALLBACK = 99 * 1024  # sm_86, sm_89, sm_120 and anything unknown
# Default-table entries must leave this fraction of the device's shared memory unused (Triton versions differ a little).
TABLE_SHARED_MEMORY_MARGIN = 0.10
# Most 32-bit tile values one thread may hold (by `tile_values_per_thread`) before ptxas spills badly (of 255).
MAX_TILE_VALUES_PER_THREAD = 192
# dK/dV spills in every config; on an H200 (benchmarks/results/kernel_tuning_NVIDIA-H200_2026-11-26.md) its fastest
# V1 d=128 configs sat at 216 and 240 by the estimate (2.96 and 3.29 ms against 9.6 ms for the old entry at 102), so
# autotuning times dK/dV candidates up to this limit.
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


def padded_dim(dim: int) -> int:
    """The block a head dimension is padded to: a power of two, and at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (dim - 1).bit_length())


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

    @classmethod
    def of(cls, kernel, dtype, head_dim, value_dim, shared_k, causal, n_q, n_k):
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
        return cls(kernel, dtype, head_dim, value_dim, bool(shared_k), bool(causal), bucket_length(n_q),
                   bucket_length(n_k))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def cache_key(self, device: DeviceInfo, triton_version: str) -> str:
        return "|".join([
            device.name, f"sm_{device.capability[0]}{device.capability[1]}", f"triton {triton_version}", self.kernel,
            self.dtype, f"d={self.head_dim}", f"dv={self.value_dim}", "v2" if self.shared_k else "v1",
            "causal" if self.causal else "full", f"nq<={self.n_q_bucket}", f"nk<={self.n_k_bucket}",
        ])


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    shared_memory: int  # bytes one block may use (opt-in maximum)


# ----------------------------------------------------------------------------------------------------------------
# Resources a config needs, computed before compiling
# ----------------------------------------------------------------------------------------------------------------


def shared_memory_bytes(kernel: str, config: BlockConfig, block_d: int, block_dv: int, shared_k: bool,
                        dtype_bytes: int) -> int:
    """Shared memory one program of `kernel` needs on sm_90 (Triton 3.6 and 3.9, aligned pointers and strides).

    Triton keeps every tile that feeds tl.dot in shared memory: the tiles a loop streams num_stages deep (its
    software pipeline), the tiles loaded once before the loop single. dK/dV also streams four fp32 row vectors (LSE
    and δ of both maps) per stage. Probability and dS tiles feed tl.dot from registers. check_compile.py prints this
    next to the compiler's figure: equal at 2 and 3 stages except dK/dV (up to 5 KiB above, 4 KiB of it a layout
    conversion buffer that V2 with BLOCK_N=64 and 8 warps needs), above it at 1 and 4 stages and where a tile is too
    small for wgmma (fewer than 64 rows a warpgroup: Triton then stages less).
    """
    m, n, stages = config.block_m, config.block_n, max(1, config.num_stages)
    k_tiles = 1 if shared_k else 2
    if kernel == "forward":  # streams K1ᵀ (and K2ᵀ) and V per key block; Q1 and Q2 stay
        elements = stages * n * (k_tiles * block_d + block_dv) + 2 * m * block_d
        extra_bytes = 0
    elif kernel == "preprocess":  # streams K2ᵀ and Vᵀ; Q2 and dO stay
        elements = stages * n * (block_d + block_dv) + m * (block_d + block_dv)
        extra_bytes = 0
    elif kernel == "dkdv":  # streams Q1ᵀ, Q2ᵀ and dO per query block; K1 (and K2) and V stay
        elements = stages * m * (2 * block_d + block_dv) + n * (k_tiles * block_d + block_dv)
        # The compiler rounds the row vectors to 1 KiB, and some layouts need a 4 KiB conversion buffer besides.
        extra_bytes = -(-stages * 4 * m * 4 // 1024) * 1024 + 4096
    elif kernel == "dq":  # streams K1 (and K2) and Vᵀ; Q1, Q2 and dO stay
        elements = stages * n * (k_tiles * block_d + block_dv) + m * (2 * block_d + block_dv)
        extra_bytes = 0
    else:
        raise ValueError(f"kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    return elements * dtype_bytes + extra_bytes


def tile_values_per_thread(kernel: str, config: BlockConfig, block_d: int, block_dv: int, shared_k: bool,
                           dtype_bytes: int) -> float:
    """32-bit registers one thread needs for its accumulators, score tiles and resident tiles (the bulk of them).

    An estimate for pruning autotuning candidates, checked against ptxas on sm_90: forward, preprocess and dQ configs
    at or below MAX_TILE_VALUES_PER_THREAD spilled at most 64 bytes, those above it up to 3 KiB; dK/dV spills some
    bytes in every config, hundreds to thousands above it.
    """
    m, n = config.block_m, config.block_n
    if kernel == "forward":  # acc1, acc2; S and P of both maps
        values = 2 * m * block_dv + 2 * m * n
    elif kernel == "preprocess":  # P2 and dP; the O tile
        values = 2 * m * n + m * block_dv
    elif kernel == "dkdv":  # dK1 (and dK2) and dV; P1ᵀ, P2ᵀ and dPᵀ; K1 (and K2) and V stay in registers too
        resident = n * ((1 if shared_k else 2) * block_d + block_dv)
        values = resident + 3 * m * n + resident * dtype_bytes / 4
    elif kernel == "dq":  # dQ1 and dQ2; P1, P2 and dP
        values = 2 * m * block_d + 3 * m * n
    else:
        raise ValueError(f"kernel={kernel!r}; expected one of {', '.join(KERNELS)}")
    return values / (32 * config.num_warps)


def problem_shared_memory(problem: KernelProblem, config: BlockConfig) -> int:
    return shared_memory_bytes(problem.kernel, config, padded_dim(problem.head_dim), padded_dim(problem.value_dim),
                               problem.shared_k, problem.dtype_bytes)


def fits(problem: KernelProblem, config: BlockConfig, shared_memory_limit: int) -> bool:
    """Whether `config` fits the device's shared memory and (by the estimate) its registers without heavy spilling."""
    values = tile_values_per_thread(problem.kernel, config, padded_dim(problem.head_dim),
                                    padded_dim(problem.value_dim), problem.shared_k, problem.dtype_bytes)
    limit = MAX_TILE_VALUES_PER_THREAD_DKDV if problem.kernel == "dkdv" else MAX_TILE_VALUES_PER_THREAD
    return problem_shared_memory(problem, config) <= shared_memory_limit and values <= limit


# ----------------------------------------------------------------------------------------------------------------
# The default table
# ----------------------------------------------------------------------------------------------------------------


def _entries(**by_kernel):
    return {kernel: BlockConfig(*values) for kernel, values in by_kernel.items()}


# (capability major, head-dim block, value-dim block) -> kernel -> config. Head dims below 64 use the 64 entries.
# Chosen from sm_90 compiles of candidates (Triton 3.6, registers from ptxas -v; configs_sm90.md lists them): the
# largest tiles that leave TABLE_SHARED_MEMORY_MARGIN of the shared memory free in bf16/fp16 and spill no registers
# in forward, preprocess and dQ. dK/dV spilled in nearly every config compiled (its resident dK1, dK2, dV and K1,
# K2, V tiles are as wide as a 4d-wide attention's). Hopper's V1 d=128 entries were timed on an H200 at N=4096
# (benchmarks/kernel_tuning.py): dK/dV is the fastest candidate; forward and dQ the fastest that leave the margin
# (their fastest, at 3 stages, leave less: 10% and 18% faster there); the other entries are not timed yet:
# DIFF_ATTN_AUTOTUNE=1 times the alternatives. fp32 (TF32) configs are shrunk by `fit_to_device` where needed.
DEFAULT_CONFIGS = {
    # Hopper (H100, H200): 227 KiB shared memory.
    (9, 64, 128): _entries(forward=(128, 64, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                           dq=(128, 64, 8, 3)),  # V1 d <= 64
    (9, 128, 256): _entries(forward=(64, 64, 8, 2), preprocess=(128, 32, 8, 3), dkdv=(32, 64, 8, 3),
                            dq=(128, 32, 8, 2)),  # V1 d = 96, 128 (timed on an H200)
    (9, 64, 64): _entries(forward=(128, 64, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                          dq=(128, 64, 8, 3)),  # V2 d <= 64
    (9, 128, 128): _entries(forward=(128, 32, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                            dq=(128, 32, 8, 3)),  # V2 d = 96, 128
    # Ampere (A100: 163 KiB) and the base for architectures without entries: Hopper's, with stages or blocks cut
    # where they would not leave the margin or spilled on sm_80 (check_compile.py --arch 80: at most 88 bytes).
    (8, 64, 128): _entries(forward=(64, 64, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                           dq=(128, 64, 8, 2)),
    (8, 128, 256): _entries(forward=(64, 32, 8, 3), preprocess=(128, 32, 8, 2), dkdv=(16, 32, 8, 3),
                            dq=(64, 32, 8, 2)),
    (8, 64, 64): _entries(forward=(128, 64, 8, 3), preprocess=(128, 64, 8, 3), dkdv=(16, 128, 8, 3),
                          dq=(128, 64, 8, 3)),
    (8, 128, 128): _entries(forward=(128, 32, 8, 3), preprocess=(128, 64, 8, 2), dkdv=(16, 128, 8, 3),
                            dq=(128, 32, 8, 3)),
}
TABLE_ARCHS = sorted({major for major, _, _ in DEFAULT_CONFIGS})


def table_key(capability_major: int, head_dim: int, value_dim: int) -> tuple[int, int, int]:
    """The DEFAULT_CONFIGS key for a problem: architectures without entries use the nearest older one (or sm_80's)."""
    older = [major for major in TABLE_ARCHS if major <= capability_major]
    arch = max(older) if older else TABLE_ARCHS[0]
    return arch, max(64, padded_dim(head_dim)), max(64, padded_dim(value_dim))


def fit_to_device(problem: KernelProblem, config: BlockConfig, shared_memory_limit: int) -> BlockConfig:
    """`config`, made smaller one deterministic step at a time until it fits the shared memory: fewer stages, then a
    smaller streamed block (keys in forward, preprocess and dQ; queries in dK/dV), then a smaller resident block.
    Registers are not estimated here: the table's entries are checked against ptxas by check_compile.py."""
    streamed = "block_m" if problem.kernel == "dkdv" else "block_n"
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


def _halve(config: BlockConfig, field: str) -> BlockConfig:
    values = dict(block_m=config.block_m, block_n=config.block_n, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    values[field] //= 2
    return BlockConfig(**values)


def default_config(problem: KernelProblem, device: DeviceInfo) -> BlockConfig:
    """The table's config for `problem` on `device`, fitted to the device."""
    entry = DEFAULT_CONFIGS[table_key(device.capability[0], problem.head_dim, problem.value_dim)][problem.kernel]
    return fit_to_device(problem, entry, device.shared_memory)


# ----------------------------------------------------------------------------------------------------------------
# Autotuning (opt-in) and its disk cache
# ----------------------------------------------------------------------------------------------------------------

# Blocks autotuning tries, by kernel: dK/dV streams query blocks (BLOCK_M) past resident key blocks (BLOCK_N).
_CANDIDATE_BLOCKS = {
    "dkdv": [(16, 128), (16, 64), (32, 64), (32, 128), (16, 32), (32, 32), (64, 64)],
    "other": [(128, 64), (128, 32), (64, 64), (64, 32), (64, 128), (128, 128)],
}


def _candidates(kernel: str) -> list[BlockConfig]:
    blocks = _CANDIDATE_BLOCKS["dkdv" if kernel == "dkdv" else "other"]
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
    """Name, capability and shared memory per block of a CUDA device (torch's figure, else by capability)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    capability = (props.major, props.minor)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or SHARED_MEMORY_BY_CAPABILITY.get(
        capability, SHARED_MEMORY_FALLBACK)
    return DeviceInfo(props.name, capability, int(shared))


def within_table_margin(nbytes: int, shared_memory_limit: int) -> bool:
    return nbytes <= math.floor(shared_memory_limit * (1 - TABLE_SHARED_MEMORY_MARGIN))
