"""flash-attn-4's Hopper kernels compiled on a CPU: the shared memory, registers and local memory (spills) of each
forward and backward kernel, at the baseline's and DIFF V1's head dims, with the library's tiles and with the tiles
``models/attention/flash_attn4_tiles.py`` fits to a wide V.

flash-attn-4 compiles without a GPU: under torch's FakeTensorMode its interface compiles and launches nothing, and
``FLASH_ATTENTION_ARCH=sm_90`` / ``CUTE_DSL_ARCH=sm_90a`` pick the Hopper kernels and target. The CuTe DSL keeps each
kernel's IR and cubin (``CUTE_DSL_KEEP``); the shared memory a launch asks for is the size of the kernel's shared
allocation in the IR (the number the DSL checks against the card's 232,448 bytes at launch), the registers and the
frame (local memory a thread spills to) are the cubin's ``.nv.info`` attributes.

It needs flash-attn-4 and its CuTe DSL next to a CPU torch, e.g. in a virtual environment of its own:

    python -m venv /tmp/fa4 && /tmp/fa4/bin/pip install --no-deps flash-attn-4==4.0.0b36 \\
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \\
        nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi torch-c-dlpack-ext cuda-bindings cuda-pathfinder \\
        quack-kernels einops
    PYTHONPATH=.venv/lib/python3.11/site-packages:. /tmp/fa4/bin/python benchmarks/fa4_compile.py

(``.venv``'s site-packages for torch). It writes ``fa4_compile_sm90_<date>.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132",
       "CUTE_DSL_KEEP": "cubin,ir"}
SHAPES = [(64, 64), (64, 128), (96, 96), (96, 192), (128, 128), (128, 256)]  # (q/k, v head dims)
KERNELS = {"forward": "flash_fwd_sm90", "backward": "flash_bwd_sm90"}


def cubin_attributes(path: Path) -> dict:
    """Registers a thread (EIATTR_REGCOUNT) and its frame in bytes (EIATTR_FRAME_SIZE: local memory, where registers
    spill) of the cubin's kernel, from its ``.nv.info`` section."""
    data = path.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    found = {}
    for name_offset, _, _, _, offset, size, *_ in headers:
        name = data[names_at + name_offset:data.index(b"\0", names_at + name_offset)].decode()
        if name != ".nv.info":
            continue
        i, info = 0, data[offset:offset + size]
        while i + 4 <= len(info):
            fmt, attr = info[i], info[i + 1]
            length = struct.unpack_from("<H", info, i + 2)[0] if fmt == 4 else 0
            value = info[i + 4:i + 4 + length]
            if attr in (0x2F, 0x11) and length == 8:  # REGCOUNT, FRAME_SIZE: (function, value)
                found["registers" if attr == 0x2F else "frame"] = struct.unpack("<II", value)[1]
            i += 4 + length
    return found


def compile_shape(d: int, dv: int, fitted: bool, dump: Path) -> None:
    """Compile one forward and one backward (batch 4, 2048 tokens, 8 heads, causal, bf16) into ``dump``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn.cute import interface

    if fitted:
        from diff_transformer.models.attention.flash_attn4_tiles import fit_wide_v_tiles

        assert fit_wide_v_tiles()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k = (torch.empty(4, 2048, 8, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        v = torch.empty(4, 2048, 8, dv, dtype=torch.bfloat16, device="cuda")
        out, lse = interface._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
        interface._flash_attn_bwd(q, k, v, out, torch.empty_like(out), lse, causal=True)
    fwd = interface._tile_size_fwd_sm90(d, dv, True, False)
    bwd = interface._tile_size_bwd_sm90(d, dv, True, False)
    (dump / "tiles.txt").write_text(f"forward {fwd.m_block_size}x{fwd.n_block_size}"
                                    f"{'' if fwd.mma_pv_is_rs else ', P in smem'}\n"
                                    f"backward {bwd.m_block_size}x{bwd.n_block_size}, stages Q {bwd.num_stages_Q} "
                                    f"dO {bwd.num_stages_dO} P/dS {bwd.num_stages_PdS}"
                                    f"{', dKV swapAB' if bwd.dKV_swapAB else ''}\n")


def measure(dump: Path) -> dict:
    rows = {}
    tiles = dict(line.split(" ", 1) for line in (dump / "tiles.txt").read_text().splitlines())
    for what, kernel in KERNELS.items():
        ir = next(dump.glob(f"*{kernel}*.mlir"))
        sizes = re.findall(r'memref<i8, smem, align<\d+>, "(\d+):1">', ir.read_text())
        cubin = next(dump.glob(f"*{kernel}*.cubin"))
        rows[what] = dict(tiles=tiles[what], smem=max(map(int, sizes)), **cubin_attributes(cubin))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--one", nargs=3, metavar=("D", "DV", "FITTED"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        compile_shape(int(args.one[0]), int(args.one[1]), args.one[2] == "1", Path(os.environ["CUTE_DSL_DUMP_DIR"]))
        return
    from diff_transformer.models.attention.flash_attn4_tiles import SM90_SHARED_MEMORY

    from importlib.metadata import PackageNotFoundError, version

    try:
        version("flash-attn-4")
    except PackageNotFoundError:
        print("error: fa4_compile.py: flash-attn-4 is not installed in this environment; its docstring says how "
              "(python benchmarks/fa4_compile.py --help)", file=sys.stderr)
        raise SystemExit(2)

    lines = []
    for d, dv in SHAPES:
        for fitted in ([False, True] if dv > d else [False]):
            with tempfile.TemporaryDirectory() as dump:  # each shape in a process of its own: its own caches
                env = dict(os.environ, **ENV, CUTE_DSL_DUMP_DIR=dump)
                proc = subprocess.run([sys.executable, __file__, "--one", str(d), str(dv), str(int(fitted))],
                                      env=env, capture_output=True, text=True)
                if proc.returncode:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"error: compiling ({d}, {dv}) failed (exit {proc.returncode})")
                for what, row in measure(Path(dump)).items():
                    fits = "yes" if row["smem"] <= SM90_SHARED_MEMORY else "**no**"
                    lines.append(f"| ({d}, {dv}) | {'fitted' if fitted else 'library'} | {what} | {row['tiles']} | "
                                 f"{row['smem']:,} | {fits} | {row.get('registers', '?')} | {row.get('frame', '?')} |")
                    print(lines[-1], flush=True)
    report = "\n".join([
        f"# flash-attn-4's sm_90 kernels compiled on a CPU, {datetime.date.today()}", "",
        f"flash-attn-4 {version('flash-attn-4')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}; causal, bf16, "
        "batch 4, 2048 tokens, 8 heads. Command: `python benchmarks/fa4_compile.py` (the environment in its "
        "docstring). Shared memory: the kernel's shared allocation in the IR (what a launch asks for; an sm_90 block "
        f"may use {SM90_SHARED_MEMORY:,} bytes). Registers a thread at launch and frame bytes (local memory, where "
        "registers spill) from the cubin. `library`: flash-attn-4's own tiles; `fitted`: "
        "`models/attention/flash_attn4_tiles.py`'s for a V wider than Q·K.", "",
        "| head dims (q/k, v) | tiles | kernel | tile | shared memory, bytes | fits | registers | frame bytes |",
        "|---|---|---|---|---|---|---|---|", *lines, ""])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fa4_compile_sm90_{datetime.date.today()}.md"
    path.write_text(report)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
