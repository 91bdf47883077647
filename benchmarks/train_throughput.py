"""Training throughput of DIFF vs its mirrored baseline, and TP=2 vs TP=1 step time, in one run.

    python benchmarks/train_throughput.py [--model tiny] [--steps 60] [--tp 1 2] [--out benchmarks/results]

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

from tests.train_runs import free_port  # noqa: E402


def machine_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"


def run(model: str, kind: str, tp: int, steps: int, run_dir: Path, extra) -> dict:
    overrides = [
        f"model={model}", f"model.attention={kind}", f"parallel.tp={tp}", f"trainer.max_steps={steps}",
        "trainer.eval_interval=0", "trainer.log_interval=1000000", f"optim.warmup_steps={max(1, steps // 10)}",
        "trainer.micro_batch_size=8", "trainer.global_batch_size=16", "logging.wandb.mode=disabled",
        "checkpoint.interval=0", "checkpoint.save_at_end=false", f"hydra.run.dir={run_dir}", *extra,
    ]
    if tp == 1:
        cmd = [sys.executable, str(REPO / "train.py"), *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
               f"--master_port={free_port()}", str(REPO / "train.py"), *overrides]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    kept = records[len(records) // 5:]
    step_time = statistics.median(r["step_time"] for r in kept)
    return {"model": model, "attention": kind, "tp": tp, "step_time_s": step_time,
            "tokens_per_s": records[0]["tokens_per_s"] * records[0]["step_time"] / step_time}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            for kind in ("diff", "vanilla"):
                rows.append(run(args.model, kind, tp, args.steps, Path(tmp) / f"{kind}-tp{tp}", args.overrides))
                r = rows[-1]
                print(f"{r['attention']:>8} tp={tp}: {r['step_time_s'] * 1e3:8.1f} ms/step  {r['tokens_per_s']:10,.0f} tok/s",
                      flush=True)

    by = {(r["attention"], r["tp"]): r for r in rows}
    lines = [
        f"# Training throughput, `{args.model}` model, {machine_name()}, {datetime.date.today()}",
        "",
        f"Command: `python benchmarks/train_throughput.py --model {args.model} --steps {args.steps} --tp "
        f"{' '.join(map(str, args.tp))}` (micro-batch 8, global batch 16, fp32 on CPU / auto on GPU; median step "
        f"time after the first 20% of steps). Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}.",
        "",
        "| attention | TP | ms/step | tokens/s |",
        "|---|---|---|---|",
        *[f"| {r['attention']} | {r['tp']} | {r['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} |" for r in rows],
        "",
    ]
    for tp in args.tp:
        lines.append(f"- DIFF / baseline tokens/s at TP={tp}: "
                     f"{by[('diff', tp)]['tokens_per_s'] / by[('vanilla', tp)]['tokens_per_s']:.3f}")
    for tp in args.tp:
        if tp != 1 and 1 in args.tp:
            for kind in ("diff", "vanilla"):
                lines.append(f"- {kind}: TP={tp} step time / TP=1 step time: "
                             f"{by[(kind, tp)]['step_time_s'] / by[(kind, 1)]['step_time_s']:.3f}")
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train_throughput_{machine_name()}_{datetime.date.today()}.md"
    path.write_text(report)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
