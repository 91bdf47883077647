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
# writing part of them (also in the background process of an async save); "sigterm@N" and "sigint@N" send SIGTERM or
# SIGINT after step N; "sigint_in_save@N" SIGINT at once and again 1.2 s later as the save of step N begins (a Ctrl-C
# delivered twice, then pressed again); "enospc_metrics@N" a full disk
# half-way through metrics.jsonl's record of step N; "sigterm_at_exit@PATH" SIGTERM once more as the process exits
# after a signal's save (the first thing it does on the way out), and the process ids of its children into PATH.
FAULTY_TRAIN = r"""
import atexit, errno, functools, json, multiprocessing, os, runpy, signal, sys, time
faults = dict(f.split("@") for f in sys.argv[1].split(","))
sys.argv = sys.argv[2:]
if "enospc_metrics" in faults:
    full_at, real_write, disk = f'{{"step": {faults["enospc_metrics"]},', os.write, {"full": False}
    def write_until_full(fd, data):
        try:
            metrics = os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl")
        except OSError:
            metrics = False
        if metrics and (disk["full"] or bytes(data[:20]).decode(errors="ignore").startswith(full_at)):
            if not disk["full"]:
                disk["full"] = True
                return real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)
    os.write = write_until_full
if "sigint_in_save" in faults:
    from diff_transformer.training.checkpoint import CheckpointManager
    save_at, write = int(faults["sigint_in_save"]), CheckpointManager._write
    def write_interrupted(self, tmp):
        if self.trainer.step == save_at:
            os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded (torchrun): the save goes on
            time.sleep(1.2)
            os.kill(os.getpid(), signal.SIGINT)
        return write(self, tmp)
    CheckpointManager._write = write_interrupted
if "sigterm_at_exit" in faults:
    from diff_transformer.training.trainer import Trainer
    save_on_signal = Trainer._save_and_exit_on_signal
    def save_then_signal_again_at_exit(self, signals):
        save_on_signal(self, signals)
        with open(faults["sigterm_at_exit"], "w") as f:
            json.dump([child.pid for child in multiprocessing.active_children()], f)
        atexit.register(os.kill, os.getpid(), signal.SIGTERM)  # runs before the clean-up registered earlier
    Trainer._save_and_exit_on_signal = save_then_signal_again_at_exit
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
for name in ("sigterm", "sigint"):
    if name in faults:
        from diff_transformer.training.trainer import Trainer
        def measure_then_signal(self, data, at=int(faults[name]), measure=Trainer._train_and_measure,
                                signum=getattr(signal, name.upper())):
            record = measure(self, data)
            if self.step == at:
                os.kill(os.getpid(), signum)
            return record
        Trainer._train_and_measure = measure_then_signal
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_with_faults(run_dir, overrides, faults: str, expect_rc: int, env=None):
    command = train_command(run_dir, overrides)  # [python, train.py, overrides...]
    proc = subprocess.run(
        [sys.executable, "-c", FAULTY_TRAIN, faults, *command[1:]], cwd=REPO, env=env or train_env(),
        capture_output=True, text=True, timeout=300,
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


# ------------------------------------------------------------------------------------------------------------------
# Extending a run, Ctrl-C, a full disk under metrics.jsonl, an incomplete checkpoint, another tokenizer
# ------------------------------------------------------------------------------------------------------------------
EXTENDED = [RUN[0], "trainer.max_steps=12", "optim.lr=2e-3"] + RUN[2:]  # the 8-step run, 4 steps more at another lr


def linear_lr(step, peak=2e-3, warmup=1, steps=12):
    """The rate step ``step`` trains at under megatron-core's linear schedule (after step - 1 scheduler steps)."""
    done = step - 1
    return peak * done / warmup if done <= warmup else peak * (1 - (done - warmup) / (steps - warmup))


def pids_alive(pids, wait_s=10.0):
    """Those of ``pids`` still running after up to ``wait_s`` seconds (zombies count as ended)."""
    import time

    deadline = time.time() + wait_s
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[-1].split()[0] != "Z":
                        alive.append(pid)
            except OSError:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def extended(uninterrupted, tmp_path_factory):
    """The finished 8-step run extended to 12 steps at another peak learning rate; Ctrl-C after step 10, and SIGTERM
    once more as the process exits: (run directory, the process, the ids of its child processes)."""
    run = tmp_path_factory.mktemp("extended") / "run"
    shutil.copytree(uninterrupted, run)
    children = run.parent / "children.json"
    proc = run_with_faults(run, EXTENDED, f"sigint@10,sigterm_at_exit@{children}", expect_rc=EXIT_STOPPED_RESUMABLE)
    return run, proc, json.loads(children.read_text())


def test_extending_a_finished_run_trains_on_the_new_schedule(extended, uninterrupted):
    """Megatron rebuilds the schedule from the config and keeps the step: steps 9-10 train at the new linear decay
    over 12 steps from the new peak, not at the finished schedule's end (lr 0); the changed keys are logged."""
    run, _, _ = extended
    rates = {r["step"]: r["lr"] for r in read_metrics(run)}
    assert {s: rates[s] for s in range(1, 9)} == {r["step"]: r["lr"] for r in read_metrics(uninterrupted)}
    assert rates[9] == pytest.approx(linear_lr(9)) and rates[10] == pytest.approx(linear_lr(10)) and rates[10] > 0
    log = (run / "train.log").read_text()
    assert f"resumed from {ckpt(run, 8)} at step 8" in log
    assert "resuming with settings changed since the checkpoint" in log
    assert "optim.lr: 0.003 -> 0.002" in log and "trainer.max_steps: 8 -> 12" in log
    assert "max_steps: 12" in (run / "config.yaml").read_text()


def test_ctrl_c_saves_and_the_rerun_resumes(extended):
    """SIGINT saves the step as SIGTERM does (exit 75, no traceback); a signal repeated as the process exits neither
    changes its status (143) nor leaves a child process behind; the same command then resumes and finishes."""
    run, proc, children = extended
    log = (run / "train.log").read_text()
    assert "SIGINT: saving step 10 before exiting" in log
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    assert (run / "checkpoints" / LATEST_FILE).read_text().strip() == checkpoint_name(10)
    assert children and pids_alive(children) == [], "the run's child processes ended with it"
    rerun = run_train(run, EXTENDED, env={"PYTHONWARNINGS": ""})  # every warning a user would see
    log = (run / "train.log").read_text()
    assert f"resumed from {ckpt(run, 10)} at step 10" in log
    # third-party notices that tell a user nothing (Apex missing, deprecations inside the libraries) are filtered
    for notice in ("Apex", "Megatron-FSDP", "deprecated", "DTensor"):
        assert notice not in rerun.stderr + rerun.stdout + log, notice
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 13)), "every step once"
    assert records[-1]["lr"] == pytest.approx(linear_lr(12))


def test_a_second_ctrl_c_during_the_save_exits_at_once(uninterrupted, tmp_path):
    """Ctrl-C after step 10, again as its save begins: exit 130 with one error line, no traceback, and the last good
    checkpoint (step 8) untouched and named by `latest`."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    proc = run_with_faults(run, EXTENDED, "sigint@10,sigint_in_save@10", expect_rc=130)
    error = one_error_line(proc)
    assert error.startswith("error: a second SIGINT: exiting now without saving")
    assert f"rerun the same command (it resumes from {checkpoint_name(8)})" in error
    assert (run / "checkpoints" / LATEST_FILE).read_text().strip() == checkpoint_name(8)
    assert not ckpt(run, 10).exists() and verify_checkpoint(str(ckpt(run, 8))).ok


def test_a_full_disk_under_metrics_jsonl_stops_the_run_with_one_error_line(uninterrupted, tmp_path):
    """The disk fills up half-way through step 10's record: exit 1, one error line that says what to do, and
    metrics.jsonl ends with the complete record of step 9 (no torn line)."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    error = one_error_line(run_with_faults(run, EXTENDED, "enospc_metrics@10", expect_rc=1))
    assert f"cannot write {run / 'metrics.jsonl'} at step 10 (No space left on device)" in error
    assert f"free space there and rerun the same command (it resumes from {checkpoint_name(8)})" in error
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 10))


def test_an_incomplete_checkpoint_is_moved_aside_not_saved_over(uninterrupted, tmp_path):
    """step 8 without its trainer_state.json: resumed from step 6, step 8 kept aside as damaged, retrained and saved
    again (with the uninterrupted run's losses), where the save used to fail on the directory in its way."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (ckpt(run, 8) / STATE_FILE).unlink()
    run_train(run, RUN)
    log = (run / "train.log").read_text()
    assert f"checkpoint {ckpt(run, 8)} is damaged ({STATE_FILE} is missing" in log
    assert f"resumed from {ckpt(run, 6)} at step 6" in log
    assert (run / "checkpoints" / f"{checkpoint_name(8)}.damaged").is_dir()
    assert verify_checkpoint(str(ckpt(run, 8))).ok
    assert losses(run) == losses(uninterrupted)


def test_resuming_with_another_tokenizer_is_refused(uninterrupted, tmp_path):
    """Checkpoints record the tokenizer's sha256; a resume whose tokenizer differs (of any size) is refused, naming
    both, and the run directory stays as it was."""
    from diff_transformer.training.checkpoint_files import record_files

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    state = json.loads((ckpt(run, 8) / STATE_FILE).read_text())
    assert state["tokenizer_sha256"] == json.loads((run / "run.json").read_text())["data"]["tokenizer_sha256"]
    state["tokenizer_sha256"] = "0" * 64  # as if the run had trained with another tokenizer
    (ckpt(run, 8) / STATE_FILE).write_text(json.dumps(state))
    manifest = json.loads((ckpt(run, 8) / MANIFEST_FILE).read_text())
    manifest["files"].update(record_files([str(ckpt(run, 8) / STATE_FILE)], str(ckpt(run, 8))))
    (ckpt(run, 8) / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = run_train(run, RUN, expect_rc=2)
    assert f"checkpoint {ckpt(run, 8)} was trained with the tokenizer of sha256 000000000000" in one_error_line(proc)
    assert "a run cannot change its tokenizer" in proc.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
