"""launch.slurm against a real SLURM: a one-node cluster on localhost (munged, slurmctld, slurmd; 2 CPUs, no GPUs)
runs the smoke experiment submitted with `python -m launch.slurm submit`, and a run sent the preemption signal
requeues itself and ends with the losses of the uninterrupted run.

Needs root: the slurm-wlm and munge packages are installed with apt when missing (skips when that is impossible).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from diff_transformer.distributed import free_port
from launch import slurm

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("slurm-wlm", "munge")
GPU_TYPE, GPUS = "h100", 1  # declared on the node, for the memory plan at submission
DAEMONS = ("munged", "slurmctld", "slurmd")


class ClusterUnavailable(RuntimeError):
    """SLURM cannot run here (not root, packages missing and not installable): tests skip."""


def ensure_installed(timeout_s: float = 300) -> None:
    """Install Debian's slurm-wlm and munge with apt when a daemon is missing."""
    if all(shutil.which(d) for d in (*DAEMONS, "sbatch", "scontrol")):
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("slurm-wlm and munge are not installed and installing them needs root")
    if not shutil.which("apt-get"):
        raise ClusterUnavailable("slurm-wlm and munge are not installed and apt-get is not available")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise ClusterUnavailable(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        raise ClusterUnavailable(f"apt installed {PACKAGES} but {missing} are still not on PATH")


@dataclass
class LocalSlurmCluster:
    """munged + slurmctld + slurmd, each started here in the foreground and stopped by its own pid."""

    root: Path
    cpus: int = 2
    processes: dict = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        """Environment for SLURM client commands (sbatch, squeue, scontrol) to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def freezer_cgroup(self) -> bool:
        """cgroup v1 with a writable freezer hierarchy, as on hosts and containers without systemd."""
        return os.access("/sys/fs/cgroup/freezer", os.W_OK)

    def write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "munge", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        (self.root / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"
        )
        # GPUs the node declares by model (no devices: the memory plan at submission reads the model; jobs ask none)
        (self.root / "gres.conf").write_text(f"NodeName={host} Name=gpu Type={GPU_TYPE} File=/dev/null Count={GPUS}\n")
        self.conf.write_text(
            "\n".join([
                "ClusterName=localtest",
                # Job ids apart from any other test cluster on this host: they name the jobs' cgroups.
                f"FirstJobId={random.randrange(1000, 1_000_000)}",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.root}/munge/munge.socket",
                f"StateSaveLocation={self.root}/state",
                f"SlurmdSpoolDir={self.root}/spool",
                f"SlurmctldPidFile={self.root}/slurmctld.pid",
                f"SlurmdPidFile={self.root}/slurmd.pid",
                f"SlurmctldLogFile={self.root}/log/slurmctld.log",
                f"SlurmdLogFile={self.root}/log/slurmd.log",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                # The freezer cgroup holds every process of a job, also those whose parent died: all are killed.
                f"ProctrackType=proctrack/{'cgroup' if self.freezer_cgroup else 'linuxproc'}",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "SwitchType=switch/none",
                "MpiDefault=none",
                "GresTypes=gpu",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerType=sched/builtin",
                "JobRequeue=1",
                "ReturnToService=2",
                "KillWait=10",
                "MinJobAge=600",
                "InactiveLimit=0",
                "SlurmctldTimeout=30",
                "SlurmdTimeout=30",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} Gres=gpu:{GPU_TYPE}:{GPUS} State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ])
        )

    def _start(self, name: str, command: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def start(self, timeout_s: float = 60) -> None:
        self.write_config()
        munge_dir = self.root / "munge"
        self._start("munged", [
            "munged", "--foreground", "--force", f"--socket={munge_dir}/munge.socket", f"--key-file={munge_dir}/munge.key",
            f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed",
        ])
        self._wait_for(lambda: (munge_dir / "munge.socket").exists(), "munged socket", timeout_s)
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: self.client("scontrol", "ping", check=False).returncode == 0, "slurmctld ping", timeout_s)
        self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        self._wait_for(self._node_idle, "the node to be idle", timeout_s)

    def _node_idle(self) -> bool:
        result = self.client("sinfo", "-h", "-o", "%T", check=False)
        return result.returncode == 0 and result.stdout.strip().rstrip("*") == "idle"

    def _wait_for(self, condition, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}:\n{self.logs()}")
            if condition():
                return
            time.sleep(0.2)
        raise TimeoutError(f"waited {timeout_s} s for {what}:\n{self.logs()}")

    def client(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def logs(self, tail: int = 30) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.is_file():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop the daemons started here, in reverse order, each by its own pid."""
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
        self.processes.clear()
        # slurmd leaves its empty per-node cgroups behind; rmdir removes only empty ones, so a live job is safe.
        host = socket.gethostname().split(".")[0]
        node_cgroup = Path("/sys/fs/cgroup/freezer") / f"slurm_{host}"
        if self.freezer_cgroup and node_cgroup.is_dir():
            for directory in sorted((p for p in node_cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    directory.rmdir()
                except OSError:
                    pass
            try:
                node_cgroup.rmdir()
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------------------ tests

SMOKE = ["experiment=smoke", "logging.wandb.mode=disabled", f"data.cache_dir={REPO_ROOT / 'data' / 'cache'}"]
CPU_JOB = ["nodes=1", "gpus_per_node=0", "cpus_per_task=1", "time=15:00", "grace=30"]
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (munged, slurmctld and slurmd run as root)")
    try:
        ensure_installed()
    except (ClusterUnavailable, subprocess.TimeoutExpired) as error:
        pytest.skip(f"SLURM unavailable: {error}")
    local = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"))
    saved_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(local.conf)  # launch.slurm's sbatch/scontrol and the jobs reach this cluster
    try:
        local.start()
        yield local
    finally:
        local.stop()
        if saved_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved_conf


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """The uninterrupted and the to-be-preempted run, submitted together (one CPU each) to share the wall time.
    Sequences of 256 make the 30 steps last seconds, so that the signal reaches the preempted run while it trains
    (at the smoke experiment's 64 tokens they take under a second)."""
    root = tmp_path_factory.mktemp("runs")
    submitted = {}
    for name in ("uninterrupted", "preempted"):
        overrides = [*SMOKE, "model.seq_length=256", *CPU_JOB, f"run_dir={root / name}", f"job_name={name}"]
        assert slurm.main(["submit", *overrides]) == 0
        submitted[name] = root / name
    return submitted


def job_id(run_dir: Path) -> str:
    return json.loads((run_dir / "launch.json").read_text())["job_ids"][-1]


def wait_for(condition, what: str, cluster: LocalSlurmCluster, run_dir: Path, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"waited {timeout_s} s for {what}\n{job_log(run_dir)}\n{cluster.logs()}")


def job_log(run_dir: Path) -> str:
    logs = sorted(run_dir.glob("slurm-*.out"))
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-4000:]}" for p in logs)


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Last logged loss of each step: steps replayed after a resume overwrite the interrupted segment's."""
    return {row["step"]: row["loss"] for row in metric_rows(run_dir)}


def finished_state(run_dir: Path) -> dict | None:
    state = slurm.job_status(job_id(run_dir))
    return state if state["state"] in FINISHED else None


def test_preempted_job_requeues_and_matches_uninterrupted_losses(cluster, jobs):
    # First in the file: the signal must reach the job while it trains, next to the uninterrupted one.
    run_dir = jobs["preempted"]
    job = job_id(run_dir)
    # Signal once the run is training and has steps left, as SLURM does `grace` seconds before the time limit.
    rows = wait_for(lambda: [r for r in metric_rows(run_dir) if r["step"] >= 2], "training to start", cluster, run_dir)
    assert max(r["step"] for r in metric_rows(run_dir)) < 30, "the run finished before the signal; lengthen it"
    signalled_at_step = max(r["step"] for r in rows)
    cluster.client("scancel", "--signal=USR1", job)

    def requeued_and_released():
        state = slurm.job_status(job)
        if state["restarts"] < 1:
            if state["state"] in FINISHED:
                raise AssertionError(f"job ended without requeueing: {state}\n{job_log(run_dir)}")
            return None
        if state["state"] == "PENDING" and state["reason"] == "BeginTime":
            # SLURM holds a requeued job back for about two minutes; a test need not wait for that.
            cluster.client("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
        return state if state["state"] == "RUNNING" or state["state"] in FINISHED else None

    wait_for(requeued_and_released, "the job to requeue itself and start again", cluster, run_dir, timeout_s=120)
    state = wait_for(lambda: finished_state(run_dir), "the requeued job to finish", cluster, run_dir)
    assert state["state"] == "COMPLETED" and state["restarts"] == 1, f"{state}\n{job_log(run_dir)}"

    log = (run_dir / f"slurm-{job}.out").read_text()
    assert f"job {job} start 0 on" in log and f"job {job} start 1 on" in log  # one log, appended across the requeue
    assert any((run_dir / "checkpoints").iterdir())
    # The signal's checkpoint: at or after the step seen before signalling, before the end.
    saved_steps = sorted(int(m.group(1)) for p in (run_dir / "checkpoints").iterdir() if (m := re.search(r"(\d+)$", p.name)))
    assert any(signalled_at_step <= step < 30 for step in saved_steps), saved_steps
    wait_for(lambda: finished_state(jobs["uninterrupted"]), "the uninterrupted job", cluster, jobs["uninterrupted"])
    reference = losses_by_step(jobs["uninterrupted"])
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference) == list(range(1, 31))
    assert [losses[s] for s in range(1, 31)] == pytest.approx([reference[s] for s in range(1, 31)], rel=1e-5)


def test_smoke_job_runs_to_completion(cluster, jobs, capsys):
    run_dir = jobs["uninterrupted"]
    state = wait_for(lambda: finished_state(run_dir), "the smoke job to finish", cluster, run_dir)
    assert state["state"] == "COMPLETED", f"{state}\n{job_log(run_dir)}"
    assert state["restarts"] == 0 and state["exit_code"] == "0:0"
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, 31))
    assert losses[30] < losses[1] - 0.3  # the smoke experiment learns
    assert [r["step"] for r in metric_rows(run_dir) if "val_loss" in r] == [10, 20, 30]
    description = json.loads((run_dir / "run.json").read_text())
    assert (description["name"], description["max_steps"]) == ("smoke", 30)
    log = (run_dir / f"slurm-{job_id(run_dir)}.out").read_text()
    assert f"job {job_id(run_dir)} start 0 on" in log
    assert "torchrun.sh: node 0/1, 1 processes" in log
    # The job ran the snapshot, and status reads the finished job back.
    assert (run_dir / "code" / "train.py").read_bytes() == (REPO_ROOT / "train.py").read_bytes()
    assert slurm.main(["status", str(run_dir)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "COMPLETED" and status["last_metrics"]["step"] == 30


def test_submission_refuses_a_job_that_cannot_fit_the_partitions_gpus(cluster, tmp_path, capsys):
    """The memory plan at submission, for the GPUs asked for: their memory read from the partition's GRES type (the
    node declares h100s), the estimate printed, and a job that cannot fit refused with train.py's error line, before
    anything is written or queued."""
    import torch

    from diff_transformer.config import padded_vocab_size, to_object
    from diff_transformer.training.accounting import memory_plan_problem

    big = ["model=13.1b", "nodes=1", f"gpus_per_node={GPUS}", "partition=debug", f"run_dir={tmp_path / 'big'}"]
    assert slurm.main(["submit", *big]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    typed = to_object(slurm.compose_config(["model=13.1b"], world_size=GPUS))
    vocab = typed.model.vocab_size or typed.data.bundled_vocab_size
    padded = padded_vocab_size(vocab, typed.model.make_vocab_size_divisible_by, 1)
    assert errors == ["error: " + memory_plan_problem(typed, torch.bfloat16, GPUS, padded, 80.0, "cuda")]
    assert "exceeds the 72.0 GiB usable of 80 GiB" in errors[0]
    assert not (tmp_path / "big").exists()

    assert slurm.main(["submit", "--dry-run", *SMOKE, "nodes=1", f"gpus_per_node={GPUS}",
                       f"run_dir={tmp_path / 'smoke'}"]) == 0
    printed = capsys.readouterr().out
    assert "memory plan: estimated" in printed and "of 80 GiB (the default partition: h100)" in printed
    plan = json.loads((tmp_path / "smoke" / "launch.json").read_text())["memory_plan"]
    assert plan["budget_gib"] == 80.0 and 0 < plan["estimate_gib"]["total"] < 1


def array_states(cluster: LocalSlurmCluster, job: str) -> list[str]:
    listing = cluster.client("scontrol", "show", "job", "-o", job, check=False).stdout
    return re.findall(r"JobState=(\S+)", listing)


def test_preprocess_job_array_writes_the_partitions_of_one_run(cluster, tmp_path):
    """`launch.slurm preprocess partitions=3`: one array task per partition; the three shards, concatenated, hold the
    tokens of one unpartitioned run."""
    import gzip

    from data import indexed, preprocess
    from data.config import BUNDLED_CORPUS
    from data.tokenizer import train_tokenizer

    with gzip.open(BUNDLED_CORPUS, "rt") as stream:
        documents = [json.loads(line)["text"][:2000] for _, line in zip(range(30), stream)]
    files = []
    for i in range(3):
        files.append(tmp_path / f"part{i}.jsonl")
        files[-1].write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[i * 10:(i + 1) * 10]))
    train_tokenizer([str(f) for f in files], tmp_path / "tok", 512, num_threads=1)
    whole = preprocess.preprocess([str(f) for f in files], str(tmp_path / "tok"), str(tmp_path / "one" / "s"))

    run_dir = tmp_path / "array"
    assert slurm.main(["preprocess", "partitions=3", "cpus_per_task=1", "time=10:00", f"run_dir={run_dir}",
                       "--input", *map(str, files), "--tokenizer", str(tmp_path / "tok"),
                       "--out", str(tmp_path / "three" / "s")]) == 0
    script = (run_dir / "preprocess.sbatch").read_text()
    assert "#SBATCH --array=1-3" in script and '--partition "${SLURM_ARRAY_TASK_ID}/3"' in script
    job = job_id(run_dir)

    def finished():
        states = array_states(cluster, job)
        return states if len(states) == 3 and all(s in FINISHED for s in states) else None

    states = wait_for(finished, "the three array tasks", cluster, run_dir, timeout_s=180)
    assert states == ["COMPLETED"] * 3, job_log(run_dir)
    shards = [str(tmp_path / "three" / f"s-{i}-of-3") for i in (1, 2, 3)]
    assert b"".join(open(s + ".bin", "rb").read() for s in shards) == (tmp_path / "one" / "s.bin").read_bytes()
    lengths = [n for s in shards for n in indexed.read_index(s + ".idx").sequence_lengths.tolist()]
    assert lengths == indexed.read_index(str(tmp_path / "one" / "s.idx")).sequence_lengths.tolist()
    assert sum(preprocess.read_manifest(s)["totals"]["tokens"] for s in shards) == whole["totals"]["tokens"]
