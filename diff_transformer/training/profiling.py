"""Where one training step's time goes (``trainer.profile_step``): torch.profiler over the step, every kernel (on a
GPU) or every operator's own CPU time (on a CPU) put in one of a few kinds of work, and what is left of the step's
wall time as idle (the device waiting for the host: launches, syncs, Python).

On a GPU the profile also says where the idle comes from: every gap in which no kernel (or copy) ran, put on the
operator that launched the kernel after it, with the module it ran in (a profiler range per module call, on the
profiled step only, when the layers are not compiled) or the backward node; and the host syncs inside the step, counted
from the CUDA runtime's synchronising calls, with the Python line of each (``torch.cuda.set_sync_debug_mode``).
Its memsets and fill kernels are counted by the call site of the operator that launched them (``device_fills``);
the same call sites name the fills of a CPU profile (``zero_fills``, ``benchmarks/zero_fills.py``).

Kinds, tried in this order on the kernel's or operator's name and on the names of the operators and profiler ranges
around it: DIFF epilogue, attention, communication, optimizer (the whole optimizer step: gradient norm, clipping,
AdamW), GEMM, norms, other elementwise. The table is written to ``<run dir>/profile_step_<N>.json`` and read by
``benchmarks/train_throughput.py``.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from diff_transformer.fileio import atomic_write_json

CATEGORIES = ("GEMM", "attention", "DIFF epilogue", "norms", "other elementwise", "optimizer", "communication", "idle")

# (kind, substrings of a lower-cased name), first match wins
_PATTERNS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("DIFF epilogue", ("diff_epilogue", "diffepilogue")),
    ("attention", ("flash", "fmha", "scaled_dot_product", "sdpa", "attention", "_diff_attn", "cudnn_attn", "mha_")),
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
                       "c10d", "gloo", "sendrecv", "isend", "irecv")),
    ("optimizer", ("optimizer.step", "adam", "multi_tensor", "_foreach_", "clip_grad")),
    ("GEMM", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "cublas",
              "cutlass", "xmma", "nvjet", "wgmma", "mkldnn")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "layernorm")),
)
# profiler ranges whose own time is not work of the step
MODULE_RANGE = "module: "  # the prefix of the per-module ranges of a profiled step
_WRAPPERS = ("profilerstep", "[memory]", "train_step", MODULE_RANGE)
# the CUDA runtime calls that wait for the device (cudaMemcpyAsync to pageable memory is followed by one of these)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_BACKWARD_NODE = "autograd::engine::evaluate_function: "
# a CUDA runtime or driver call on the host (cudaLaunchKernel, cuLaunchKernelEx, cudaMemsetAsync, ...)
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")
# the operators that fill a tensor (torch.zeros, zeros_like, new_zeros, ones, full: an allocation, then one of these)
FILL_OPS = ("aten::zero_", "aten::fill_")
# frames that only pass a call on: compat's CPU stand-in for megatron-core's CUDA tensor factories
_PASS_THROUGH = {("diff_transformer/compat.py", "_on_cpu")}
# an inductor kernel that does nothing but fill (triton_poi_fused_zeros_0), not one with a fill fused into other work
_INDUCTOR_FILL = re.compile(r"^triton_[a-z]+_fused_(zeros|zeros_like|new_zeros|full|full_like|fill|ones)_\d+$")
# a Python frame of a profile recorded with_stack: "path(line): function"
_FRAME = re.compile(r"^(?P<path>[^<(][^(]*\.py)\(\d+\): ")


def categorize(name: str, context: Sequence[str] = ()) -> str:
    """The kind of work of a kernel or operator ``name`` launched inside ``context`` (the names of the operators and
    ranges around it, innermost first): the first kind whose pattern matches the name, else the context."""
    for candidate in (name, *context):
        lowered = candidate.lower()
        for kind, patterns in _PATTERNS:
            if any(p in lowered for p in patterns):
                return kind
    return "other elementwise"


def _context(event) -> List[str]:
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def _work_context(event) -> List[str]:
    """The context that decides a kind of work: module ranges left out (an elementwise operator in a module named
    ...Attention is not attention work)."""
    return [name for name in _context(event) if not name.startswith(MODULE_RANGE)]


def launch_site(op) -> str:
    """Where a host operator ran: its name, the innermost module range around it, the backward node it belongs to."""
    names = _context(op)
    site = op.name
    module = next((n[len(MODULE_RANGE):] for n in names if n.startswith(MODULE_RANGE)), None)
    if module:
        site += f" in {module}"
    node = next((n[len(_BACKWARD_NODE):] for n in names if n.startswith(_BACKWARD_NODE)), None)
    if node:
        site += f" in {node} (backward)"
    return site


def _is_device(event) -> bool:
    device_type = getattr(event, "device_type", None)
    return device_type is not None and device_type.name == "CUDA"


def _is_device_work(event) -> bool:
    """A kernel, copy or fill on the GPU (the profiler's ranges projected onto the GPU's timeline are not work)."""
    return _is_device(event) and not getattr(event, "is_user_annotation", False)


class Launchers:
    """The host operator that launched each device event of a profile, found in the first way that works: the
    operator the profiler linked it to (``linked_correlation_id``); else the CUDA runtime call of the same correlation
    id (``cudaLaunchKernel``, ``cudaMemsetAsync``, ...) and the operator around that call (its ``cpu_parent``, its
    linked operator, or the innermost operator whose time span holds it). ``how`` counts each way's uses."""

    WAYS = ("linked", "runtime call", "time span", "not recorded")

    def __init__(self, events: Sequence):
        host = [e for e in events if not _is_device(e)]
        # operators and runtime calls number their ids apart (the profiler's and CUPTI's correlation ids)
        self._linked = {e.id: e for e in host if getattr(e, "linked_correlation_id", 0) == 0
                        and not _RUNTIME_CALL.match(e.name)}
        self._calls = {e.id: e for e in host if _RUNTIME_CALL.match(e.name)}
        ops = sorted((e for e in host if not _RUNTIME_CALL.match(e.name) and not getattr(e, "is_async", False)
                      and not getattr(e, "is_python_function", False)), key=lambda e: e.time_range.start)
        self._ops, self._starts = ops, [e.time_range.start for e in ops]
        self.how = {way: 0 for way in self.WAYS}
        self.misses: List[Dict[str, Any]] = []  # a few device events without a launcher, as the profile had them

    def _around(self, call, horizon: int = 1024):
        """The innermost operator whose span holds ``call`` (the latest to start among those not yet ended)."""
        at = call.time_range.start
        last = bisect.bisect_right(self._starts, at) - 1
        for i in range(last, max(-1, last - horizon), -1):
            if self._ops[i].time_range.end >= call.time_range.end:
                return self._ops[i]
        return None

    def launcher(self, event):
        """The launching operator of device event ``event``, or None; counted in ``how``."""
        op, way = self._linked.get(getattr(event, "linked_correlation_id", 0) or None), "linked"
        if op is None:
            call = self._calls.get(event.id)
            way = "runtime call"
            op = None if call is None else (call.cpu_parent or self._linked.get(call.linked_correlation_id or None))
            if op is None and call is not None:
                op, way = self._around(call), "time span"
        self.how[way if op is not None else "not recorded"] += 1
        if op is None and len(self.misses) < 5:
            self.misses.append({"name": event.name[:80], "id": event.id,
                                "linked_correlation_id": getattr(event, "linked_correlation_id", 0),
                                "runtime_call": getattr(self._calls.get(event.id), "name", None)})
        return op


def _python_frame(op, within_node: bool = False) -> Optional[str]:
    """The innermost Python frame around ``op`` outside torch (profiles recorded with_stack), as the profiler names it:
    ``path(first line of the function): function``; ``within_node``: only below the backward node around ``op``
    (a Python backward's own frames; above the node is the caller of ``backward()``)."""
    parent = op
    while parent is not None:
        if within_node and parent.name.startswith(_BACKWARD_NODE):
            return None
        match = _FRAME.match(parent.name)
        if (match and not match["path"].startswith("torch/")
                and (match["path"], parent.name.rsplit(": ", 1)[-1]) not in _PASS_THROUGH):
            return parent.name
        parent = parent.cpu_parent
    return None


def call_site(op, forward_frames: Optional[Dict[int, str]] = None) -> Tuple[str, str]:
    """(where, chain) of a host operator: ``launch_site`` of the outermost aten operator around it, with the Python
    frame that called it (in a backward node without Python frames of its own, the frame of the node's forward
    operator, from ``forward_frames``: sequence number to frame); and the chain of aten operators from there to
    ``op``."""
    chain, outer = [op.name], op
    while outer.cpu_parent is not None and outer.cpu_parent.name.startswith("aten::"):
        outer = outer.cpu_parent
        chain.append(outer.name)
    where = launch_site(outer)
    node = next((p for p in _parents(outer) if p.name.startswith(_BACKWARD_NODE)), None)
    frame = _python_frame(outer, within_node=node is not None)
    if frame is None and node is not None:
        forward = (forward_frames or {}).get(node.sequence_nr)
        frame = f"forward at {forward}" if forward else None
    return (f"{where} ({frame})" if frame else where), " > ".join(reversed(chain))


def _parents(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _compact(name: str) -> str:
    return name.removeprefix("aten::").replace("_", "").lower()


def _forward_frames(events: Sequence) -> Dict[int, str]:
    """Sequence number to the Python frame of the forward operator that made the backward node of that number
    (profiles recorded with_stack): an operator outside any backward node whose name begins the node's name
    (``aten::embedding`` for ``EmbeddingBackward0``; other operators record the same number)."""
    nodes = {e.sequence_nr: _compact(e.name[len(_BACKWARD_NODE):]) for e in events
             if e.name.startswith(_BACKWARD_NODE) and getattr(e, "sequence_nr", -1) >= 0}
    frames: Dict[int, str] = {}
    for event in events:
        node = nodes.get(getattr(event, "sequence_nr", -1))
        if node is None or event.sequence_nr in frames or not node.startswith(_compact(event.name)):
            continue
        if not any(p.name.startswith(_BACKWARD_NODE) for p in _parents(event)):
            frame = _python_frame(event)
            if frame:
                frames[event.sequence_nr] = frame
    return frames


def _fill_kind(name: str) -> Optional[str]:
    """"memset", "fill" (torch's fill kernel, or an inductor kernel that only fills), or None."""
    lowered = name.lower()
    if "memset" in lowered:
        return "memset"
    if "fillfunctor" in lowered or _INDUCTOR_FILL.match(name):
        return "fill"
    return None


def _memset_bytes(event) -> Optional[int]:
    """The bytes a memset wrote, where the profile records them (torch ≥ 2.12: ``event_metadata``; before: the
    activity's metadata JSON)."""
    metadata = getattr(event, "event_metadata", None)
    if getattr(metadata, "bytes", None) is not None:
        return metadata.bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch ≥ 2.12 deprecates metadata_json
        match = re.search(r'"bytes":\s*(\d+)', getattr(event, "metadata_json", None) or "")
    return int(match.group(1)) if match else None


def device_fills(events: Iterable, launchers: Optional[Launchers] = None) -> List[Dict[str, Any]]:
    """The memsets and fill kernels on the device by kind and ``call_site`` of the operator that launched each:
    count, bytes (memsets whose trace records them), milliseconds of device time, and the device work that most
    often came next on the same stream (what a fill prepares: a library's memset precedes its kernel); most first.
    Where no launcher is recorded the site says so, with the kernel's name."""
    events = list(events)
    launchers = launchers or Launchers(events)
    following: Dict[int, str] = {}
    streams: Dict[Any, List[Any]] = {}
    for event in sorted((e for e in events if _is_device_work(e)), key=lambda e: e.time_range.start):
        streams.setdefault(getattr(event, "device_resource_id", None), []).append(event)
    for work in streams.values():
        for event, after in zip(work, work[1:]):
            following[id(event)] = after.name[:80]
    sites: Dict[Tuple[str, str, str], Dict[str, Any]] = {}
    for event in events:
        kind = _fill_kind(event.name) if _is_device_work(event) else None
        if kind is None:
            continue
        op = launchers.launcher(event)
        where, chain = call_site(op) if op is not None else (f"{event.name[:80]} (launcher not recorded)", "")
        row = sites.setdefault((kind, where, chain), {"kind": kind, "site": where, "chain": chain, "count": 0,
                                                     "bytes": 0, "ms": 0.0, "next": {}})
        row["count"] += 1
        row["bytes"] += _memset_bytes(event) or 0
        row["ms"] += (event.time_range.end - event.time_range.start) * 1e-3
        after = following.get(id(event), "(none)")
        row["next"][after] = row["next"].get(after, 0) + 1
    for row in sites.values():  # the most frequent next work, with how many of the row's fills it followed
        name, count = max(row["next"].items(), key=lambda x: x[1])
        row["next"] = {"name": name, "count": count}
    return sorted(sites.values(), key=lambda r: (-r["count"], -r["ms"]))


def zero_fills(events: Iterable) -> List[Dict[str, Any]]:
    """The fills a host profile records (a CPU step; on a GPU the host side of each memset and fill kernel): every
    ``FILL_OPS`` operator not inside another, by ``call_site`` (with its Python frame when recorded with_stack) and
    the operator it was called as; count and elements filled (None unless recorded with shapes); most first."""
    events = [e for e in events if not _is_device(e)]
    frames = _forward_frames(events)
    sites: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for event in events:
        if event.name not in FILL_OPS or any(p.name in FILL_OPS for p in _parents(event)):
            continue
        where, chain = call_site(event, frames)
        row = sites.setdefault((where, chain), {"site": where, "chain": chain, "count": 0, "elements": None})
        row["count"] += 1
        shapes = getattr(event, "input_shapes", None)  # recorded with shapes: the filled tensor's first
        if shapes:
            row["elements"] = (row["elements"] or 0) + int(torch.Size(shapes[0]).numel())
    return sorted(sites.values(), key=lambda r: (-r["count"], r["site"]))


def idle_gaps(events: Iterable, top: int = 12, launchers: Optional[Launchers] = None
              ) -> Tuple[float, List[Dict[str, Any]]]:
    """(seconds the device was busy, the gaps between its work by where they end): every interval in which no
    kernel or copy ran, from the first device event of the step to its last, put on the launch site of the event that
    ends it (``launch_site`` of the operator that launched it), largest total first."""
    events = list(events)
    launchers = launchers or Launchers(events)
    device = sorted((e for e in events if _is_device_work(e)), key=lambda e: e.time_range.start)
    busy, gaps = 0.0, {}
    end = None
    for event in device:
        start, stop = event.time_range.start, event.time_range.end
        if end is not None and start > end:
            launcher = launchers.launcher(event)
            site = launch_site(launcher) if launcher is not None else f"{event.name} (launcher not recorded)"
            gap = gaps.setdefault(site, {"site": site, "seconds": 0.0, "count": 0, "largest_ms": 0.0})
            gap["seconds"] += (start - end) * 1e-6
            gap["count"] += 1
            gap["largest_ms"] = max(gap["largest_ms"], (start - end) * 1e-3)
        if end is None or start > end:
            busy += (stop - start) * 1e-6
            end = stop
        elif stop > end:
            busy += (stop - end) * 1e-6
            end = stop
    return busy, sorted(gaps.values(), key=lambda g: -g["seconds"])[:top]


FILL_SITES = 40  # the call sites of fills a profile keeps, most first
OUTSIDE_OPERATORS = "(outside any operator: torch.cuda.synchronize, the profiler's own)"


def host_syncs(events: Iterable) -> List[Dict[str, Any]]:
    """The CUDA runtime's synchronising calls of the step by ``launch_site`` of the operator that made them (those
    outside any operator under OUTSIDE_OPERATORS), most first."""
    sites: Dict[str, int] = {}
    for event in events:
        if _is_device(event) or event.name not in SYNC_CALLS:
            continue
        site = OUTSIDE_OPERATORS if event.cpu_parent is None else launch_site(event.cpu_parent)
        sites[site] = sites.get(site, 0) + 1
    return [{"site": site, "count": n} for site, n in sorted(sites.items(), key=lambda x: -x[1])]


def breakdown(events: Iterable, step_seconds: float, device: str) -> Tuple[Dict[str, float], List[Tuple[str, str, float]]]:
    """(seconds per kind, idle included; the largest items as (name, kind, seconds)) of the profiler's function
    events of one step. ``device="cuda"`` counts every kernel's time (a kernel belongs to the operator that launched
    it); ``"cpu"`` every operator's own (self) CPU time."""
    seconds = {kind: 0.0 for kind in CATEGORIES}
    items: Dict[Tuple[str, str], float] = {}
    for event in events:
        if device == "cuda":
            work = [(kernel.name, kernel.duration) for kernel in getattr(event, "kernels", [])]
        else:
            if getattr(event, "device_type", None) is not None and event.device_type.name != "CPU":
                continue
            if any(w in event.name.lower() for w in _WRAPPERS):
                continue
            work = [(event.name, event.self_cpu_time_total)]
        for name, micros in work:
            if micros <= 0:
                continue
            kind = categorize(name, [event.name, *_work_context(event)] if device == "cuda" else _work_context(event))
            seconds[kind] += micros * 1e-6
            items[(name, kind)] = items.get((name, kind), 0.0) + micros * 1e-6
    seconds["idle"] = max(0.0, step_seconds - sum(seconds.values()))
    top = sorted(((name, kind, t) for (name, kind), t in items.items()), key=lambda x: -x[2])[:30]
    return seconds, top


class _ModuleRanges:
    """A profiler range around every module call (``module: <class>``) while open: global module hooks, so only for
    eager layers (hooks added after compiling would make dynamo recompile)."""

    def __init__(self):
        self._open: List[Any] = []
        self._handles: List[Any] = []

    def __enter__(self) -> "_ModuleRanges":
        from torch.nn.modules import module as nn_module

        self._handles = [nn_module.register_module_forward_pre_hook(self._enter),
                         nn_module.register_module_forward_hook(self._exit)]
        return self

    def _enter(self, module, args) -> None:
        scope = torch.autograd.profiler.record_function(MODULE_RANGE + type(module).__name__)
        scope.__enter__()
        self._open.append(scope)

    def _exit(self, module, args, output) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        while self._open:  # a forward that raised left its ranges open
            self._open.pop().__exit__(None, None, None)


class _SyncSites:
    """The Python lines of the synchronising CUDA calls while open: with ``debug_mode`` (a GPU) torch warns at each
    (``torch.cuda.set_sync_debug_mode("warn")``) and the warnings are counted by line; other warnings are shown as
    usual once it closes."""

    MESSAGE = "called a synchronizing CUDA operation"  # torch's warning (c10/cuda/CUDAFunctions.cpp)

    def __init__(self, debug_mode: bool):
        self.sites: Dict[str, int] = {}
        self._debug_mode = debug_mode
        self._catch = warnings.catch_warnings(record=True)
        self._caught: List[Any] = []

    def __enter__(self) -> "_SyncSites":
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")
        if self._debug_mode:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def stop(self) -> None:
        """No more warnings at syncs (before a synchronisation of the caller's own)."""
        if self._debug_mode:
            torch.cuda.set_sync_debug_mode("default")

    def __exit__(self, *exc) -> None:
        self.stop()
        self._catch.__exit__(*exc)
        for w in self._caught:
            if self.MESSAGE in str(w.message):
                site = f"{w.filename if w.filename.startswith('<') else os.path.relpath(w.filename)}:{w.lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class StepProfiler:
    """``with StepProfiler() as p: <one step>`` then ``p.write(run_dir, step, step_seconds)``. On a GPU it
    synchronises before and after the step, so that the step's time and its kernels line up, and records where the
    device waited (``module_ranges``: a range per module call, for eager layers only)."""

    def __init__(self, module_ranges: bool = True):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._profile: Optional[torch.profiler.profile] = None
        self._stack = contextlib.ExitStack()
        self._module_ranges = module_ranges
        self._sync_sites = _SyncSites(debug_mode=self.device == "cuda")

    def __enter__(self) -> "StepProfiler":
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        if self.device == "cuda":
            torch.cuda.synchronize()
        self._profile = self._stack.enter_context(profile(activities=activities))
        if self._module_ranges:
            self._stack.enter_context(_ModuleRanges())
        self._stack.enter_context(self._sync_sites)
        return self

    def synchronize(self) -> None:
        """Wait for the step's kernels (before reading its wall time); ends the count of the step's syncs."""
        self._sync_sites.stop()
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __exit__(self, *exc) -> None:
        self.synchronize()
        self._stack.__exit__(*exc)

    def write(self, run_dir: str, step: int, step_seconds: float) -> str:
        events = self._profile.events()
        seconds, top = breakdown(events, step_seconds, self.device)
        record: Dict[str, Any] = {
            "step": step, "device": self.device, "step_time_s": step_seconds, "seconds": seconds,
            "top": [{"name": n, "kind": k, "seconds": t} for n, k, t in top],
        }
        # on a CPU there is no device work: nothing busy, no gaps, no syncs (the same code, so CI runs it)
        launchers = Launchers(events)
        busy, gaps = idle_gaps(events, launchers=launchers)
        launchers.how, launchers.misses = dict.fromkeys(Launchers.WAYS, 0), []  # from here, the fills' launchers
        fills = device_fills(events, launchers)
        record.update(busy_s=busy, idle_gaps=gaps, host_syncs=host_syncs(events),
                      fills=fills[:FILL_SITES], host_fills=zero_fills(events)[:FILL_SITES],
                      fill_totals={kind: {"count": sum(f["count"] for f in fills if f["kind"] == kind),
                                          "ms": sum(f["ms"] for f in fills if f["kind"] == kind)}
                                   for kind in ("memset", "fill")},
                      fill_launchers={"how": launchers.how, "not_recorded_examples": launchers.misses},
                      sync_sites=[{"site": site, "count": n} for site, n in
                                  sorted(self._sync_sites.sites.items(), key=lambda x: -x[1])])
        path = os.path.join(run_dir, f"profile_step_{step}.json")
        atomic_write_json(path, record)
        return path

