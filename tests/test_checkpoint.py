"""Checkpoint bookkeeping without training: retention, the latest pointer, partial saves, free space, config
compatibility, metrics truncation and the bad-step guard."""

import json
import math
import os

import pytest

from diff_transformer.config import CheckpointConfig, FailureConfig, validate_checkpoint_config, validate_failure_config
from diff_transformer.training import checkpoint
from diff_transformer.training.checkpoint import (
    LATEST_FILE,
    STATE_FILE,
    checkpoint_name,
    checkpoints_to_delete,
    latest_checkpoint,
    list_checkpoints,
    model_config_differences,
    remove_partial_saves,
)
from diff_transformer.training.failures import BadStepGuard
from diff_transformer.training.metrics import truncate_metrics


def fake_checkpoint(root, step, complete=True):
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    if complete:
        (path / STATE_FILE).write_text(json.dumps({"step": step}))
    return path


def test_retention_keeps_the_newest_and_every_mth():
    steps = [100, 200, 300, 400, 500, 600, 700]
    assert checkpoints_to_delete(steps, keep_last=2, keep_every=0) == [100, 200, 300, 400, 500]
    assert checkpoints_to_delete(steps, keep_last=2, keep_every=300) == [100, 200, 400, 500]
    assert checkpoints_to_delete(steps, keep_last=10, keep_every=0) == []


def test_apply_retention_removes_directories(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    removed = checkpoint.apply_retention(str(tmp_path), keep_last=2, keep_every=4)
    assert sorted(os.path.basename(p) for p in removed) == [checkpoint_name(2)]
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [4, 6, 8]


def test_latest_pointer_and_its_fallbacks(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 30, complete=False)  # a save that never finished is never loaded
    assert latest_checkpoint(str(tmp_path)).endswith(checkpoint_name(20))
    (tmp_path / LATEST_FILE).write_text(checkpoint_name(10) + "\n")
    assert latest_checkpoint(str(tmp_path)).endswith(checkpoint_name(10)), "the pointer decides"
    (tmp_path / LATEST_FILE).write_text(checkpoint_name(30) + "\n")
    assert latest_checkpoint(str(tmp_path)).endswith(checkpoint_name(20)), "a pointer to a partial one is ignored"


def test_a_checkpoint_is_found_from_a_latest_file_a_run_dir_or_a_checkpoints_dir(tmp_path, capsys):
    from diff_transformer.checkpoint import main
    from diff_transformer.training.checkpoint import resolve_checkpoint_path

    root = tmp_path / "run" / "checkpoints"
    fake_checkpoint(root, 2)
    newest = fake_checkpoint(root, 4)
    (root / LATEST_FILE).write_text(checkpoint_name(4) + "\n")
    state = {"step": 4, "consumed_samples": 16, "layout": {"tp": 1, "pp": 1, "dp": 1, "world_size": 1,
             "distributed_optimizer": False}, "config": {"model": {"name": "debug", "attention": "diff"}}}
    (newest / STATE_FILE).write_text(json.dumps(state))
    for given in (root / LATEST_FILE, tmp_path / "run", root, newest):
        assert resolve_checkpoint_path(str(given)) == str(newest), given
    assert main(["inspect", str(root / LATEST_FILE)]) == 0  # the README's command
    assert f"checkpoint   {newest}" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is not a checkpoint: give a step_* checkpoint directory" in capsys.readouterr().err


def test_partial_saves_are_removed(tmp_path):
    partial = tmp_path / f".{checkpoint_name(40)}.tmp"
    partial.mkdir()
    fake_checkpoint(tmp_path, 20)
    remove_partial_saves(str(tmp_path))
    assert not partial.exists() and (tmp_path / checkpoint_name(20)).exists()


def test_refuses_to_start_without_room_for_one_checkpoint(tmp_path, monkeypatch):
    needed = checkpoint.estimate_checkpoint_bytes(100_000_000, __import__("torch").float32)
    assert needed == 100_000_000 * 12  # fp32 weights + two fp32 Adam moments
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: _Usage(needed - 1))
    with pytest.raises(ValueError, match=r"has 1\.12 GiB free, less than one checkpoint \(1\.12 GiB\)"):
        checkpoint.ensure_free_space(str(tmp_path / "not" / "yet" / "made"), needed)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: _Usage(needed))
    checkpoint.ensure_free_space(str(tmp_path), needed)


class _Usage:
    def __init__(self, free):
        self.free = free


def test_model_config_differences_name_the_keys():
    saved = {"hidden_size": 64, "num_layers": 2, "attention": "diff", "attention_backend": "sdpa"}
    current = {"hidden_size": 128, "num_layers": 2, "attention": "vanilla", "attention_backend": "triton"}
    assert model_config_differences(saved, current) == [
        "model.attention: checkpoint 'diff', config 'vanilla'",
        "model.hidden_size: checkpoint 64, config 128",
    ]


def test_config_validation_names_bad_values(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.keep_last=0"):
        validate_checkpoint_config(CheckpointConfig(keep_last=0))
    with pytest.raises(ValueError, match="checkpoint.resume='/nope'"):
        validate_checkpoint_config(CheckpointConfig(resume="/nope"))
    validate_checkpoint_config(CheckpointConfig(resume=str(tmp_path)))
    with pytest.raises(ValueError, match="failures.signals has 'SIGFOO'"):
        validate_failure_config(FailureConfig(signals=["SIGFOO"]))
    with pytest.raises(ValueError, match="failures.loss_spike_factor=0.5"):
        validate_failure_config(FailureConfig(loss_spike_factor=0.5))


def test_truncate_metrics_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "lo')  # the last line cut by a crash
    assert truncate_metrics(str(path), 3) == 3
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert truncate_metrics(str(path), 3) == 0


def test_bad_step_guard():
    guard = BadStepGuard(FailureConfig(max_consecutive_bad_steps=2, loss_spike_factor=2.0, loss_spike_window=3))
    assert guard.check(4.0) is None and guard.check(4.0) is None
    assert guard.check(100.0) is None, "no spike test before the window is full"
    assert guard.check(math.nan) == "loss is nan" and not guard.exhausted
    assert guard.check(4.0) is None and guard.consecutive == 0
    assert "exceeds 2.0 x the mean" in guard.check(2 * 36.0 + 1)  # mean of (4, 100, 4) is 36
    assert guard.check(math.inf) == "loss is inf" and guard.exhausted


def test_preemption_signal_only_sets_a_flag_until_the_ranks_agree():
    import signal

    from diff_transformer.training.failures import PreemptionSignals

    previous = signal.getsignal(signal.SIGUSR1)
    signals = PreemptionSignals(["SIGUSR1"], grace_period_s=60).install()
    try:
        assert not signals.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == "SIGUSR1" and signals.agreed()
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous
