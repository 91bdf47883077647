"""launch: SLURM submission files and commands (against stand-in SLURM clients), requeue, torchrun.sh checks, sweeps."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from diff_transformer.distributed import set_torch_env_from_slurm
from diff_transformer.training.failures import requeue_current_job
from launch import slurm

REPO_ROOT = Path(__file__).resolve().parent.parent


def fake_slurm_commands(bin_dir: Path, job_state: str = "RUNNING", fail: str | None = None) -> Path:
    """sbatch/scontrol/scancel stand-ins that log their arguments to calls.log and answer like SLURM 22.05."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "calls.log"
    answers = {
        "sbatch": 'echo "4242;localtest"',
        "scontrol": (
            'if [ "$1" = show ] && [ "$2" = hostnames ]; then echo node07; echo node08; '
            f'else echo "JobId=4242 JobName=smoke JobState={job_state} Reason=None Restarts=1 RunTime=00:01:02 '
            'TimeLimit=1-00:00:00 NodeList=node07 ExitCode=0:0"; fi'
        ),
        "scancel": "true",
        # partitions gpu (default) and small, as `sinfo -h -o "%P|%G|%f"` lists them
        "sinfo": ('if [ "$5" = small ]; then echo "small|gpu:mystery:2|(null)"; '
                  'else echo "gpu*|gpu:a100_80gb:4(S:0-1)|(null)"; fi'),
    }
    for name, answer in answers.items():
        script = bin_dir / name
        body = f'echo "{name} $*" >> {log}\n' + (f"echo '{name}: error' >&2; exit 1\n" if name == fail else answer + "\n")
        script.write_text("#!/bin/bash\n" + body)
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return log


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    log = fake_slurm_commands(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    return log


def test_split_arguments_separates_launch_settings_from_overrides():
    settings, overrides = slurm.split_arguments(
        ["model=3b", "nodes=4", "gpus_per_node=8", "parallel.tp=2", "partition=gpu", "exclusive=true", "grace=300"]
    )
    assert (settings.nodes, settings.gpus_per_node, settings.partition, settings.exclusive, settings.grace) == (
        4, 8, "gpu", True, 300)
    assert overrides == ["model=3b", "parallel.tp=2"]


@pytest.mark.parametrize("argument, message", [
    ("nodes=0", "nodes=0 must be at least 1"),
    ("nodes=two", "nodes='two' is not an integer"),
    ("time=tomorrow", "time='tomorrow' is not a SLURM time"),
    ("grace=3", "grace=3 s is too short"),
    ("exclusive=maybe", "exclusive='maybe' is not a boolean"),
    ("experiment", "'experiment' is not KEY=VALUE"),
])
def test_bad_launch_settings_are_named(argument, message):
    with pytest.raises(ValueError, match=message):
        slurm.split_arguments([argument])


def test_submit_writes_snapshot_config_and_sbatch_then_status_and_cancel(tmp_path, fake_slurm):
    run_dir = tmp_path / "run"
    record = slurm.submit(["experiment=smoke", "trainer.max_steps=7", "trainer.global_batch_size=32", "nodes=2", "gpus_per_node=4", "partition=gpu",
                           "account=proj", "qos=high", "time=02:00:00", f"run_dir={run_dir}", "python=/usr/bin/python3"])
    assert record["job_ids"] == ["4242"]
    assert json.loads((run_dir / "launch.json").read_text())["job_ids"] == ["4242"]
    script = (run_dir / "submit.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --qos=high", "#SBATCH --time=02:00:00", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --signal=USR1@120", f"#SBATCH --output={run_dir}/slurm-%j.out", f"cd {run_dir}/code",
                 "export NPROC_PER_NODE=4", "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
                 "srun --kill-on-bad-exit=1 --cpu-bind=none bash launch/torchrun.sh \\",
                 "  experiment=smoke \\", "  trainer.max_steps=7 \\", "  trainer.global_batch_size=32 \\",
                 f"  hydra.run.dir={run_dir}"):
        assert line in script.splitlines(), line
    assert "nodes=2" not in script.split("#SBATCH")[-1].split("srun", 1)[1]  # launch settings never reach Hydra
    # The snapshot holds the code the job runs; the config is the composed one.
    for relative in ("train.py", "launch/torchrun.sh", "launch/slurm.py", "configs/config.yaml",
                     "configs/experiment/smoke.yaml"):
        assert (run_dir / "code" / relative).read_bytes() == (REPO_ROOT / relative).read_bytes()
    assert not (run_dir / "code" / ".venv").exists() and not (run_dir / "code" / ".git").exists()
    config = (run_dir / "config.yaml").read_text()
    assert "max_steps: 7" in config and "name: debug" in config
    calls = fake_slurm.read_text().splitlines()
    assert calls == ["sinfo -h -o %P|%G|%f -p gpu", f"sbatch --parsable {run_dir}/submit.sbatch"]  # the plan's GPUs
    assert json.loads((run_dir / "launch.json").read_text())["memory_plan"]["budget_gib"] == 80.0

    state = slurm.status(str(run_dir))
    assert (state["job_id"], state["state"], state["restarts"], state["nodes"]) == ("4242", "RUNNING", 1, "node07")
    assert slurm.main(["cancel", str(run_dir)]) == 0
    assert fake_slurm.read_text().splitlines()[-1] == "scancel 4242"

    with pytest.raises(FileExistsError, match="already holds a submission"):
        slurm.submit(["experiment=smoke", f"run_dir={run_dir}", "python=/usr/bin/python3"])


def test_submit_refuses_a_bad_config_before_queueing(tmp_path, fake_slurm):
    with pytest.raises(Exception, match="no_such_key"):
        slurm.submit(["experiment=smoke", "trainer.no_such_key=1", f"run_dir={tmp_path / 'a'}", "python=/usr/bin/python3"])
    # The layout must fit the job's processes: TP=3 does not divide 2 heads.
    with pytest.raises(ValueError, match="parallel.tp=3"):
        slurm.submit(["experiment=smoke", "parallel.tp=3", "nodes=1", "gpus_per_node=3", f"run_dir={tmp_path / 'b'}",
                      "python=/usr/bin/python3"])
    assert not fake_slurm.exists()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cpu_job_dry_run_takes_one_process_per_node(tmp_path):
    assert slurm.main(["submit", "--dry-run", "experiment=smoke", "gpus_per_node=0", f"run_dir={tmp_path}",
                       "python=/usr/bin/python3"]) == 0
    script = (tmp_path / "submit.sbatch").read_text()
    assert "--gpus-per-node" not in script and "export NPROC_PER_NODE=1" in script
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}" in script  # the CPU job's default of 2 CPUs, one process
    assert json.loads((tmp_path / "launch.json").read_text())["job_ids"] == []
    with pytest.raises(ValueError, match="never submitted"):
        slurm.status(str(tmp_path))


@pytest.mark.parametrize("name, gib", [
    ("h100", 80.0), ("nvidia_h100_80gb_hbm3", 80.0), ("h100nvl", 94.0), ("a100", 40.0), ("a100-sxm4-80gb", 80.0),
    ("a100_80g", 80.0), ("a10", 24.0), ("h200", 141.0), ("l40s", 48.0), ("v100-32gb", 32.0), ("mystery", None),
])
def test_gpu_memory_of_slurm_gpu_type_names(name, gib):
    assert slurm.gpu_memory_of_type(name) == gib


def test_submit_runs_the_memory_plan_for_the_gpus_it_asks_for(tmp_path, fake_slurm, capsys):
    """Refused with the plan's error line (budget given, or the partition's GPU type), before anything is written;
    a partition of GPUs of unknown memory is submitted with a note that the plan was not checked."""
    big = ["model=13.1b", "nodes=1", "gpus_per_node=8", "python=/usr/bin/python3"]
    assert slurm.main(["submit", *big, "trainer.gpu_memory_gib=80", f"run_dir={tmp_path / 'a'}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: estimated memory per GPU")
    assert "exceeds the 72.0 GiB usable of 80 GiB (90%; trainer.gpu_memory_gib sets the budget)" in errors[0]
    assert not (tmp_path / "a").exists() and not fake_slurm.exists()
    # the partition's a100_80gb (fake sinfo): the same line
    assert slurm.main(["submit", *big, f"run_dir={tmp_path / 'b'}"]) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == errors
    assert slurm.main(["submit", "--dry-run", *big, "partition=small", f"run_dir={tmp_path / 'c'}"]) == 0
    assert "memory plan not checked at submission: no GPU model with a known memory size on partition small" in (
        capsys.readouterr().out)


def _corpus(tmp_path, files=3):
    paths = []
    for i in range(files):
        paths.append(tmp_path / f"in{i}.jsonl")
        paths[-1].write_text(json.dumps({"text": f"document {i}"}) + "\n")
    (tmp_path / "tok").mkdir()
    return [str(p) for p in paths]


def test_preprocess_array_sbatch(tmp_path, fake_slurm, monkeypatch):
    _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "array"
    record = slurm.submit_preprocess(["partitions=3", "cpus_per_task=16", "max_running=2", "partition=cpu",
                                      "time=12:00:00", f"run_dir={run_dir}", "python=/usr/bin/python3",
                                      "--input", "in*.jsonl", "--tokenizer", "tok", "--out=shards/corpus"])
    assert record["job_ids"] == ["4242"] and fake_slurm.read_text().splitlines() == [
        f"sbatch --parsable {run_dir}/preprocess.sbatch"]
    assert record["blend_entry"] == f"{tmp_path}/shards/corpus-*-of-3"
    assert record["shards"] == [f"{tmp_path}/shards/corpus-{i}-of-3" for i in (1, 2, 3)]
    lines = (run_dir / "preprocess.sbatch").read_text().splitlines()
    for line in ("#SBATCH --array=1-3%2", "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --time=12:00:00", "#SBATCH --partition=cpu", f"#SBATCH --output={run_dir}/slurm-%A_%a.out",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", f"cd {run_dir}/code",
                 "/usr/bin/python3 -m data.preprocess \\", f"  '{tmp_path}/in*.jsonl' \\", f"  {tmp_path}/tok \\",
                 f"  --out={tmp_path}/shards/corpus \\", "  --workers \\", "  15 \\",
                 '  --partition "${SLURM_ARRAY_TASK_ID}/3"'):
        assert line in lines, line
    assert (run_dir / "code" / "data" / "preprocess.py").read_bytes() == (REPO_ROOT / "data/preprocess.py").read_bytes()


@pytest.mark.parametrize("arguments, message", [
    (["partitions=4"], r"partitions=4: 4 partitions of 3 work units"),
    (["partitions=0"], r"partitions=0: give partitions=N"),
    (["partitions=2", "nodes=2"], r"nodes is not a setting"),
    (["partitions=2", "--partition", "1/2"], r"--partition 1/2: each array task takes its own"),
    (["partitions=2", "--tokenizer", "nowhere"], r"--tokenizer nowhere does not exist"),
])
def test_preprocess_array_refuses_bad_arguments_before_writing(tmp_path, fake_slurm, monkeypatch, capsys,
                                                                arguments, message):
    inputs = _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    settings = [a for a in arguments if not a.startswith("--") and "=" in a]
    rest = [a for a in arguments if a not in settings]
    command = ["preprocess", *settings, f"run_dir={tmp_path / 'run'}", "--input", *inputs, "--out", "s"]
    command += rest if "--tokenizer" in rest else rest + ["--tokenizer", "tok"]
    assert slurm.main(command) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert __import__("re").search(message, errors[0]), errors[0]
    assert not (tmp_path / "run").exists() and not fake_slurm.exists()


def test_requeue_current_job(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert requeue_current_job() is False  # outside SLURM: nothing to do
    log = fake_slurm_commands(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert requeue_current_job() is True
    assert log.read_text().splitlines() == ["scontrol requeue 77"]
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_current_job() is True
    assert log.read_text().splitlines()[-1] == "scontrol requeue 70_3"
    fake_slurm_commands(tmp_path / "bin", fail="scontrol")
    assert requeue_current_job() is False


def test_torch_env_from_slurm_for_directly_started_tasks(tmp_path, monkeypatch):
    fake_slurm_commands(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # set first, so that monkeypatch records the key and removes what the call below writes
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
                       "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "20123"}.items():
        monkeypatch.setenv(key, value)
    assert set_torch_env_from_slurm() is True
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")] \
        == ["5", "8", "1", "4", "node07", "20123"]
    assert set_torch_env_from_slurm() is False  # torchrun (or a first call) already set RANK


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 must be below NNODES=2"),
    ({"NPROC_PER_NODE": "x"}, "NPROC_PER_NODE=x is not a non-negative integer"),
])
def test_torchrun_script_refuses_bad_layout(env, message):
    result = subprocess.run(["bash", str(REPO_ROOT / "launch" / "torchrun.sh"), "experiment=smoke"],
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr


def compose(overrides):
    from hydra import compose as hydra_compose, initialize_config_dir
    from diff_transformer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)


def test_paper_scaling_sweep_reproduces_the_recipe():
    for size, lr in (("830m", 1.5e-3), ("1.4b", 1.5e-3), ("2.8b", 1.5e-3), ("6.8b", 7.5e-4), ("13.1b", 7.5e-4)):
        cfg = compose(["+sweep=paper_scaling", f"+sweep/paper_size={size}", "model.attention=vanilla"])
        tokens = cfg.trainer.max_steps * cfg.trainer.global_batch_size * cfg.model.seq_length
        assert (cfg.model.name, cfg.model.attention, cfg.optim.lr) == (size, "vanilla", lr)
        assert (cfg.optim.beta2, cfg.optim.warmup_steps, cfg.optim.decay, cfg.optim.weight_decay) == (0.98, 375, "linear", 0.05)
        assert cfg.trainer.global_batch_size * cfg.model.seq_length == 262_144 and 10e9 < tokens < 10.5e9
    params = cfg.hydra.sweeper.params
    assert params["+sweep/paper_size"].split(",") == ["830m", "1.4b", "2.8b", "6.8b", "13.1b"]
    assert params["model.attention"] == "diff,vanilla"


@pytest.mark.parametrize("sweep", ["tiny", "ablations", "paper_scaling"])
def test_sweeps_log_to_wandb_offline_like_every_run(sweep):
    assert compose([f"+sweep={sweep}"]).logging.wandb.mode == "offline"


def test_tiny_sweep_sizes_span_1_to_10m_parameters():
    cfg = compose(["+sweep=tiny"])
    sizes = cfg.hydra.sweeper.params["model"].split(",")
    assert 3 <= len(sizes) <= 4 and cfg.hydra.sweeper.params["model.attention"] == "diff,vanilla"
    vocab = cfg.data.bundled_vocab_size
    totals = []
    for size in sizes:
        m = compose(["+sweep=tiny", f"model={size}"]).model
        head_dim = m.hidden_size // (2 * m.num_heads)
        # DIFF and its baseline have the same count: q, k, v, o (E x E) + SwiGLU (3 E F) + 2 norms, tied embedding.
        layer = 4 * m.hidden_size * 2 * m.num_heads * head_dim + 3 * m.hidden_size * m.ffn_hidden_size + 2 * m.hidden_size
        totals.append(m.num_layers * layer + vocab * m.hidden_size)
    assert totals == sorted(totals) and 1e6 <= totals[0] and totals[-1] <= 10e6, totals


def test_submit_takes_relative_paths_from_where_it_runs(tmp_path, monkeypatch):
    """The job runs inside the code snapshot: relative data and checkpoint paths must not resolve there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prev" / "ckpt").mkdir(parents=True)
    run_dir = tmp_path / "run"
    slurm.submit(["experiment=smoke", "data.source=shards", "data.blend=[shards/a,shards/b]", "data.tokenizer_dir=tok",
                  "checkpoint.load_weights_only=prev/ckpt", "gpus_per_node=1", f"run_dir={run_dir}",
                  "python=/usr/bin/python3"], dry_run=True)
    lines = (run_dir / "submit.sbatch").read_text().splitlines()
    for line in (f"  'data.blend=[{tmp_path}/shards/a,{tmp_path}/shards/b]' \\",
                 f"  data.tokenizer_dir={tmp_path}/tok \\",
                 f"  checkpoint.load_weights_only={tmp_path}/prev/ckpt \\",
                 f"  data.cache_dir={tmp_path}/data/cache \\"):
        assert line in lines, (line, lines)
    assert "data.blend=[shards/a,shards/b]" not in "\n".join(lines).split("srun", 1)[1]
    config = (run_dir / "config.yaml").read_text()
    assert f"- {tmp_path}/shards/a" in config and f"tokenizer_dir: {tmp_path}/tok" in config


def test_train_takes_relative_data_paths_from_the_launch_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "experiment=smoke", "data.source=shards", "data.blend=[shards/x]",
         "data.tokenizer_dir=tok", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"shard file {tmp_path}/shards/x.bin does not exist" in result.stderr
