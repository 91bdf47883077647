"""Benchmark: fused differential FlashAttention against the unfused ways of computing the same thing.

For each N (B·N tokens fixed) it times forward, backward and forward+backward (median) and measures peak memory of
    V1  fused `diff_flash_attn`
    V1  two SDPA calls (one per map, V read twice) + subtraction
    V1  flash-attn: four calls (Q/K head dim d, so V split into halves, as the reference code does) + subtraction
    base  vanilla attention of equal parameters, 2H heads of d, one SDPA / flash-attn call
    V2  fused `diff_flash_attn_v2`
    V2  one SDPA call over 2H query heads + subtraction
Every method is checked against the fused kernel (output and gradients) before it is timed.

    GPU:  .venv/bin/python benchmarks/attention.py            # writes benchmarks/results/attention_<gpu>_<date>.md
    CPU:  .venv/bin/python benchmarks/attention.py --smoke    # Triton interpreter, tiny N, prints only

CPU numbers come from the Triton interpreter and say nothing about GPU speed; they are never written to results/.
"""

import argparse
import datetime
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import triton  # noqa: E402

from benchmarks.reports import time_ms  # noqa: E402
from kernels import diff_flash_attn, diff_flash_attn_v2  # noqa: E402

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

FLOP_FORMULA = """\
FLOPs = 2 × multiply-adds, per (query, key) pair that attends (causal: × 1/2 of N²), per head h of each problem:
  V1, two maps of Q/K head dim d that both read one V of 2d:
    forward  = 2·(2·d + 2·2d)                   S1, S2 = Q·Kᵀ; O1 = P1·V, O2 = P2·V
    backward = 2·(2·d + 2d + 2d + 2·d + 2·d)    recomputed S1, S2; dP = dO·Vᵀ once (dP2 = −λ·dP);
                                                dV = (P1 − λ·P2)ᵀ·dO once; dQ1, dQ2 = dS·K; dK1, dK2 = dSᵀ·Q
  V2, two maps of d that both read one K and one V of d:
    forward  = 2·(2·d + 2·d),  backward = 2·(2·d + d + d + 2·d + 2·d)
  baseline, 2H heads of d (per pair of heads): forward = 2·2·(d + d),  backward = 2·2·(3·d + 2·d)
V1's backward is the baseline's (20·d FLOPs a pair), V2's 16·d. These are the products the algorithm needs; every
method of one problem is credited with them, so TFLOP/s compare like for like. The fused kernels execute more, as
recomputation (kernels/diff_attn/forward.py and backward.py name the designs): the backward preprocess recomputes S2 and dP (d + d_v)
for δ, the dQ kernel S1, S2 and dP (2·d + d_v), and the split backward's dV kernel S1 and S2 (2·d): V1's backward
executes 2·19·d a pair with the split backward (2·17·d fused, 2·15·d with atomic dQ), V2's 2·15·d (13, 12). The
two-pass forward executes V1's 2·6·d as the one-pass does, V2's 2·5·d against 2·4·d."""


@dataclass
class Problem:
    batch: int
    seq_len: int
    n_heads: int
    n_kv_groups: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    device: str


def attention_flops(p: Problem, heads, d_qk, d_v, maps, maps_share_v):
    """(forward, backward) FLOPs of FLOP_FORMULA: `heads` heads of `maps` softmax maps each; maps that read one V
    share dP = dO·Vᵀ and dV = (Σ ±P)ᵀ·dO in the backward."""
    scale = 0.5 if p.causal else 1.0
    pairs = p.batch * heads * p.seq_len * p.seq_len * scale
    value_products = 1 if maps_share_v else maps
    return 2 * pairs * maps * (d_qk + d_v), 2 * pairs * (3 * maps * d_qk + 2 * value_products * d_v)


# ---------------------------------------------------------------------------------------------------------------
# Methods: each builds its inputs and returns (inputs requiring grad, forward function).
# ---------------------------------------------------------------------------------------------------------------


def _randn(p, *shape):
    return torch.randn(*shape, device=p.device, dtype=p.dtype).requires_grad_()


def v1_inputs(p: Problem):
    b, n, h, hkv, d = p.batch, p.seq_len, p.n_heads, p.n_kv_groups, p.head_dim
    lam = torch.tensor(0.6, device=p.device, requires_grad=True)
    return [_randn(p, b, n, 2 * h, d), _randn(p, b, n, 2 * hkv, d), _randn(p, b, n, hkv, 2 * d), lam]


def v2_inputs(p: Problem):
    b, n, h, hkv, d = p.batch, p.seq_len, p.n_heads, p.n_kv_groups, p.head_dim
    lam = torch.sigmoid(torch.randn(b, n, h, device=p.device)).to(p.dtype).requires_grad_()
    return [_randn(p, b, n, 2 * h, d), _randn(p, b, n, hkv, d), _randn(p, b, n, hkv, d), lam]


def baseline_inputs(p: Problem):
    b, n, h, hkv, d = p.batch, p.seq_len, p.n_heads, p.n_kv_groups, p.head_dim
    return [_randn(p, b, n, 2 * h, d), _randn(p, b, n, 2 * hkv, d), _randn(p, b, n, 2 * hkv, d)]


def _sdpa(q, k, v, causal):
    """SDPA on (B, N, heads, d) tensors; GQA handled by SDPA itself."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        enable_gqa=q.shape[2] != k.shape[2], scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return out.transpose(1, 2)


def v1_fused(q, k, v, lam, causal):
    return diff_flash_attn(q, k, v, lam, causal=causal)


def v1_two_sdpa(q, k, v, lam, causal):
    o1 = _sdpa(q[:, :, 0::2], k[:, :, 0::2], v, causal)
    o2 = _sdpa(q[:, :, 1::2], k[:, :, 1::2], v, causal)
    return o1 - lam.to(o1.dtype) * o2


def _flash_attn_gqa(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal, softmax_scale=1.0 / math.sqrt(q.shape[-1]))


def v1_four_flash_attn(q, k, v, lam, causal):
    d = q.shape[-1]
    q1, q2, k1, k2 = q[:, :, 0::2], q[:, :, 1::2], k[:, :, 0::2], k[:, :, 1::2]
    va, vb = v[..., :d], v[..., d:]
    o1 = torch.cat([_flash_attn_gqa(q1, k1, va, causal), _flash_attn_gqa(q1, k1, vb, causal)], dim=-1)
    o2 = torch.cat([_flash_attn_gqa(q2, k2, va, causal), _flash_attn_gqa(q2, k2, vb, causal)], dim=-1)
    return o1 - lam.to(o1.dtype) * o2


def v2_fused(q, k, v, lam, causal):
    return diff_flash_attn_v2(q, k, v, lam, causal=causal)


def v2_one_sdpa(q, k, v, lam, causal):
    o = _sdpa(q, k, v, causal)
    return o[:, :, 0::2] - lam.unsqueeze(-1) * o[:, :, 1::2]


def baseline_sdpa(q, k, v, causal):
    return _sdpa(q, k, v, causal)


def baseline_flash_attn(q, k, v, causal):
    return _flash_attn_gqa(q, k, v, causal)


# ---------------------------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------------------------


def peak_memory_mib(fn, inputs, on_gpu):
    """Peak memory of one forward+backward above what the inputs and their gradients already hold."""
    if not on_gpu:
        return float("nan")
    for x in inputs:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in inputs:
        x.grad = None
    return peak / 2**20


def rel_rms(actual, expected):
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def check_agrees(name, fn, reference_fn, inputs, causal, tolerance):
    """The method's output and gradients must match the fused kernel's before it is timed."""
    out = fn(*inputs, causal)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, upstream)
    ref_out = reference_fn(*inputs, causal)
    ref_grads = torch.autograd.grad(ref_out, inputs, upstream)
    errors = [rel_rms(out, ref_out)] + [rel_rms(g, r) for g, r in zip(grads, ref_grads)]
    if max(errors) > tolerance:
        raise RuntimeError(f"{name} disagrees with the fused kernel: relative RMS errors {errors} > {tolerance}")


def measure(name, fn, inputs, p: Problem, flops, args):
    on_gpu = p.device == "cuda"
    forward = lambda: fn(*inputs, p.causal)  # noqa: E731
    out = forward()
    upstream = torch.randn_like(out)
    backward = lambda: torch.autograd.grad(out, inputs, upstream, retain_graph=True)  # noqa: E731
    both = lambda: torch.autograd.grad(forward(), inputs, upstream)  # noqa: E731
    fwd_ms = time_ms(forward, p.device, args.cpu_repeats, "median")
    bwd_ms = time_ms(backward, p.device, args.cpu_repeats, "median")
    both_ms = time_ms(both, p.device, args.cpu_repeats, "median")
    del out
    memory = peak_memory_mib(forward, inputs, on_gpu)
    fwd_flops, bwd_flops = flops
    return dict(
        method=name, N=p.seq_len, B=p.batch, fwd_ms=fwd_ms, bwd_ms=bwd_ms, both_ms=both_ms,
        fwd_tflops=fwd_flops / fwd_ms / 1e9, bwd_tflops=bwd_flops / bwd_ms / 1e9,
        both_tflops=(fwd_flops + bwd_flops) / both_ms / 1e9, peak_mib=memory,
    )


def matmul_tflops(device, dtype, size):
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, 3, "median")
    return 2 * size**3 / ms / 1e9


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def run_problem(p: Problem, args):
    # fp32 on a GPU: the fused kernels multiply in TF32 (10 mantissa bits, as fp16).
    tf32 = p.dtype == torch.float32 and p.device == "cuda"
    tolerance = 3e-2 if p.dtype == torch.bfloat16 else 5e-3 if p.dtype == torch.float16 or tf32 else 1e-4
    d, h = p.head_dim, p.n_heads
    rows = []

    v1_flops = attention_flops(p, h, d, 2 * d, maps=2, maps_share_v=True)
    v1 = v1_inputs(p)
    methods_v1 = [("V1 fused diff_flash_attn", v1_fused), ("V1 two SDPA calls + sub", v1_two_sdpa)]
    if flash_attn_func is not None and p.device == "cuda":
        methods_v1.append(("V1 four flash_attn calls + sub", v1_four_flash_attn))
    for name, fn in methods_v1:
        if fn is not v1_fused:
            check_agrees(name, fn, v1_fused, v1, p.causal, tolerance)
        rows.append(measure(name, fn, v1, p, v1_flops, args))
    del v1

    base_flops = attention_flops(p, 2 * h, d, d, maps=1, maps_share_v=False)
    base = baseline_inputs(p)
    methods_base = [("baseline 2H heads, SDPA", baseline_sdpa)]
    if flash_attn_func is not None and p.device == "cuda":
        methods_base.append(("baseline 2H heads, flash_attn", baseline_flash_attn))
    for name, fn in methods_base:
        rows.append(measure(name, fn, base, p, base_flops, args))
    del base

    v2_flops = attention_flops(p, h, d, d, maps=2, maps_share_v=True)
    v2 = v2_inputs(p)
    check_agrees("V2 one SDPA call + sub", v2_one_sdpa, v2_fused, v2, p.causal, tolerance)
    for name, fn in (("V2 fused diff_flash_attn_v2", v2_fused), ("V2 one SDPA call + sub", v2_one_sdpa)):
        rows.append(measure(name, fn, v2, p, v2_flops, args))
    del v2
    return rows


def format_table(rows):
    header = ("| method | N | B | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s "
              "| peak MiB | fwd+bwd speed-up vs unfused |")
    lines = [header, "|" + "---|" * 11]
    reference = {}
    for row in rows:
        family = row["method"].split()[0]
        if "fused" not in row["method"] and family in ("V1", "V2"):
            reference.setdefault((family, row["N"]), row["both_ms"])  # the first unfused SDPA method of the family
    for row in rows:
        family = row["method"].split()[0]
        base_ms = reference.get((family, row["N"]))
        speedup = f"{base_ms / row['both_ms']:.2f}×" if base_ms and family in ("V1", "V2") else ""
        memory = "n/a" if math.isnan(row["peak_mib"]) else f"{row['peak_mib']:.0f}"
        lines.append(
            f"| {row['method']} | {row['N']} | {row['B']} | {row['fwd_ms']:.3f} | {row['bwd_ms']:.3f} "
            f"| {row['both_ms']:.3f} | {row['fwd_tflops']:.3g} | {row['bwd_tflops']:.3g} | {row['both_tflops']:.3g} "
            f"| {memory} | {speedup} |"
        )
    return "\n".join(lines)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter check); prints only")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="B·N, fixed across N")
    parser.add_argument("--heads", type=int, default=8, help="differential heads H (baseline has 2H)")
    parser.add_argument("--kv-groups", type=int, default=None, help="Hkv (default: H, no GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="default bf16 on GPU, fp32 in the CPU interpreter")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--cpu-repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="on GPU, print the table without writing it")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"),
                        help="directory of the report attention_<gpu>_<date>.md (on a lent GPU machine: $OUT)")
    return parser.parse_args()


def main():
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if args.smoke:
        args.seq_lens, args.tokens, args.heads, args.head_dim, args.cpu_repeats = [96], 96, 2, 32, 1
    dtype_name = args.dtype or ("bf16" if on_gpu else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    kv_groups = args.kv_groups or args.heads
    torch.manual_seed(0)

    hardware = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    matmul_size = 8192 if on_gpu else 256
    matmul = matmul_tflops(device, dtype, matmul_size)
    rows = []
    for seq_len in args.seq_lens:
        batch = max(1, args.tokens // seq_len)
        problem = Problem(batch, seq_len, args.heads, kv_groups, args.head_dim, not args.no_causal, dtype, device)
        rows += run_problem(problem, args)
        print(f"done N={seq_len} B={batch}", file=sys.stderr)

    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    report = "\n".join([
        f"# Differential attention kernels: {hardware}, {today}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}, flash-attn "
        f"{'installed' if flash_attn_func is not None else 'not installed'}; {dtype_name}; "
        f"H={args.heads} differential heads (baseline 2H={2 * args.heads}), Hkv={kv_groups}, d={args.head_dim}, "
        f"{'causal' if not args.no_causal else 'non-causal'}, B·N={args.tokens}.",
        f"Measured {dtype_name} matmul rate ({matmul_size}³ torch.matmul): {matmul:.3g} TFLOP/s.",
        "Times are medians (triton.testing.do_bench on GPU). Peak MiB: one forward+backward, above the inputs.",
        "Speed-up: the method's fwd+bwd time relative to the first unfused method of its family (SDPA).",
        "",
        "```",
        FLOP_FORMULA,
        "```",
        "",
        format_table(rows),
        "",
    ])
    print(report)
    if on_gpu and not args.smoke and not args.no_write:
        slug = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name().lower()).strip("-")
        path = Path(args.out) / f"attention_{slug}_{today}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
