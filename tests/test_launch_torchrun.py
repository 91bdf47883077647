"""launch/torchrun.sh across two "nodes" on loopback: two torchrun processes joined by a c10d rendezvous train the
smoke experiment data-parallel, with the losses of one process that takes the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diff_transformer.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_SH = REPO_ROOT / "launch" / "torchrun.sh"
SMOKE = ["experiment=smoke", "trainer.max_steps=2", "optim.warmup_steps=1", "trainer.eval_interval=0",
         "logging.wandb.mode=disabled", f"data.cache_dir={REPO_ROOT / 'data' / 'cache'}"]  # run from tmp_path

pytestmark = pytest.mark.multiproc


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((run_dir / "run.json").read_text()), rows


def launch_env(**extra: str) -> dict:
    # the CPU tier also on a GPU machine: two "nodes" on one host cannot share its GPU under NCCL
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}
    for inherited in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "RDZV_ID",
                      "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "RANK", "WORLD_SIZE"):
        if inherited not in extra:
            env.pop(inherited, None)
    return env


def test_two_nodes_on_loopback_match_one_process(tmp_path):
    two_nodes = tmp_path / "two_nodes"
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            ["bash", str(TORCHRUN_SH), *SMOKE, f"hydra.run.dir={two_nodes}"],
            env=launch_env(NNODES="2", NODE_RANK=str(rank), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, RDZV_ID="two-node-test"),
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=240)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank} exited {node.returncode}:\n{output[-3000:]}"
        assert f"torchrun.sh: node {rank}/2, 1 processes, rendezvous 127.0.0.1:{port}" in output

    description, rows = read_run(two_nodes)
    assert description["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 2}

    one_process = tmp_path / "one_process"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), *SMOKE, f"hydra.run.dir={one_process}"],
                            env=launch_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    reference_description, reference_rows = read_run(one_process)
    assert reference_description["layout"]["dp"] == 1
    assert description["tokens_per_step"] == reference_description["tokens_per_step"]
    # Data parallelism over two nodes splits the same global batch: the same losses up to summation order.
    assert [r["step"] for r in rows] == [r["step"] for r in reference_rows] == [1, 2]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference_rows], rel=1e-5)
