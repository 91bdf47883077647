"""Checkpoint bookkeeping without training: retention, the latest pointer, partial saves, free space, config
compatibility, metrics truncation and the bad-step guard."""

import json
import math
import os
import zlib

import pytest

from diff_transformer.config import CheckpointConfig, FailureConfig, validate_checkpoint_config, validate_failure_config
from diff_transformer.training import checkpoint
from diff_transformer.training.checkpoint import (
    FORMAT_VERSION,
    LATEST_FILE,
    STATE_FILE,
    write_checkpoint_state,
    checkpoint_name,
    checkpoints_to_delete,
    latest_checkpoint,
    list_checkpoints,
    model_config_differences,
    remove_partial_saves,
)
from diff_transformer.training.failures import BadStepGuard
from diff_transformer.training.metrics import truncate_metrics


def fake_checkpoint(root, step, complete=True, state=None):
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (path / "common.pt").write_bytes(b"common" * 10)
    if complete:  # trainer_state.json, then the manifest, as a save commits them
        write_checkpoint_state(str(path), state or {"format_version": FORMAT_VERSION, "step": step})
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
    state = {"format_version": FORMAT_VERSION, "step": 4, "consumed_samples": 16, "layout": {
        "tp": 1, "pp": 1, "dp": 1, "world_size": 1, "distributed_optimizer": False},
        "config": {"model": {"name": "debug", "attention": "diff"}}}
    newest = fake_checkpoint(root, 4, state=state)
    (root / LATEST_FILE).write_text(checkpoint_name(4) + "\n")
    for given in (root / LATEST_FILE, tmp_path / "run", root, newest):
        assert resolve_checkpoint_path(str(given)) == str(newest), given
    assert main(["inspect", str(root / LATEST_FILE)]) == 0  # the command docs/checkpoints.md gives
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
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: _Usage(300 * 1024))
    with pytest.raises(ValueError) as err:
        checkpoint.ensure_free_space(str(tmp_path / "not" / "yet" / "made"), needed, keep_last=3)
    # sizes in units that do not round to zero, and choices that keep the run (moving the checkpoints along)
    assert "has 300 KiB free, less than one checkpoint (1.12 GiB)" in str(err.value)
    assert "rerun with checkpoint.dir set to its new place" in str(err.value)
    assert "checkpoint.keep_last, now 3" in str(err.value)
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

    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGINT)}
    quiet = PreemptionSignals(["SIGUSR1"], grace_period_s=60).install()
    assert signal.getsignal(signal.SIGINT) == quiet._handle, "Ctrl-C saves too, whatever failures.signals says"
    quiet.uninstall()
    assert {s: signal.getsignal(s) for s in previous} == previous, "no signal came: the handlers are restored"
    signals = PreemptionSignals(["SIGUSR1"], grace_period_s=60).install()
    try:
        assert not signals.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == "SIGUSR1" and signals.agreed()
        signals.uninstall()
        # the run is on its way out: a repeated signal cannot kill it half-way through its exit
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN == signal.getsignal(signal.SIGINT)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ------------------------------------------------------------------------------------------------------------------
# The manifest, verification and the fallback of checkpoint.resume=auto
# ------------------------------------------------------------------------------------------------------------------
def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verification_names_every_damaged_file(tmp_path):
    from diff_transformer.training.checkpoint_files import MANIFEST_FILE, verify

    path = fake_checkpoint(tmp_path, 2)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == ["__0_0.distcp", "common.pt", STATE_FILE]
    assert verify(str(path)).ok
    flip_byte(path / "__0_0.distcp")
    (path / "common.pt").write_bytes((path / "common.pt").read_bytes()[:-7])
    result = verify(str(path))
    assert result.problems == [
        "common.pt: 53 bytes, the manifest records 60 (truncated)",
        f"__0_0.distcp: crc32 {zlib.crc32((path / '__0_0.distcp').read_bytes()):08x}, the manifest records "
        f"{manifest['files']['__0_0.distcp']['crc32']} (contents changed)",
    ]
    # sizes only: the truncation, not the flipped bit
    assert verify(str(path), checksums=False).problems == ["common.pt: 53 bytes, the manifest records 60 (truncated)"]
    (path / "common.pt").unlink()
    assert "common.pt: missing" in verify(str(path)).problems
    (path / MANIFEST_FILE).unlink()
    assert verify(str(path)).problems == [f"{MANIFEST_FILE} is missing (the checkpoint was saved with one)"]
    old = fake_checkpoint(tmp_path, 4, complete=False)
    (old / STATE_FILE).write_text(json.dumps({"format_version": 1, "step": 4}))  # saved before manifests
    result = verify(str(old))
    assert result.ok and not result.has_manifest


def test_resume_auto_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    from diff_transformer.training.checkpoint import CheckpointDamaged, select_resume_checkpoint

    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    (tmp_path / LATEST_FILE).write_text(checkpoint_name(6) + "\n")  # step 8: a save killed before the pointer moved
    flip_byte(tmp_path / checkpoint_name(6) / "__0_0.distcp")
    (tmp_path / checkpoint_name(4) / "common.pt").unlink()
    with caplog.at_level("WARNING", logger="diff_transformer"):
        chosen, skipped = select_resume_checkpoint(str(tmp_path))
    assert chosen == str(tmp_path / checkpoint_name(2))
    assert [(os.path.basename(p), why.split(":")[0]) for p, why in skipped] == [
        (checkpoint_name(6), "__0_0.distcp"), (checkpoint_name(4), "common.pt")]
    assert f"checkpoint {tmp_path / checkpoint_name(6)} is damaged (__0_0.distcp: crc32" in caplog.text
    assert (tmp_path / checkpoint_name(6)).is_dir(), "a damaged checkpoint is evidence: never deleted"
    flip_byte(tmp_path / checkpoint_name(2) / STATE_FILE, offset=3)
    with pytest.raises(CheckpointDamaged, match=r"no checkpoint under .* verifies \(step_00000006: __0_0.distcp.*"
                                                r"step_00000004: common.pt: missing; step_00000002: trainer_state"):
        select_resume_checkpoint(str(tmp_path))
    assert select_resume_checkpoint(str(tmp_path / "empty")) == (None, [])


def test_sizes_read_in_units_that_do_not_round_to_zero():
    from diff_transformer.training.checkpoint_files import format_bytes

    assert [format_bytes(n) for n in (17, 1536, 312 * 1024, 1.53 * 2**20, 1023 * 2**20, 5 * 2**40)] == [
        "17 B", "1.5 KiB", "312 KiB", "1.53 MiB", "1023 MiB", "5 TiB"]


def test_last_logged_step_reads_the_end_of_metrics(tmp_path):
    from diff_transformer.training.metrics import last_logged_step

    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(str(path)) is None
    path.write_text("".join(json.dumps({"step": s, "pad": "x" * 300}) + "\n" for s in range(1, 400)) + '{"step": 4')
    assert last_logged_step(str(path)) == 399, "the last complete record, past a line cut by a crash"


# ------------------------------------------------------------------------------------------------------------------
# One run per directory
# ------------------------------------------------------------------------------------------------------------------
def run_config(tmp_path, **checkpoint_keys):
    from diff_transformer.config import Config

    cfg = Config()
    for key, value in checkpoint_keys.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def used_run_dir(tmp_path, steps=30, checkpoints=()):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    for step in checkpoints:
        fake_checkpoint(run / "checkpoints", step)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- this launch\n")
    return run


def test_a_fresh_start_where_a_run_is_is_refused_with_the_choices(tmp_path):
    from diff_transformer.training.run_directory import RunDirectoryInUse, check_start

    run = used_run_dir(tmp_path, checkpoints=(10, 20))
    assert check_start(run_config(tmp_path), str(run)) is None, "resume=auto resumes"
    with pytest.raises(RunDirectoryInUse) as err:
        check_start(run_config(tmp_path, resume="none"), str(run))
    message = str(err.value)
    assert "already holds a run (metrics.jsonl up to step 30; 2 checkpoints in" in message and "(newest step_00000020)" in message
    assert "resume it (checkpoint.resume=auto)" in message and "hydra.run.dir=NEW" in message and "overwrite_run=true" in message
    # progress in metrics.jsonl, but the checkpoint directory is elsewhere and empty: refused, not restarted
    with pytest.raises(RunDirectoryInUse, match=r"checkpoint directory .*elsewhere holds no checkpoint to resume from"):
        check_start(run_config(tmp_path, dir=str(tmp_path / "elsewhere")), str(run))
    assert check_start(run_config(tmp_path, resume="none"), str(tmp_path / "new")) is None


def test_overwrite_run_moves_the_old_run_aside(tmp_path):
    from diff_transformer.training.run_directory import check_start, move_old_run_aside

    run = used_run_dir(tmp_path, checkpoints=(10,))
    cfg = run_config(tmp_path, resume="none")
    cfg.overwrite_run = True
    state = check_start(cfg, str(run))
    assert state is not None and not any(tmp_path.glob("run.old-*")), "nothing moves before the start is committed"
    from diff_transformer.training.run_directory import LOCK_FILE, lock_run_directory, release_run_directory

    lock_run_directory(str(run))
    try:
        [(old, new)] = move_old_run_aside(state)
        assert old == str(run) and os.path.basename(new).startswith("run.old-")
        assert sorted(os.listdir(new)) == [".hydra", "checkpoints", "metrics.jsonl"], "the old run as it was"
        assert os.listdir(run) == [LOCK_FILE], "a new, empty run directory, locked by the run that moved the old one"
    finally:
        release_run_directory()
    assert os.listdir(run) == []
