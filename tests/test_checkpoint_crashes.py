"""Crash points inside a save that test_resume does not reach: a kill between the checkpoint's rename and the
``latest`` update, and a kill while an asynchronous save is still writing. In both the last good checkpoint loads,
the next run resumes from it, and its losses equal an uninterrupted run's.
"""

import subprocess
import sys

import pytest

from diff_transformer.training.checkpoint import LATEST_FILE, checkpoint_name, is_complete, read_trainer_state
from tests.train_runs import REPO, read_metrics, run_train, train_command, train_env

STEPS = 6
RUN = [
    "experiment=smoke", f"trainer.max_steps={STEPS}", "optim.warmup_steps=1", "trainer.eval_interval=0",
    "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "checkpoint.interval=2", "checkpoint.keep_last=5",
]

# train.py with one fault injected: the whole process group is killed (SIGKILL, as a node failure would) at the
# named point of the save of step FAULT_STEP.
FAULTY_TRAIN = r"""
import os, runpy, signal, sys
fault, step = sys.argv[1], int(sys.argv[2])
sys.argv = sys.argv[3:]
from diff_transformer.training import checkpoint

def die():
    os.killpg(os.getpgrp(), signal.SIGKILL)

if fault == "before_latest":
    write = checkpoint.atomic_write_text
    def write_or_die(path, text):
        if os.path.basename(path) == checkpoint.LATEST_FILE and text.strip() == checkpoint.checkpoint_name(step):
            die()
        write(path, text)
    checkpoint.atomic_write_text = write_or_die
elif fault == "async_write":
    schedule = checkpoint.CheckpointManager._schedule_async
    def schedule_then_die(self, request, finalize):
        queue = schedule(self, request, finalize)
        if self.trainer.step == step:
            die()  # the forked writer is still writing: it dies too, leaving the partial temporary directory
        return queue
    checkpoint.CheckpointManager._schedule_async = schedule_then_die
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_with_fault(run_dir, overrides, fault: str, step: int):
    command = train_command(run_dir, overrides)  # [python, train.py, overrides...]
    proc = subprocess.run(
        [sys.executable, "-c", FAULTY_TRAIN, fault, str(step), *command[1:]], cwd=REPO, env=train_env(),
        capture_output=True, text=True, timeout=300, start_new_session=True,
    )
    assert proc.returncode == -9, f"the fault did not fire (exit {proc.returncode}):\n{proc.stderr[-3000:]}"


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted")
    run_train(run, RUN)
    return losses(run)


def test_kill_between_rename_and_latest_update(tmp_path, uninterrupted):
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run_with_fault(run, RUN, "before_latest", step=4)
    assert is_complete(str(root / checkpoint_name(4))), "renamed, so complete"
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(2), "the pointer update never happened"

    run_train(run, RUN)
    log = (run / "train.log").read_text()
    assert f"resumed from {root / checkpoint_name(2)} at step 2" in log, "the checkpoint `latest` names loads"
    # the orphaned step-4 checkpoint is replaced by this run's own, so `latest` names step 4 again after it
    assert f"replacing {root / checkpoint_name(4)}" in log
    assert f"saved checkpoint {root / checkpoint_name(4)} (interval" in log
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(STEPS)
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == uninterrupted


def test_kill_during_an_asynchronous_write(tmp_path, uninterrupted):
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    overrides = RUN + ["checkpoint.async_save=true"]
    run_with_fault(run, overrides, "async_write", step=4)
    assert (root / f".{checkpoint_name(4)}.tmp").is_dir() and not (root / checkpoint_name(4)).exists()
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(2)

    run_train(run, overrides)
    log = (run / "train.log").read_text()
    assert f"resumed from {root / checkpoint_name(2)} at step 2" in log
    assert not (root / f".{checkpoint_name(4)}.tmp").exists(), "the partial save is removed"
    assert read_trainer_state(str(root / checkpoint_name(4)))["step"] == 4
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(STEPS)
    assert losses(run) == uninterrupted
