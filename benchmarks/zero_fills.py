"""Audit: the zero-fills and fills of one training step, by Python call site, on a CPU.

    python benchmarks/zero_fills.py [--kinds diff vanilla] [--compile off on] [--micro-batches 2] [--out DIR]

About 80 s and 0.7 GB on a 2-core CPU.

The model has the structure of ``830m`` at the debug size: 2 layers, tied embeddings, ``trainer.fusions=on`` and
``trainer.grad_accumulation_fusion=on``, ``model.attention_backend=sdpa`` (as the H100 profile), megatron-core's DDP
with its fp32 gradient buffer, one process. DIFF's epilogue is the compiled one (``trainer.diff_epilogue=compile``):
the Triton one runs interpreted on a CPU, whose Python calls a profile with stacks records by the million; its
launchers allocate no filled buffer (``kernels/diff_epilogue``: ``torch.empty`` only). Each setting
runs in its own process: one step to warm up (and compile), then one step of ``--micro-batches`` micro-batches under
torch.profiler with stacks and shapes. A fill is an ``aten::zero_`` or ``aten::fill_`` not inside another (what
``torch.zeros``, ``zeros_like``, ``new_zeros``, ``ones``, ``full`` and the kernels that zero their outputs call);
``profiling.zero_fills`` names its call site: the outermost operator, its backward node, the Python frame (in a
backward node without Python frames, the frame of its forward).

On a GPU each such fill is one device operation, a zero-fill (``zero_``: a FillFunctor kernel on torch 2.11, whose
H100 profile of 2026-11-27 shows three ``FillFunctor<int>`` a step, as many as the int zeros of megatron-core this
audit finds; a memset on a torch that zeroes with ``cudaMemsetAsync``) or a fill kernel, except the fills a CPU
kernel makes of its own output (its reductions', its dot product's, the CPU attention backward's): the column "on a GPU" says which.
What a CPU cannot show: the memsets inside cuDNN and cuBLAS, and the buffers inductor zeroes inside its generated
Triton code (on a CPU inductor writes C++ loops; no fill of the compiled layers reaches the host's operators).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, positive_int, table_cell, write_report  # noqa: E402

SEQUENCE, MICRO_BATCH, VOCAB = 64, 2, 512
# fills a CPU kernel makes of its own output; their CUDA kernels write the output instead
CPU_KERNEL_FILLS = ("aten::sum", "aten::mean", "aten::dot", "_for_cpu")


def overrides(kind: str, compiled: bool, micro_batches: int) -> list[str]:
    return ["model=debug", f"model.attention={kind}", f"model.vocab_size={VOCAB}", f"model.seq_length={SEQUENCE}",
            "model.share_embeddings=true", "model.attention_backend=sdpa", "trainer.fusions=on",
            "trainer.diff_epilogue=compile", "trainer.grad_accumulation_fusion=on",
            f"trainer.compile={str(compiled).lower()}", f"trainer.micro_batch_size={MICRO_BATCH}",
            f"trainer.global_batch_size={MICRO_BATCH * micro_batches}"]


def batches(vocab: int):
    """Random micro-batches as the trainer's loader gives them."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQUENCE).expand(MICRO_BATCH, SEQUENCE)
    while True:
        tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQUENCE), generator=generator)
        yield {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(MICRO_BATCH, SEQUENCE),
               "position_ids": positions}


def build(kind: str, compiled: bool, micro_batches: int, run_dir: str):
    """The trainer's model, optimizer and step (no data, no checkpoints) in a world of one."""
    from benchmarks.checkpoint import build_trainer
    from benchmarks.train_throughput import compose

    trainer = build_trainer(compose(overrides(kind, compiled, micro_batches)), run_dir)
    trainer.num_microbatches, trainer.is_last_stage, trainer.dp_size = micro_batches, True, 1
    return trainer


def audit(kind: str, compiled: bool, micro_batches: int) -> list[dict]:
    """The fills of one profiled step (after a warm-up step), by call site."""
    from diff_transformer.training.profiling import zero_fills

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build(kind, compiled, micro_batches, run_dir)
        data = batches(VOCAB)
        trainer.train_step(data)
        profile_data = batches(VOCAB)  # built before the profile: its own fills are not the step's
        step_batches = iter([next(profile_data) for _ in range(micro_batches)])
        with torch.profiler.profile(with_stack=True, record_shapes=True) as profile:
            trainer.train_step(step_batches)
    return zero_fills(profile.events())


def on_a_gpu(row: dict) -> str:
    if any(name in row["chain"] for name in CPU_KERNEL_FILLS):
        return "no (the CPU kernel's own)"
    return "zero-fill" if row["chain"].endswith("aten::zero_") else "fill kernel"


def render(results: dict, micro_batches: int, command: str) -> str:
    lines = [f"# Zero-fills of one training step, by call site, {machine_name()}", "",
             f"Command: `{command}`. The debug model with `830m`'s structure (2 layers, tied embeddings, "
             f"trainer.fusions=on, trainer.grad_accumulation_fusion=on), fp32, {micro_batches} micro-batches of "
             f"{MICRO_BATCH} × {SEQUENCE} tokens in the profiled step, torch {torch.__version__}. A count of "
             f"{micro_batches} (1 per micro-batch) is a fill each micro-batch makes; 1 is a fill of the step. "
             "megatron-core's zero-filled dummy gradient of the tied embedding (vocabulary × hidden, one a "
             "micro-batch, in LinearWithGradAccumulationAndAsyncCommunicationBackward) is gone: "
             "compat.skip_tied_embedding_dummy_gradient, tests/test_weight_gradient.py.", "",
             "| model | compile | call site (outermost operator, module or backward node, Python frame) | operators "
             "| count | per micro-batch | elements | on a GPU |", "|---|---|---|---|---|---|---|---|"]
    for (kind, compiled), rows in results.items():
        for row in rows:
            lines.append(f"| {kind} | {'on' if compiled else 'off'} | {table_cell(row['site'])} | {row['chain']} "
                         f"| {row['count']} | {row['count'] / micro_batches:g} | {row['elements']:,} "
                         f"| {on_a_gpu(row)} |")
        total = sum(r["count"] for r in rows if not on_a_gpu(r).startswith("no"))
        lines.append(f"| {kind} | {'on' if compiled else 'off'} | **all that a GPU would run** | | **{total}** | "
                     f"{total / micro_batches:g} | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from diff_transformer.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=["diff", "diff_v2", "vanilla"], default=["diff", "vanilla"])
    parser.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches of the profiled step")
    parser.add_argument("--out", default=None, help="directory to write zero_fills_<machine>_<date>.md to")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "COMPILE"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out}: a file, not a directory for the report")
    if args.one:
        print(json.dumps(audit(args.one[0], args.one[1] == "on", args.micro_batches)))
        return 0
    results = {}
    for kind in args.kinds:
        for compiled in args.compile:  # a process each: its own world, compile caches and megatron patches
            child = subprocess.run([sys.executable, __file__, "--one", kind, compiled,
                                    "--micro-batches", str(args.micro_batches)], cwd=REPO, capture_output=True,
                                   text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if child.returncode != 0:
                print(child.stderr[-4000:], file=sys.stderr)
                return child.returncode
            results[(kind, compiled == "on")] = json.loads(child.stdout.strip().splitlines()[-1])
    command = " ".join(["python benchmarks/zero_fills.py", "--kinds", *args.kinds, "--compile", *args.compile,
                        "--micro-batches", str(args.micro_batches)])
    report = render(results, args.micro_batches, command)
    if args.out:
        write_report(report, args.out, "zero_fills")
    else:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
