"""Compile the fused kernels for a GPU target without a GPU: code generation, shared memory and registers.

    env -u TRITON_INTERPRET .venv/bin/python kernels/diff_attn/check_compile.py [--arch 90] [--config M N W S]

Compiles forward, backward preprocess, dK/dV and dQ for V1 (V 2d wide) and V2 at head dims 64, 96 and 128 in bf16
and fp16 (causal), with the config the launcher uses there: the default table's entry for the architecture, fitted
to its shared memory (kernels/diff_attn/tuning.py), or --config for all. Each goes through Triton's full pipeline
(TTIR → PTX → cubin with the bundled ptxas), specialised as a real launch is: pointers 16-byte aligned, strides and
lengths divisible by 16, which is what lets Triton pipeline the loads through shared memory (without it the
figures are several times smaller). Prints the compiler's shared memory next to `tuning.shared_memory_bytes` and
the registers and spill bytes ptxas reports. Exits non-zero if a kernel fails to compile, if the formula is below
the compiler's figure, if a kernel needs more shared memory than the architecture has, or if a bf16/fp16 table
entry spills more than MAX_SPILL_BYTES (--dtypes fp32 compiles the shrunk fp32 configs and shows their spills).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the compile check needs the real compiler, not the interpreter")
# Run as a script, the kernels compiled are this checkout's, not those of an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.diff_attn import fused, tuning  # noqa: E402

KERNELS = {
    "forward": fused._diff_attn_fwd_kernel,
    "preprocess": fused._diff_attn_bwd_preprocess_kernel,
    "dkdv": fused._diff_attn_bwd_dkdv_kernel,
    "dq": fused._diff_attn_bwd_dq_kernel,
}
FP32_POINTERS = {"LAM", "LSE", "DELTA", "R2"}
FLOAT_SCALARS = {"qk_scale", "sm_scale"}
HEAD_DIMS = (64, 96, 128)
# dK/dV spills a few dozen bytes in every config measured; a table entry that spills more than this is refused.
MAX_SPILL_BYTES = 128
DTYPES = ("bf16", "fp16")


def compile_one(kernel, dtype, head_dim, value_dim, shared_k, arch, config):
    """The compiled kernel, specialised as a launch with aligned tensors and lengths divisible by 16 is."""
    constexprs = dict(
        HEAD_D=head_dim, VALUE_D=value_dim, BLOCK_D=tuning.padded_dim(head_dim),
        BLOCK_DV=tuning.padded_dim(value_dim), CAUSAL=True, SHARED_K=shared_k, UPCAST=False,
        DOT_PRECISION="tf32", BLOCK_M=config.block_m, BLOCK_N=config.block_n,
    )
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name.isupper() and not name.startswith("N_") and name != "GROUP":
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        else:
            signature[name] = "i32"
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name].startswith("*") or name.startswith("stride_") or name in ("N_Q", "N_K")
    }
    return triton.compile(
        ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )


def ptxas_registers(ptx, arch):
    """(registers, spill store bytes) that the bundled ptxas reports for the PTX, or None where it cannot run."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        ptxas = get_ptxas(arch).path
    except (ImportError, AttributeError):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", source, "-o", os.path.join(tmp, "k.o")],
            capture_output=True, text=True,
        )
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    if result.returncode or not registers or not spills:
        return None
    return int(registers.group(1)), int(spills.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--config", type=int, nargs=4, metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
                        help="compile this config everywhere instead of the default table's")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16", "fp32"], default=list(DTYPES))
    args = parser.parse_args()
    capability = (args.arch // 10, args.arch % 10)
    limit = tuning.SHARED_MEMORY_BY_CAPABILITY.get(capability, tuning.SHARED_MEMORY_FALLBACK)
    device = tuning.DeviceInfo(f"sm_{args.arch}", capability, limit)
    print(f"triton {triton.__version__}, sm_{args.arch}, shared memory limit {limit} B", flush=True)
    failures = []
    for name, kernel in KERNELS.items():
        for shared_k in (False, True):
            for head_dim in args.head_dims:
                value_dim = head_dim if shared_k else 2 * head_dim
                for dtype in args.dtypes:
                    problem = tuning.KernelProblem.of(name, dtype, head_dim, value_dim, shared_k, True, 4096, 4096)
                    config = (tuning.BlockConfig(*args.config) if args.config
                              else tuning.default_config(problem, device))
                    label = f"{name:10s} {'V2' if shared_k else 'V1'} {dtype} d={head_dim:3d} [{config}]"
                    start = time.perf_counter()
                    try:
                        compiled = compile_one(kernel, dtype, head_dim, value_dim, shared_k, args.arch, config)
                    except Exception as err:  # noqa: BLE001 - report every failure, then exit non-zero
                        failures.append(f"{label}: {type(err).__name__}: {err}")
                        print(f"{label}: FAILED to compile ({type(err).__name__})", flush=True)
                        continue
                    shared = compiled.metadata.shared
                    formula = tuning.shared_memory_bytes(
                        name, config, tuning.padded_dim(head_dim), tuning.padded_dim(value_dim), shared_k,
                        tuning.DTYPE_BYTES[dtype])
                    registers = ptxas_registers(compiled.asm["ptx"], args.arch)
                    regs_text = "registers n/a" if registers is None else f"{registers[0]} registers, " \
                                                                            f"{registers[1]} B spilled"
                    print(f"{label}: ok, shared {shared} B (formula {formula} B, limit {limit} B), {regs_text}, "
                          f"{time.perf_counter() - start:.1f} s", flush=True)
                    if formula < shared:
                        failures.append(f"{label}: formula {formula} B is below the compiler's {shared} B")
                    if shared > limit:
                        failures.append(f"{label}: needs {shared} B of shared memory, the limit is {limit} B")
                    # fp32 (TF32) configs are the table's shrunk to fit: their spills are shown, not refused.
                    if not args.config and dtype != "fp32" and registers is not None \
                            and registers[1] > MAX_SPILL_BYTES:
                        failures.append(f"{label}: the table entry spills {registers[1]} B of registers")
    if failures:
        print("\n".join(["", "FAILED:"] + failures))
        sys.exit(1)
    print("all kernels compiled; shared memory within the formula and the limit")


if __name__ == "__main__":
    main()
