"""Run train.py as users do (plain python or torchrun) and read back what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# One node: torchrun binds its rendezvous store to a port it picks itself, which the workers share (a port picked here
# and bound later could be taken meanwhile by another test's connections).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def train_command(run_dir, overrides, nproc: int = 1):
    if nproc == 1:
        launcher = [sys.executable, str(REPO / "train.py")]
    else:
        launcher = [*TORCHRUN, f"--nproc_per_node={nproc}", str(REPO / "train.py")]
    return launcher + list(overrides) + [f"hydra.run.dir={run_dir}"]


# What torchrun (or a world of one started in-process) sets; a child process must start its own world.
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train_env():
    """The environment of a test's train.py: the CPU tier (gloo, fp32), also on a GPU machine, where several
    processes could not share one GPU under NCCL and bit-exact comparisons assume the CPU's deterministic kernels."""
    env = dict(os.environ, WANDB_MODE="offline", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for key in DISTRIBUTED_ENV:  # a world the test process itself joined is not the child's
        env.pop(key, None)
    return env


def run_train(run_dir, overrides, nproc: int = 1, expect_rc: int = 0, timeout: int = 300, env=None):
    """Train with Hydra overrides into ``run_dir`` (``env``: variables to add); fails the test unless train.py exits
    with ``expect_rc``."""
    proc = subprocess.run(
        train_command(run_dir, overrides, nproc), cwd=REPO, env={**train_env(), **(env or {})}, capture_output=True,
        text=True, timeout=timeout,
    )
    if proc.returncode != expect_rc:
        raise AssertionError(
            f"train.py exited {proc.returncode}, expected {expect_rc}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def read_metrics(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def short_document_shards(root) -> list:
    """train.py overrides for a shard of the bundled corpus cut into short documents (data/short_documents.py, mean
    200 characters: about 60 tokens, several documents in each sample of the debug model), tokenized with the bundled
    corpus's tokenizer, under ``root``."""
    from data.config import DataConfig
    from data.datasets import prepare
    from data.preprocess import preprocess
    from data.short_documents import write_short_documents

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = prepare(DataConfig()).tokenizer_dir
    write_short_documents(str(root / "short.jsonl"), mean_chars=200, max_chars=400_000)
    preprocess([str(root / "short.jsonl")], tokenizer_dir, str(root / "short"))
    return ["data.source=shards", f"data.tokenizer_dir={tokenizer_dir}", f"data.blend=[{root / 'short'}]"]
