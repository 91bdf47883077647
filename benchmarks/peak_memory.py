"""Measured peak memory per rank of a short training run, next to the framework's estimate: the worker each memory
benchmark runs in its ranks (`benchmarks/memory_plan.py`, `benchmarks/zero_memory.py`), and its launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from diff_transformer.distributed import free_port  # noqa: E402
from tests.train_runs import train_env  # noqa: E402


def rank_worker(out_dir: str, overrides) -> None:
    """One rank: set up and train under PeakMemory; write this rank's measurement and estimate as rank<r>.json."""
    from hydra import compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object
    from diff_transformer.distributed import destroy_distributed
    from diff_transformer.training.accounting import GIB, PeakMemory, estimate_memory_per_gpu
    from diff_transformer.training.engines import create_trainer

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = to_object(compose("config", overrides=list(overrides)))
    trainer = create_trainer(cfg, os.path.join(out_dir, "run"))
    try:
        with PeakMemory(cpu_method="heap") as peak:  # every thread: collectives free tensors on gloo's
            trainer.setup()
            trainer.fit()
        world = torch.distributed.get_world_size()
        estimate = estimate_memory_per_gpu(cfg, trainer.dtype, world, trainer.padded_vocab)
        rank = torch.distributed.get_rank()
        parameters = trainer.num_parameters
    finally:
        destroy_distributed()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak": peak.bytes / GIB, "end": peak.end_bytes / GIB, "estimate": estimate,
                   "parameters": parameters}, f)


def measure(script: str, nproc: int, overrides, work: Path) -> dict:
    """Run ``script --worker work -- overrides`` in ``nproc`` processes (``script`` calls `rank_worker`); the
    measurement of the rank with the highest peak, and the highest memory still held at the end."""
    ranks = launch_ranks(script, nproc, overrides, work)
    worst = max(ranks, key=lambda r: r["peak"])
    return {"peak": worst["peak"], "end": max(r["end"] for r in ranks), "estimate": worst["estimate"],
            "parameters": worst["parameters"]}


def launch_ranks(script: str, nproc: int, overrides, work: Path, worker_args=()) -> list:
    """Run ``script --worker work [worker_args] -- overrides`` in ``nproc`` processes; each rank's rank<r>.json."""
    work.mkdir(parents=True)
    args = [str(script), "--worker", str(work), *worker_args, "--", *overrides]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
