"""Benchmark: the host's time for one layer's core attention, forward+backward, by kind and backend: what the GPU waits
for when the host issues kernels more slowly than the GPU runs them.

    GPU:  python benchmarks/host_overhead.py        # the 830m layer's heads (H=8, d=96) at N=128, B=1: its kernels
                                                    # take microseconds, so a call's wall time is the host's
    CPU:  python benchmarks/host_overhead.py        # the same calls at N=16, Triton's launches left out (the
                                                    # interpreter would time itself), the launchers planning as on an
                                                    # H100

On an H100 (2026-11-27) DIFF's `830m` step idled 23% of its time with its kernels busy 1.24x the baseline's: the
step is the host's. Each row gives the median host time of a call (a call's wall time, calls issued back to back with
no synchronisation between them; on a GPU, the synchronised time is given too: where it is much larger, the GPU and
not the host limited the row), its ratio to the baseline's (one ``sdpa`` call over 2H heads), and what a call issues:
torch operations that do work (aten ops other than views and metadata, counted by a TorchDispatchMode with
compiled functions run eagerly: on a GPU each is a kernel launch or a copy) and Triton launches. On a CPU the times are the Python and dispatcher work of the same
code path; a GPU adds each launch's own cost (a Triton launch's host time, cuDNN's plan lookup), so the counts are the
part of the comparison that carries over from a CPU unchanged. The same for RoPE, and then each Triton kernel of those
rows replayed alone with a call's arguments: Triton's own time a launch, apart from the launchers around it (on an
H100 a DIFF epilogue's two launches and their launcher cost V2 about 1 ms a call more than the baseline's).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before the first triton import: the launchers' GPU branch, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DIFF_ATTN_SIMULATE_GPU", "sm_90")
    os.environ.setdefault("DIFF_ATTN_POISON", "0")  # the fused kernel's buffers as a GPU allocates them

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.core_attention import _fwd_bwd, _inputs, _module  # noqa: E402
from benchmarks.reports import machine_name, positive_int, table_cell  # noqa: E402

# aten ops that move no data: views, metadata, and the profiler's markers
_NO_WORK = {
    "view", "_unsafe_view", "reshape", "transpose", "permute", "unflatten", "flatten", "select", "slice", "unsqueeze",
    "squeeze", "expand", "alias", "t", "as_strided", "unbind", "split", "chunk", "detach", "view_as", "lift_fresh",
    "_record_function_enter_new", "_record_function_exit", "promote_types", "result_type", "is_same_size",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided",
}
# (kind, backend, epilogue) in order: the baseline first (every ratio divides by it)
ROWS = [
    ("vanilla", "sdpa", "unfused"),
    ("diff", "sdpa", "triton"),
    ("diff", "triton", "triton"),
    ("diff_v2", "sdpa", "triton"),
]
FA4_ROWS = [("vanilla", "flash_attn4", "unfused"), ("diff", "flash_attn4", "triton")]


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def triton_launches(run: bool, record: list | None = None):
    """Inside the block, every Triton launch (``kernel[grid](...)``) is counted into the yielded list's first entry
    (and appended to ``record`` as (kernel, grid, args, kwargs)); with ``run=False`` it is left out (on a CPU, where
    the interpreter would run it)."""
    from triton.runtime.jit import KernelInterface

    count = [0]
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        launch = original(self, grid)

        def counted(*args, **kwargs):
            count[0] += 1
            if record is not None:
                record.append((self, grid, args, kwargs))
            return launch(*args, **kwargs) if run else None

        return counted

    KernelInterface.__getitem__ = getitem
    try:
        yield count
    finally:
        KernelInterface.__getitem__ = original


def time_calls(call, device, calls, repeats):
    """(host µs per call, synchronised µs per call or None on a CPU, work ops per call, Triton launches per call, the
    most frequent work ops) of ``call()``."""
    on_gpu = device == "cuda"
    with triton_launches(run=on_gpu) as launches:
        for _ in range(3):  # compiles, chooses configs, warms the caches
            call()
        # counted eagerly (a compiled function is not traced under a dispatch mode): its ops as eager issues them
        before = launches[0]
        with torch.compiler.set_stance("force_eager"), _CountOps() as counter:
            call()
        per_call_launches = launches[0] - before
        host, synced = [], []
        for _ in range(repeats):
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            host.append((time.perf_counter() - start) / calls * 1e6)
            if on_gpu:
                torch.cuda.synchronize()
                synced.append((time.perf_counter() - start) / calls * 1e6)
    work = {op: c for op, c in counter.ops.items() if op not in _NO_WORK}
    top = ", ".join(f"{op} {c}" for op, c in sorted(work.items(), key=lambda x: (-x[1], x[0]))[:6])
    return (statistics.median(host), statistics.median(synced) if synced else None, sum(work.values()),
            per_call_launches, top)


def core_attention_call(kind, backend, epilogue, heads, d, n, b, dtype, device):
    """One core-attention call, forward+backward, as a call."""
    module = _module(kind, backend, epilogue, heads, heads, d, dtype, device)
    tensors, bias = _inputs(kind, heads, heads, d, n, b, dtype, device)
    return lambda: _fwd_bwd(module, tensors, bias)


def rope_implementations():
    """(label, function) of RoPE as the model can apply it to its query and key, twice a layer."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from diff_transformer.models.rope import FusedRoPEFunction
    from kernels.rope import rotary

    return [("megatron-core unfused", _apply_rotary_pos_emb_bshd),
            ("compiled (jit_fuser; trainer.compile inlines it)", FusedRoPEFunction.apply),
            ("Triton (kernels.rope; the model's on a GPU)", rotary)]


def rope_call(function, heads, d, n, b, dtype, device):
    """RoPE on one [N, B, 2H, d] query, forward+backward, as a call."""
    x = torch.randn(n, b, 2 * heads, d, dtype=dtype, device=device, requires_grad=True)
    inverse = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    angles = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inverse)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    grad = torch.ones(n, b, 2 * heads, d, dtype=dtype, device=device)
    return lambda: function(x, freqs).backward(grad)


def _kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or type(kernel).__name__


def measure_launches(paths, device, calls, repeats):
    """(label, time_calls of the launch) of each distinct Triton kernel the ``paths`` ((label, call) pairs) launch,
    replayed alone with the arguments its first launch in that call passed: Triton's own host time a launch, apart
    from the launchers' Python and the torch operations around them (on a CPU the launch is left out, so only the
    replay's own Python is timed)."""
    on_gpu, seen, rows = device == "cuda", set(), []
    for path, call in paths:
        record = []
        with triton_launches(run=on_gpu, record=record):
            call()
        for kernel, grid, args, kwargs in record:
            name = _kernel_name(kernel)
            if name in seen:
                continue
            seen.add(name)
            rows.append((f"{name} ({path})", *time_calls(lambda: kernel[grid](*args, **kwargs), device, calls,
                                                         repeats)))
    return rows


def baseline_host(results):
    """The baseline's host µs a call (``vanilla sdpa``, the row every ratio divides by), or None where it failed."""
    return next((r[1] for r in results if r[0] == "vanilla sdpa"), None)


def _table(results, base, device):
    lines = [
        "| module | host µs / call | / baseline |" + (" synchronised µs |" if device == "cuda" else "")
        + " work ops | Triton launches | most frequent work ops |",
        "|---|---|---|" + ("---|" if device == "cuda" else "") + "---|---|---|",
    ]
    for label, host, synced, ops, launches, top in results:
        if host is None:
            lines.append(f"| {label} | {top} | |" + (" |" if device == "cuda" else "") + " | | |")
            continue
        ratio = f"{host / base:.2f}x" if base else ""
        sync_cell = f" {synced:.0f} |" if device == "cuda" else ""
        lines.append(f"| {label} | {host:.0f} | {ratio} |{sync_cell} {ops} | {launches} | {top} |")
    return lines


def render(results, rope_results, launch_results, heads, d, n, b, dtype, device, command) -> str:
    base = baseline_host(results)
    where = ("its kernels launched" if device == "cuda" else
             "Triton's launches left out, the launchers planning as on an H100 (DIFF_ATTN_SIMULATE_GPU=sm_90)")
    lines = [
        f"# Host time of one layer's core attention, forward+backward: {machine_name()}, {datetime.date.today()}",
        "",
        f"torch {torch.__version__}; {str(dtype).replace('torch.', '')}; H={heads} differential heads (baseline "
        f"2H={2 * heads}), d={d}, N={n}, B={b}, causal; {where}. Command: `{command}`. Host µs: the median wall time "
        "of a call among calls issued back to back" + (", and synchronised (the GPU's limit where much larger)"
                                                       if device == "cuda" else "") + ". Work ops: aten ops other "
        "than views, metadata and allocations (each a kernel launch or a copy on a GPU; a compiled function's counted "
        "as eager issues them, where on a GPU it launches its fused kernels instead); Triton: launches.",
        "",
    ]
    lines += _table(results, base, device)
    lines += [
        "",
        f"RoPE of one query (or key) of the layer, [N, B, 2H, d] = [{n}, {b}, {2 * heads}, {d}], forward+backward: "
        "twice a layer and micro-batch, in DIFF's layer and the baseline's alike (/ baseline: over megatron-core's "
        "unfused RoPE).",
        "",
    ]
    lines += _table(rope_results, rope_results[0][1] if rope_results else None, device)
    lines += [
        "",
        "Each Triton kernel of the rows above, one launch replayed alone with the arguments a call passed: Triton's "
        "own host time a launch" + ("" if device == "cuda" else " (left out on a CPU: the replay's Python alone)")
        + " (/ baseline: over the baseline's whole call).",
        "",
    ]
    lines += _table(launch_results, baseline_host(results), device)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from diff_transformer.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=positive_int, default=8, help="differential heads H (the baseline has 2H)")
    parser.add_argument("--head-dim", type=positive_int, default=96)
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="short, so that the kernels' own time stays small: default 128 on a GPU, 16 on a CPU "
                             "(whose attention kernels run on the host)")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--calls", type=positive_int, default=20, help="calls per timed batch")
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed batches per row (median)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"),
                        help="directory of the report host_overhead_d<d>_N<N>_<machine>_<date>.md")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: a file, not a directory for the report")

    from diff_transformer.compat import apply_cpu_patches
    from diff_transformer.models.attention.base import flash_library_installed

    apply_cpu_patches()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args.seq_len = args.seq_len or (128 if device == "cuda" else 16)
    torch.manual_seed(0)
    rows = ROWS + (FA4_ROWS if device == "cuda" and flash_library_installed("flash_attn4") else [])
    command = (f"python benchmarks/host_overhead.py --heads {args.heads} --head-dim {args.head_dim} --seq-len "
               f"{args.seq_len} --batch {args.batch} --calls {args.calls} --repeats {args.repeats}")
    results = []
    paths = []  # (name, call) of every row that ran: their Triton launches are replayed alone below
    for kind, backend, epilogue in rows:
        label = f"{kind} {backend}" + ("" if kind == "vanilla" or backend == "triton" else f" + {epilogue} epilogue")
        try:
            call = core_attention_call(kind, backend, epilogue, args.heads, args.head_dim, args.seq_len, args.batch,
                                       dtype, device)
            results.append((label, *time_calls(call, device, args.calls, args.repeats)))
            paths.append((f"{kind} {backend}", call))
        except Exception as err:  # one failing row hides no other
            results.append((label, None, None, None, None, table_cell(f"failed: {type(err).__name__}: {err}")))
        print(results[-1], flush=True)
    rope_results = []
    for label, function in rope_implementations():
        try:
            call = rope_call(function, args.heads, args.head_dim, args.seq_len, args.batch, dtype, device)
            rope_results.append((label, *time_calls(call, device, args.calls, args.repeats)))
            paths.append(("RoPE", call))
        except Exception as err:  # one failing row hides no other
            rope_results.append((label, None, None, None, None, table_cell(f"failed: {type(err).__name__}: {err}")))
        print(rope_results[-1], flush=True)
    try:
        launch_results = measure_launches(paths, device, args.calls, args.repeats)
    except Exception as err:  # the tables above stand without it
        launch_results = [("replayed launches", None, None, None, None,
                           table_cell(f"failed: {type(err).__name__}: {err}"))]
    for row in launch_results:
        print(row, flush=True)
    report = render(results, rope_results, launch_results, args.heads, args.head_dim, args.seq_len, args.batch, dtype,
                    device, command)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_overhead_d{args.head_dim}_N{args.seq_len}_{machine_name()}_{datetime.date.today()}.md"
    path.write_text(report)
    print(report)
    base = baseline_host(results)
    print("headline: host µs per core-attention call fwd+bwd (/ baseline; work ops, Triton launches): " + "; ".join(
        f"{label} " + ("failed" if host is None else
                       f"{host:.0f} ({f'{host / base:.2f}x; ' if base else ''}{ops}, {launches})")
        for label, host, _, ops, launches, _ in results))
    print("headline: host µs per RoPE call fwd+bwd (work ops, Triton launches): " + "; ".join(
        f"{label.split(' (')[0]} " + ("failed" if host is None else f"{host:.0f} ({ops}, {launches})")
        for label, host, _, ops, launches, _ in rope_results))
    print("headline: host µs per Triton launch replayed alone: " + "; ".join(
        f"{label.split(' (')[0]} " + ("failed" if host is None else f"{host:.0f}")
        for label, host, *_ in launch_results))
    print(f"written: {path}")
    return 0 if all(r[1] is not None for r in results + rope_results + launch_results) else 1


if __name__ == "__main__":
    from diff_transformer.cli import run

    sys.exit(run(main))
