"""Peak memory per rank under DeepSpeed ZeRO stages 0-3 (and CPU optimizer offload) next to the estimate, with
megatron-core's DDP and distributed optimizer as the reference, in one run.

    python benchmarks/zero_memory.py [--hidden 512] [--layers 8] [--dp 4] [--bucket 1e7] [--prefetch 4e6] [--out DIR]

Each setting is a real training setup (``Trainer.setup`` and three steps of ``fit``: model, engine, optimizer; no
validation, no checkpoints), one process per rank under torchrun. The model is the debug model widened until the
weights, gradients and optimizer state dominate (``--hidden`` wide, ``--layers`` deep, sequence 64, micro-batch 2,
bundled 4096-piece vocabulary: 27.8M parameters by default), fp32 on a CPU, bf16 on a GPU. DeepSpeed allocates its
reduction bucket whole (5e8 elements by default, 2 GB in fp32, which would dwarf this model), so the runs set
``zero_optimization.reduce_bucket_size`` to ``--bucket`` elements, and ZeRO-3's prefetch bucket (5e7 by default, more
than the whole model) to ``--prefetch``, about one layer; the estimate counts both.

Measured: the peak of bytes allocated from before the model is built to the end of the third step, on the rank where
it is highest (``accounting.PeakMemory``: CUDA allocator statistics on a GPU; on a CPU glibc's in-use heap bytes,
sampled every millisecond, which includes what offload puts on the host, the same memory there). Estimate:
``training.accounting.estimate_memory_per_gpu`` (device) plus its ``host`` part (offloaded). Writes
``<out>/zero_memory_<machine>_<date>.md`` (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, write_report  # noqa: E402

from benchmarks.peak_memory import measure, rank_worker  # noqa: E402

DS = ["engine=deepspeed"]
# CPU offload with torch's AdamW on the host (DeepSpeed's CPU Adam needs a JIT build; its memory is the same)
HOST_ADAM = ["+engine.extra.zero_force_ds_cpu_optimizer=false", "+engine.extra.optimizer={params: {torch_adam: true}}"]
SETTINGS = [
    ("megatron DDP", []),
    ("megatron distributed optimizer", ["parallel.distributed_optimizer=true"]),
    ("ZeRO-0", DS + ["engine.zero_stage=0"]),
    ("ZeRO-1", DS + ["engine.zero_stage=1"]),
    ("ZeRO-2", DS + ["engine.zero_stage=2"]),
    ("ZeRO-3", DS + ["engine.zero_stage=3"]),
    ("ZeRO-2, optimizer offload cpu", DS + ["engine.zero_stage=2", "engine.offload_optimizer=cpu"] + HOST_ADAM),
    ("ZeRO-3, optimizer and parameter offload cpu",
     DS + ["engine.zero_stage=3", "engine.offload_optimizer=cpu", "engine.offload_param=cpu"] + HOST_ADAM),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, default=4, help="processes (data-parallel ranks)")
    parser.add_argument("--bucket", type=float, default=1e7, help="zero_optimization.reduce_bucket_size (elements)")
    parser.add_argument("--prefetch", type=float, default=4e6, help="stage3_prefetch_bucket_size (elements)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    if args.worker:
        rank_worker(args.worker, args.overrides)
        return 0

    heads = args.hidden // 128
    common = [
        "model=debug", f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
        f"model.num_heads={heads}", f"model.ffn_hidden_size={args.hidden * 11 // 4}", "trainer.micro_batch_size=2",
        f"trainer.global_batch_size={2 * args.dp}", "trainer.max_steps=3", "optim.warmup_steps=1",
        "trainer.eval_interval=0", "trainer.log_interval=1", "logging.wandb.mode=disabled",
        "checkpoint.interval=0", "checkpoint.save_at_end=false", *args.overrides,
    ]
    buckets = [
        f"+engine.extra.zero_optimization.reduce_bucket_size={int(args.bucket)}",
        f"+engine.extra.zero_optimization.stage3_prefetch_bucket_size={int(args.prefetch)}",
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(SETTINGS):
            extra = buckets if overrides[:1] == DS else []
            r = measure(__file__, args.dp, common + overrides + extra, Path(tmp) / str(i))
            rows.append((name, r))
            e = r["estimate"]
            print(f"{name:45} estimate {e['total'] * 1024:8.1f} + host {e['host'] * 1024:7.1f} MiB  "
                  f"measured {r['peak'] * 1024:8.1f} MiB", flush=True)
    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    lines = [
        f"# Peak memory per rank under ZeRO stages, {machine_name()}, {datetime.date.today()}",
        "",
        f"Command: `python benchmarks/zero_memory.py --hidden {args.hidden} --layers {args.layers} --dp {args.dp} "
        f"--bucket {args.bucket:g} --prefetch {args.prefetch:g}` ({rows[0][1]['parameters']:,}-parameter DIFF model: debug widened to hidden "
        f"{args.hidden}, {args.layers} layers, {heads} heads; sequence 64, micro-batch 2, {args.dp} data-parallel "
        f"ranks, {dtype}; three steps; DeepSpeed's reduce_bucket_size {args.bucket:g} and stage3_prefetch_bucket_size "
        f"{args.prefetch:g} elements). Estimate: "
        "`training.accounting.estimate_memory_per_gpu`, on the device and (offload) on the host. Measured: the peak "
        "of bytes allocated from before the model was built to the end of step 3, on the rank where it is highest "
        "(GPU: CUDA allocator statistics; CPU: glibc's in-use heap sampled every millisecond, which on a CPU holds "
        "the offloaded state too, so compare it with device + host); end: still allocated after step 3. Offload "
        f"runs step torch's AdamW on the host. Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| setting | estimate MiB: weights / grads / optimizer / activations+logits | device total | host | "
        "measured peak MiB | estimate (device + host) / measured | end MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        e = r["estimate"]
        total = e["total"] + e["host"]
        lines.append(
            f"| {name} | {e['weights'] * 1024:.1f} / {e['grads'] * 1024:.1f} / {e['optimizer'] * 1024:.1f} / "
            f"{(e['activations'] + e['logits']) * 1024:.1f} | {e['total'] * 1024:.1f} | {e['host'] * 1024:.1f} | "
            f"{r['peak'] * 1024:.1f} | {total / r['peak']:.2f} | {r['end'] * 1024:.1f} |"
        )
    write_report("\n".join(lines) + "\n", args.out, "zero_memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
