"""Submit training runs to SLURM, follow them, cancel them.

    python -m launch.slurm submit experiment=smoke nodes=1 gpus_per_node=8 partition=gpu time=04:00:00
    python -m launch.slurm submit model=3b nodes=4 gpus_per_node=8 parallel.tp=2 account=proj qos=high
    python -m launch.slurm status runs/smoke/2026-11-25_22-30-00      # or a job id
    python -m launch.slurm cancel runs/smoke/2026-11-25_22-30-00
    python -m launch.slurm preprocess partitions=64 cpus_per_task=32 partition=cpu time=24:00:00 \
        --input 'corpus/*.jsonl.zst' --tokenizer tok/ --out shards/corpus

`submit` takes launch settings (the KEY=VALUE names in LAUNCH_KEYS) and Hydra overrides for train.py (everything
else), composes the config to fail on a bad key before anything is queued, and runs the memory plan for the GPUs it
asks for (nodes x gpus_per_node, each of `trainer.gpu_memory_gib` or else the memory of the partition's GPU type,
read from SLURM): it prints the estimate, and refuses a job that cannot fit with the `error:` line train.py would
print once the job had waited in the queue and started. Then it writes into the run directory:
  code/             a snapshot of the repository's files, which the job runs (later edits do not leak into it)
  config.yaml       the resolved config at submission (train.py rewrites it at start with the same content)
  submit.sbatch     the job script: srun starts launch/torchrun.sh once per node; `sbatch submit.sbatch` resubmits
  launch.json       the command, overrides, commit, and the ids of the jobs submitted
The job asks for `--signal=USR1@<grace>`, `--requeue` and `--open-mode=append`: on the signal torchrun forwards
USR1 to the workers, which save a checkpoint; global rank 0 requeues the job
(diff_transformer.training.failures.requeue_current_job), and the requeued job resumes
from that checkpoint (checkpoint.resume=auto) with its log appended to slurm-<jobid>.out.

`preprocess` submits `python -m data.preprocess` as a job array of `partitions` tasks, task I running
`--partition I/partitions` (data/preprocess.py) on one node, from a code snapshot in its run directory
(default runs/preprocess/<out name>/<timestamp>: code/, preprocess.sbatch, launch.json, slurm-<job>_<task>.out). Every
task resumes from the units and segments already committed, so `sbatch <run dir>/preprocess.sbatch` (or
`sbatch --array=3,5 ...` for the tasks that failed) finishes the work without redoing any; a finished partition is a
no-op. Then `data.blend=[PREFIX-*-of-N]` trains on the N shards as one.
"""

from __future__ import annotations

import argparse
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
    settings, overrides = _settings_from(LaunchSettings, arguments, others_allowed=True)
    validate_settings(settings)
    return settings, overrides


def _settings_from(cls, arguments: Sequence[str], others_allowed: bool):
    """An instance of the dataclass ``cls`` from the KEY=VALUE arguments naming its fields, and the other arguments."""
    keys = tuple(f.name for f in dataclasses.fields(cls))
    values: dict = {}
    overrides: list[str] = []
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for argument in arguments:
        key, sep, value = argument.partition("=")
        if not sep:
            raise ValueError(f"argument {argument!r} is not KEY=VALUE; launch settings are {', '.join(keys)}")
        if key not in keys:
            if not others_allowed:
                raise ValueError(f"{key} is not a setting; settings are {', '.join(keys)}")
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
    return cls(**values), overrides


def _check_time(time: str) -> None:
    if not _TIME_FORMAT.match(time):
        raise ValueError(f"time={time!r} is not a SLURM time; use e.g. 04:00:00, 2-00:00:00 or 90 (minutes)")


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
    _check_time(settings.time)


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
    procs = procs_per_node(settings)
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
        # Below Linux's ephemeral ports (32768-60999 by default): a port in that range can be held by any outgoing
        # connection on the node, and the rendezvous then fails with EADDRINUSE.
        "export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))",
        f"export NPROC_PER_NODE={procs}",
        # Each process's share of the task's CPUs for torch's intra-op threads, unless the environment sets it
        # (torchrun sets 1 only for several processes a node; one process would start a thread per core of the node).
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{max(1, cpus // procs)}}}",
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


# ------------------------------------------------------------------------------------------------------------------
# The memory plan at submission
# ------------------------------------------------------------------------------------------------------------------
# Memory of one device in GiB by GPU model, as SLURM names them in a GRES type or a node feature (datasheets; a size
# in the name, such as a100_80gb, wins). Longest names are matched first, so a100 is not read as a10.
GPU_MEMORY_GIB = {
    "h200": 141.0, "gh200": 96.0, "h100nvl": 94.0, "h100_nvl": 94.0, "h100": 80.0, "h800": 80.0, "a100": 40.0,
    "a800": 80.0, "l40s": 48.0, "l40": 48.0, "a40": 48.0, "a6000": 48.0, "l4": 24.0, "a10": 24.0, "v100": 16.0,
    "mi300x": 192.0, "mi250x": 64.0, "mi250": 64.0,
}
_SIZE_IN_NAME = re.compile(r"(?<![0-9])([0-9]{2,3})g(?:b|ib)?(?![a-z0-9])")


def gpu_memory_of_type(name: str) -> float | None:
    """GiB of a GPU named like SLURM GRES types and features are (h100, nvidia_h100_80gb_hbm3, a100-80g), or None."""
    lowered = name.lower()
    size = _SIZE_IN_NAME.search(lowered)
    if size and any(model in lowered for model in GPU_MEMORY_GIB):
        return float(size.group(1))
    for model in sorted(GPU_MEMORY_GIB, key=len, reverse=True):
        if model in lowered:
            return GPU_MEMORY_GIB[model]
    return None


def partition_gpu_memory(partition: str | None) -> tuple[float | None, str]:
    """(GiB of the smallest GPU on the partition's nodes, where it was read) from SLURM's GRES types and node features
    (sinfo); (None, why not) when SLURM names no GPU model whose memory is known."""
    where = f"partition {partition}" if partition else "the default partition"
    command = ["sinfo", "-h", "-o", "%P|%G|%f"] + (["-p", partition] if partition else [])
    try:
        rows = _run(command, "the memory plan").splitlines()
    except RuntimeError as error:
        return None, f"SLURM did not describe {where} ({error})"
    if not partition:
        rows = [row for row in rows if row.split("|")[0].endswith("*")]
    found: dict[str, float] = {}
    for row in rows:
        _, gres, features = (row.split("|") + ["", ""])[:3]
        names = [entry.split(":")[1] for entry in re.split(r",(?![^(]*\))", gres) if entry.startswith("gpu:")
                 and entry.count(":") >= 2]
        names += [feature for feature in features.split(",") if feature and feature != "(null)"]
        for name in names:
            gib = gpu_memory_of_type(name)
            if gib is not None:
                found[name] = gib
    if not found:
        return None, (f"no GPU model with a known memory size on {where} (GRES and features: "
                      f"{'; '.join(rows) or 'none'})")
    name = min(found, key=found.get)
    return found[name], f"{where}: {name}" + (f", the smallest of {', '.join(sorted(found))}" if len(found) > 1 else "")


def _planned_vocab(typed) -> int:
    """The vocabulary train.py will pad: model.vocab_size, else the tokenizer's (the bundled one is trained to
    data.bundled_vocab_size pieces)."""
    if typed.model.vocab_size is not None:
        return typed.model.vocab_size
    if typed.data.tokenizer_dir is not None:
        from data.tokenizer import load_tokenizer

        return load_tokenizer(typed.data.tokenizer_dir).vocab_size
    return typed.data.bundled_vocab_size


def check_memory_plan(cfg, settings: LaunchSettings) -> dict | None:
    """The job's memory per GPU at its size (``training.accounting.check_memory_plan``, as train.py runs it): the
    estimate and its budget, None when there is nothing to check (a CPU job without trainer.gpu_memory_gib), or a
    record saying why it was not checked. ValueError, with train.py's message, when it cannot fit."""
    import torch

    from diff_transformer.config import padded_vocab_size, to_object
    from diff_transformer.training.accounting import USABLE_MEMORY_FRACTION, check_memory_plan as plan

    typed = to_object(cfg)
    gpu = settings.gpus_per_node > 0
    budget, source = typed.trainer.gpu_memory_gib, "trainer.gpu_memory_gib"
    if budget is None and gpu:
        budget, source = partition_gpu_memory(settings.partition)
        if budget is None:
            return {"checked": False, "reason": f"{source}; give trainer.gpu_memory_gib=GiB to check at submission"}
    if budget is None:
        return None
    precision = typed.trainer.precision
    dtype = torch.bfloat16 if precision == "bf16" or (precision == "auto" and gpu) else torch.float32
    world = settings.nodes * procs_per_node(settings)
    padded = padded_vocab_size(_planned_vocab(typed), typed.model.make_vocab_size_divisible_by, typed.parallel.tp)
    estimate = plan(typed, dtype, world, padded, budget_gib=budget, device="cuda" if gpu else "cpu")
    return {"checked": True, "estimate_gib": estimate, "budget_gib": budget, "source": source,
            "usable_gib": USABLE_MEMORY_FRACTION * budget, "world_size": world}


def describe_memory_plan(plan: dict | None) -> str | None:
    if plan is None:
        return None
    if not plan["checked"]:
        return f"memory plan not checked at submission: {plan['reason']}"
    e = plan["estimate_gib"]
    parts = ", ".join(f"{k} {e[k]:.1f}" for k in ("weights", "grads", "optimizer", "activations", "logits"))
    return (f"memory plan: estimated {e['total']:.2f} GiB per GPU ({parts}) fits the {plan['usable_gib']:.1f} GiB "
            f"usable of {plan['budget_gib']:g} GiB ({plan['source']}) on {plan['world_size']} processes")


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
    memory_plan = check_memory_plan(cfg, settings)  # refuses, before anything is written, a job that cannot fit
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
        "memory_plan": memory_plan,
    }
    return _sbatch_and_record(run_dir / "submit.sbatch", record, dry_run)


def _sbatch_and_record(script: Path, record: dict, dry_run: bool) -> dict:
    """Submit ``script`` (unless dry_run) and write launch.json beside it: ``record``, the time and the job id."""
    record = {**record, "submitted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "job_ids": []}
    if not dry_run:
        output = _run(["sbatch", "--parsable", str(script)], "submit")
        record["job_ids"].append(output.strip().split(";")[0])
    (script.parent / "launch.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# ------------------------------------------------------------------------------------------------------------------
# Preprocessing as a job array
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PreprocessSettings:
    """The KEY=VALUE settings of `preprocess`; the arguments from the first --option on are data.preprocess's."""

    partitions: int = 0  # N: tasks of the array, one per --partition I/N
    cpus_per_task: int = 8  # one task's CPUs; data.preprocess gets --workers cpus_per_task - 1 unless given
    max_running: int | None = None  # tasks running at once (SLURM's --array=1-N%K)
    mem: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    constraint: str | None = None
    job_name: str = "preprocess"
    run_dir: str | None = None  # default: runs/preprocess/<name of --out>/<timestamp>
    python: str | None = None  # default: <repo>/.venv/bin/python


class _RefusingParser(argparse.ArgumentParser):
    """data.preprocess's parser, raising ValueError where it would exit."""

    def error(self, message):
        raise ValueError(f"data.preprocess arguments: {message}")


_PATH_OPTIONS = ("--input", "--tokenizer", "--out")


def _absolute_path_arguments(arguments: Sequence[str]) -> list[str]:
    """data.preprocess arguments with the paths (and globs) of --input, --tokenizer and --out made absolute: the
    tasks run in the code snapshot."""
    out, option = [], None
    for argument in arguments:
        if argument.startswith("--"):
            name, sep, value = argument.partition("=")
            option = name if name in _PATH_OPTIONS else None
            if sep and option:
                argument = f"{name}={os.path.abspath(os.path.expanduser(value))}"
                option = None
            out.append(argument)
        elif option:
            out.append(os.path.abspath(os.path.expanduser(argument)))
            if option != "--input":  # only --input takes several
                option = None
        else:
            out.append(argument)
    return out


def split_preprocess_arguments(arguments: Sequence[str]) -> tuple[PreprocessSettings, list[str], str]:
    """The settings (KEY=VALUE, before the first --option), data.preprocess's arguments (paths made absolute) and its
    --out prefix, checked as the tasks will run them: inputs that exist, a tokenizer, no more partitions than work
    units."""
    from data.preprocess import build_parser, partition_plan

    first = next((i for i, a in enumerate(arguments) if a.startswith("--")), len(arguments))
    settings, _ = _settings_from(PreprocessSettings, arguments[:first], others_allowed=False)
    command = list(arguments[first:])
    if settings.partitions < 1:
        raise ValueError(f"partitions={settings.partitions}: give partitions=N, the number of array tasks (1 or more)")
    if settings.cpus_per_task < 1:
        raise ValueError(f"cpus_per_task={settings.cpus_per_task} must be at least 1")
    if settings.max_running is not None and settings.max_running < 1:
        raise ValueError(f"max_running={settings.max_running} must be at least 1")
    _check_time(settings.time)
    parsed = build_parser(_RefusingParser).parse_args(command)
    if parsed.partition:
        raise ValueError(f"--partition {parsed.partition}: each array task takes its own; give partitions=N only")
    if not os.path.exists(parsed.tokenizer):
        raise ValueError(f"--tokenizer {parsed.tokenizer} does not exist")
    if parsed.unit_mb < 1:
        raise ValueError(f"--unit-mb {parsed.unit_mb} must be at least 1")
    try:
        partition_plan(parsed.input, settings.partitions, parsed.unit_mb, parsed.preset)
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"partitions={settings.partitions}: {error}") from None
    command = _absolute_path_arguments(command)
    if parsed.workers == 1 and not any(a == "--workers" or a.startswith("--workers=") for a in command):
        command += ["--workers", str(max(1, settings.cpus_per_task - 1))]  # the reader and writer need one
    return settings, command, os.path.abspath(os.path.expanduser(parsed.out))


def render_preprocess_sbatch(settings: PreprocessSettings, command: Sequence[str], run_dir: Path, python: str,
                             command_line: str, git: dict) -> str:
    """The array job: task I runs data.preprocess --partition I/N from the code snapshot."""
    n = settings.partitions
    directives = [
        f"--job-name={settings.job_name}",
        f"--array=1-{n}" + (f"%{settings.max_running}" if settings.max_running else ""),
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={settings.cpus_per_task}",
        f"--time={settings.time}",
        f"--output={run_dir}/slurm-%A_%a.out",
        "--open-mode=append",
        "--requeue",  # a preempted task runs again and resumes from what it committed
    ]
    for key in ("partition", "account", "qos", "mem", "constraint"):
        value = getattr(settings, key)
        if value:
            directives.append(f"--{key}={value}")
    code_dir = run_dir / "code"
    lines = [
        "#!/bin/bash",
        f"# {command_line}",
        f"# Commit {git.get('commit') or 'unknown'}{' with uncommitted changes' if git.get('dirty') else ''}; "
        f"code snapshot in {code_dir}.",
        f"# Resubmit (each task resumes): sbatch {run_dir}/preprocess.sbatch; some tasks only: sbatch --array=3,5 ...",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(str(code_dir))}",
        f"export PYTHONPATH={shlex.quote(str(code_dir))}${{PYTHONPATH:+:$PYTHONPATH}}",
        'echo "task ${SLURM_ARRAY_TASK_ID} of job ${SLURM_ARRAY_JOB_ID} on $(hostname) at $(date -u +%FT%TZ)"',
        f"{shlex.quote(python)} -m data.preprocess \\",
        *(f"  {shlex.quote(a)} \\" for a in command),
        f'  --partition "${{SLURM_ARRAY_TASK_ID}}/{n}"',
        "",
    ]
    return "\n".join(lines)


def submit_preprocess(arguments: Sequence[str], dry_run: bool = False) -> dict:
    """Snapshot the code, write preprocess.sbatch (a job array) into the run directory and submit it."""
    settings, command, out = split_preprocess_arguments(arguments)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    default = REPO_ROOT / "runs" / "preprocess" / Path(out).name / stamp
    run_dir = Path(settings.run_dir or default).expanduser().absolute()
    if (run_dir / "preprocess.sbatch").exists():
        raise FileExistsError(f"{run_dir} already holds a submission; resubmit it with "
                              f"`sbatch {run_dir}/preprocess.sbatch` or give another run_dir")
    python = settings.python or str(REPO_ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists() and not dry_run:
        raise FileNotFoundError(f"python={python} does not exist; create the .venv or pass python=/path/to/python")
    command_line = "python -m launch.slurm preprocess " + " ".join(shlex.quote(a) for a in arguments)
    git = git_state(REPO_ROOT)
    run_dir.mkdir(parents=True, exist_ok=True)
    copied = snapshot_code(REPO_ROOT, run_dir / "code")
    script = render_preprocess_sbatch(settings, command, run_dir, python, command_line, git)
    (run_dir / "preprocess.sbatch").write_text(script)
    n = settings.partitions
    record = {
        "command": command_line,
        "settings": dataclasses.asdict(settings),
        "preprocess": command,
        "shards": [f"{out}-{i}-of-{n}" for i in range(1, n + 1)],
        "blend_entry": f"{out}-*-of-{n}",
        "run_dir": str(run_dir),
        "git": git,
        "files_in_snapshot": copied,
    }
    return _sbatch_and_record(run_dir / "preprocess.sbatch", record, dry_run)


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
    preprocess_parser = commands.add_parser(
        "preprocess", help="data.preprocess as a SLURM job array, one --partition I/N per task",
        description=f"Settings (KEY=VALUE, first): {', '.join(f.name for f in dataclasses.fields(PreprocessSettings))}."
                    " Then data.preprocess's arguments (--input ... --tokenizer DIR --out PREFIX ...).",
    )
    preprocess_parser.add_argument("--dry-run", action="store_true", help="write the run directory without submitting")
    preprocess_parser.add_argument("arguments", nargs=argparse.REMAINDER, metavar="KEY=VALUE ... --input ...")
    for name, text in (("status", "state of a job and its latest metrics"), ("cancel", "scancel a job")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("target", help="run directory (with launch.json) or job id")
    args = parser.parse_args(argv)
    try:
        if args.command == "submit":
            record = submit(args.arguments, dry_run=args.dry_run)
            if describe_memory_plan(record["memory_plan"]):
                print(describe_memory_plan(record["memory_plan"]))
            where = record["run_dir"]
            if record["job_ids"]:
                print(f"submitted job {record['job_ids'][-1]}; run directory {where}")
            else:
                print(f"wrote {where}/submit.sbatch (not submitted: --dry-run)")
        elif args.command == "preprocess":
            record = submit_preprocess(args.arguments, dry_run=args.dry_run)
            where = record["run_dir"]
            if record["job_ids"]:
                print(f"submitted job array {record['job_ids'][-1]} ({record['settings']['partitions']} tasks); "
                      f"run directory {where}; then train with data.blend=[{record['blend_entry']}]")
            else:
                print(f"wrote {where}/preprocess.sbatch (not submitted: --dry-run)")
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
