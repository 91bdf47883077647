"""Quickstart: train the tiny DIFF model and its mirrored Transformer (on the bundled corpus unless data.* overrides
say otherwise), plot both, and measure their throughput against each other.

    python -m diff_transformer.quickstart [--out DIR] [--steps N] [--ab-rounds R] [extra Hydra overrides...]

Each model is a normal ``train.py experiment=quickstart`` run in its own run directory (so ``compare`` and
``checkpoint inspect`` work on them too); the bundled corpus is tokenized on first use. Ctrl-C stops the run in
progress after it saves; the same command resumes it. Then both models train in this process in alternating short
windows (``training.paired_throughput``), so that a neighbour's load slows both alike. Writes
``DIR/loss_curves.png`` and ``DIR/summary.json``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from diff_transformer.analysis.plots import QUICKSTART_LABELS as LABELS
from diff_transformer.analysis.plots import plot_loss_curves
from diff_transformer.cli import EXIT_INTERRUPTED, EXIT_STOPPED_RESUMABLE, ArgumentParser, print_error, run
from diff_transformer.fileio import OUTPUT_MARKER, atomic_write_json, check_output, move_aside, old_suffix

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "configs" / "experiment" / "quickstart.yaml"
COMMAND = "quickstart"  # the name in the output directory's marker: a rerun writes into its own directory
KINDS = ("diff", "vanilla")
SMOOTHING_RECORDS = 30  # the train-loss curve is a moving average over 1/30 of the records (analysis.plots)


class Interrupted(Exception):
    """Ctrl-C: the trainer saved (or was stopped before it started); the message says where and how to resume."""


class TrainingFailed(Exception):
    """train.py exited with an error it has already reported; the quickstart exits with its status."""


def preset_schedule() -> tuple[int, int]:
    """(trainer.max_steps, optim.warmup_steps) of the quickstart preset."""
    import yaml

    preset = yaml.safe_load(PRESET.read_text())
    return int(preset["trainer"]["max_steps"]), int(preset["optim"]["warmup_steps"])


def warmup_for(steps: int, extra: Sequence[str]) -> tuple[int, str]:
    """(warm-up steps for ``--steps steps``, where that number comes from): the user's optim.warmup_steps, else the
    preset's warm-up scaled to the steps (its 30 of 300), at least 1."""
    given = [x.split("=", 1)[1] for x in extra if x.split("=", 1)[0].lstrip("+") == "optim.warmup_steps"]
    if given:
        try:
            return int(given[-1]), "optim.warmup_steps"
        except ValueError:
            return 0, "optim.warmup_steps"  # train.py names the bad value
    preset_steps, preset_warmup = preset_schedule()
    return (max(1, preset_warmup * steps // preset_steps),
            f"{PRESET.relative_to(REPO)} warms up {preset_warmup} of its {preset_steps} steps, scaled to --steps")


def check_steps(steps: int | None, extra: Sequence[str]) -> None:
    """Refuse --steps that leave no step after the warm-up (train.py would refuse it only after the first run)."""
    if steps is None:
        return
    if steps < 1:
        raise ValueError(f"--steps {steps}: give a whole number of at least 2")
    warmup, source = warmup_for(steps, extra)
    if steps <= warmup:
        raise ValueError(f"--steps {steps} is too few for a warm-up of {warmup} step{'s' if warmup != 1 else ''} "
                         f"({source}): give --steps {warmup + 1} or more")


def prepare_out(out: Path, force: bool) -> None:
    """Refuse a directory holding what the quickstart did not write (``--force``: move it aside first); a quickstart's
    own directory is resumed."""
    check_output(str(out), command=COMMAND, force=force)
    if force and out.is_dir() and any(out.iterdir()) and not (out / OUTPUT_MARKER).exists():
        print(f"--force: moved {out} aside to {move_aside(str(out), old_suffix())}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / OUTPUT_MARKER).exists():
        atomic_write_json(str(out / OUTPUT_MARKER),
                          {"command": COMMAND, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def train(kind: str, run_dir: Path, steps: int | None, extra: Sequence[str]) -> None:
    cmd = [sys.executable, str(REPO / "train.py"), "experiment=quickstart", f"model.attention={kind}",
           f"hydra.run.dir={run_dir}"]
    if steps is not None:
        cmd += [f"trainer.max_steps={steps}", f"optim.warmup_steps={warmup_for(steps, [])[0]}"]
    cmd += list(extra)  # the user's overrides win
    print(f"\n=== {LABELS[kind]}: {' '.join(cmd[1:])}", flush=True)
    trainer = subprocess.Popen(cmd, cwd=REPO)
    try:
        status = trainer.wait()
    except KeyboardInterrupt:
        # a Ctrl-C at the terminal reached the trainer too (it takes the two as one); a SIGINT sent to this process
        # alone reaches it only so. Either way: wait for its save, however long (a second Ctrl-C stops it at once).
        trainer.send_signal(signal.SIGINT)
        status = wait_through_interrupts(trainer)
        if status in (EXIT_STOPPED_RESUMABLE, 0):
            raise Interrupted(f"interrupted (SIGINT): the {LABELS[kind]} run saved its last step in {run_dir}; "
                              f"rerun the same command to resume it") from None
        if status == EXIT_INTERRUPTED:  # before its training started: train.py said so in its own line
            raise Interrupted() from None
        raise Interrupted(f"interrupted (SIGINT): the {LABELS[kind]} run stopped (exit {status}); rerun the same "
                          f"command to go on") from None
    if status == EXIT_STOPPED_RESUMABLE:  # the trainer was stopped by a signal of its own (SIGTERM)
        raise Interrupted(f"the {LABELS[kind]} run was stopped by a signal after saving in {run_dir}; rerun the "
                          "same command to resume it")
    if status != 0:
        raise TrainingFailed(status)


def wait_through_interrupts(process: subprocess.Popen) -> int:
    """``process``'s exit status; each further Ctrl-C is passed on to it (its second one stops it at once)."""
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)


def run_description(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def trained_on(run_dir: Path) -> str:
    """The data a run trained on, as its run.json names it (what the figure's title says)."""
    return run_description(run_dir).get("data_source") or "unrecorded data"


def device_name() -> str:
    """The device the runs trained on (this machine's: train.py takes a GPU when there is one)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def figure_title(out: Path, runs: Dict[str, List[dict]]) -> str:
    """What the figure shows, from the runs: model, tokens, seeds, device and the train curves' smoothing."""
    from diff_transformer.figure_style import human_number

    described = [run_description(out / kind) for kind in runs]
    models = " / ".join(dict.fromkeys(d["model"] for d in described))
    seeds = sorted({d["seed"] for d in described})
    tokens = max(records[-1].get("tokens", 0) for records in runs.values())
    window = max(1, len(next(iter(runs.values()))) // SMOOTHING_RECORDS)
    steps = max(records[-1]["step"] for records in runs.values())
    seed_text = f"one seed ({seeds[0]})" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"
    smoothing = (f"{window}-step moving average over the faint per-step curve" if window > 1 else
                 "every step, unsmoothed")
    return (f"{models} DIFF vs Transformer on {device_name()}: {human_number(tokens)} tokens ({steps} steps) each, "
            f"{seed_text}\ntrain loss: {smoothing}")


def throughput(records: List[dict]) -> float:
    """Median tokens/s over the run, skipping the first steps (warm-up, allocation)."""
    rates = [r["tokens_per_s"] for r in records[len(records) // 10 + 1:]] or [r["tokens_per_s"] for r in records]
    return float(np.median(rates))


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m diff_transformer.quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output directory (default: outputs/quickstart/<time>)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model (default: the preset's)")
    parser.add_argument("--ab-rounds", type=int, default=10,
                        help="rounds of the throughput A/B after training (0: skip it)")
    parser.add_argument("--force", action="store_true", help="move aside a non-empty --out the quickstart did not write")
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x]
    if bad:
        parser.error(f"unrecognised arguments {bad}: pass options before Hydra overrides of the form key=value")
    if args.ab_rounds < 0:
        parser.error(f"--ab-rounds {args.ab_rounds}: give 0 (no A/B) or more rounds")
    check_steps(args.steps, extra)
    out = Path(args.out or REPO / "outputs" / "quickstart" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    prepare_out(out, args.force)

    runs = {}
    try:
        for kind in KINDS:
            train(kind, out / kind, args.steps, extra)
            with open(out / kind / "metrics.jsonl") as f:
                runs[kind] = [json.loads(line) for line in f if line.strip()]
    except Interrupted as stop:
        if stop.args:
            print_error(str(stop))
        return EXIT_INTERRUPTED
    except TrainingFailed as failed:
        return failed.args[0]

    png = plot_loss_curves(runs, out / "loss_curves.png", trained_on(out / KINDS[0]), figure_title(out, runs))
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
    print("\n=== quickstart summary")
    for kind in KINDS:
        s = summary[kind]
        val = "none logged" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"
        print(f"{LABELS[kind]:>24}: train loss {s['final_train_loss']:.4f}, validation loss {val}, "
              f"{s['tokens_per_s_median']:,.0f} tokens/s (median over its run)")
    summary["diff_vs_vanilla_throughput"] = None
    if args.ab_rounds:
        from diff_transformer.training.paired_throughput import paired_run_throughput

        print(f"measuring throughput: {args.ab_rounds} rounds of alternating windows of each model ...", flush=True)
        try:
            ab = paired_run_throughput(str(out / "diff" / "config.yaml"), str(out / "vanilla" / "config.yaml"),
                                       rounds=args.ab_rounds)
        except KeyboardInterrupt:
            print_error("interrupted (SIGINT) during the throughput A/B: both runs are complete; rerun the same "
                        "command to plot and measure")
            return EXIT_INTERRUPTED
        summary["diff_vs_vanilla_throughput"] = ab.ratio
        summary["throughput_ab"] = ab.to_json()
        print(ab.describe("DIFF", "Transformer"))
    else:
        summary["throughput_ab"] = {"skipped": "--ab-rounds 0"}
    atomic_write_json(str(out / "summary.json"), summary)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
