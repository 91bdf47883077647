"""Faults injected into checkpoints and saves, through train.py as users run it: damaged checkpoints (a flipped
byte, a truncated or a deleted file) are skipped for the newest one that verifies, with losses equal to an
uninterrupted run from there; a full disk during a save (sync or async) stops the run with one error line and the
last good checkpoint intact, and rerunning resumes; a signal stops the run resumable (exit status 75); the same
under DeepSpeed. One module fixture trains once and saves four checkpoints; every fault runs on a copy of it.
"""

import json
import shutil
import subprocess
import sys

import pytest

from diff_transformer.training.checkpoint import (
    LATEST_FILE,
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointSaveFailed,
    checkpoint_name,
    verify_checkpoint,
)
from tests.train_runs import REPO, read_metrics, run_train, train_command, train_env

STEPS = 8
RUN = [
    "experiment=smoke", f"trainer.max_steps={STEPS}", "optim.warmup_steps=1", "trainer.eval_interval=0",
    "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "checkpoint.interval=2", "checkpoint.keep_last=5",
]
EXIT_STOPPED_RESUMABLE = 75

# train.py with faults: "enospc@N" makes the torch_dist writer fail with ENOSPC on the files of step N's save, after
# writing part of them (also in the background process of an async save); "sigterm@N" sends SIGTERM after step N.
FAULTY_TRAIN = r"""
import errno, functools, os, runpy, signal, sys
faults = dict(f.split("@") for f in sys.argv[1].split(","))
sys.argv = sys.argv[2:]
if "enospc" in faults:
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    full_at = f"step_{int(faults['enospc']):08d}"
    write_item = filesystem_async._write_item
    @functools.wraps(write_item)  # megatron-core reads its signature
    def write_item_until_full(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
        if full_at in str(stream.name):
            stream.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(*args, **kwargs)
    filesystem_async._write_item = write_item_until_full
if "sigterm" in faults:
    from diff_transformer.training.trainer import Trainer
    at, measure = int(faults["sigterm"]), Trainer._train_and_measure
    def measure_then_signal(self, data):
        record = measure(self, data)
        if self.step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return record
    Trainer._train_and_measure = measure_then_signal
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_with_faults(run_dir, overrides, faults: str, expect_rc: int):
    command = train_command(run_dir, overrides)  # [python, train.py, overrides...]
    proc = subprocess.run(
        [sys.executable, "-c", FAULTY_TRAIN, faults, *command[1:]], cwd=REPO, env=train_env(), capture_output=True,
        text=True, timeout=300,
    )
    assert proc.returncode == expect_rc, f"exit {proc.returncode}, expected {expect_rc}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def one_error_line(proc) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def ckpt(run_dir, step):
    return run_dir / "checkpoints" / checkpoint_name(step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Eight steps saved every two (asynchronously: the manifests come from the background writer). It starts in a
    directory an earlier run used, with overwrite_run=true: that run is moved aside, not mixed in."""
    run = tmp_path_factory.mktemp("faults") / "uninterrupted"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    run_train(run, RUN + ["checkpoint.async_save=true", "overwrite_run=true"])
    return run


def test_overwrite_run_moves_the_old_run_aside(uninterrupted):
    [old] = uninterrupted.parent.glob("uninterrupted.old-*")
    assert (old / "metrics.jsonl").read_text().count("\n") == 3, "the old run is kept as it was"
    assert [r["step"] for r in read_metrics(uninterrupted)] == list(range(1, STEPS + 1)), "no step twice"
    assert "overwrite_run=true: moved the old run" in (uninterrupted / "train.log").read_text()


def test_a_refused_resume_changes_nothing_in_the_run_directory(uninterrupted, tmp_path):
    """A resume refused after the model is built (another model config) leaves config.yaml and train.log as they were."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = subprocess.run(train_command(run, RUN + ["model.ffn_hidden_size=128"]), cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = one_error_line(proc)
    assert "was saved with a different model config; differing keys: model.ffn_hidden_size: checkpoint 176, config 128" in error
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_damaged_checkpoints_are_skipped_for_the_newest_that_verifies(uninterrupted, tmp_path):
    """The newest three checkpoints damaged three ways; the oldest saved before manifests existed. The run falls
    back to the oldest (loaded with a warning that it is unverified), keeps the damaged ones aside, and retraces the
    uninterrupted run's losses; a SIGTERM after step 7 stops it with a checkpoint and exit status 75."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    distcp = sorted(p.name for p in ckpt(run, 8).glob("*.distcp"))
    flipped = ckpt(run, 8) / distcp[-1]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = ckpt(run, 6) / distcp[0]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    (ckpt(run, 4) / "common.pt").unlink()
    (ckpt(run, 2) / MANIFEST_FILE).unlink()  # as saved before checkpoints recorded checksums
    state = json.loads((ckpt(run, 2) / STATE_FILE).read_text())
    (ckpt(run, 2) / STATE_FILE).write_text(json.dumps(dict(state, format_version=1)))

    from diff_transformer.checkpoint import main as checkpoint_cli

    assert checkpoint_cli(["inspect", str(ckpt(run, 6))]) == 2, "inspect refuses a truncated checkpoint"
    proc = run_with_faults(run, RUN, "sigterm@7", expect_rc=EXIT_STOPPED_RESUMABLE)
    log = (run / "train.log").read_text()
    root = run / "checkpoints"
    assert f"checkpoint {ckpt(run, 8)} is damaged ({flipped.name}: crc32" in log
    assert f"checkpoint {ckpt(run, 6)} is damaged ({truncated.name}: " in log and "(truncated)" in log
    assert f"checkpoint {ckpt(run, 4)} is damaged (common.pt: missing)" in log
    assert f"checkpoint {ckpt(run, 2)} has no {MANIFEST_FILE}" in log and "contents are unverified" in log
    assert f"resumed from {ckpt(run, 2)} at step 2" in log
    for step in (4, 6, 8):  # evidence, moved aside: never loaded, never deleted by retention
        assert (root / f"{checkpoint_name(step)}.damaged").is_dir()
    assert "SIGTERM: saving step 7 before exiting" in log and "error:" not in proc.stderr
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(7)
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, 8)), "metrics.jsonl truncated to the step resumed from: no step twice"
    assert resumed == {s: loss for s, loss in losses(uninterrupted).items() if s <= 7}
    assert verify_checkpoint(str(ckpt(run, 7))).ok
    # the checks an unmanifested checkpoint still gets: files present and long enough
    (ckpt(run, 2) / "common.pt").unlink()
    assert verify_checkpoint(str(ckpt(run, 2))).problems == ["common.pt: missing"]


def test_a_full_disk_stops_the_save_cleanly_and_a_rerun_resumes(uninterrupted, tmp_path):
    """ENOSPC in the writer at step 4 (sync): the partial save is removed, `latest` stays on step 2, one error line
    names the directory, the sizes and the choices. The rerun resumes from step 2; ENOSPC again at step 6, now in
    the background process of an async save: the same, on step 4."""
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    error = one_error_line(run_with_faults(run, RUN, "enospc@4", expect_rc=1))
    assert f"error: the checkpoint disk at {root} filled up while saving the checkpoint of step 4" in error
    assert "`latest` still names step_00000002" in error and "are free there now" in error
    assert "rerun the same command" in error and "checkpoint.dir set to its new place" in error
    assert not (root / f".{checkpoint_name(4)}.tmp").exists() and not ckpt(run, 4).exists()
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(2)

    error = one_error_line(run_with_faults(run, RUN + ["checkpoint.async_save=true"], "enospc@6", expect_rc=1))
    assert "filled up while saving the checkpoint of step 6" in error and "`latest` still names step_00000004" in error
    assert f"resumed from {ckpt(run, 2)} at step 2" in (run / "train.log").read_text()
    assert not (root / f".{checkpoint_name(6)}.tmp").exists() and not ckpt(run, 6).exists()
    assert verify_checkpoint(str(ckpt(run, 4))).ok
    resumed = losses(run)
    assert resumed == {s: loss for s, loss in losses(uninterrupted).items() if s in resumed}


def test_no_room_before_a_save_skips_or_stops_it(tmp_path, monkeypatch, caplog, megatron_single_process):
    """Before each save rank 0 compares the free space with the checkpoint's size: an interval save is skipped with a
    warning (checkpoint.on_disk_full=skip) or the run stops (stop, and always for the save that ends a run)."""
    import torch

    from diff_transformer.config import Config
    from diff_transformer.training import checkpoint
    from diff_transformer.training.checkpoint import CheckpointManager

    class Run:
        cfg, step, dtype, num_parameters = Config(), 4, torch.float32, 1_000_000

    manager = CheckpointManager(Run(), str(tmp_path / "checkpoints"))
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 300 * 1024)
    with caplog.at_level("WARNING", logger="diff_transformer"):
        assert manager.save(reason="interval") is None
    assert "skipping the checkpoint of step 4: the checkpoint disk at" in caplog.text
    assert "has 300 KiB free, less than the 12 MiB a checkpoint needs" in caplog.text
    with pytest.raises(CheckpointSaveFailed, match=r"the run stops at step 4 \(end; checkpoint.on_disk_full=skip\)"):
        manager.save(reason="end")
    Run.cfg.checkpoint.on_disk_full = "stop"
    with pytest.raises(CheckpointSaveFailed) as err:
        manager.save(reason="interval")
    assert err.value.disk_full and "free space there and rerun the same command" in str(err.value)
    assert list((tmp_path / "checkpoints").iterdir()) == [], "nothing was started"


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("faults") / "deepspeed"
    run_train(run, DEEPSPEED)
    return run


DEEPSPEED = RUN[:1] + ["trainer.max_steps=4"] + RUN[2:] + ["engine=deepspeed", "engine.zero_stage=1"]


def test_deepspeed_checkpoints_are_verified_and_fall_back(deepspeed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(deepspeed_run, run)
    manifest = json.loads((ckpt(run, 4) / MANIFEST_FILE).read_text())
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in manifest["files"], "DeepSpeed's files are in the manifest"
    optim = ckpt(run, 4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(optim.read_bytes())
    data[-100] ^= 0x10
    optim.write_bytes(bytes(data))
    run_train(run, DEEPSPEED)
    log = (run / "train.log").read_text()
    assert f"checkpoint {ckpt(run, 4)} is damaged ({optim.name}: crc32" in log
    assert f"resumed from {ckpt(run, 2)} at step 2" in log
    assert losses(run) == losses(deepspeed_run)
