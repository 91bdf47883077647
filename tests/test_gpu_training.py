"""The GPU tier of training: train.py on one CUDA device (NCCL world of one, bf16), with a checkpoint saved, an
automatic resume and the fused kernel. The CPU tier's exactness tests (tests/test_resume.py) hide the GPU."""

import os
import subprocess

import pytest

from tests.train_runs import DISTRIBUTED_ENV, REPO, read_metrics, train_command

pytestmark = pytest.mark.gpu


def run_on_gpu(run_dir, overrides):
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    proc = subprocess.run(train_command(run_dir, overrides), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"train.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_bf16_training_saves_and_resumes_on_a_gpu(tmp_path, backend):
    overrides = ["experiment=smoke", f"model.attention_backend={backend}", "trainer.eval_interval=5",
                 "checkpoint.interval=5"]
    first = run_on_gpu(tmp_path, [*overrides, "trainer.max_steps=10"])
    assert "dtype bfloat16" in first
    assert (tmp_path / "checkpoints" / "step_00000010").is_dir()
    second = run_on_gpu(tmp_path, [*overrides, "trainer.max_steps=14"])
    assert "resumed from" in second
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 15))
    assert all(r["loss"] == r["loss"] and r["loss"] < 20 for r in records)  # finite: NaN != NaN
    assert records[9]["loss"] < records[0]["loss"]
