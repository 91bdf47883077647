"""Compile the DIFF epilogue's kernels for a GPU architecture without a GPU, and report registers and spills.

    env -u TRITON_INTERPRET .venv/bin/python kernels/diff_epilogue/check_compile.py [--arch 90]

Every kernel (forward, backward) for bf16 and fp32 inputs, head dims 64, 96 and 128, and the variants the model
runs (V1 with and without the sub-layer norm, V2, and both with the maps already combined by context parallelism's
fused ring: one part of V as wide as a head's output); exits non-zero on a compile failure or a register spill (a spill
in this memory-bound kernel costs more than the few registers it saves).
"""

import argparse
import os
import sys
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the compile check needs the real compiler, not the interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.diff_attn.check_compile import ptxas_registers  # noqa: E402
from kernels.diff_epilogue import fused  # noqa: E402

KERNELS = {"forward": fused._diff_epilogue_fwd_kernel, "backward": fused._diff_epilogue_bwd_kernel}
FP32_POINTERS = {"LAM", "RSTD", "DLAM", "DW"}
# name: (two d-wide parts of V, λ per token, the norm, two maps (not yet combined), the part's width in head dims)
VARIANTS = {"V1": (True, False, True, True, 1), "V1 no norm": (True, False, False, True, 1),
            "V2": (False, True, False, True, 1), "V1 ring": (False, False, True, False, 2),
            "V2 ring": (False, True, False, False, 1)}


def compile_one(kernel, dtype, head_dim, variant, arch):
    two_halves, per_token, norm, two_maps, width = VARIANTS[variant]
    block_t, block_d = fused._tile(width * head_dim)
    constexprs = dict(BLOCK_T=block_t, BLOCK_D=block_d, TWO_HALVES=two_halves, LAM_PER_TOKEN=per_token,
                      HAS_NORM=norm, TWO_MAPS=two_maps)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("eps", "scale"):
            signature[name] = "fp32"
        elif name.isupper():
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        else:
            signature[name] = "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}", flush=True)
    failures = []
    for name, kernel in KERNELS.items():
        for variant in VARIANTS:
            for dtype in ("bf16", "fp32"):
                for head_dim in (64, 96, 128):
                    label = f"{name:8s} {variant:10s} {dtype} d={head_dim:3d}"
                    start = time.perf_counter()
                    try:
                        compiled = compile_one(kernel, dtype, head_dim, variant, args.arch)
                    except Exception as err:  # noqa: BLE001 - report every failure, then exit non-zero
                        failures.append(f"{label}: {type(err).__name__}: {err}")
                        print(f"{label}: FAILED to compile ({type(err).__name__})", flush=True)
                        continue
                    registers = ptxas_registers(compiled.asm["ptx"], args.arch)
                    text = "registers n/a" if registers is None else f"{registers[0]} registers, {registers[1]} B spilled"
                    print(f"{label}: ok, {text}, {time.perf_counter() - start:.1f} s", flush=True)
                    if registers is not None and registers[1] > 0:
                        failures.append(f"{label}: {registers[1]} B spilled")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
