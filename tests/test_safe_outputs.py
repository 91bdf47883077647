"""Nothing a user wrote is lost: the outputs of commands (marked as theirs, replaced atomically, anything else moved
aside, never an input, a run or a checkpoint), the run-directory lock, start-up checks of writability and
credentials, what a reader makes of a byte-order mark, `latest` pointers that name nothing, and the advice a stopped
run gives. In-process and cheap; the launches that exercise the same through train.py are in test_bad_input.py and
test_checkpoint_faults.py."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile

import pytest

from diff_transformer.fileio import OUTPUT_MARKER, check_output, check_writable, replace_directory, staging_directory
from tests.train_runs import REPO, train_command, train_env


# ------------------------------------------------------------------------------------------------------------------
# The outputs of commands
# ------------------------------------------------------------------------------------------------------------------
def write_output(target, files, command="tool"):
    staging = staging_directory(str(target))
    for name, text in files.items():
        with open(os.path.join(staging, name), "w") as f:
            f.write(text)
    return replace_directory(staging, str(target), command)


def test_replacing_an_output_never_deletes_what_the_command_did_not_write(tmp_path):
    out = tmp_path / "out"
    assert write_output(out, {"a": "1"}) is None and (out / "a").read_text() == "1" and (out / OUTPUT_MARKER).exists()
    assert write_output(out, {"b": "2"}) is None, "its own earlier output is replaced"
    assert sorted(os.listdir(out)) == [OUTPUT_MARKER, "b"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    kept = write_output(foreign, {"c": "3"})
    assert kept and os.path.basename(kept).startswith("foreign.old-"), "someone's files are moved aside"
    assert open(os.path.join(kept, "notes.txt")).read() == "mine" and (foreign / "c").exists()
    assert write_output(tmp_path / "out", {"d": "4"}, command="another") is not None, "another command's output too"
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name or p.name.startswith(".out.")]


def test_an_output_is_checked_before_any_work(tmp_path):
    run, corpus, notes = tmp_path / "run", tmp_path / "corpus", tmp_path / "notes.txt"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "trainer_state.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    corpus.mkdir()
    (corpus / "a.txt").write_text("text")
    notes.write_text("notes")
    refusals = {
        "is the input": (str(corpus), [str(corpus)]),
        "lies inside the input": (str(corpus / "tok"), [str(corpus)]),
        "holds the input": (str(tmp_path), [str(corpus / "a.txt")]),
        "is a run directory": (str(run), []),
        "lies inside .*/run, a run directory": (str(run / "hf"), []),
        "lies inside .*step_00000002, a checkpoint": (str(run / "checkpoints" / "step_00000002" / "x"), []),
        "notes.txt is a file, not a directory": (str(notes / "out"), []),
        "notes.txt is a file; give a directory": (str(notes), []),
        r"holds files this command did not write \(a.txt\)": (str(corpus), []),
    }
    for expected, (out, inputs) in refusals.items():
        with pytest.raises(ValueError, match=expected):
            check_output(out, inputs, "tool")
    check_output(str(corpus), [], "tool", force=True)  # --force: moved aside when written
    write_output(tmp_path / "mine", {"a": "1"})
    check_output(str(tmp_path / "mine"), [], "tool")  # its own output: replaced
    with pytest.raises(ValueError, match="is a directory; give the path of the file"):
        check_output(str(corpus), [], "tool", directory=False)
    with pytest.raises(ValueError, match=r"notes.txt exists; give a new path, or add --force"):
        check_output(str(notes), [], "tool", directory=False)


def test_the_tokenizer_replaces_its_own_output_and_keeps_anyone_elses(tmp_path):
    from data.tokenizer import WRITER, main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus, with words and numbers {i * 7}\n" for i in range(400)))
    out = tmp_path / "tok"
    args = ["train", "--input", str(corpus), "--vocab-size", "300", "--out", str(out)]
    main(args)
    first = (out / "tokenizer.model").read_bytes()
    main(args + ["--max-sentences", "100"])  # an earlier tokenizer of this command: replaced
    assert sorted(os.listdir(out)) == [OUTPUT_MARKER, "tokenizer.model", "tokenizer_config.json"]
    assert json.loads((out / OUTPUT_MARKER).read_text())["command"] == WRITER
    assert (out / "tokenizer.model").read_bytes() != first
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files this command did not write"):
        main(["train", "--input", str(corpus), "--vocab-size", "300", "--out", str(theirs)])
    main(["train", "--input", str(corpus), "--vocab-size", "300", "--out", str(theirs), "--force"])
    [aside] = tmp_path.glob("theirs.old-*")
    assert (aside / "notes.txt").read_text() == "mine" and (theirs / "tokenizer.model").exists()
    # readable by the group as any directory the user makes (the umask's mode), not a temporary directory's 0700
    (tmp_path / "made").mkdir()
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in (out, theirs)} == {stat.S_IMODE((tmp_path / "made").stat().st_mode)}


def test_no_command_writes_over_or_through_what_it_did_not_write(tmp_path):
    """A file given as --out, shards in a run or a checkpoint, and symbolic links at the paths a command writes:
    each refused with a message, or (--force) the link replaced; the file a link names is never written."""
    from data.preprocess import check_output_prefix, preprocess
    from data.short_documents import main as short_documents
    from diff_transformer.fileio import atomic_write_text

    victim = tmp_path / "victim.txt"
    victim.write_text("someone's file")
    mine = tmp_path / "mine.jsonl"
    mine.write_text("mine")
    with pytest.raises(ValueError, match=r"mine\.jsonl exists; give a new path, or add --force"):
        short_documents(["--out", str(mine), "--max-chars", "1000"])
    link = tmp_path / "short.jsonl"
    link.symlink_to(victim)
    with pytest.raises(ValueError, match=r"short\.jsonl exists \(a symbolic link to .*victim\.txt: --force replaces"):
        short_documents(["--out", str(link), "--max-chars", "1000"])
    short_documents(["--out", str(link), "--max-chars", "1000", "--force"])
    assert not link.is_symlink() and '"text"' in link.read_text()
    planted = tmp_path / "state.json"  # a link where the atomic writer's temporary file used to be named
    (tmp_path / f"state.json.tmp.{os.getpid()}").symlink_to(victim)
    atomic_write_text(str(planted), "new\n")
    assert planted.read_text() == "new\n" and victim.read_text() == "someone's file" and mine.read_text() == "mine"

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "trainer_state.json").write_text("{}")
    (run / "run.json").write_text("{}")
    for prefix, what in ((run / "shards" / "corpus", "run directory"),
                         (run / "checkpoints" / "step_00000002" / "corpus", "checkpoint")):
        with pytest.raises(ValueError, match=f"lies inside .*, a {what}"):
            check_output_prefix(str(prefix), [str(mine)])
    out = tmp_path / "shards"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    for name, target in (("corpus.parts", tmp_path / "elsewhere"), ("corpus.lock", tmp_path / "lock")):
        (out / name).symlink_to(target)
        with pytest.raises(ValueError, match=f"{name} is a symbolic link"):  # before the tokenizer loads
            preprocess([str(mine)], str(tmp_path / "no-tokenizer"), str(out / "corpus"))
        (out / name).unlink()
    assert not os.listdir(tmp_path / "elsewhere") and not (tmp_path / "lock").exists()


# ------------------------------------------------------------------------------------------------------------------
# The run-directory lock
# ------------------------------------------------------------------------------------------------------------------
HOLD_LOCK = """
import sys, time
from diff_transformer.training.run_directory import lock_run_directory
lock_run_directory(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_start_in_a_locked_run_directory_is_refused(tmp_path):
    """train.py in a directory whose lock another process holds: refused before torch is imported, naming the
    holder; a holder killed outright releases the lock (an OS lock)."""
    from diff_transformer.training.run_directory import (
        LOCK_FILE, RunDirectoryInUse, lock_run_directory, release_run_directory,
    )

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run(train_command(run, ["experiment=smoke", "trainer.max_steps=2", "optim.warmup_steps=1"]),
                              cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"run directory {run} is in use by a run that is still going (pid {holder.pid} on host " \
               f"{socket.gethostname()}, started " in errors[0]
        assert sorted(os.listdir(run)) == [LOCK_FILE], "the refused start wrote nothing"
        with pytest.raises(RunDirectoryInUse, match=f"pid {holder.pid}"):
            lock_run_directory(str(run))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock_run_directory(str(run))  # the killed holder's lock is gone with it
    release_run_directory()
    assert os.listdir(run) == []


# ------------------------------------------------------------------------------------------------------------------
# Start-up checks
# ------------------------------------------------------------------------------------------------------------------
def unwritable_directory(tmp_path):
    """A directory this process cannot create files in: read-only by its mode, or (as root, whom modes do not stop)
    one of the kernel's; None when neither is."""
    locked = tmp_path / "read_only"
    locked.mkdir()
    locked.chmod(0o555)
    for candidate in (str(locked), "/sys/kernel"):
        try:
            fd, name = tempfile.mkstemp(dir=candidate)
            os.close(fd)
            os.remove(name)
        except OSError:
            return candidate
    return None


def test_an_unwritable_checkpoint_directory_is_refused_at_start_up(tmp_path):
    from diff_transformer.config import Config
    from diff_transformer.training.run_directory import check_disks

    where = unwritable_directory(tmp_path)
    if where is None:
        pytest.skip("no directory here refuses this process's writes")
    cfg = Config()
    cfg.checkpoint.dir = os.path.join(where, "checkpoints")
    with pytest.raises(ValueError, match=rf"checkpoint\.dir={cfg.checkpoint.dir} is not writable: cannot create a file "
                                         rf"in {where}, where it would be created"):
        check_disks(cfg, str(tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"the run directory hydra\.run\.dir={where} is not writable"):
        check_writable(where, "the run directory hydra.run.dir")


def test_a_resume_without_room_for_one_more_checkpoint_is_refused_before_torch(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from diff_transformer.config import Config
    from diff_transformer.training.run_directory import check_disks

    from diff_transformer.training.checkpoint_files import write_checkpoint_state

    run = tmp_path / "run"
    saved = run / "checkpoints" / "step_00000004"
    saved.mkdir(parents=True)
    (saved / "weights").write_bytes(b"\0" * 4096)
    write_checkpoint_state(str(saved), {"format_version": 2, "step": 4})  # its manifest: 4 KiB and more
    cfg = Config()
    check_disks(cfg, str(run))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(ValueError, match=r"the checkpoint disk at .* has 1000 B free, less than one checkpoint"):
        check_disks(cfg, str(run))


def test_wandb_online_needs_credentials_before_the_model_is_built(tmp_path, monkeypatch):
    from diff_transformer.config import Config
    from diff_transformer.training.metrics import wandb_credentials_problem

    cfg = Config()
    cfg.logging.wandb.mode = "online"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert "needs a W&B API key for api.wandb.ai" in wandb_credentials_problem(cfg)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789\n")
    assert wandb_credentials_problem(cfg) is None
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789")
    assert wandb_credentials_problem(cfg) is None
    cfg.logging.wandb.mode = "offline"
    monkeypatch.delenv("WANDB_API_KEY")
    assert wandb_credentials_problem(cfg) is None


LAYOUT_REFUSAL = """
import sys
from diff_transformer.config import Config, validate
from diff_transformer.distributed import destroy_distributed

cfg = Config()
cfg.model.name, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_heads = "debug", 2, 64, 2
cfg.model.ffn_hidden_size, cfg.trainer.max_steps, cfg.trainer.global_batch_size = 176, 10, 8
cfg.optim.warmup_steps, cfg.parallel.tp = 1, 3
try:
    validate(cfg, 1)
except ValueError as err:
    print(err)
destroy_distributed()  # what train.py does on a refusal
print("megatron-core imported:", "megatron.core" in sys.modules)
"""


def test_a_bad_layout_is_refused_without_importing_megatron_core():
    """Shapes and layout are checked before the attention kinds (megatron-core ModuleSpecs, seconds to import)."""
    proc = subprocess.run([sys.executable, "-c", LAYOUT_REFUSAL], cwd=REPO, env=train_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parallel.tp=3 does not divide model.num_heads=2" in proc.stdout
    assert "megatron-core imported: False" in proc.stdout


@pytest.mark.parametrize("key, value, expected", [
    ("trainer.log_interval", 0, r"trainer\.log_interval=0 must be at least 1"),
    ("trainer.eval_interval", -1, r"trainer\.eval_interval=-1 must be >= 0"),
    ("optim.beta2", 1.0, r"optim\.beta2=1\.0 must lie in \[0, 1\)"),
    ("optim.eps", 0.0, r"optim\.eps=0\.0 must be positive"),
    ("optim.weight_decay", -0.1, r"optim\.weight_decay=-0\.1 must be >= 0"),
    ("optim.clip_grad", -1.0, r"optim\.clip_grad=-1\.0 must be >= 0"),
    ("logging.level", "LOUD", r"logging\.level='LOUD' is unknown"),
])
def test_every_value_is_checked_at_start_up(key, value, expected):
    from diff_transformer.config import Config, validate_settings

    cfg = Config()
    cfg.trainer.max_steps, cfg.trainer.global_batch_size, cfg.optim.warmup_steps = 10, 8, 1
    validate_settings(cfg)
    group, name = key.split(".")
    setattr(getattr(cfg, group), name, value)
    with pytest.raises(ValueError, match=expected):
        validate_settings(cfg)


# ------------------------------------------------------------------------------------------------------------------
# Readers, pointers, advice
# ------------------------------------------------------------------------------------------------------------------
def test_a_byte_order_mark_is_not_text(tmp_path):
    from data.readers import iter_records

    jsonl, txt = tmp_path / "docs.jsonl", tmp_path / "doc.txt"
    jsonl.write_bytes("\ufeff".encode() + b'{"text": "first"}\n{"text": "second"}\n')
    txt.write_bytes("\ufeff".encode() + b"a text file")
    assert list(iter_records(str(jsonl))) == ["first", "second"]
    assert list(iter_records(str(txt))) == ["a text file"]
    assert list(iter_records(str(txt), txt_mode="blank_line")) == ["a text file"]


def fake_checkpoint(root, step):
    from diff_transformer.training.checkpoint_files import checkpoint_name, write_checkpoint_state

    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    write_checkpoint_state(str(path), {"format_version": 2, "step": step})
    return path


def test_a_latest_pointer_that_names_nothing(tmp_path, caplog):
    """Under checkpoint.resume=auto the newest complete checkpoint is used, saying why; a path a user gave is
    refused, naming what `latest` holds and the checkpoint that would load."""
    from diff_transformer.training.checkpoint_files import latest_checkpoint, resolve_checkpoint_path

    root = tmp_path / "checkpoints"
    good = fake_checkpoint(root, 10)
    for pointer, problem in ((bytes(range(128, 256)), "holds no checkpoint name"),
                             (b"step_00000020\n", "names step_00000020, which is missing")):
        (root / "latest").write_bytes(pointer)
        with caplog.at_level("WARNING", logger="diff_transformer"):
            assert latest_checkpoint(str(root)) == str(good)
        assert problem in caplog.text and "using the newest complete checkpoint" in caplog.text
        caplog.clear()
        for given in (root, root / "latest", tmp_path):
            with pytest.raises(ValueError, match=f"{problem}.*: give the step_\\* checkpoint to load \\(the newest "
                                                 f"complete one is {good}\\)"):
                resolve_checkpoint_path(str(given))


def test_incomplete_checkpoints_are_found_and_passed_over(tmp_path):
    """A step directory without its trainer_state.json is listed as incomplete (resume=auto moves it aside: the
    launch in test_checkpoint_faults.py), and a `latest` naming it is passed over for the newest complete one."""
    from diff_transformer.training.checkpoint_files import incomplete_checkpoints, latest_checkpoint

    root = tmp_path / "checkpoints"
    good = fake_checkpoint(root, 2)
    (root / "step_00000004").mkdir()  # its trainer_state.json lost
    (root / "latest").write_text("step_00000004\n")
    assert incomplete_checkpoints(str(root)) == [str(root / "step_00000004")]
    assert latest_checkpoint(str(root)) == str(good)


def test_a_stopped_run_says_how_to_go_on_truthfully(tmp_path):
    """With a checkpoint, the same command resumes; without one (a crash or a full disk before the first save), the
    rerun needs overwrite_run=true, and the refusal of a plain rerun says so."""
    from diff_transformer.config import Config
    from diff_transformer.training.checkpoint_files import rerun_advice
    from diff_transformer.training.run_directory import RunDirectoryInUse, check_start

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    assert "with overwrite_run=true (no checkpoint was saved yet" in rerun_advice(str(run / "checkpoints"))
    cfg = Config()
    with pytest.raises(RunDirectoryInUse) as refusal:
        check_start(cfg, str(run))
    assert "holds a run that saved no checkpoint (metrics.jsonl up to step 3;" in str(refusal.value)
    assert "start it again from step 0 with the same command and overwrite_run=true, which keeps the old run aside" \
        in str(refusal.value)
    fake_checkpoint(run / "checkpoints", 2)
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    assert rerun_advice(str(run / "checkpoints")) == "rerun the same command (it resumes from step_00000002)"
