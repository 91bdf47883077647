"""Submit training runs to SLURM, follow them, cancel them.

    python -m launch.slurm submit experiment=smoke nodes=1 gpus_per_node=8 partition=gpu time=04:00:00
    python -m launch.slurm submit model=3b nodes=4 gpus_per_node=8 parallel.tp=2 account=proj qos=high
    python -m launch.slurm status runs/smoke/2026-11-25_22-30-00      # or a job id
    python -m launch.slurm cancel runs/smoke/2026-11-25_22-30-00

`submit` takes launch settings (the KEY=VALUE names in LAUNCH_KEYS) and Hydra overrides for train.py (everything
else), composes the config to fail on a bad key before anything is queued, then writes into the run directory:
  code/             a snapshot of the repository's files, which the job runs (later edits do not leak into it)
  config.yaml       the resolved config at submission (train.py rewrites it at start with the same content)
  submit.sbatch     the job script: srun starts launch/torchrun.sh once per node; `sbatch submit.sbatch` resubmits
  launch.json       the command, overrides, commit, and the ids of the jobs submitted
The job asks for `--signal=USR1@<grace>`, `--requeue` and `--open-mode=append`: on the signal torchrun forwards
USR1 to the workers, which save a checkpoint; global rank 0 requeues the job
(diff_transformer.training.failures.requeue_current_job), and the requeued job resumes
from that checkpoint (checkpoint.resume=auto) with its log appended to slurm-<jobid>.out.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from diff_transformer.cli import ArgumentParser

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
# Files the job does not need in its snapshot, even when git tracks them.
SNAPSHOT_EXCLUDE = re.compile(r"(^|/)(\.git|\.venv|__pycache__|outputs|multirun|runs|wandb|\.pytest_cache)(/|$)|\.pyc$")


@dataclasses.dataclass
class LaunchSettings:
    """Where and how large the job is: the KEY=VALUE settings `submit` takes apart from Hydra overrides."""

    nodes: int = 1
    gpus_per_node: int = 8  # 0: a CPU job
    procs_per_node: int | None = None  # processes torchrun starts per node; default gpus_per_node (1 on CPU)
    cpus_per_task: int | None = None  # CPUs for each node's torchrun; default 8 per GPU (2 on CPU)
    mem: str | None = None  # e.g. 400G; default: the partition's
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"  # SLURM's time format: [days-]hours:minutes:seconds
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None  # default: the experiment name
    grace: int = 120  # seconds between the USR1 warning and the time limit: enough to save a checkpoint
    run_dir: str | None = None  # default: runs/<name>/<model>-<attention>/<timestamp>
    python: str | None = None  # default: <repo>/.venv/bin/python


LAUNCH_KEYS = tuple(f.name for f in dataclasses.fields(LaunchSettings))
_TIME_FORMAT = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+$")


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key}={text!r} is not a boolean; use true or false")


def split_arguments(arguments: Sequence[str]) -> tuple[LaunchSettings, list[str]]:
    """Launch settings from KEY=VALUE arguments named in LAUNCH_KEYS; the rest are Hydra overrides, in order."""
    values: dict = {}
    overrides: list[str] = []
    types = {f.name: f.type for f in dataclasses.fields(LaunchSettings)}
    for argument in arguments:
        key, sep, value = argument.partition("=")
        if not sep:
            raise ValueError(f"argument {argument!r} is not KEY=VALUE; launch settings are {', '.join(LAUNCH_KEYS)}")
        if key not in LAUNCH_KEYS:
            overrides.append(argument)
            continue
        if key in values:
            raise ValueError(f"{key} is given twice ({values[key]!r} and {value!r})")
        kind = types[key]
        if "int" in kind:
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not an integer") from None
        elif "bool" in kind:
            values[key] = _parse_bool(key, value)
        else:
            values[key] = value
    settings = LaunchSettings(**values)
    validate_settings(settings)
    return settings, overrides


def validate_settings(settings: LaunchSettings) -> None:
    if settings.nodes < 1:
        raise ValueError(f"nodes={settings.nodes} must be at least 1")
    if settings.gpus_per_node < 0:
        raise ValueError(f"gpus_per_node={settings.gpus_per_node} must be 0 (CPU) or more")
    if settings.procs_per_node is not None and settings.procs_per_node < 1:
        raise ValueError(f"procs_per_node={settings.procs_per_node} must be at least 1")
    if settings.cpus_per_task is not None and settings.cpus_per_task < 1:
        raise ValueError(f"cpus_per_task={settings.cpus_per_task} must be at least 1")
    if settings.grace < 10:
        raise ValueError(f"grace={settings.grace} s is too short to save a checkpoint; give 10 or more seconds")
    if not _TIME_FORMAT.match(settings.time):
        raise ValueError(f"time={settings.time!r} is not a SLURM time; use e.g. 04:00:00, 2-00:00:00 or 90 (minutes)")


def procs_per_node(settings: LaunchSettings) -> int:
    return settings.procs_per_node or max(1, settings.gpus_per_node)


def _hydra_override_value(overrides: Sequence[str], key: str) -> str | None:
    value = None
    for override in overrides:
        name, _, rest = override.lstrip("+~").partition("=")
        if name == key:
            value = rest
    return value


def compose_config(overrides: Sequence[str], world_size: int | None = None, repo_root: Path = REPO_ROOT):
    """The job's config as train.py will compose it; a bad key or value fails here, before anything is queued."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # The typed schemas (config_schema) come from the repository's ConfigStore registration.
    if str(repo_root) not in sys.path:
        sys.path.insert(0, str(repo_root))
    config_module = importlib.import_module("diff_transformer.config")
    config_module.register_configs()
    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(repo_root / "configs"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=job_overrides)
    except (HydraException, OmegaConfBaseException) as err:  # a bad key or value: one line, as train.py says it
        raise ValueError(config_module.config_error_message(err)) from None
    finally:
        GlobalHydra.instance().clear()
    # Schema types, missing values and the cross-field rules train.py checks before it starts.
    typed = config_module.to_object(cfg)
    if world_size is not None:
        config_module.validate(typed, world_size)
    return cfg


def default_run_dir(cfg, now: datetime.datetime | None = None) -> Path:
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    return REPO_ROOT / "runs" / str(cfg.name) / f"{cfg.model.name}-{cfg.model.attention}" / stamp


def repository_files(repo_root: Path) -> list[Path]:
    """Files to snapshot: git's tracked and untracked-but-not-ignored files, or every file outside build outputs."""
    try:
        listing = subprocess.run(
            ["git", "-C", str(repo_root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True, text=True,
        ).stdout.split("\0")
        files = [Path(name) for name in listing if name]
    except (FileNotFoundError, subprocess.CalledProcessError):
        files = [p.relative_to(repo_root) for p in repo_root.rglob("*") if p.is_file()]
    return sorted(f for f in files if not SNAPSHOT_EXCLUDE.search(f.as_posix()) and (repo_root / f).is_file())


def snapshot_code(repo_root: Path, destination: Path) -> int:
    """Copy the repository's files into destination; returns how many were copied."""
    files = repository_files(repo_root)
    for relative in files:
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo_root / relative, target)
    return len(files)


def git_state(repo_root: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(repo_root), *args], check=True, capture_output=True, text=True).stdout.strip()
        except (FileNotFoundError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def render_sbatch(settings: LaunchSettings, overrides: Sequence[str], run_dir: Path, job_name: str, python: str,
                  command_line: str, git: dict) -> str:
    """The job script: readable, and resubmittable by hand with `sbatch <run dir>/submit.sbatch`."""
    code_dir = run_dir / "code"
    cpus = settings.cpus_per_task or (8 * settings.gpus_per_node if settings.gpus_per_node else 2)
    directives = [
        f"--job-name={job_name}",
        f"--nodes={settings.nodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the per-GPU workers
        f"--cpus-per-task={cpus}",
        f"--time={settings.time}",
        f"--output={run_dir}/slurm-%j.out",
        "--open-mode=append",  # a requeued job keeps its id and appends to the same log
        "--requeue",
        f"--signal=USR1@{settings.grace}",
    ]
    if settings.gpus_per_node:
        directives.append(f"--gpus-per-node={settings.gpus_per_node}")
    for key in ("partition", "account", "qos", "mem", "constraint"):
        value = getattr(settings, key)
        if value:
            directives.append(f"--{key}={value}")
    if settings.exclusive:
        directives.append("--exclusive")
    train_arguments = [*overrides, f"hydra.run.dir={run_dir}"]
    lines = [
        "#!/bin/bash",
        f"# {command_line}",
        f"# Commit {git.get('commit') or 'unknown'}{' with uncommitted changes' if git.get('dirty') else ''}; "
        f"code snapshot in {code_dir}.",
        f"# Resubmit (resumes from the latest checkpoint): sbatch {run_dir}/submit.sbatch",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(str(code_dir))}",
        f"export PYTHON={shlex.quote(python)}",
        f"export PYTHONPATH={shlex.quote(str(code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        f"export NPROC_PER_NODE={procs_per_node(settings)}",
        # Leave a margin inside the warning for the requeue itself once the checkpoint is written.
        f"export SHUTDOWN_GRACE_S={max(5, settings.grace - 5)}",
        "",
        'echo "job ${SLURM_JOB_ID} start ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST} at $(date -u +%FT%TZ)"',
        "srun --kill-on-bad-exit=1 --cpu-bind=none bash launch/torchrun.sh \\",
        *(f"  {shlex.quote(a)} \\" for a in train_arguments[:-1]),
        f"  {shlex.quote(train_arguments[-1])}",
        "",
    ]
    return "\n".join(lines)


def _run(command: Sequence[str], what: str) -> str:
    try:
        result = subprocess.run(list(command), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RuntimeError(f"{command[0]} not found: {what} needs the SLURM client commands on PATH") from None
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _refuse_existing_submission(run_dir: Path) -> None:
    if (run_dir / "submit.sbatch").exists():
        raise FileExistsError(
            f"{run_dir} already holds a submission; resubmit it with `sbatch {run_dir}/submit.sbatch` "
            "or give another run_dir"
        )


def submit(arguments: Sequence[str], dry_run: bool = False) -> dict:
    """Snapshot code and config into the run directory, write submit.sbatch and submit it; returns launch.json."""
    from omegaconf import OmegaConf

    from diff_transformer.config import resolve_launch_paths

    settings, overrides = split_arguments(arguments)
    run_dir_override = _hydra_override_value(overrides, "hydra.run.dir")
    if run_dir_override and settings.run_dir:
        raise ValueError(f"give the run directory once: run_dir={settings.run_dir} or hydra.run.dir={run_dir_override}")
    overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    given_run_dir = settings.run_dir or run_dir_override
    if given_run_dir:
        _refuse_existing_submission(Path(given_run_dir).expanduser().absolute())
    cfg = compose_config(overrides, world_size=settings.nodes * procs_per_node(settings))
    # the job runs inside the code snapshot: relative paths are taken from here, the directory submit runs in
    absolute = resolve_launch_paths(cfg, os.getcwd())
    changed_keys = {o.split("=", 1)[0] for o in absolute}
    overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in changed_keys] + absolute
    run_dir = Path(given_run_dir or default_run_dir(cfg)).expanduser().absolute()
    _refuse_existing_submission(run_dir)
    python = settings.python or str(REPO_ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists() and not dry_run:
        raise FileNotFoundError(f"python={python} does not exist; create the .venv or pass python=/path/to/python")
    job_name = settings.job_name or str(cfg.name)
    command_line = "python -m launch.slurm submit " + " ".join(shlex.quote(a) for a in arguments)
    git = git_state(REPO_ROOT)

    run_dir.mkdir(parents=True, exist_ok=True)
    copied = snapshot_code(REPO_ROOT, run_dir / "code")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    script = render_sbatch(settings, overrides, run_dir, job_name, python, command_line, git)
    (run_dir / "submit.sbatch").write_text(script)
    record = {
        "command": command_line,
        "settings": dataclasses.asdict(settings),
        "overrides": list(overrides),
        "run_dir": str(run_dir),
        "git": git,
        "files_in_snapshot": copied,
        "submitted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "job_ids": [],
    }
    if not dry_run:
        output = _run(["sbatch", "--parsable", str(run_dir / "submit.sbatch")], "submit")
        record["job_ids"].append(output.strip().split(";")[0])
    (run_dir / "launch.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def resolve_job(target: str) -> tuple[str, Path | None]:
    """A job id and its run directory (when known) from either a run directory or a job id."""
    path = Path(target)
    if (path / "launch.json").is_file():
        record = json.loads((path / "launch.json").read_text())
        if not record["job_ids"]:
            raise ValueError(f"{path} was written with --dry-run and never submitted; sbatch {path}/submit.sbatch")
        return record["job_ids"][-1], path
    if re.fullmatch(r"\d+(_\d+)?", target):
        return target, None
    raise ValueError(f"{target!r} is neither a run directory with launch.json nor a job id")


def _scontrol_fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", text))


def job_status(job_id: str) -> dict:
    """State of a job from scontrol (recent jobs), else sacct; `state` is UNKNOWN when SLURM forgot it."""
    try:
        fields = _scontrol_fields(_run(["scontrol", "show", "job", "-o", job_id], "status"))
        return {
            "job_id": job_id,
            "state": fields.get("JobState", "UNKNOWN"),
            "reason": fields.get("Reason"),
            "restarts": int(fields.get("Restarts", 0)),
            "run_time": fields.get("RunTime"),
            "time_limit": fields.get("TimeLimit"),
            "nodes": fields.get("NodeList"),
            "exit_code": fields.get("ExitCode"),
        }
    except RuntimeError as scontrol_error:
        try:
            rows = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,Elapsed,NodeList,ExitCode"], "status")
        except RuntimeError:
            raise scontrol_error from None
        for row in rows.splitlines():
            job, state, elapsed, nodes, exit_code = row.split("|")
            if job == job_id:
                return {"job_id": job_id, "state": state.split()[0], "reason": None, "restarts": None,
                        "run_time": elapsed, "time_limit": None, "nodes": nodes, "exit_code": exit_code}
        return {"job_id": job_id, "state": "UNKNOWN"}


def last_metrics(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    last = None
    with open(metrics) as f:
        for line in f:
            try:
                last = json.loads(line)
            except json.JSONDecodeError:
                continue
    return last


def status(target: str) -> dict:
    job_id, run_dir = resolve_job(target)
    result = job_status(job_id)
    if run_dir is not None:
        result["run_dir"] = str(run_dir)
        result["last_metrics"] = last_metrics(run_dir)
    return result


def cancel(target: str) -> str:
    job_id, _ = resolve_job(target)
    _run(["scancel", job_id], "cancel")
    return job_id


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m launch.slurm", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    submit_parser = commands.add_parser(
        "submit", help="snapshot, write submit.sbatch, sbatch it",
        description=f"Launch settings (KEY=VALUE): {', '.join(LAUNCH_KEYS)}. Every other KEY=VALUE is a Hydra override.",
    )
    submit_parser.add_argument("--dry-run", action="store_true", help="write the run directory without submitting")
    submit_parser.add_argument("arguments", nargs="*", metavar="KEY=VALUE")
    for name, text in (("status", "state of a job and its latest metrics"), ("cancel", "scancel a job")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("target", help="run directory (with launch.json) or job id")
    args = parser.parse_args(argv)
    try:
        if args.command == "submit":
            record = submit(args.arguments, dry_run=args.dry_run)
            where = record["run_dir"]
            if record["job_ids"]:
                print(f"submitted job {record['job_ids'][-1]}; run directory {where}")
            else:
                print(f"wrote {where}/submit.sbatch (not submitted: --dry-run)")
        elif args.command == "status":
            print(json.dumps(status(args.target), indent=2))
        else:
            print(f"cancelled job {cancel(args.target)}")
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
