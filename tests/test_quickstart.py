"""The quickstart refuses what would fail or lose files before it trains, and Ctrl-C stops it after its trainer saves:
exit 130 with one line, and the same command resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diff_transformer import quickstart
from diff_transformer.cli import EXIT_INTERRUPTED, EXIT_REFUSED, run
from tests.train_runs import REPO, read_metrics, train_env


def refusal(capsys, *argv) -> str:
    assert run(quickstart.main, list(argv)) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_foreign_non_empty_out_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert "holds files this command did not write (notes.txt)" in refusal(capsys, "--out", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_steps_too_few_for_the_warmup_are_refused_naming_the_minimum(tmp_path, capsys):
    out = tmp_path / "q"
    assert "give --steps 2 or more" in refusal(capsys, "--out", str(out), "--steps", "1")
    assert "give --steps 31 or more" in refusal(capsys, "--out", str(out), "--steps", "20", "optim.warmup_steps=30")
    assert not out.exists()
    preset_steps, preset_warmup = quickstart.preset_schedule()
    assert (preset_steps, preset_warmup) == (300, 30)  # configs/experiment/quickstart.yaml
    assert quickstart.warmup_for(300, []) == (30, quickstart.warmup_for(300, [])[1])


def test_ctrl_c_waits_for_the_save_exits_130_and_the_rerun_resumes(tmp_path):
    """SIGINT to the quickstart alone (as `kill -INT` sends it; a terminal's Ctrl-C reaches the trainer too, which
    takes the two as one) once its first run has logged a step: the trainer saves, the quickstart says so in one
    line; the same command then resumes that run (its steps contiguous), trains the other and measures both."""
    out = tmp_path / "quick"
    # records reach metrics.jsonl at logging steps: every step here, so the interrupt lands early in the first run
    command = [sys.executable, "-m", "diff_transformer.quickstart", "--out", str(out), "--steps", "30",
               "--ab-rounds", "2", "model=debug", "trainer.eval_iters=1", "trainer.log_interval=1",
               "logging.wandb.mode=disabled"]
    proc = subprocess.Popen(command, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = out / "diff" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.stat().st_size) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED, (stdout[-2000:], stderr[-3000:])
    assert stderr.startswith("error: interrupted (SIGINT): the DIFF Transformer run saved its last step")
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    saved = (out / "diff" / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(saved.split("_")[-1])
    assert stopped_at < 30 and not (out / "vanilla").exists()

    rerun = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, (rerun.stdout[-2000:], rerun.stderr[-3000:])
    assert f"resumed from {out / 'diff' / 'checkpoints' / saved} at step {stopped_at}" in rerun.stdout
    assert [r["step"] for r in read_metrics(out / "diff")] == list(range(1, 31))
    assert [r["step"] for r in read_metrics(out / "vanilla")] == list(range(1, 31))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["throughput_ab"]["rounds"] == 2 and summary["diff_vs_vanilla_throughput"] > 0
    assert "DIFF / Transformer throughput: " in rerun.stdout and (out / "loss_curves.png").exists()


@pytest.mark.parametrize("records,expected", [(6, "every step, unsmoothed"), (300, "10-step moving average")])
def test_the_figure_title_says_model_device_tokens_seed_and_smoothing(tmp_path, monkeypatch, records, expected):
    runs = {}
    for kind in quickstart.KINDS:
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "run.json").write_text(json.dumps({"model": "tiny", "seed": 1234}))
        runs[kind] = [{"step": s, "loss": 5.0, "tokens": 2048 * s} for s in range(1, records + 1)]
    monkeypatch.setattr(quickstart, "device_name", lambda: "CPU")
    title = quickstart.figure_title(tmp_path, runs)
    assert title.startswith(f"tiny DIFF vs Transformer on CPU: {'12.3K' if records == 6 else '614K'} tokens "
                            f"({records} steps) each, one seed (1234)")
    assert expected in title
