"""Quickstart: train the tiny DIFF model and its mirrored baseline (on the bundled corpus unless data.* overrides say
otherwise), then plot both.

    python -m diff_transformer.quickstart [--out DIR] [--steps N] [extra Hydra overrides...]

Each model is a normal ``train.py experiment=quickstart`` run in its own run directory (so ``compare`` and
``checkpoint inspect`` work on them too); the bundled corpus is tokenized on first use. Writes
``DIR/loss_curves.png`` and ``DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import numpy as np

from diff_transformer.analysis.plots import QUICKSTART_LABELS as LABELS
from diff_transformer.analysis.plots import plot_loss_curves
from diff_transformer.fileio import atomic_write_json

REPO = Path(__file__).resolve().parent.parent
KINDS = ("diff", "vanilla")


def train(kind: str, run_dir: Path, steps: int | None, extra: Sequence[str]) -> None:
    cmd = [sys.executable, str(REPO / "train.py"), "experiment=quickstart", f"model.attention={kind}",
           f"hydra.run.dir={run_dir}", *extra]
    if steps is not None:
        cmd += [f"trainer.max_steps={steps}", f"optim.warmup_steps={max(1, steps // 10)}"]
    print(f"\n=== {LABELS[kind]}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def trained_on(run_dir: Path) -> str:
    """The data a run trained on, as its run.json names it (what the figure's title says)."""
    description = json.loads((run_dir / "run.json").read_text())
    return description.get("data_source") or "unrecorded data"


def throughput(records: List[dict]) -> float:
    """Median tokens/s over the run, skipping the first steps (warm-up, allocation)."""
    rates = [r["tokens_per_s"] for r in records[len(records) // 10 + 1:]] or [r["tokens_per_s"] for r in records]
    return float(np.median(rates))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output directory (default: outputs/quickstart/<time>)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model (default: the preset's)")
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x]
    if bad:
        parser.error(f"unrecognised arguments {bad}: pass options before Hydra overrides of the form key=value")
    out = Path(args.out or REPO / "outputs" / "quickstart" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    runs = {}
    for kind in KINDS:
        train(kind, out / kind, args.steps, extra)
        with open(out / kind / "metrics.jsonl") as f:
            runs[kind] = [json.loads(line) for line in f if line.strip()]

    png = plot_loss_curves(runs, out / "loss_curves.png", trained_on(out / KINDS[0]))
    summary = {}
    for kind, records in runs.items():
        vals = [r["val_loss"] for r in records if "val_loss" in r]
        summary[kind] = {
            "final_train_loss": records[-1]["loss"],
            "final_val_loss": vals[-1] if vals else None,
            "tokens_per_s_median": throughput(records),
            "lambda": records[-1].get("lambda"),
            "run_dir": str(out / kind),
        }
    summary["diff_vs_vanilla_throughput"] = summary["diff"]["tokens_per_s_median"] / summary["vanilla"]["tokens_per_s_median"]
    atomic_write_json(str(out / "summary.json"), summary)

    print("\n=== quickstart summary")
    for kind in KINDS:
        s = summary[kind]
        print(f"{LABELS[kind]:>24}: train loss {s['final_train_loss']:.4f}, validation loss "
              f"{s['final_val_loss']:.4f}, {s['tokens_per_s_median']:,.0f} tokens/s")
    print(f"DIFF throughput / baseline throughput: {summary['diff_vs_vanilla_throughput']:.3f}")
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
