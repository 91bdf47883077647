"""Process groups and every collective the framework calls itself: the one place that knows which device a
collective's tensors must live on.

NCCL only reduces CUDA tensors and gloo only CPU tensors, so every scalar, flag or count that crosses ranks is
allocated by :func:`collective_device` for the group it is reduced on, and read back to a Python value here; tensors
that already live somewhere (gradients) go through :func:`all_reduce_tensor`, which refuses a tensor on the wrong
device with a message instead of NCCL's "No backend type associated with device type cpu". No other module calls a
``torch.distributed`` collective (tests/test_distributed.py checks).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any, List, Optional, Sequence

import torch

from diff_transformer import compat


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    """A TCP port free on this host right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_torch_env_from_slurm() -> bool:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from SLURM for processes that srun starts directly
    (one per GPU, as the submitit launcher does), when torchrun has not set them; True when it set them."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return False
    env = os.environ
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(int(env["SLURM_NTASKS"]) // int(env.get("SLURM_NNODES", "1")))
    if "MASTER_ADDR" not in env:
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], check=True, capture_output=True, text=True
        ).stdout.split()
        env["MASTER_ADDR"] = hosts[0]
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    return True


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_distributed(backend: str, tp: int = 1, pp: int = 1, seed: int = 0, cp: int = 1) -> None:
    """Start the default process group (torchrun's env, or a single local process) and megatron's TP/CP/PP groups
    (megatron's order tp-cp-ep-dp-pp: the ranks of a TP group are adjacent, then those of a CP group)."""
    compat.apply_cpu_patches()
    compat.apply_grad_norm_patches()
    compat.keep_grad_norm_on_device(all_reduce_tensor)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    backend = resolve_backend(backend)
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend=backend)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    if "megatron.core.parallel_state" in sys.modules:  # never imported (a start refused early): nothing to tear down
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def device_type_for_backend(backend: str) -> str:
    """``cuda`` for NCCL, ``cpu`` for gloo (and for anything else torch runs on the CPU)."""
    return "cuda" if str(backend).lower() == "nccl" else "cpu"


def collective_device(group: Optional[Any] = None) -> torch.device:
    """The device a tensor must live on to be reduced over ``group`` (default: the world)."""
    if not torch.distributed.is_initialized():
        return torch.device("cpu")
    if device_type_for_backend(torch.distributed.get_backend(group)) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_REDUCE_OPS = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}


def all_reduce_tensor(tensor: torch.Tensor, group: Optional[Any] = None, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (``op``: sum or max); it must already live where the group's backend
    reduces."""
    if _is_trivial(group):
        return tensor
    _check_device(tensor, group, "all_reduce_tensor")
    torch.distributed.all_reduce(tensor, op=_REDUCE_OPS[op], group=group)
    return tensor


def all_gather_tensor(tensor: torch.Tensor, group: Optional[Any] = None) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape and dtype on every rank of ``group``), in group-rank order; it must
    already live where the group's backend gathers."""
    if _is_trivial(group):
        return [tensor]
    _check_device(tensor, group, "all_gather_tensor", "gathered over")
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


def _check_device(tensor: torch.Tensor, group: Optional[Any], what: str, verb: str = "reduced over") -> None:
    expected = device_type_for_backend(torch.distributed.get_backend(group))
    if tensor.device.type != expected:
        raise RuntimeError(
            f"{what}: a {tensor.device.type} tensor cannot be {verb} a "
            f"{torch.distributed.get_backend(group)} group, which needs {expected} tensors"
        )


def _is_trivial(group: Optional[Any]) -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1


def all_reduce_values(
    values: Sequence[float], group: Optional[Any] = None, op: str = "sum", dtype: torch.dtype = torch.float64
) -> List[float]:
    """Reduce Python numbers over ``group`` (``op``: sum or max) and return them as Python numbers on every rank (a
    group of one: no device tensor, so no host sync)."""
    if _is_trivial(group):
        if dtype == torch.float64 or not dtype.is_floating_point:
            return [float(v) if dtype.is_floating_point else int(v) for v in values]
        return torch.tensor(list(values), dtype=dtype).tolist()  # rounded to dtype, as a reduction would
    tensor = torch.tensor(list(values), dtype=dtype, device=collective_device(group))
    torch.distributed.all_reduce(tensor, op=_REDUCE_OPS[op], group=group)
    return tensor.cpu().tolist()


def any_rank(flag: bool, group: Optional[Any] = None) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``group`` (collective)."""
    return bool(all_reduce_values([1 if flag else 0], group, op="max", dtype=torch.int32)[0])


def broadcast_values(values: Sequence[float], src: int, group: Optional[Any] = None) -> List[float]:
    """Rank ``src``'s numbers (global rank) on every rank of ``group``; other ranks pass placeholders of the same
    length."""
    if _is_trivial(group):
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    torch.distributed.broadcast(tensor, src=src, group=group)
    return tensor.cpu().tolist()


def broadcast_tensor(tensor: torch.Tensor, src: int, group: Optional[Any] = None) -> torch.Tensor:
    """Rank ``src``'s ``tensor`` (global rank) in place on every rank of ``group`` (the others pass one of the same
    shape and dtype), without leaving the device."""
    if _is_trivial(group):
        return tensor
    _check_device(tensor, group, "broadcast_tensor", "broadcast over")
    torch.distributed.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    """A picklable object from global rank ``src`` on every rank (small payloads: decisions, paths)."""
    if _is_trivial(group):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, group=group)  # NCCL: staged on the current CUDA device
    return box[0]


def all_gather_objects(obj: Any, group: Optional[Any] = None) -> List[Any]:
    if _is_trivial(group):
        return [obj]
    gathered: List[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, obj, group=group)
    return gathered


class RingExchange:
    """The sends and receives of one step around a ring, in flight; :meth:`wait` returns the received tensors."""

    def __init__(self, requests: List[Any], sent: List[torch.Tensor], received: List[torch.Tensor]):
        self._requests = requests
        self._sent = sent  # alive until the sends complete
        self._received = received

    def wait(self) -> List[torch.Tensor]:
        for request in self._requests:
            request.wait()
        return self._received


def ring_exchange(tensors: Sequence[torch.Tensor], group: Any) -> RingExchange:
    """Start sending ``tensors`` to the next rank of ``group`` (group rank + 1, wrapping) and receiving tensors of the
    same shapes and dtypes from the previous one, without waiting: the caller computes, then calls ``wait()``.
    Every rank of the group calls it with the same shapes (context parallelism's ring attention)."""
    for tensor in tensors:
        _check_device(tensor, group, "ring_exchange", "sent around")
    ranks = torch.distributed.get_process_group_ranks(group)
    me = torch.distributed.get_rank(group)
    send_to, receive_from = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    operations = [torch.distributed.P2POp(torch.distributed.isend, t, send_to, group) for t in sent]
    operations += [torch.distributed.P2POp(torch.distributed.irecv, t, receive_from, group) for t in received]
    return RingExchange(torch.distributed.batch_isend_irecv(operations), sent, received)


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
