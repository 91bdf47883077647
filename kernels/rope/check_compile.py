"""Compile the fused RoPE kernel for a GPU architecture without a GPU, and report registers and spills.

    env -u TRITON_INTERPRET .venv/bin/python kernels/rope/check_compile.py [--arch 90]
    PYTHONPATH=/tmp/triton36 ... kernels/rope/check_compile.py    # under another Triton (the GPU image's 3.6:
                                                                 # pip install --no-deps triton==3.6.0 --target DIR)

Forward and backward for bf16 and fp32 inputs, at the rotary widths of the model's head dims (64, 96, 128) with all
features rotated, and at d = 128 with half of them rotated (the rest copied), each with the tile the launcher takes
on a GPU for 16 heads; exits non-zero on a compile failure or a register spill.
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
from kernels.rope import fused  # noqa: E402

HEADS = 16
SHAPES = {"d=64": (64, 64), "d=96": (96, 96), "d=128": (128, 128), "d=128 half rotated": (128, 64)}


def compile_one(dtype, head_dim, rotated, backward, arch):
    block_h, block_half, block_rest = fused._tile(HEADS, rotated // 2, head_dim - rotated)
    constexprs = dict(BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_REST=block_rest, BACKWARD=backward)
    signature = {}
    for name in fused._rope_kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "FREQS":
            signature[name] = "*fp32"
        elif name.isupper():
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "i32"
    return triton.compile(ASTSource(fused._rope_kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}", flush=True)
    failures = []
    for backward in (False, True):
        for shape, (head_dim, rotated) in SHAPES.items():
            for dtype in ("bf16", "fp32"):
                label = f"{'backward' if backward else 'forward':8s} {shape:18s} {dtype}"
                start = time.perf_counter()
                try:
                    compiled = compile_one(dtype, head_dim, rotated, backward, args.arch)
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
