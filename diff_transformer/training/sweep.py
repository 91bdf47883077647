"""Sweeps (``python train.py -m +sweep=...``): the sweep directory's owner check, its id, its cost, and finished runs.

A sweep directory (``hydra.sweep.dir``) holds ``multirun.yaml`` (Hydra's), ``sweep.json`` (the sweep's id, written
once) and one run directory per run. Rerunning the same command on the same directory continues the sweep: each run
resumes from its own checkpoints (``checkpoint.resume=auto``), and a finished run is skipped. A directory that holds
anything else (another program's ``multirun.yaml``, another sweep's, files no run wrote) is refused before anything is
written. Standard library, Hydra and OmegaConf only: train.py decides before it imports torch.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
from typing import Any, Dict, List, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from diff_transformer.config import cooldown_steps
from diff_transformer.fileio import atomic_write_json, name_some
from diff_transformer.training.metrics import METRICS_FILE, last_logged_step

SWEEP_RECORD = "sweep.json"
HYDRA_RECORD = "multirun.yaml"
# what a run writes in its own directory (any one marks a run directory), and what launchers write beside the runs
RUN_FILES = {"run.json", "config.yaml", METRICS_FILE, "train.log", ".run.lock", ".hydra", "checkpoints", "wandb"}
LAUNCHER_FILES = {".submitit"}


class SweepDirectoryRefused(ValueError):
    """A sweep directory that holds someone else's files."""


class SweepRefusal(BaseException):
    """Carries SweepDirectoryRefused out of the callback: Hydra turns a callback's Exception into a warning and goes
    on, so the refusal is no Exception (train.py prints it as an error line)."""


def _foreign_entries(sweep_dir: str) -> List[str]:
    """Entries of ``sweep_dir`` that no run of a sweep wrote."""
    foreign = []
    for name in sorted(os.listdir(sweep_dir)):
        path = os.path.join(sweep_dir, name)
        if name in (SWEEP_RECORD, HYDRA_RECORD) or name in LAUNCHER_FILES:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            inside = set(os.listdir(path))
            if not inside or inside & RUN_FILES:
                continue
        foreign.append(name)
    return foreign


def check_sweep_directory(sweep_dir: str, name: str, job_name: str) -> Optional[Dict[str, str]]:
    """Refuse (SweepDirectoryRefused) a sweep directory holding another program's or sweep's files; returns its
    ``sweep.json`` when it holds this sweep already (a rerun), else None."""
    if not os.path.isdir(sweep_dir):
        if os.path.exists(sweep_dir):
            raise SweepDirectoryRefused(f"hydra.sweep.dir={sweep_dir} is a file, not a directory: choose another")
        return None
    advice = "choose another directory (hydra.sweep.dir=NEW)"
    record = None
    record_path = os.path.join(sweep_dir, SWEEP_RECORD)
    if os.path.exists(record_path):
        try:
            with open(record_path) as f:
                record = json.load(f)
            recorded_name, recorded_id = record["name"], record["id"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SweepDirectoryRefused(f"sweep directory {sweep_dir}: {SWEEP_RECORD} is unreadable ({err}), so "
                                        f"whose sweep it holds is unknown: {advice}") from None
        if recorded_name != name:
            raise SweepDirectoryRefused(f"sweep directory {sweep_dir} holds the sweep {recorded_id} (name="
                                        f"{recorded_name}), not one named {name}: {advice}, or rerun that sweep")
    hydra_record = os.path.join(sweep_dir, HYDRA_RECORD)
    if os.path.exists(hydra_record):
        try:
            recorded = OmegaConf.load(hydra_record)
            recorded_job = OmegaConf.select(recorded, "hydra.job.name")
            recorded_name = OmegaConf.select(recorded, "name", throw_on_resolution_failure=False)
        except Exception as err:  # noqa: BLE001 - any unreadable YAML is someone else's
            raise SweepDirectoryRefused(
                f"sweep directory {sweep_dir}: its {HYDRA_RECORD} is unreadable ({type(err).__name__}), so whose sweep "
                f"it holds is unknown: {advice}") from None
        if recorded_job != job_name or recorded_name != name:
            raise SweepDirectoryRefused(
                f"sweep directory {sweep_dir} holds another sweep ({HYDRA_RECORD} of program {recorded_job}, name="
                f"{recorded_name}; this is {job_name}, name={name}): {advice}")
        if record is None:
            # a sweep of this program started before sweeps recorded an id: it keeps the directory's name as its id
            record = {"id": f"{name}-{os.path.basename(os.path.abspath(sweep_dir))}", "name": name}
    foreign = _foreign_entries(sweep_dir)
    if foreign:
        shown = name_some(foreign, 5)
        raise SweepDirectoryRefused(f"sweep directory {sweep_dir} holds files no run of a sweep wrote ({shown}): "
                                    f"{advice}")
    return record


def new_sweep_id(name: str) -> str:
    """The name, the start time and a few random characters: unique across invocations."""
    return f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def sweep_of_run(sweep_dir: str, name: str) -> Dict[str, str]:
    """run.json's ``sweep`` for a run of the sweep in ``sweep_dir``: its recorded id (else the directory's name)."""
    sweep_dir = os.path.abspath(sweep_dir)
    try:
        with open(os.path.join(sweep_dir, SWEEP_RECORD)) as f:
            sweep_id = json.load(f)["id"]
    except (OSError, ValueError, KeyError, TypeError):  # launched without the callback: the directory names it
        sweep_id = f"{name}-{os.path.basename(sweep_dir)}"
    return {"id": sweep_id, "dir": sweep_dir}


# ------------------------------------------------------------------------------------------------------------------
# Runs of a sweep: a finished one is skipped, another run's directory refused
# ------------------------------------------------------------------------------------------------------------------
def finished_run(cfg: Any, run_dir: str) -> Optional[str]:
    """The line to print when ``run_dir`` holds this very run finished (metrics.jsonl at trainer.max_steps), else
    None. ValueError when it holds another run (the sweep's subdirectories do not tell its runs apart)."""
    info_path = os.path.join(run_dir, "run.json")
    if not os.path.isfile(info_path):
        return None
    try:
        with open(info_path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    ours = {"model": cfg.model.name, "attention": cfg.model.attention, "seed": cfg.seed, "lr": cfg.optim.lr,
            "max_steps": cfg.trainer.max_steps}
    differ = [f"{key} {info[key]} (this run: {value})" for key, value in ours.items()
              if key in info and info[key] != value and key != "max_steps"]
    if differ:
        raise ValueError(
            f"run directory {run_dir} holds another run ({', '.join(differ)}): the sweep's hydra.sweep.subdir must "
            "tell its runs apart, e.g. hydra.sweep.subdir='${model.name}-${model.attention}-lr${optim.lr}-seed${seed}'"
        )
    last = last_logged_step(os.path.join(run_dir, METRICS_FILE))
    if last is None or last < cfg.trainer.max_steps:
        return None
    return f"skip: {run_dir} finished (metrics.jsonl at step {last}, trainer.max_steps={cfg.trainer.max_steps})"


# ------------------------------------------------------------------------------------------------------------------
# The Hydra callback: check the directory, record the id, print the plan and its cost, before any run starts
# ------------------------------------------------------------------------------------------------------------------
def _job_overrides(config: DictConfig) -> List[List[str]]:
    """Every job's overrides, as Hydra's basic sweeper will launch them (the first parameter varies slowest)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{key}={value}" for key, value in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    params += list(config.hydra.overrides.task)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(params), None) for job in batch]


def _run_tokens(job: DictConfig) -> Dict[str, Any]:
    """(tokens the run trains on, whether it is a cooldown branch) of one composed job."""
    t, c = job.trainer, OmegaConf.to_container(job.checkpoint, resolve=False)
    tokens_per_step = t.global_batch_size * job.model.seq_length
    if c.get("branch_from") is None:
        return {"tokens": t.max_steps * tokens_per_step, "branch": False}
    start = c["branch_step"] if c.get("branch_step") is not None else t.max_steps - cooldown_steps(job.optim,
                                                                                                  t.max_steps)
    return {"tokens": (t.max_steps - start) * tokens_per_step, "branch": True}


def plan_line(config: DictConfig, sweep_id: str) -> str:
    """The sweep's runs and tokens (with cooldown branches: the tokens against the plain sweep's, the same runs without
    branches), composed from the config as Hydra will compose each job."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    runs = [_run_tokens(loader.load_sweep_config(config, job)) for job in _job_overrides(config)]
    plain = sum(r["tokens"] for r in runs if not r["branch"])
    branches = [r for r in runs if r["branch"]]
    line = f"sweep {sweep_id}: {len(runs)} runs, {sum(r['tokens'] for r in runs) / 1e6:.3g}M tokens"
    if branches:
        extra = sum(r["tokens"] for r in branches)
        line += (f" ({len(runs) - len(branches)} runs {plain / 1e6:.3g}M + {len(branches)} cooldown branches "
                 f"{extra / 1e6:.3g}M: {(plain + extra) / plain:.2f}x the plain sweep's tokens)")
    return line


class SweepCallback(Callback):
    """Hydra callback (configs/config.yaml's hydra.callbacks): before a multirun launches anything, refuse a sweep
    directory holding someone else's files, record the sweep's id, and print the plan and its cost."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = os.path.abspath(str(config.hydra.sweep.dir))
        try:
            record = check_sweep_directory(sweep_dir, config.name, config.hydra.job.name)
        except SweepDirectoryRefused as err:
            raise SweepRefusal(err) from None
        sweep_id = record["id"] if record else new_sweep_id(config.name)
        try:
            plan = plan_line(config, sweep_id)
        except Exception as err:  # noqa: BLE001 - a job that cannot compose is refused by the sweeper itself, next
            plan = f"sweep {sweep_id}: cost unknown ({type(err).__name__}: {str(err).splitlines()[0]})"
        print(plan + (f"; continuing {sweep_dir}" if record else f" in {sweep_dir}"), flush=True)
        if record is None or not os.path.exists(os.path.join(sweep_dir, SWEEP_RECORD)):
            os.makedirs(sweep_dir, exist_ok=True)
            atomic_write_json(os.path.join(sweep_dir, SWEEP_RECORD), {
                "id": sweep_id, "name": config.name, "created": datetime.datetime.now().isoformat(timespec="seconds"),
            })
