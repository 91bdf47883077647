"""The memory estimate (``training.accounting``) against the measured peak, for the memory switches, in one run.

    python benchmarks/memory_plan.py [--model tiny] [--seq 512] [--micro-batch 4] [--max-procs 2] [--out DIR]

Each setting is a real training setup (``Trainer.setup`` and three steps of ``fit``: megatron-core model, DDP,
optimizer, schedules; no validation, no checkpoints), one process per rank (torchrun for TP, DP and PP; settings
with more processes than ``--max-procs``, e.g. the number of GPUs, are skipped). The measured figure is the peak of
bytes allocated from before the model is built to the end of the third step (``accounting.PeakMemory``: CUDA
allocator statistics on a GPU; on a CPU glibc's in-use heap bytes, sampled every millisecond), on the rank where it
is highest; "persistent" is what is still allocated at the end (weights, gradient buffers, optimizer state). Writes
``<out>/memory_plan_<machine>_<date>.md`` (default out: benchmarks/results).
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

# (name, processes, overrides): each switch against the run without it
SETTINGS = [
    ("DIFF sdpa", 1, []),
    ("DIFF sdpa, recompute selective", 1, ["trainer.recompute=selective"]),
    ("DIFF sdpa, recompute full (uniform, 1)", 1, ["trainer.recompute=full"]),
    ("DIFF sdpa, recompute full (block, 2 of 4)", 1,
     ["trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_layers=2"]),
    ("DIFF eager", 1, ["model.attention_backend=eager"]),
    ("DIFF eager, recompute selective", 1, ["model.attention_backend=eager", "trainer.recompute=selective"]),
    ("baseline sdpa", 1, ["model.attention=vanilla"]),
    ("baseline sdpa, recompute full", 1, ["model.attention=vanilla", "trainer.recompute=full"]),
    ("DIFF sdpa, TP=2", 2, ["parallel.tp=2"]),
    ("DIFF sdpa, TP=2, sequence parallel", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("DIFF sdpa, PP=2", 2, ["parallel.pp=2"]),
    ("DIFF sdpa, DP=2", 2, []),
    ("DIFF sdpa, DP=2, distributed optimizer, overlap", 2,
     ["parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
      "parallel.overlap_param_gather=true"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--max-procs", type=int, default=2, help="skip settings needing more processes (GPUs)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    if args.worker:
        rank_worker(args.worker, args.overrides)
        return 0

    common = [
        f"model={args.model}", f"model.seq_length={args.seq}", f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.global_batch_size={4 * args.micro_batch}", "trainer.max_steps=3", "optim.warmup_steps=1",
        "trainer.eval_interval=0", "trainer.log_interval=1", "logging.wandb.mode=disabled",
        "checkpoint.interval=0", "checkpoint.save_at_end=false", *args.overrides,
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, nproc, overrides) in enumerate(SETTINGS):
            if nproc > args.max_procs:
                continue
            r = measure(__file__, nproc, common + overrides, Path(tmp) / str(i))
            e = r["estimate"]
            persistent = e["weights"] + e["grads"] + e["optimizer"]
            rows.append((name, nproc, e, persistent, r))
            print(f"{name:50} estimate {e['total'] * 1024:8.1f} MiB  measured {r['peak'] * 1024:8.1f} MiB  "
                  f"ratio {e['total'] / r['peak']:.2f}", flush=True)
    lines = [
        f"# Memory estimate vs measured peak, `{args.model}` model, {machine_name()}, {datetime.date.today()}",
        "",
        f"Command: `python benchmarks/memory_plan.py --model {args.model} --seq {args.seq} --micro-batch "
        f"{args.micro_batch}` (sequence {args.seq}, micro-batch {args.micro_batch}, 4 micro-batches per step and "
        f"rank, fp32 on CPU / bf16 on GPU; three steps). Estimate: `training.accounting.estimate_memory_per_gpu`; "
        f"measured: the peak of bytes allocated from before the model was built to the end of step 3 (GPU: CUDA "
        f"allocator statistics; CPU: glibc's in-use heap, sampled every millisecond), on the rank where it is "
        f"highest; persistent: still allocated at the end. Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| setting | processes | estimate MiB (weights+grads+optimizer / activations / logits) | measured peak MiB "
        "| estimate / measured | persistent: estimate / measured MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, nproc, e, persistent, r in rows:
        lines.append(
            f"| {name} | {nproc} | {e['total'] * 1024:.1f} ({persistent * 1024:.1f} / {e['activations'] * 1024:.1f} / "
            f"{e['logits'] * 1024:.1f}) | {r['peak'] * 1024:.1f} | {e['total'] / r['peak']:.2f} | "
            f"{persistent * 1024:.1f} / {r['end'] * 1024:.1f} |"
        )
    write_report("\n".join(lines) + "\n", args.out, "memory_plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
