"""The cost of the training-time attention diagnostics (trainer.attention_diagnostics), measured against the step.

    python benchmarks/attention_diagnostics.py [--steps 40] [--out benchmarks/results]

Trains each configuration with the diagnostics on at every 10th step and reads metrics.jsonl: the probe's seconds
(attn/seconds) over the median step time gives the cost of one evaluation's diagnostics in steps, c; at
trainer.eval_interval = E they cost c / E of the training time. Next to it, the estimate that
``trainer.attention_diagnostics=auto`` uses (training/diagnostics.py: FLOPs of the probe's forward and eager maps over
the FLOPs of E steps), so that the rule's threshold can be checked against the measurement.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reports import machine_name, write_report  # noqa: E402

CONFIGS = {
    "debug (smoke: 8 x 64 tokens)": ["experiment=smoke"],
    "tiny (quickstart: 16 x 128 tokens)": ["experiment=quickstart"],
    "scale_8m (quickstart batch: 16 x 128)": ["experiment=quickstart", "model=scale_8m"],
    "tiny at 512 tokens (8 x 512)": ["experiment=quickstart", "model.seq_length=512", "trainer.global_batch_size=8",
                                     "trainer.micro_batch_size=8"],
}
# On a GPU (bf16): the quickstart model, and the paper's 830M at its sequence length 2048.
GPU_CONFIGS = {
    "tiny (quickstart: 16 x 128 tokens)": ["experiment=quickstart"],
    "830m at 2048 (8 x 2048 tokens)": ["experiment=quickstart", "model=830m", "trainer.global_batch_size=8",
                                       "trainer.micro_batch_size=4"],
}
INTERVAL = 10


def measure(overrides, steps: int, run_dir: Path):
    cmd = [sys.executable, str(REPO / "train.py"), *overrides, f"trainer.max_steps={steps}", "optim.warmup_steps=1",
           f"trainer.eval_interval={INTERVAL}", "trainer.eval_iters=1", "trainer.attention_diagnostics=on",
           "checkpoint.interval=0", "checkpoint.save_at_end=false", "logging.wandb.mode=disabled",
           f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_time = statistics.median(r["step_time"] for r in records[2:])
    seconds = [r["attn/seconds"] for r in records if "attn/seconds" in r][1:]  # the first includes warm-up
    log = (run_dir / "train.log").read_text()
    estimate = float(log.split("estimated cost ")[1].split("%")[0]) / 100 * INTERVAL
    return step_time, statistics.median(seconds), estimate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        import torch

        configs = GPU_CONFIGS if torch.cuda.is_available() else CONFIGS
        for i, (name, overrides) in enumerate(configs.items()):
            step, diag, estimate = measure(overrides, args.steps, Path(tmp) / str(i))
            c = diag / step
            rows.append(f"| {name} | {1000 * step:.1f} | {1000 * diag:.2f} | {c:.3f} | {estimate:.3f} | "
                        f"{100 * c / 100:.3f}% | {100 * c / 1000:.4f}% | {max(1, round(c / 0.01))} |")
    report = "\n".join([
        f"# Attention diagnostics: cost on {machine_name()}",
        "",
        "Diagnostics on every evaluation (probe: 2 validation sequences; entropy, sink rate and largest logit per "
        f"layer); median over {args.steps} steps with evaluations every {INTERVAL}. c = diagnostics seconds / step "
        "seconds (one evaluation's cost in steps); at trainer.eval_interval = E the cost is c / E of training time. "
        "The estimate is the FLOP rule of `trainer.attention_diagnostics=auto`, which turns them on when "
        "estimate / E <= 1%.",
        "",
        "| config | step ms | diagnostics ms | c measured | c estimated | cost at E=100 | cost at E=1000 | smallest E under 1% |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    write_report(report, args.out, "attention_diagnostics")
    return 0


if __name__ == "__main__":
    sys.exit(main())
