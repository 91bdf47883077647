"""Where the fused kernel's time goes, and what autotuning would buy: one shape, the default table against tuned configs.

    python benchmarks/kernel_tuning.py --seq-len 4096 --batch 4 --heads 8 --head-dim 128 [--v2] [--tune dkdv dq]

1. fwd and fwd+bwd time with the default table (`kernels/diff_attn/tuning.py`, DEFAULT_CONFIGS);
2. with DIFF_ATTN_AUTOTUNE=1 for the kernels named by --tune (the others keep their table entry, written to the cache
   first so they are not tuned): every candidate's time per kernel is logged (the first candidate is the table's), and
   the chosen configs go to <cache dir>/diff_attn_configs.json;
3. fwd and fwd+bwd time again with the tuned configs, and the ratio to step 1.
--max-tile-values raises the register estimate's limit so that candidates pruned as spilling are timed too.
GPU only: the Triton interpreter times nothing useful.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8, help="differential heads H")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--v2", action="store_true", help="differential attention V2 instead of V1")
    parser.add_argument("--tune", nargs="+", default=["forward", "preprocess", "dkdv", "dq"],
                        help="kernels to autotune (the others keep the default table's config)")
    parser.add_argument("--max-tile-values", type=int, default=None,
                        help="override tuning.MAX_TILE_VALUES_PER_THREAD (the register-pressure pruning limit)")
    parser.add_argument("--cache-dir", default=None, help="where the tuned configs are written (default: a temp dir)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/kernel_tuning.py times GPU kernels; no CUDA device is visible")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="diff_attn_tuning_")
    os.environ["DIFF_ATTN_CACHE_DIR"] = cache_dir
    os.environ["DIFF_ATTN_AUTOTUNE"] = "0"
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    import triton
    from triton.testing import do_bench

    from kernels import diff_flash_attn, diff_flash_attn_v2
    from kernels.diff_attn import tuning

    if args.max_tile_values is not None:
        tuning.MAX_TILE_VALUES_PER_THREAD = args.max_tile_values
    unknown = sorted(set(args.tune) - set(tuning.KERNELS))
    if unknown:
        raise SystemExit(f"error: --tune {' '.join(unknown)}: expected kernels among {', '.join(tuning.KERNELS)}")

    torch.manual_seed(0)
    b, n, h, d = args.batch, args.seq_len, args.heads, args.head_dim
    dev, dtype = "cuda", torch.bfloat16
    q = torch.randn(b, n, 2 * h, d, device=dev, dtype=dtype, requires_grad=True)
    if args.v2:
        k = torch.randn(b, n, h, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(b, n, h, d, device=dev, dtype=dtype, requires_grad=True)
        lam = torch.full((b, n, h), 0.5, device=dev, requires_grad=True)
        fn, value_dim = diff_flash_attn_v2, d
    else:
        k = torch.randn(b, n, 2 * h, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(b, n, h, 2 * d, device=dev, dtype=dtype, requires_grad=True)
        lam = torch.tensor(0.5, device=dev, requires_grad=True)
        fn, value_dim = diff_flash_attn, 2 * d
    grad = torch.randn(b, n, h, value_dim, device=dev, dtype=dtype)

    def forward():
        return fn(q, k, v, lam, causal=True)

    def forward_backward():
        out = forward()
        torch.autograd.grad(out, (q, k, v, lam), grad)

    def timings(label):
        fwd, both = do_bench(forward), do_bench(forward_backward)
        print(f"{label}: fwd {fwd:.3f} ms, bwd {both - fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)
        return fwd, both

    shape = f"B={b} N={n} H={h} d={d} {'V2' if args.v2 else 'V1'} bf16 causal"
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}; {shape}")
    forward_backward()  # compile the table's configs
    default = timings("default table")

    device = tuning.device_info(torch.device(dev))
    cache = tuning.ConfigCache(tuning.default_cache_path())
    for kernel in tuning.KERNELS:
        if kernel not in args.tune:
            problem = tuning.KernelProblem.of(kernel, "bf16", d, value_dim, args.v2, True, n, n)
            cache.put(problem.cache_key(device, triton.__version__), tuning.default_config(problem, device))
    os.environ["DIFF_ATTN_AUTOTUNE"] = "1"
    print(f"autotuning {', '.join(args.tune)} (the first candidate of each is the table's entry)", flush=True)
    forward_backward()
    tuned = timings("tuned")
    print(f"tuned / default: fwd {tuned[0] / default[0]:.3f}, fwd+bwd {tuned[1] / default[1]:.3f}")
    print(json.dumps(json.loads(Path(tuning.default_cache_path()).read_text()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
