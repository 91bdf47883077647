"""Find, on any device, the places where code reads a tensor's values on the host: on a GPU each one waits until the
device has finished the work queued before it (a host sync), and the device then idles while the host refills its
queue.

:class:`HostReads` is a context manager that records each such read with the Python line that made it: the Python
reads (``item``, ``tolist``, ``numpy``, ``bool``/``float``/``int``/``index`` of a tensor, a blocking ``cpu()`` or
``to("cpu")``), ``torch.tensor`` of host numbers on a named device (a blocking copy to a GPU), and the operators that
read values inside torch or a library (``_local_scalar_dense``, operators whose output shape depends on the values,
such as ``nonzero`` or indexing with a boolean mask). On a CPU nothing waits, but the same code makes the same reads,
so a CPU test can count a GPU step's syncs.
"""

from __future__ import annotations

import collections
import os
import traceback
from typing import Counter, List, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that hand the host a tensor's values
PYTHON_READS = frozenset({"item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
                          "__format__"})
# Tensor methods that copy to the host; blocking unless non_blocking=True (into pinned memory, then no wait)
HOST_COPIES = frozenset({"cpu", "to"})
# operators that read values on the host: a scalar's value, an output shape that depends on the values, a comparison
# returned as a Python bool
SYNCING_OPERATORS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_numpy", "is_nonzero", "equal",
                               "masked_select", "_unique2", "unique_dim", "unique_consecutive", "allclose",
                               "repeat_interleave"})
# indexing with a boolean mask: its output shape is the mask's count of trues
_MASK_INDEXING = frozenset({"index", "index_put", "index_put_"})
# frames that are the machinery, not the caller
_SKIPPED_FRAMES = (os.sep + os.path.join("torch", ""), os.path.abspath(__file__))
# reads that are of host tensors on a GPU too: data loading (in worker processes there)
HOST_SIDE = (os.path.join("torch", "utils", "data", ""),)


def call_site(depth: int = 1, stack=None) -> str:
    """``path:line`` of the innermost frame outside torch and this module (``depth`` frames, innermost first, joined by
    `` <- ``); paths relative to the working directory where they lie under it."""
    stack = traceback.extract_stack()[:-1] if stack is None else stack
    frames = [f for f in stack if not any(s in f.filename for s in _SKIPPED_FRAMES)]
    names = []
    for frame in frames[-depth:]:
        path = os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd()) else frame.filename
        names.append(f"{path}:{frame.lineno}")
    return " <- ".join(reversed(names))


def _is_host_copy(name: str, args, kwargs) -> bool:
    """``cpu()``, or ``to("cpu")`` named as a string, blocking. A ``torch.device`` argument is taken for the code's
    device (the CPU itself on a CPU run, where a copy to it cannot be told from no copy)."""
    if kwargs.get("non_blocking") or (name == "to" and any(a is True for a in args[2:])):
        return False
    if name == "cpu":
        return True
    targets = [a for a in args[1:] if isinstance(a, str)] + [kwargs.get("device")]
    return any(isinstance(t, str) and torch.device(t).type == "cpu" for t in targets)


def _has_mask(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class _PythonReads(TorchFunctionMode):
    def __init__(self, owner: "HostReads"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in PYTHON_READS or (name in HOST_COPIES and _is_host_copy(name, args, kwargs)):
            self.owner._record(name)
            self.owner._inside += 1  # the operators this read runs are the same read
            try:
                return func(*args, **kwargs)
            finally:
                self.owner._inside -= 1
        return func(*args, **kwargs)


class _OperatorReads(TorchDispatchMode):
    def __init__(self, owner: "HostReads"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if not self.owner._inside and (name in SYNCING_OPERATORS or (name in _MASK_INDEXING and _has_mask(args))):
            self.owner._record(f"aten::{name}")
        return func(*args, **(kwargs or {}))


class HostReads:
    """Records every host read of a tensor's values made while it is entered: ``reads`` lists (what, where), in
    order; ``depth`` frames of each call site (innermost first). Reads with a frame of a file whose path contains one
    of ``host_side`` are left out: they read host tensors, also on a GPU."""

    def __init__(self, depth: int = 1, host_side: Sequence[str] = HOST_SIDE):
        self.depth = depth
        self.host_side = tuple(host_side)
        self.reads: List[Tuple[str, str]] = []
        self._inside = 0
        self._modes = (_PythonReads(self), _OperatorReads(self))

    def _record(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if not any(part in frame.filename for frame in stack for part in self.host_side):
            self.reads.append((what, call_site(self.depth, stack)))

    def counts(self) -> Counter:
        """How many reads each (what, where) made."""
        return collections.Counter(self.reads)

    def __enter__(self) -> "HostReads":
        self._tensor = torch.tensor
        torch.tensor = self._watched_tensor
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        torch.tensor = self._tensor

    def _watched_tensor(self, data, *args, **kwargs):
        """torch.tensor: host numbers made into a tensor on a named device, a blocking copy to a GPU."""
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            self._record("tensor(device=)")
        self._inside += 1
        try:
            return self._tensor(data, *args, **kwargs)
        finally:
            self._inside -= 1

    def __str__(self) -> str:
        return "; ".join(f"{what} at {where} x{n}" for (what, where), n in self.counts().items()) or "no host reads"
