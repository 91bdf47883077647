"""Compile the fused kernels for a GPU target without a GPU, and lint what the compiler made of the sm_90 table.

    env -u TRITON_INTERPRET .venv/bin/python kernels/diff_attn/check_compile.py [--jobs 2]     # compile and lint
    ... check_compile.py --record --verify forward_out    # the suite's lint: the committed figures, one recompiled
    ... check_compile.py --update-record                  # after changing a kernel: compile all, rewrite the record
    PYTHONPATH=/tmp/triton36 ... check_compile.py         # under another Triton (pip install --no-deps
                                                          # triton==3.6.0 --target /tmp/triton36: the GPU image's)

Compiles every kernel of the table's design for V1 (V 2d wide) and V2 at head dims 64, 96 and 128 in bf16 (causal;
fp16 compiles to the same code), the dK/dV-side kernels also with GQA's loop over a group's query heads, with the
config the launcher uses there (kernels/diff_attn/tuning.py), through Triton's full pipeline (TTIR → TTGIR → PTX →
cubin with the bundled ptxas), specialised as a real launch is: pointers 16-byte aligned, strides and lengths
divisible by 16 (which is what lets Triton pipeline the loads through shared memory). For each kernel it prints the
compiler's shared memory next to `tuning.shared_memory_bytes`, the registers and spill bytes ptxas reports, and from
the TTGIR each product's tile, warp layout and wgmma N, the wgmma wait depths, TMA and warp specialisation. The lint
(exit status 1, naming each offending kernel and config) fails a kernel of the sm_90 table that
  - fails to compile, or needs more shared memory than the architecture has, or more than the formula says;
  - spills MAX_SPILL_BYTES or more of registers;
  - computes a product without wgmma (a `tt.dot` left, i.e. mma.sync);
  - replicates a product's tile across warps (warpsPerCTA × the instruction's shape larger than the tile: two
    warpgroups computing the same rows).
--kernels/--config/--design/--head-dims/--previous compile other combinations (reported, never linted);
--all-kernels adds the kernels the table's designs do not launch; --json and --markdown write the figures.
Compiles run in --jobs processes (about 2 s of CPU each on the 2-core machines of CI). The figures of the table's
kernels are committed in compile_record/, keyed by the kernels' source and how they are compiled and read, one file
per Triton version: --record reads them and compiles only what the record lacks; --verify recompiles the named
kernels (V1 d = 128) and fails if this machine's compiler gives other figures than the record.
"""

import argparse
import concurrent.futures
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, the kernels compiled are this checkout's, not those of an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402

from kernels.diff_attn import backward, forward, launch, tiles, tuning  # noqa: E402

HEAD_DIMS = (64, 96, 128)
# Spill stores under this many bytes were harmless on an H200; over ~1 KiB they cost 2-4x.
MAX_SPILL_BYTES = 128
FP32_POINTERS = {"LAM", "LSE", "RSTD", "DELTA", "R2", "DW_PARTIAL", "DQ_ACC"}
INT32_POINTERS = {"DOC_Q", "DOC_K"}  # document ids, read only with DOCUMENTS (the table's kernels compile without)
FLOAT_SCALARS = {"qk_scale", "sm_scale", "out_scale", "norm_eps"}
# Integer arguments that may be negative or odd: no divisibility hint.
PLAIN_INTS = {"causal_offset", "N_HEADS", "N_KV_GROUPS", "GROUP"}
KERNEL_FUNCTIONS = {
    "forward": forward._diff_attn_fwd_kernel,
    "forward_lse": forward._diff_attn_fwd_lse_kernel,
    "forward_out": forward._diff_attn_fwd_out_kernel,
    "preprocess": backward._diff_attn_bwd_preprocess_kernel,
    "dkdv": backward._diff_attn_bwd_kv_kernel,
    "dk": backward._diff_attn_bwd_kv_kernel,
    "dv": backward._diff_attn_bwd_kv_kernel,
    "dkdq": backward._diff_attn_bwd_kv_kernel,
    "dq": backward._diff_attn_bwd_dq_kernel,
}
# What a compile depends on besides the source (a spec also says whether the lint judges it: "linted").
SPEC_FIELDS = ("kernel", "dtype", "head_dim", "value_dim", "shared_k", "gqa", "arch", "design", "config")
# The table's compiled figures under each Triton version that linted them, committed with the kernels.
RECORD_DIR = Path(__file__).resolve().parent / "compile_record"


def constexprs(kernel, head_dim, value_dim, shared_k, design, config, gqa=False):
    """The constexpr arguments a launch of `kernel` passes (V1 with the sub-layer norm's epilogue, V2 without)."""
    values = dict(launch._dims(head_dim, value_dim, design.split_dims), CAUSAL=True, SHARED_K=shared_k,
                  USE_DESC=design.descriptors, UPCAST=False, DOT_PRECISION="tf32", BLOCK_M=config.block_m,
                  BLOCK_N=config.block_n, DOCUMENTS=False)
    if kernel in ("forward", "forward_out", "preprocess"):
        values.update(EPILOGUE=not shared_k, NORM=not shared_k)
    if kernel in launch._KEY_BLOCK_FLAGS:
        values.update(zip(("COMPUTE_DK", "COMPUTE_DV", "ATOMIC_DQ"), launch._KEY_BLOCK_FLAGS[kernel]))
        values["HEAD_LOOP"] = gqa
    function = KERNEL_FUNCTIONS[kernel]
    return {name: value for name, value in values.items() if name in function.arg_names}


def compile_one(spec):
    """Compile one kernel as a launch with aligned tensors and lengths divisible by 16 is specialised."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    function = KERNEL_FUNCTIONS[spec["kernel"]]
    config = tuning.BlockConfig(*spec["config"])
    design = tuning.Design(**spec["design"])
    values = constexprs(spec["kernel"], spec["head_dim"], spec["value_dim"], spec["shared_k"], design, config,
                        spec["gqa"])
    signature = {}
    for name in function.arg_names:
        if name in values:
            signature[name] = "constexpr"
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        elif name.isupper() and not name.startswith("N_") and name != "GROUP":
            signature[name] = ("*fp32" if name in FP32_POINTERS else "*i32" if name in INT32_POINTERS
                               else f"*{spec['dtype']}")
        else:
            signature[name] = "i32"
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(function.arg_names)
        if signature[name].startswith("*") or (signature[name] == "i32" and name not in PLAIN_INTS)
    }
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(function, signature, values, aligned), target=GPUTarget("cuda", spec["arch"], 32),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )
    seconds = time.perf_counter() - start
    registers = ptxas_registers(compiled.asm["ptx"], spec["arch"])
    return dict(spec, shared=compiled.metadata.shared, registers=registers and registers[0],
                spilled=registers and registers[1], compile_s=round(seconds, 2), **mma_report(compiled.asm["ttgir"]))


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


def compile_plain(kernel, constexprs, dtype, arch, fp32_pointers=(), fp32_scalars=()):
    """Compile ``kernel`` for sm_``arch`` with 4 warps: pointers in ``dtype`` (those named in ``fp32_pointers`` fp32),
    the scalars named in ``fp32_scalars`` fp32, every other lower-case argument i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in fp32_scalars:
            signature[name] = "fp32"
        elif name.isupper():
            signature[name] = "*fp32" if name in fp32_pointers else f"*{dtype}"
        else:
            signature[name] = "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=4))


def arch_arguments(doc):
    """--arch of a compile check's command line, parsed; prints the Triton version and the target first."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}", flush=True)
    return args


def report_no_spill(label, compile, arch, failures):
    """Compile (``compile()``, a Triton CompiledKernel), print its registers and spills, and add to ``failures`` a
    failure to compile or any spill: the check of the memory-bound kernels (the epilogue, RoPE), whose spills cost
    more than the registers they save."""
    start = time.perf_counter()
    try:
        compiled = compile()
    except Exception as err:  # noqa: BLE001 - report every failure, then exit non-zero
        failures.append(f"{label}: {type(err).__name__}: {err}")
        print(f"{label}: FAILED to compile ({type(err).__name__})", flush=True)
        return
    registers = ptxas_registers(compiled.asm["ptx"], arch)
    text = "registers n/a" if registers is None else f"{registers[0]} registers, {registers[1]} B spilled"
    print(f"{label}: ok, {text}, {time.perf_counter() - start:.1f} s", flush=True)
    if registers is not None and registers[1] > 0:
        failures.append(f"{label}: {registers[1]} B spilled")


_MMA_LAYOUT = re.compile(
    r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+), versionMinor = \d+, warpsPerCTA = \[(\d+), (\d+)\], "
    r"instrShape = \[(\d+), (\d+), (\d+)\]", re.MULTILINE)
_WGMMA = re.compile(r"ttng\.warp_group_dot %.*-> tensor<(\d+)x(\d+)x\w+, #(\w+)>")
_PLAIN_DOT = re.compile(r"= tt\.dot ")
_WAIT = re.compile(r"ttng\.warp_group_dot_wait .*\{pendings = (\d+) : i32\}")


def mma_report(ttgir):
    """From the TTGIR: each product's (M, N) tile, warp layout and wgmma N; replicated products; plain tt.dots left
    (mma.sync); the wgmma wait depths."""
    layouts = {m[0]: (int(m[1]), (int(m[2]), int(m[3])), (int(m[4]), int(m[5]), int(m[6])))
               for m in _MMA_LAYOUT.findall(ttgir)}
    products, replicated = [], []
    for rows, cols, layout in _WGMMA.findall(ttgir):
        _, (warps_m, warps_n), (instr_m, instr_n, _) = layouts[layout]
        rows, cols = int(rows), int(cols)
        text = f"{rows}x{cols} warps [{warps_m},{warps_n}] N={instr_n}"
        if text not in products:
            products.append(text)
        # Each warp of a warpgroup owns instr_m rows; a layout covering more rows or columns than the tile repeats it.
        if warps_m * instr_m > rows or warps_n * instr_n > cols:
            if text not in replicated:
                replicated.append(text)
    return dict(products=products, replicated=replicated, plain_dots=len(_PLAIN_DOT.findall(ttgir)),
                warp_specialized="ttg.warp_specialize" in ttgir, tma="async_tma_copy" in ttgir,
                wait_pendings=sorted({int(p) for p in _WAIT.findall(ttgir)}),
                wgmma_n=sorted({n for _, _, (_, n, _) in layouts.values()}))


def previous_specs(head_dims, dtype):
    """The kernels as they ran before this table (one-pass forward, fused dK/dV, padded head dims) with their Hopper
    configs: the reference of the compile figures (never linted)."""
    design = tuning.PREVIOUS_DESIGN
    specs = []
    for shared_k in (False, True):
        for head_dim in head_dims:
            value_dim = head_dim if shared_k else 2 * head_dim
            configs = tuning.PREVIOUS_HOPPER_CONFIGS[tuning.table_key(9, head_dim, value_dim)]
            for kernel in design.kernels:
                specs.append(dict(kernel=kernel, dtype=dtype, head_dim=head_dim, value_dim=value_dim,
                                  shared_k=shared_k, gqa=False, arch=90, design=design.__dict__,
                                  config=configs[kernel].as_list(), linted=False))
    return specs


def table_specs(arch, head_dims, dtype, all_kernels):
    """One spec per kernel the table's design launches (or every kernel) for V1 and V2 at each head dim."""
    capability = (arch // 10, arch % 10)
    limit = tuning.SHARED_MEMORY_BY_CAPABILITY.get(capability, tuning.SHARED_MEMORY_FALLBACK)
    device = tuning.DeviceInfo(f"sm_{arch}", capability, limit)
    specs = []
    for shared_k in (False, True):
        for head_dim in head_dims:
            value_dim = head_dim if shared_k else 2 * head_dim
            key = tuning.table_key(capability[0], head_dim, value_dim)
            design = tuning.DEFAULT_DESIGNS[key]
            if capability[0] < 9:
                design = tuning.Design(design.forward, design.backward, False, design.split_dims)
            for kernel in tuning.KERNELS if all_kernels else design.kernels:
                # The key-block kernels compile differently for GQA (a loop over the group's query heads).
                for gqa in (False, True) if kernel in tuning.KEY_BLOCK_KERNELS else (False,):
                    problem = tuning.KernelProblem.of(kernel, dtype, head_dim, value_dim, shared_k, True, 4096, 4096,
                                                      design.split_dims, design.descriptors, gqa)
                    specs.append(dict(kernel=kernel, dtype=dtype, head_dim=head_dim, value_dim=value_dim,
                                      shared_k=shared_k, gqa=gqa, arch=arch, design=design.__dict__,
                                      config=tuning.default_config(problem, device).as_list(),
                                      linted=kernel in design.kernels))
    return specs, limit


def label(spec):
    design = tuning.Design(**spec["design"])
    gqa = " GQA" if spec["gqa"] else ""
    return (f"{spec['kernel'] + gqa:15s} {'V2' if spec['shared_k'] else 'V1'} {spec['dtype']} d={spec['head_dim']:3d} "
            f"[{tuning.BlockConfig(*spec['config'])}; {design}]")


def formula_bytes(spec):
    design = tuning.Design(**spec["design"])
    problem = tuning.KernelProblem.of(spec["kernel"], spec["dtype"], spec["head_dim"], spec["value_dim"],
                                      spec["shared_k"], True, 4096, 4096, design.split_dims, design.descriptors,
                                      spec["gqa"])
    return tuning.problem_shared_memory(problem, tuning.BlockConfig(*spec["config"]))


def problems(result, limit):
    """What the lint refuses in one compiled kernel, as sentences."""
    found = []
    if result["shared"] > limit:
        found.append(f"needs {result['shared']} B of shared memory, the limit is {limit} B")
    if formula_bytes(result) < result["shared"]:
        found.append(f"the formula's {formula_bytes(result)} B is below the compiler's {result['shared']} B")
    if result["spilled"] is not None and result["spilled"] >= MAX_SPILL_BYTES:
        found.append(f"spills {result['spilled']} B of registers (limit {MAX_SPILL_BYTES - 1} B)")
    if result["plain_dots"]:
        found.append(f"{result['plain_dots']} products compiled without wgmma (mma.sync)")
    if result["replicated"]:
        found.append(f"replicated MMA tiles: {', '.join(result['replicated'])}")
    return found


def source_hash():
    """What the compiled figures depend on: the kernels' source (tiles.py, forward.py, backward.py; launcher edits keep
    the record), how they are compiled and read, Triton's version."""
    digest = hashlib.sha256(triton.__version__.encode())
    for module in (tiles, forward, backward):
        digest.update(Path(module.__file__).read_text().encode())
    for part in (compile_one, constexprs, ptxas_registers, mma_report):
        digest.update(inspect.getsource(part).encode())
    for pattern in (_MMA_LAYOUT, _WGMMA, _PLAIN_DOT, _WAIT):
        digest.update(pattern.pattern.encode())
    digest.update(repr(sorted(FP32_POINTERS | FLOAT_SCALARS | PLAIN_INTS)).encode())
    return digest.hexdigest()[:16]


class ResultCache:
    """Compiled figures by (source hash, spec), one JSON file per Triton version in `directory`.

    The repository keeps the figures of the table's kernels (RECORD_DIR, written by --update-record under each
    Triton version): with an unchanged tree the lint reads them instead of compiling everything again, and
    --verify recompiles some of them to check that this machine's compiler still gives the same figures."""

    def __init__(self, directory, readonly=False):
        self.path = Path(directory) / f"triton-{triton.__version__}.json" if directory else None
        self.readonly = readonly
        self.entries = {}
        if self.path and self.path.exists():
            try:
                self.entries = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError):
                self.entries = {}
        self.prefix = source_hash()

    def key(self, spec):
        return self.prefix + " " + json.dumps({k: spec[k] for k in SPEC_FIELDS}, sort_keys=True)

    def get(self, spec):
        hit = self.entries.get(self.key(spec))
        return dict(hit, linted=spec["linted"]) if hit else None

    def put(self, result):
        self.entries[self.key(result)] = {k: v for k, v in result.items() if k not in ("linted", "compile_s")}

    def save(self, keep=None):
        """Write the entries of this source (only those of `keep`'s specs, if given)."""
        if not self.path or self.readonly:
            return
        keys = {self.key(spec) for spec in keep} if keep is not None else None
        kept = {k: v for k, v in self.entries.items() if k.startswith(self.prefix) and (keys is None or k in keys)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")


def compile_all(specs, jobs):
    """(results, failures) of compiling `specs` in `jobs` processes."""
    results, failures = [], []
    if not specs:
        return results, failures
    with concurrent.futures.ProcessPoolExecutor(max(1, min(jobs, len(specs)))) as pool:
        futures = {pool.submit(compile_one, spec): spec for spec in specs}
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            try:
                results.append(future.result())
            except Exception as err:  # noqa: BLE001 - report every failure, then exit non-zero
                failures.append(f"{label(spec)}: failed to compile: {type(err).__name__}: {err}".splitlines()[0])
    return results, failures


def write_markdown(path, results, limit, arguments):
    """Append the figures as a markdown table (one row per kernel) under a heading naming the command."""
    lines = [f"### triton {triton.__version__}: `check_compile.py {arguments}`", "",
             "| kernel | version | d | GQA | design | BLOCK_M×BLOCK_N / warps / stages | shared B (formula) | "
             "registers | spill B | products (tile, warps, wgmma N) | lint |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        design = tuning.Design(**r["design"])
        switches = "+".join(name for name, on in (("TMA", design.descriptors), ("split", design.split_dims)) if on)
        config = tuning.BlockConfig(*r["config"])
        found = problems(r, limit)
        lines.append(
            f"| {r['kernel']} | {'V2' if r['shared_k'] else 'V1'} | {r['head_dim']} | {'yes' if r['gqa'] else ''} | "
            f"{design.forward}/{design.backward}{' ' + switches if switches else ''} | "
            f"{config.block_m}×{config.block_n} / {config.num_warps} / {config.num_stages} | "
            f"{r['shared']} ({formula_bytes(r)}) | {r['registers']} | {r['spilled']} | {'; '.join(r['products'])} | "
            f"{'; '.join(found) if found else 'ok'} |")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n\n")


FIGURES = ("shared", "registers", "spilled", "products", "replicated", "plain_dots", "wait_pendings", "tma",
           "warp_specialized")


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("error: TRITON_INTERPRET=1: the compile check needs the real compiler; unset it")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--all-kernels", action="store_true", help="also the kernels the designs do not launch")
    parser.add_argument("--kernels", nargs="+", choices=tuning.KERNELS, help="only these kernels")
    parser.add_argument("--config", type=int, nargs=4, metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
                        help="compile this config instead of the table's (not linted)")
    parser.add_argument("--design", default="", help="fields over the table's design, as DIFF_ATTN_DESIGN (not linted)")
    parser.add_argument("--versions", choices=["v1", "v2", "both"], default="both")
    parser.add_argument("--previous", action="store_true",
                        help="the kernels' earlier design and Hopper configs instead of the table's (not linted)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--cache", default=None, help="directory of a result cache (default: none)")
    parser.add_argument("--record", action="store_true",
                        help="read the committed figures (compile_record/) for kernels whose source is unchanged")
    parser.add_argument("--update-record", action="store_true", help="compile and write compile_record/ afresh")
    parser.add_argument("--verify", nargs="*", default=[], metavar="KERNEL",
                        help="with --record: compile these kernels of V1 d=128 afresh and check the record's figures")
    parser.add_argument("--json", default=None, help="write one JSON line per kernel here")
    parser.add_argument("--markdown", default=None, help="append a table of the figures to this file")
    args = parser.parse_args()

    specs, limit = table_specs(args.arch, args.head_dims, args.dtype, args.all_kernels or bool(args.kernels))
    if args.previous:
        specs = previous_specs(args.head_dims, args.dtype)
    if args.kernels:
        specs = [s for s in specs if s["kernel"] in args.kernels]
    if args.versions != "both":
        specs = [s for s in specs if s["shared_k"] == (args.versions == "v2")]
    if args.config or args.design:
        for spec in specs:
            spec["linted"] = False
            if args.config:
                spec["config"] = list(args.config)
            if args.design:
                spec["design"] = tuning.Design(**spec["design"]).overridden(args.design).__dict__
    lint = args.arch == 90
    print(f"triton {triton.__version__}, sm_{args.arch}, shared memory limit {limit} B, {len(specs)} kernels, "
          f"{args.jobs} processes", flush=True)

    if args.update_record:
        cache = ResultCache(RECORD_DIR)
        cache.entries = {}
    else:
        cache = ResultCache(RECORD_DIR if args.record else args.cache, readonly=args.record)
    results, to_compile = [], []
    for spec in specs:
        hit = cache.get(spec)
        (results if hit else to_compile).append(hit or spec)
    if args.record and to_compile:
        print(f"{len(to_compile)} kernels are not in the record for this source and Triton version: compiling "
              "them (refresh it with --update-record under each Triton version)", flush=True)
    start = time.perf_counter()
    compiled, failures = compile_all(to_compile, args.jobs)
    for result in compiled:
        cache.put(result)
    results += compiled
    cache.save(keep=specs if args.update_record else None)

    verify = [s for s in specs if s["kernel"] in args.verify and s["head_dim"] == 128 and not s["shared_k"]
              and s not in to_compile]
    fresh, verify_failures = compile_all(verify, args.jobs)
    failures += verify_failures
    for result in fresh:
        recorded = cache.get(result)
        changed = {k: (recorded[k], result[k]) for k in FIGURES if recorded[k] != result[k]}
        print(f"verified {label(result)} against the record: "
              f"{'same figures' if not changed else f'CHANGED {changed}'}", flush=True)
        if changed:
            failures.append(f"{label(result)}: compiles to other figures than the record ({changed}): this "
                            "machine's compiler differs, or the record is stale (--update-record)")

    order = {cache.key(spec): i for i, spec in enumerate(specs)}
    results.sort(key=lambda result: order.get(cache.key(result), 0))
    for result in results:
        regs = "registers n/a" if result["registers"] is None else \
            f"{result['registers']} registers, {result['spilled']} B spilled"
        seconds = f", {result['compile_s']} s" if "compile_s" in result else ", recorded"
        print(f"{label(result)}: shared {result['shared']} B (formula {formula_bytes(result)} B), {regs}, "
              f"{'; '.join(result['products'])}, waits {result['wait_pendings']}"
              f"{', TMA' if result['tma'] else ''}{', warp-specialized' if result['warp_specialized'] else ''}"
              f"{seconds}", flush=True)
        found = problems(result, limit)
        if found and result["linted"] and lint:
            failures.append(f"{label(result)}: {'; '.join(found)}")
        elif found:
            print(f"    (not linted) {'; '.join(found)}")
    if args.json:
        with open(args.json, "a") as f:
            for result in results:
                f.write(json.dumps(dict(result, triton=triton.__version__, formula=formula_bytes(result))) + "\n")
    if args.markdown:
        write_markdown(args.markdown, results, limit, " ".join(sys.argv[1:]))
    print(f"{len(to_compile)} compiled, {len(specs) - len(to_compile)} from "
          f"{'the record' if args.record else 'the cache'}, {len(fresh)} verified, "
          f"{time.perf_counter() - start:.1f} s")
    if failures:
        print("\n".join(["", "FAILED:"] + failures))
        sys.exit(1)
    if not lint or not any(spec["linted"] for spec in specs):
        print("compiled (nothing linted: the lint covers the sm_90 table as it is)")
        return
    print(f"lint passed (triton {triton.__version__}): every table kernel compiles with wgmma, no replicated tile, "
          f"spills under {MAX_SPILL_BYTES} B and shared memory within the formula and the limit")


if __name__ == "__main__":
    main()
