"""Compile the DIFF epilogue's kernels for a GPU architecture without a GPU, and report registers and spills.

    env -u TRITON_INTERPRET .venv/bin/python kernels/diff_epilogue/check_compile.py [--arch 90]

Every kernel (forward, backward) for bf16 and fp32 inputs, head dims 64, 96 and 128, and the variants the model
runs (V1 with and without the sub-layer norm, V2, and both with the maps already combined by context parallelism's
fused ring: one part of V as wide as a head's output); exits non-zero on a compile failure or a register spill (a spill
in this memory-bound kernel costs more than the few registers it saves).
"""

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the compile check needs the real compiler, not the interpreter")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from kernels.diff_attn.check_compile import arch_arguments, compile_plain, report_no_spill  # noqa: E402
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
    return compile_plain(kernel, constexprs, dtype, arch, FP32_POINTERS, ("eps", "scale"))


def main() -> int:
    args = arch_arguments(__doc__)
    failures = []
    for name, kernel in KERNELS.items():
        for variant in VARIANTS:
            for dtype in ("bf16", "fp32"):
                for head_dim in (64, 96, 128):
                    label = f"{name:8s} {variant:10s} {dtype} d={head_dim:3d}"
                    report_no_spill(label, lambda: compile_one(kernel, dtype, head_dim, variant, args.arch),
                                    args.arch, failures)
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
