"""Compile the fused RoPE kernel for a GPU architecture without a GPU, and report registers and spills.

    env -u TRITON_INTERPRET .venv/bin/python kernels/rope/check_compile.py [--arch 90]
    PYTHONPATH=/tmp/triton36 ... kernels/rope/check_compile.py    # under another Triton (the GPU image's 3.6:
                                                                 # pip install --no-deps triton==3.6.0 --target DIR)

Forward and backward for bf16 and fp32 inputs, at the rotary widths of the model's head dims (64, 96, 128) with all
features rotated, and at d = 128 with half of them rotated (the rest copied), each with the tile the launcher takes
on a GPU for 16 heads; exits non-zero on a compile failure or a register spill.
"""

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the compile check needs the real compiler, not the interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from kernels.diff_attn.check_compile import arch_arguments, compile_plain, report_no_spill  # noqa: E402
from kernels.rope import fused  # noqa: E402

HEADS = 16
SHAPES = {"d=64": (64, 64), "d=96": (96, 96), "d=128": (128, 128), "d=128 half rotated": (128, 64)}


def compile_one(dtype, head_dim, rotated, backward, arch):
    block_h, block_half, block_rest = fused._tile(HEADS, rotated // 2, head_dim - rotated)
    constexprs = dict(BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_REST=block_rest, BACKWARD=backward)
    return compile_plain(fused._rope_kernel, constexprs, dtype, arch, fp32_pointers=("FREQS",))


def main() -> int:
    args = arch_arguments(__doc__)
    failures = []
    for backward in (False, True):
        for shape, (head_dim, rotated) in SHAPES.items():
            for dtype in ("bf16", "fp32"):
                label = f"{'backward' if backward else 'forward':8s} {shape:18s} {dtype}"
                report_no_spill(label, lambda: compile_one(dtype, head_dim, rotated, backward, args.arch), args.arch,
                                failures)
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
