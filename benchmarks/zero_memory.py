"""Peak memory per rank under DeepSpeed ZeRO stages 0-3 (and CPU optimizer offload) next to the estimate, with
megatron-core's DDP and distributed optimizer as the reference, in one run; with ``--construction``, the host peak
per rank while ZeRO-3 builds the model, built whole (then partitioned by ``deepspeed.initialize``, as before
``deepspeed.zero.Init``) against built partitioned.

    python benchmarks/zero_memory.py [--hidden 512] [--layers 8] [--dp 4] [--bucket 1e7] [--prefetch 4e6] [--out DIR]
    python benchmarks/zero_memory.py --construction [--hidden 1024] [--layers 8] [--out DIR]

Each setting is a real training setup (``Trainer.setup`` and three steps of ``fit``: model, engine, optimizer; no
validation, no checkpoints), one process per rank under torchrun. The model is the debug model widened until the
weights, gradients and optimizer state dominate (``--hidden`` wide, ``--layers`` deep, sequence 64, micro-batch 2,
bundled 4096-piece vocabulary: 27.8M parameters by default), fp32 on a CPU, bf16 on a GPU. DeepSpeed allocates its
reduction bucket whole (5e8 elements by default, 2 GB in fp32, which would dwarf this model), so the runs set
``zero_optimization.reduce_bucket_size`` to ``--bucket`` elements, and ZeRO-3's prefetch bucket (5e7 by default, more
than the whole model) to ``--prefetch``, about one layer; the estimate counts both.

Construction (``--construction``): ``Trainer.setup`` only, at DP=2, DP=4 and TP=2 x DP=2; the peak of glibc's in-use
heap (sampled every millisecond) above what was allocated before, on the rank where it is highest, during the model's
construction and through ``deepspeed.initialize`` (which adds the optimizer's partitions and DeepSpeed's buckets),
and what the rank holds once the model is built. The whole-model runs swap ``build_partitioned_chunk`` for
``build_model_chunk``: the construction of the engine before it used ``deepspeed.zero.Init``.

Measured: the peak of bytes allocated from before the model is built to the end of the third step, on the rank where
it is highest (``accounting.PeakMemory``: CUDA allocator statistics on a GPU; on a CPU glibc's in-use heap bytes,
sampled every millisecond, which includes what offload puts on the host, the same memory there). Estimate:
``training.accounting.estimate_memory_per_gpu`` (device) plus its ``host`` part (offloaded). Writes
``<out>/zero_memory_<machine>_<date>.md`` (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, write_report  # noqa: E402

from benchmarks.peak_memory import launch_ranks, measure, rank_worker  # noqa: E402

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


# (name, ranks, overrides): ZeRO-3 settings whose construction is measured both ways
CONSTRUCTION = [
    ("ZeRO-3, DP=2", 2, []),
    ("ZeRO-3, DP=4", 4, []),
    ("ZeRO-3, TP=2 x DP=2", 4, ["parallel.tp=2"]),
    ("ZeRO-3, DP=2, parameter offload cpu", 2, ["engine.offload_param=cpu", "engine.offload_optimizer=cpu"] + HOST_ADAM),
]


def construction_worker(out_dir: str, build: str, overrides) -> None:
    """One rank: ``Trainer.setup`` of a ZeRO-3 run with the model built ``whole`` or ``partitioned``; writes the
    heap peaks of construction and of the whole ``_build_model`` (through deepspeed.initialize) as rank<r>.json."""
    from hydra import compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object
    from diff_transformer.distributed import destroy_distributed
    from diff_transformer.models.gpt import build_model_chunk, parameter_numel
    from diff_transformer.training import deepspeed_engine
    from diff_transformer.training.accounting import GIB, PeakMemory
    from diff_transformer.training.engines import create_trainer

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = to_object(compose("config", overrides=list(overrides)))
    trainer = create_trainer(cfg, os.path.join(out_dir, "run"))
    build_chunk = deepspeed_engine.build_partitioned_chunk
    if build == "whole":
        def build_chunk(cfg, vocab_size, dtype, ds_config):
            return build_model_chunk(cfg, vocab_size, dtype)
    measured = {}

    def construction(*args):
        with PeakMemory(cpu_method="heap") as peak:
            chunk = build_chunk(*args)
        measured["construction"] = peak
        measured["held"] = deepspeed_engine.resident_parameter_elements(chunk)
        measured["whole"] = sum(parameter_numel(p) for p in chunk.parameters())
        return chunk

    build_model = trainer._build_model

    def through_initialize():
        with PeakMemory(cpu_method="heap") as peak:
            model = build_model()
        measured["initialize"] = peak
        return model

    deepspeed_engine.build_partitioned_chunk = construction
    trainer._build_model = through_initialize
    try:
        trainer.setup()
        rank = torch.distributed.get_rank()
    finally:
        destroy_distributed()
    c, i = measured["construction"], measured["initialize"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"construction_peak": c.bytes / GIB, "construction_end": c.end_bytes / GIB,
                   "initialize_peak": i.bytes / GIB, "held": measured["held"], "whole": measured["whole"]}, f)


def construction_table(args, common) -> str:
    """Rows of the construction measurement, whole against partitioned, for every CONSTRUCTION setting."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, nproc, overrides) in enumerate(CONSTRUCTION):
            per_build = {}
            for build in ("whole", "partitioned"):
                work = Path(tmp) / f"{i}-{build}"
                ranks = launch_ranks(__file__, nproc, common + DS + ["engine.zero_stage=3"] + overrides, work,
                                     ["--build", build])
                per_build[build] = {key: max(r[key] for r in ranks) for key in ranks[0]}
                r = per_build[build]
                print(f"{name:40} {build:11} construction peak {r['construction_peak'] * 1024:8.1f} MiB, held "
                      f"{r['construction_end'] * 1024:8.1f} MiB, through initialize {r['initialize_peak'] * 1024:8.1f} "
                      f"MiB", flush=True)
            w, p = per_build["whole"], per_build["partitioned"]
            model_mib = w["whole"] * 4 / 2**20
            rows.append(
                f"| {name} | {model_mib:.1f} | {w['construction_peak'] * 1024:.1f} / {w['construction_end'] * 1024:.1f} | "
                f"{p['construction_peak'] * 1024:.1f} / {p['construction_end'] * 1024:.1f} | "
                f"{w['initialize_peak'] * 1024:.1f} | {p['initialize_peak'] * 1024:.1f} | "
                f"{p['held']:,} of {p['whole']:,} |"
            )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, default=4, help="processes (data-parallel ranks)")
    parser.add_argument("--bucket", type=float, default=1e7, help="zero_optimization.reduce_bucket_size (elements)")
    parser.add_argument("--prefetch", type=float, default=4e6, help="stage3_prefetch_bucket_size (elements)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--construction", action="store_true",
                        help="measure the ZeRO-3 construction, built whole against built partitioned")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--build", choices=("whole", "partitioned"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    if args.worker and args.build:
        construction_worker(args.worker, args.build, args.overrides)
        return 0
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
    if args.construction:
        return write_construction_report(args, common + buckets, heads)
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


def write_construction_report(args, common, heads) -> int:
    table = construction_table(args, common)
    lines = [
        f"# Host memory per rank while ZeRO-3 builds the model, {machine_name()}, {datetime.date.today()}",
        "",
        f"Command: `python benchmarks/zero_memory.py --construction --hidden {args.hidden} --layers {args.layers}` "
        f"(DIFF model: debug widened to hidden {args.hidden}, {args.layers} layers, {heads} heads, bundled "
        "4096-piece vocabulary; fp32 on a CPU; `Trainer.setup` only). Built whole: the model built on every rank, "
        "then partitioned by `deepspeed.initialize` (the engine before `deepspeed.zero.Init`); built partitioned: "
        "under `deepspeed.zero.Init`. Peaks are glibc's in-use heap above what the rank held before, sampled every "
        "millisecond, on the rank where they are highest; held: what was still allocated when construction ended. "
        "Through initialize: construction, the weights-only load (none here) and `deepspeed.initialize` (the "
        "optimizer's fp32 partitions and Adam state, DeepSpeed's buckets). Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| setting | model chunk, fp32 MiB | built whole: construction peak / held MiB | built partitioned: "
        "construction peak / held MiB | through initialize, whole MiB | through initialize, partitioned MiB | "
        "parameter elements a rank holds after construction |",
        "|---|---|---|---|---|---|---|",
        table,
    ]
    write_report("\n".join(lines) + "\n", args.out, "zero_construction")
    return 0


if __name__ == "__main__":
    sys.exit(main())
