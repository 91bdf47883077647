"""Compile the fused kernels for a GPU target without a GPU (catches code-generation errors on CPU machines).

    env -u TRITON_INTERPRET .venv/bin/python -m kernels.diff_attn.check_compile [--arch 90]

Compiles forward, backward preprocess, dK/dV and dQ for V1 and V2 at the production head dims with one fixed
block config, through Triton's full pipeline (TTIR → PTX → cubin with the bundled ptxas), and prints the
shared memory each needs. It exits non-zero on the first failure.
"""

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the compile check needs the real compiler, not the interpreter")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.diff_attn import fused  # noqa: E402

KERNELS = {
    "forward": fused._diff_attn_fwd_kernel,
    "backward preprocess": fused._diff_attn_bwd_preprocess_kernel,
    "backward dK/dV": fused._diff_attn_bwd_dkdv_kernel,
    "backward dQ": fused._diff_attn_bwd_dq_kernel,
}
FP32_POINTERS = {"LAM", "LSE", "DELTA", "R2"}
FLOAT_SCALARS = {"qk_scale", "sm_scale"}


def compile_one(kernel, dtype, head_dim, value_dim, shared_k, arch, block_m, block_n, num_warps, num_stages):
    jit_fn = getattr(kernel, "fn", kernel)  # an Autotuner wraps the JITFunction
    constexprs = dict(
        HEAD_D=head_dim, VALUE_D=value_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(value_dim)), CAUSAL=True, SHARED_K=shared_k, UPCAST=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
    )
    signature = {}
    for name in jit_fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name.isupper() and not name.startswith("N_") and name != "GROUP":
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        else:
            signature[name] = "i32"
    compiled = triton.compile(
        ASTSource(jit_fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    return compiled.metadata.shared


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--block", type=int, nargs=2, default=[64, 64], metavar=("BLOCK_M", "BLOCK_N"))
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    args = parser.parse_args()
    cases = [("bf16", 128, False), ("bf16", 128, True), ("fp16", 96, False), ("bf16", 64, True)]
    for name, kernel in KERNELS.items():
        for dtype, head_dim, shared_k in cases:
            value_dim = head_dim if shared_k else 2 * head_dim
            label = f"{name:20s} {'V2' if shared_k else 'V1'} {dtype} d={head_dim}"
            start = time.perf_counter()
            shared = compile_one(kernel, dtype, head_dim, value_dim, shared_k, args.arch, *args.block,
                                 args.num_warps, args.num_stages)
            print(f"{label}: ok, {shared / 1024:.0f} KiB shared memory, {time.perf_counter() - start:.1f} s",
                  flush=True)


if __name__ == "__main__":
    main()
