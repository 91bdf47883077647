"""No harm from a crash, a planted file or a second run: a train.py killed outright (SIGKILL, as the OOM killer does)
leaves no process and no lock behind; loading a checkpoint never runs code planted in it; a checkpoint of a newer
format, or of another run sharing the checkpoint directory, is refused; a fresh start among someone else's files is
refused; Ctrl-C during start-up exits 130 in one line. One killed run is shared by every test."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diff_transformer.training.checkpoint_files import (
    LATEST_FILE, MANIFEST_FILE, STATE_FILE, checkpoint_name, file_crc32, list_checkpoints,
)
from diff_transformer.training.run_directory import LOCK_FILE
from tests.train_runs import REPO, run_train, train_command, train_env

RUN = [
    "experiment=smoke", "optim.warmup_steps=1", "trainer.eval_interval=0", "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4", "checkpoint.interval=2",
]


def group_members(pgid: int) -> list:
    """The live (not zombie) processes of process group ``pgid``: (pid, command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append((int(entry), Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A train.py SIGKILLed (itself, not its process group) once it has saved a checkpoint: (run directory, the
    processes of its group still alive 5 s later, the step of the newest checkpoint)."""
    run = tmp_path_factory.mktemp("killed") / "run"
    with open(run.parent / "killed.log", "w") as log:
        proc = subprocess.Popen(train_command(run, RUN + ["trainer.max_steps=1000"]), cwd=REPO, env=train_env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (run / "checkpoints" / LATEST_FILE).exists():
            assert proc.poll() is None and time.time() < deadline, (run.parent / "killed.log").read_text()[-3000:]
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 5
    while group_members(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    survivors = group_members(proc.pid)
    for pid, _ in survivors:  # today's leftovers: stopped here, so that the tests after this one can run
        os.kill(pid, signal.SIGKILL)
    step, _ = list_checkpoints(str(run / "checkpoints"))[-1]
    return run, survivors, step


def copy_of_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns(LOCK_FILE))
    return to


def rewrite_with_manifest(checkpoint: Path, name: str, data: bytes) -> None:
    """Write ``name`` in ``checkpoint`` and record its new size and crc32 in the manifest, as anyone can."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"][name] = {"bytes": len(data), "crc32": file_crc32(str(checkpoint / name))}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


def errors_of(proc) -> list:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def refused(proc) -> str:
    """The one error line of a command that exited 2 without a traceback."""
    errors = errors_of(proc)
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def run_command(args, timeout=300):
    return subprocess.run(args, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------------------------
# 1. A crash never locks the user out
# ------------------------------------------------------------------------------------------------------------------
def test_a_killed_run_leaves_no_process_and_its_rerun_resumes(killed):
    run, survivors, step = killed
    assert survivors == [], f"processes of the killed train.py still alive: {survivors}"
    run_train(run, RUN + [f"trainer.max_steps={step + 2}"], timeout=240)
    resumed = f"resumed from {run / 'checkpoints' / checkpoint_name(step)} at step {step}"
    assert resumed in (run / "train.log").read_text()


HOLDER = """
import os, subprocess, sys, time
from diff_transformer.training.run_directory import lock_run_directory
lock = lock_run_directory(sys.argv[1])
if sys.argv[2] == "fork":
    if os.fork() == 0:  # a forked helper that outlives the holder
        os.write(1, b"child\\n")  # after the fork hooks ran; one write, so the two processes' lines never interleave
        time.sleep(60)
        os._exit(0)
else:  # a helper that was handed the lock's descriptor (as forked children of older versions kept it)
    subprocess.Popen(["sleep", "60"], pass_fds=[lock._fd], start_new_session=False)
os.write(1, b"held\\n")
os._exit(0)  # the holder dies without releasing anything
"""


@pytest.mark.parametrize("helper", ["fork", "inherited"])
def test_a_lock_outlived_by_a_child_of_its_holder_never_blocks(tmp_path, helper):
    """The holder's forked children close their copy of the lock at once; and a lock still held by a child but
    recorded by a holder that is gone is taken over."""
    import fcntl

    from diff_transformer.training.run_directory import lock_run_directory, release_run_directory

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), helper], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        expected = {"held", "child"} if helper == "fork" else {"held"}
        assert {holder.stdout.readline().strip() for _ in expected} == expected
        holder.wait()
        if helper == "fork":
            with open(run / LOCK_FILE) as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it any more
        lock_run_directory(str(run))
        release_run_directory()
    finally:
        for pid, _ in group_members(holder.pid):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------------------------
# 2. Loading never runs code from a file; 5. a newer format is refused
# ------------------------------------------------------------------------------------------------------------------
class Planted:
    """Unpickling it runs ``touch <marker>``: the code a planted file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def test_a_planted_metadata_pickle_is_refused_and_never_runs(killed, tmp_path, capsys):
    from diff_transformer.checkpoint import main as checkpoint_main

    run = copy_of_run(killed[0], tmp_path / "run")
    checkpoint = Path(list_checkpoints(str(run / "checkpoints"))[-1][1])
    marker = tmp_path / "code_ran"
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # the file this test's run wrote
    metadata.planner_data = Planted(marker)
    rewrite_with_manifest(checkpoint, ".metadata", pickle.dumps(metadata))
    what = f"{checkpoint.name}/.metadata names posix.system"

    assert checkpoint_main(["inspect", str(run)]) == 2
    assert what in capsys.readouterr().err
    export = run_command([sys.executable, "-m", "diff_transformer.export", str(run), "--format", "hf", "--out",
                          str(tmp_path / "hf")])
    assert what in refused(export)
    resume = run_command(train_command(run, RUN + [f"trainer.max_steps={killed[2] + 2}"]))
    assert what in refused(resume)
    assert not marker.exists(), "the planted code ran"
    assert not (tmp_path / "hf").exists()


def test_torch_files_of_a_checkpoint_load_weights_only(tmp_path):
    """What DeepSpeed's files, the RNG states and the objects inside torch_dist's .distcp files go through."""
    import torch

    from diff_transformer.training.checkpoint import CheckpointRefused, load_weights_only

    path, marker = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "code_ran"
    torch.save({"module": {"w": torch.ones(2)}, "extra": Planted(marker)}, path)
    with pytest.raises(CheckpointRefused, match=f"{path} names posix.system"):
        load_weights_only(str(path))
    assert not marker.exists()
    torch.save({"module": {"w": torch.ones(2)}}, path)
    assert torch.equal(load_weights_only(str(path))["module"]["w"], torch.ones(2))


def test_a_checkpoint_of_a_newer_format_is_refused_naming_both_versions(killed, tmp_path, capsys):
    from diff_transformer.checkpoint import main as checkpoint_main

    run = copy_of_run(killed[0], tmp_path / "run")
    checkpoint = Path(list_checkpoints(str(run / "checkpoints"))[-1][1])
    state = json.loads((checkpoint / STATE_FILE).read_text())
    state["format_version"] += 1
    rewrite_with_manifest(checkpoint, STATE_FILE, json.dumps(state).encode())
    expected = f"has format_version {state['format_version']} in its {STATE_FILE}, newer than this code reads " \
               f"(format_version {state['format_version'] - 1})"

    assert checkpoint_main(["inspect", str(checkpoint)]) == 2
    assert expected in capsys.readouterr().err
    from diff_transformer.training.checkpoint import CheckpointRefused, select_resume_checkpoint

    with pytest.raises(CheckpointRefused, match=expected.replace("(", r"\(").replace(")", r"\)")):
        select_resume_checkpoint(str(run / "checkpoints"))  # what checkpoint.resume=auto runs


# ------------------------------------------------------------------------------------------------------------------
# 4. One run per checkpoint directory
# ------------------------------------------------------------------------------------------------------------------
def test_two_runs_never_share_a_checkpoint_directory(killed, tmp_path):
    """A second run given a checkpoint directory in use is refused before it starts; and a run resumes no
    checkpoint that another run left beyond the steps its own metrics.jsonl records."""
    from diff_transformer.training.run_directory import lock_run_directory, release_run_directory

    shared = tmp_path / "shared"
    shutil.copytree(killed[0] / "checkpoints", shared, ignore=shutil.ignore_patterns(LOCK_FILE))
    (tmp_path / "a").mkdir()
    lock_run_directory(str(tmp_path / "a"), str(shared))  # run A, still going
    try:
        second = run_command(train_command(tmp_path / "b", RUN + ["trainer.max_steps=2", f"checkpoint.dir={shared}"]))
    finally:
        release_run_directory()
    assert f"checkpoint directory {shared} is in use by a run that is still going (pid {os.getpid()}" in refused(second)

    # run B logged the steps before A's newest checkpoint, then crashed in its first save
    b = tmp_path / "b"
    b.mkdir(exist_ok=True)
    step = list_checkpoints(str(shared))[-1][0]
    (b / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 8.0}) + "\n" for s in range(1, step)))
    over_shared = RUN + [f"trainer.max_steps={step + 2}", f"checkpoint.dir={shared}"]
    rerun = run_command(train_command(b, over_shared))
    assert f"is at step {step}, beyond step {step - 1}, the last this run's metrics.jsonl" in refused(rerun)
    assert [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()] == list(range(1, step))
    # a new run directory over that checkpoint directory: the checkpoint is another run's (checkpoint.resume=PATH
    # would resume it on purpose)
    fresh = run_command(train_command(tmp_path / "c", over_shared))
    assert f"is at step {step}, beyond step 0: this run's metrics.jsonl" in refused(fresh)


# ------------------------------------------------------------------------------------------------------------------
# 3. A fresh start among someone else's files; 7. Ctrl-C during start-up
# ------------------------------------------------------------------------------------------------------------------
def test_a_fresh_start_in_a_directory_of_someone_elses_files_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.yaml").write_text("learning_rate: 0.1\n")
    (theirs / "notes.txt").write_text("mine")
    proc = run_command(train_command(theirs, ["experiment=smoke", "trainer.max_steps=2", "optim.warmup_steps=1"]))
    assert f"run directory {theirs} holds files this framework did not write (config.yaml, notes.txt)" in refused(proc)
    assert sorted(p.name for p in theirs.iterdir()) == ["config.yaml", "notes.txt"]
    assert (theirs / "config.yaml").read_text() == "learning_rate: 0.1\n"


# train.py sent SIGINT by itself while it imports the named module (start-up: before any step)
INTERRUPT_DURING_IMPORT = r"""
import importlib.abc, os, runpy, signal, sys
module = sys.argv.pop(1)
class InterruptOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == module:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, InterruptOnImport())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("module", ["hydra.errors", "numpy.linalg"])
def test_ctrl_c_during_start_up_exits_130_in_one_line(tmp_path, module):
    command = train_command(tmp_path / "run", ["experiment=smoke", "trainer.max_steps=2", "optim.warmup_steps=1"])
    proc = run_command([command[0], "-c", INTERRUPT_DURING_IMPORT, module, *command[1:]])
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors_of(proc) == ["error: interrupted (SIGINT) before training started: nothing was saved; rerun the "
                               "same command"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
