"""Training throughput of DIFF vs its mirrored baseline, and TP=2 vs TP=1 step time, in one run.

    python benchmarks/train_throughput.py [--model tiny] [--steps 60] [--tp 1 2] [--out benchmarks/results]
    python benchmarks/train_throughput.py --model 830m --tp 1 --kinds diff:sdpa diff:triton vanilla:sdpa   # GPU

Each configuration is a real ``train.py`` run (megatron-core schedules, DDP, optimizer; no validation, no
checkpoints); the figure is the median over steps after the first 20% (warm-up). Ratios are only meaningful between
rows of the same run on the same machine. Writes ``<out>/train_throughput_<machine>_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, write_report  # noqa: E402

from tests.train_runs import free_port  # noqa: E402


def run(model: str, kind: str, tp: int, steps: int, run_dir: Path, extra, backend: str | None = None) -> dict:
    overrides = [
        f"model={model}", f"model.attention={kind}", f"parallel.tp={tp}", f"trainer.max_steps={steps}",
        *([f"model.attention_backend={backend}"] if backend else []),
        "trainer.eval_interval=0", "trainer.log_interval=1000000", f"optim.warmup_steps={max(1, steps // 10)}",
        "trainer.micro_batch_size=8", "trainer.global_batch_size=16", "logging.wandb.mode=disabled",
        "checkpoint.interval=0", "checkpoint.save_at_end=false", f"hydra.run.dir={run_dir}", *extra,
    ]
    if tp == 1:
        cmd = [sys.executable, str(REPO / "train.py"), *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
               f"--master_port={free_port()}", str(REPO / "train.py"), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:  # report it and go on with the next configuration: one failure hides no other result
        print(f"train.py failed with exit {proc.returncode} ({' '.join(overrides)}):\n{proc.stdout[-3000:]}\n"
              f"{proc.stderr[-6000:]}", flush=True)
        return {"model": model, "attention": kind, "backend": backend or "default", "tp": tp,
                "failed": f"exit {proc.returncode}"}
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    kept = records[len(records) // 5:]
    step_time = statistics.median(r["step_time"] for r in kept)
    mfu = [r["mfu"] for r in kept if r.get("mfu") is not None]
    return {"model": model, "attention": kind, "backend": backend or "default", "tp": tp, "step_time_s": step_time,
            "tokens_per_s": records[0]["tokens_per_s"] * records[0]["step_time"] / step_time,
            "mfu": statistics.median(mfu) if mfu else None,
            "memory_gib": max(r.get("memory_gib") or 0.0 for r in records),
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


def _percent(value) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kinds", nargs="+", default=["diff", "vanilla"], metavar="KIND[:BACKEND]",
                        help="attention kinds, each optionally with its backend (diff:triton)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    rows = []
    kinds = [tuple(k.split(":", 1)) if ":" in k else (k, None) for k in args.kinds]
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            for kind, backend in kinds:
                run_dir = Path(tmp) / f"{kind}-{backend}-tp{tp}"
                rows.append(run(args.model, kind, tp, args.steps, run_dir, args.overrides, backend))
                r = rows[-1]
                if "failed" in r:
                    print(f"{r['attention']:>8} {r['backend']:>8} tp={tp}: FAILED ({r['failed']})", flush=True)
                    continue
                mfu = f"  MFU {_percent(r['mfu'])}" if r["mfu"] is not None else ""
                print(f"{r['attention']:>8} {r['backend']:>8} tp={tp}: {r['step_time_s'] * 1e3:8.1f} ms/step  "
                      f"{r['tokens_per_s']:10,.0f} tok/s{mfu}  peak {r['memory_gib']:.2f} GiB  "
                      f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}", flush=True)

    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    by = {}
    for r in rows:  # the first backend of each kind stands for it in the ratios
        by.setdefault((r["attention"], r["tp"]), r)
    lines = [
        f"# Training throughput, `{args.model}` model, {machine_name()}, {datetime.date.today()}",
        "",
        f"Command: `python benchmarks/train_throughput.py {' '.join(args.overrides) + ' ' if args.overrides else ''}"
        f"--model {args.model} --steps {args.steps} --tp {' '.join(map(str, args.tp))} --kinds {' '.join(args.kinds)}` "
        f"(micro-batch 8 and global batch 16 unless overridden; fp32 on CPU, bf16 on GPU; median step "
        f"time after the first 20% of steps). Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| attention | backend | TP | ms/step | tokens/s | MFU | peak GiB | first loss | last loss |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['attention']} | {r['backend']} | {r['tp']} | {r['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} "
          f"| {_percent(r['mfu'])} | {r['memory_gib']:.2f} "
          f"| {r['first_loss']:.3f} | {r['last_loss']:.3f} |" for r in rows],
        *[f"| {r['attention']} | {r['backend']} | {r['tp']} | failed: {r['failed']} | | | | | |" for r in failed],
        "",
    ]
    for r in rows:
        base = by.get(("vanilla", r["tp"]))
        if r["attention"] != "vanilla" and base is not None:
            lines.append(f"- {r['attention']} ({r['backend']}) / vanilla ({base['backend']}) tokens/s at TP={r['tp']}: "
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}")
    for tp in args.tp:
        if tp != 1 and 1 in args.tp:
            for kind in dict.fromkeys(k for k, _ in kinds):
                if (kind, tp) not in by or (kind, 1) not in by:
                    continue
                lines.append(f"- {kind}: TP={tp} step time / TP=1 step time: "
                             f"{by[(kind, tp)]['step_time_s'] / by[(kind, 1)]['step_time_s']:.3f}")
    write_report("\n".join(lines) + "\n", args.out, "train_throughput")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
