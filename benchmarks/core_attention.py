"""Benchmark: the core attention modules training runs, one layer forward+backward, DIFF against its baseline.

    GPU:  python benchmarks/core_attention.py                   # d=128, N=4096, B=4, H=8, bf16
    CPU:  python benchmarks/core_attention.py --smoke           # tiny sizes, Triton interpreter; prints only
    CPU, the GPU's launch decisions: DIFF_ATTN_SIMULATE_GPU=sm_90 python benchmarks/core_attention.py --heads 2 \
          --head-dim 128 --seq-len 64 --batch 1                 # the table's configs, interpreted; prints only
    CPU, its own backends: python benchmarks/core_attention.py --v1-backends combined sdpa --v2-epilogues \
          --epilogues unfused --heads 2 --head-dim 32 --seq-len 512 --batch 4    # written to benchmarks/results

Rows (each a ``models.attention`` module with megatron's [s, b, heads, d] inputs, so the layout work counts):
    DIFF V1 ``triton`` (the fused kernel, first), the baseline (2H heads of d, one ``sdpa`` call), DIFF V1
    ``combined`` (the combined map in one autograd node, the CPU's backend at short sequences; only when asked for),
    with ``--v1-backends flash_attn4`` the baseline and DIFF V1 on flash-attn-4 (one call over the 2d-wide V),
    DIFF V1 ``sdpa`` (two library calls of the baseline's shape, equal head dims) with each DIFF epilogue (the fused
    Triton kernel, unfused, torch.compile), DIFF V2 ``sdpa`` with each epilogue. Before timing, every DIFF row's output and
    gradients are checked against ``eager`` in fp32 (bf16 inputs rounded once) at the timed head dim; a row that
    fails is reported, not timed. Also the kernel torch's SDPA dispatcher picks for each call (``torch._fused_sdp_choice``) and the
    epilogue alone at the same shape. Times are medians (``triton.testing.do_bench`` on a GPU); the ratio is each
    row's time over the baseline's (the issue's target: DIFF V1 at most 2.1x at d=128, N=4096).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, table_cell, time_ms  # noqa: E402


def _config(heads: int, kv_heads: int, d: int, v2: bool, dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=2 * heads * d, num_attention_heads=2 * heads,
        num_query_groups=kv_heads if v2 else 2 * kv_heads, kv_channels=d, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
    )


def _module(kind: str, backend: str, epilogue: str, heads, kv_heads, d, dtype, device):
    from megatron.core.transformer.enums import AttnMaskType

    from diff_transformer.models.attention import DiffV2CoreAttention, DifferentialCoreAttention, VanillaCoreAttention

    config = _config(heads, kv_heads, d, kind == "diff_v2", dtype)
    if kind == "diff":
        module = DifferentialCoreAttention(config, 3, AttnMaskType.causal, backend=backend, epilogue=epilogue)
    elif kind == "diff_v2":
        module = DiffV2CoreAttention(config, 1, AttnMaskType.causal, backend=backend, epilogue=epilogue)
    else:
        module = VanillaCoreAttention(config, 1, AttnMaskType.causal, backend=backend)
    torch.manual_seed(0)  # same parameters for every row of a kind
    for p in module.parameters():
        with torch.no_grad():
            p.normal_(1.0 if p.dim() == 1 and p.shape[0] > 4 * d // 3 else 0.0, 0.1)
    return module.to(device)


def _inputs(kind, heads, kv_heads, d, n, b, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    kv = kv_heads if kind == "diff_v2" else 2 * kv_heads
    tensors = [torch.randn(n, b, h, d, generator=g).to(device, dtype) for h in (2 * heads, kv, kv)]
    bias = torch.randn(n, b, heads, generator=g).to(device, dtype) if kind == "diff_v2" else None
    return tensors, bias


def _fwd_bwd(module, tensors, bias):
    inputs = [t.detach().requires_grad_(True) for t in tensors]
    out = module(*inputs, None, attention_bias=bias)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in inputs] + [p.grad for p in module.parameters()]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def check_against_eager(kind, backend, epilogue, shape, dtype, device) -> float:
    """Worst relative error of the output and every gradient against eager in fp32 on the same (rounded) inputs."""
    heads, kv_heads, d, n, b = shape
    row = _module(kind, backend, epilogue, heads, kv_heads, d, dtype, device)
    reference = _module(kind, "eager", "unfused", heads, kv_heads, d, torch.float32, device)
    reference.load_state_dict({k: v.float() for k, v in row.state_dict().items()})
    tensors, bias = _inputs(kind, heads, kv_heads, d, n, b, dtype, device)
    got_out, got = _fwd_bwd(row, tensors, bias)
    want_out, want = _fwd_bwd(reference, [t.float() for t in tensors], None if bias is None else bias.float())
    return max(_rel(x, y) for x, y in zip([got_out] + got, [want_out] + want))


def rows_to_time(epilogues, v2_epilogues, v1_backends=("triton", "sdpa")):
    """(kind, backend, epilogue) in the order they are timed: the fused kernel first (the row a short GPU window
    must not lose), then the baseline every ratio divides by, flash-attn-4's rows, the combined map, then the
    library paths by epilogue; DIFF V1's rows only for ``v1_backends``."""
    rows = [("diff", "triton", "unfused")] if "triton" in v1_backends else []
    rows += [("vanilla", "sdpa", "unfused")]
    if "flash_attn4" in v1_backends:  # flash-attn-4: the baseline on it too, then DIFF's one call over the 2d-wide V
        rows += [("vanilla", "flash_attn4", "unfused"), ("diff", "flash_attn4", epilogues[0])]
    rows += [("diff", "combined", "unfused")] if "combined" in v1_backends else []
    rows += [("diff", "sdpa", e) for e in epilogues] if "sdpa" in v1_backends else []
    rows += [("diff_v2", "sdpa", e) for e in v2_epilogues if e in epilogues]
    return rows


def render(results, kernels, heads, kv_heads, d, n, b, dtype, check_shape, command) -> str:
    base = next((ms for label, ms, _ in results if label.startswith("vanilla")), None)
    lines = [
        f"# Core attention, one layer forward+backward: {machine_name()}, {datetime.date.today()}", "",
        f"torch {torch.__version__}{'' if torch.cuda.is_available() else f', {torch.get_num_threads()} threads'}; "
        f"{str(dtype).replace('torch.', '')}; H={heads} differential heads (baseline 2H="
        f"{2 * heads}), Hkv={kv_heads}, d={d}, N={n}, B={b}, causal. Command: `{command}`. Each DIFF row is checked "
        f"against eager (fp32) first at the timed head dim (H={check_shape[0]}, Hkv={check_shape[1]}, d={check_shape[2]}, "
        f"N={check_shape[3]}, B={check_shape[4]}).", "",
        "| module | fwd+bwd ms | / baseline | check |", "|---|---|---|---|",
    ]
    for label, ms, check in results:
        ratio = f"{ms / base:.2f}x" if ms is not None and base else ""
        lines.append(f"| {label} | {'' if ms is None else f'{ms:.3f}'} | {ratio} | {check} |")
    lines += ["", "SDPA kernels of each kind's sdpa path (torch._fused_sdp_choice):", ""]
    lines += [f"- {kind}: {'; '.join(calls)}" for kind, calls in kernels.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): prints only")
    parser.add_argument("--heads", type=int, default=8, help="differential heads H (the baseline has 2H)")
    parser.add_argument("--kv-heads", type=int, default=None, help="Hkv (default H)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--epilogues", nargs="+", default=None, metavar="EPILOGUE",
                        help="DIFF V1 sdpa rows: the epilogues to time it with, in order (default: triton, unfused, "
                             "and compile on a GPU)")
    parser.add_argument("--v2-epilogues", nargs="*", default=["triton"], metavar="EPILOGUE",
                        help="DIFF V2 rows: the epilogues to time it with (unfused, triton, compile; none: no V2 row)")
    parser.add_argument("--v1-backends", nargs="+", default=["triton", "sdpa"],
                        choices=["triton", "sdpa", "combined", "flash_attn4"],
                        help="DIFF V1 rows: its backends to time (default triton, sdpa; flash_attn4 adds the "
                             "baseline on flash-attn-4 too, and DIFF on it with the first of --epilogues)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per row on a CPU (median)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"),
                        help="directory of the report core_attention_d<d>_N<N>_B<B>[_<v1 backends>]_<machine>_"
                             "<date>.md, rewritten after "
                             "every row (a run cut off keeps the rows it timed)")
    args = parser.parse_args()

    from diff_transformer.compat import apply_cpu_patches
    from diff_transformer.models.attention.base import record_sdpa_kernels

    apply_cpu_patches()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.smoke:
        args.heads, args.head_dim, args.seq_len, args.batch = 2, 16, 64, 2
    heads, d, n, b = args.heads, args.head_dim, args.seq_len, args.batch
    kv_heads = args.kv_heads or heads
    epilogues = args.epilogues or (["triton", "unfused", "compile"] if device == "cuda" else ["triton", "unfused"])
    rows = rows_to_time(epilogues, args.v2_epilogues, args.v1_backends)
    # the timed head dim (the table entry and column blocks the timed rows use), few heads and tokens
    check_shape = (2, min(kv_heads, 2) if kv_heads < heads else 2, d, 257 if device == "cuda" else 40, 2)
    command = (f"python benchmarks/core_attention.py --heads {heads} --head-dim {d} --seq-len {n} --batch {b}"
               f"{f' --kv-heads {kv_heads}' if args.kv_heads else ''} --epilogues {' '.join(epilogues)}"
               f" --v1-backends {' '.join(args.v1_backends)} --v2-epilogues {' '.join(args.v2_epilogues)}".rstrip())
    # a CPU's table is worth keeping without the fused kernel's row (Triton's interpreter says nothing of speed)
    write = not args.smoke and (device == "cuda" or "triton" not in args.v1_backends)
    # other DIFF V1 backends than the default's name the report, so that it keeps the default run's report
    rows_name = "" if args.v1_backends == ["triton", "sdpa"] else "_" + "-".join(args.v1_backends)

    results, kernels = [], {}
    for kind, backend, epilogue in rows:
        own_epilogue = kind == "vanilla" or backend in ("triton", "combined")  # no separate epilogue to name
        label = f"{kind} {backend}" + ("" if own_epilogue else f" + {epilogue} epilogue")
        try:
            error = check_against_eager(kind, backend, epilogue, check_shape, dtype, device) if kind != "vanilla" else 0.0
            if error > (3e-2 if dtype == torch.bfloat16 else 1e-4):
                results.append((label, None, f"wrong: {error:.1e} relative to eager"))
                continue
            module = _module(kind, backend, epilogue, heads, kv_heads, d, dtype, device)
            tensors, bias = _inputs(kind, heads, kv_heads, d, n, b, dtype, device)
            if backend == "sdpa" and kind not in kernels:
                with record_sdpa_kernels() as calls:
                    module(*tensors, None, attention_bias=bias)
                kernels[kind] = calls
            results.append((label, time_ms(lambda: _fwd_bwd(module, tensors, bias), device, args.repeats),
                            f"{error:.1e}"))
        except Exception as err:  # one failing row hides no other
            results.append((label, None, table_cell(f"failed: {type(err).__name__}: {err}")))
        print(results[-1], flush=True)
        report = render(results, kernels, heads, kv_heads, d, n, b, dtype, check_shape, command)
        if write:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            name = f"core_attention_d{d}_N{n}_B{b}{rows_name}_{machine_name()}_{datetime.date.today()}.md"
            (out / name).write_text(report)
    print(report)
    base = next((ms for label, ms, _ in results if label.startswith("vanilla")), None)
    print(f"headline: d={d} N={n} B={b} H={heads}, fwd+bwd ms (/ baseline): " + "; ".join(
        f"{label} {'failed' if ms is None else f'{ms:.3f}' + (f' ({ms / base:.2f}x)' if base else '')}"
        for label, ms, _ in results))
    return 0 if all(ms is not None for _, ms, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
