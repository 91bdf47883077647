"""Where one training step's time goes (``trainer.profile_step``): torch.profiler over the step, every kernel (on a
GPU) or every operator's own CPU time (on a CPU) put in one of a few kinds of work, and what is left of the step's
wall time as idle (the device waiting for the host: launches, syncs, Python).

Kinds, tried in this order on the kernel's or operator's name and on the names of the operators and profiler ranges
around it: DIFF epilogue, attention, communication, optimizer (the whole optimizer step: gradient norm, clipping,
AdamW), GEMM, norms, other elementwise. The table is written to ``<run dir>/profile_step_<N>.json`` and read by
``benchmarks/train_throughput.py``.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from diff_transformer.fileio import atomic_write_json

CATEGORIES = ("GEMM", "attention", "DIFF epilogue", "norms", "other elementwise", "optimizer", "communication", "idle")

# (kind, substrings of a lower-cased name), first match wins
_PATTERNS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("DIFF epilogue", ("diff_epilogue", "diffepilogue", "lambda_difference")),
    ("attention", ("flash", "fmha", "scaled_dot_product", "sdpa", "attention", "_diff_attn", "cudnn_attn", "mha_")),
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
                       "c10d", "gloo", "sendrecv", "isend", "irecv")),
    ("optimizer", ("optimizer.step", "adam", "multi_tensor", "_foreach_", "clip_grad")),
    ("GEMM", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "cublas",
              "cutlass", "xmma", "nvjet", "wgmma", "mkldnn")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "layernorm")),
)
# profiler ranges whose own time is not work of the step
_WRAPPERS = ("profilerstep", "[memory]", "train_step")


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
            kind = categorize(name, [event.name, *_context(event)] if device == "cuda" else _context(event))
            seconds[kind] += micros * 1e-6
            items[(name, kind)] = items.get((name, kind), 0.0) + micros * 1e-6
    seconds["idle"] = max(0.0, step_seconds - sum(seconds.values()))
    top = sorted(((name, kind, t) for (name, kind), t in items.items()), key=lambda x: -x[2])[:30]
    return seconds, top


class StepProfiler:
    """``with StepProfiler() as p: <one step>`` then ``p.write(run_dir, step, step_seconds)``. On a GPU it
    synchronises before and after the step, so that the step's time and its kernels line up."""

    def __init__(self):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._profile: Optional[torch.profiler.profile] = None

    def __enter__(self) -> "StepProfiler":
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        if self.device == "cuda":
            torch.cuda.synchronize()
        self._profile = profile(activities=activities)
        self._profile.__enter__()
        return self

    def synchronize(self) -> None:
        """Wait for the step's kernels (before reading its wall time)."""
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __exit__(self, *exc) -> None:
        self.synchronize()
        self._profile.__exit__(*exc)

    def write(self, run_dir: str, step: int, step_seconds: float) -> str:
        seconds, top = breakdown(self._profile.events(), step_seconds, self.device)
        path = os.path.join(run_dir, f"profile_step_{step}.json")
        atomic_write_json(path, {
            "step": step, "device": self.device, "step_time_s": step_seconds, "seconds": seconds,
            "top": [{"name": n, "kind": k, "seconds": t} for n, k, t in top],
        })
        return path
