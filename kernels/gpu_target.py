"""The GPU the Triton launchers plan for: the device itself, or, in Triton's interpreter, a simulated one.

Launchers decide by device: block configs by compute capability and shared memory, programs by multiprocessor count,
the scratch allocator that tensor-descriptor (TMA) kernels ask the host for. In the interpreter
(``TRITON_INTERPRET=1``) they normally take a CPU branch of their own, which no GPU ever runs. With
``DIFF_ATTN_SIMULATE_GPU=sm_90`` (or ``sm_80``) set as well, or inside ``simulate("sm_90")``, they take the GPU
branch: the table's configs for that device, its multiprocessors, the allocator set per thread and required by every
descriptor launch as a GPU requires it. The interpreter still runs the kernels, so CI runs every decision a GPU launch
makes; on a GPU only the compiler differs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SIMULATE_ENV = "DIFF_ATTN_SIMULATE_GPU"


@dataclass(frozen=True)
class GPU:
    name: str
    capability: tuple[int, int]
    shared_memory: int  # bytes one block may use (the opt-in maximum)
    multiprocessors: int
    memory: int  # bytes of device memory (total_memory)


# The devices the launchers' tables are written for, with their figures as torch reports them (the H100's memory as
# nvidia-smi showed it on a lent machine, 81,559 MiB; the A100's its data sheet's 80 GiB).
SIMULATED_GPUS = {
    "sm_90": GPU("NVIDIA H100 80GB HBM3", (9, 0), 232448, 132, 81559 * 2**20),
    "sm_80": GPU("NVIDIA A100-SXM4-80GB", (8, 0), 166912, 108, 80 * 2**30),
}


def _parse_simulated(value: str) -> GPU | None:
    value = value.strip()
    if not value:
        return None
    if value not in SIMULATED_GPUS:
        raise ValueError(f"{SIMULATE_ENV}={value!r}; expected one of {', '.join(SIMULATED_GPUS)} (or unset)")
    if not INTERPRET:
        raise ValueError(f"{SIMULATE_ENV}={value} simulates a GPU in Triton's interpreter; set TRITON_INTERPRET=1 "
                         "before importing triton, or unset it to launch on the GPU")
    return SIMULATED_GPUS[value]


_simulated: GPU | None = _parse_simulated(os.environ.get(SIMULATE_ENV, ""))


def simulated() -> GPU | None:
    """The simulated GPU, or None (a real GPU, or the interpreter's own branch)."""
    return _simulated


def gpu_branch() -> bool:
    """Whether launchers take their GPU branch: on a GPU, or in the interpreter simulating one."""
    return not INTERPRET or _simulated is not None


def key() -> str:
    """What launchers' memos of device decisions are keyed by, besides the device index."""
    if _simulated is not None:
        return f"simulated {_simulated.name}"
    return "interpreter" if INTERPRET else "cuda"


@contextlib.contextmanager
def simulate(arch: str):
    """Launch as on ``arch`` (a key of SIMULATED_GPUS) inside the block; needs the interpreter."""
    global _simulated
    previous = _simulated
    _simulated = _parse_simulated(arch)
    try:
        yield _simulated
    finally:
        _simulated = previous


_PROPERTIES: dict[int, GPU] = {}


def device_properties(device: torch.device) -> GPU:
    """The figures of ``device`` (the simulated GPU's in a simulation)."""
    if _simulated is not None:
        return _simulated
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROPERTIES:
        props = torch.cuda.get_device_properties(index)
        _PROPERTIES[index] = GPU(props.name, (props.major, props.minor),
                                 int(getattr(props, "shared_memory_per_block_optin", 0) or 0),
                                 props.multi_processor_count, props.total_memory)
    return _PROPERTIES[index]


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


_NO_ALLOCATOR = "Kernel requires a runtime memory allocation, but no allocator was set."


def _allocator_var():
    from triton.runtime import _allocation

    return _allocation._allocator


def ensure_allocator() -> None:
    """Set Triton's scratch allocator in this thread where none is. Triton keeps it per thread (a context variable),
    and autograd runs a CUDA backward on a device thread of its own, so the forward's thread setting it is not
    enough: every launcher that may launch a descriptor kernel calls this."""
    if not gpu_branch():
        return
    from triton.runtime import _allocation

    if isinstance(_allocator_var().get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def require_allocator() -> None:
    """In a simulation, fail as a GPU launch of a descriptor kernel fails when this thread has no allocator."""
    if _simulated is None:
        return
    from triton.runtime import _allocation

    if isinstance(_allocator_var().get(), _allocation.NullAllocator):
        raise RuntimeError(f"{_NO_ALLOCATOR} Use triton.set_allocator to specify an allocator. "
                           f"(simulated {_simulated.name}, thread {threading.current_thread().name})")
