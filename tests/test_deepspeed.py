"""engine=deepspeed against engine=megatron, end to end through train.py (torchrun over gloo, 2 processes).

One module fixture trains each configuration once; the tests read what the runs wrote. Every DP=2 run of 6 steps
skips step 3 (an injected NaN loss: the bad-step guard must drop the update under every ZeRO stage as megatron-core
does), and the ZeRO-2 and ZeRO-3 runs save at step 3 for the resume tests.
"""

import math
from pathlib import Path

import pytest

from diff_transformer.training.checkpoint import checkpoint_name, read_trainer_state
from tests.train_runs import read_metrics, run_train

STEPS = 6
COMMON = [
    "experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=0", "optim.warmup_steps=2",
    "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "failures.inject_nan_at_steps=[3]",
    "checkpoint.interval=0", "checkpoint.save_at_end=false",
]
SAVE_AT_3 = ["checkpoint.interval=3"]
DS = ["engine=deepspeed"]


def by_step(records):
    return {r["step"]: r for r in records}


def ckpt(run_dir, step):
    return str(Path(run_dir) / "checkpoints" / checkpoint_name(step))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> run directory; each configuration trained once."""
    root = tmp_path_factory.mktemp("deepspeed")
    plan = {
        "megatron-diff": COMMON,
        "megatron-vanilla": COMMON + ["model.attention=vanilla"],
        "zero0-diff": COMMON + DS + ["engine.zero_stage=0"],
        "zero1-diff": COMMON + DS + ["engine.zero_stage=1"],
        "zero2-diff": COMMON + DS + ["engine.zero_stage=2"] + SAVE_AT_3,
        "zero3-diff": COMMON + DS + ["engine.zero_stage=3"] + SAVE_AT_3,
        "zero3-vanilla": COMMON + DS + ["engine.zero_stage=3", "model.attention=vanilla"],
        "megatron-tp2": COMMON + ["parallel.tp=2"],
        "zero1-tp2": COMMON + DS + ["engine.zero_stage=1", "parallel.tp=2"],
    }
    for name, overrides in plan.items():
        run_train(root / name, overrides, nproc=2)
    for stage in (2, 3):
        source = root / f"zero{stage}-diff"
        run_train(
            root / f"zero{stage}-resumed", COMMON + DS + [f"engine.zero_stage={stage}", "checkpoint.resume=" + ckpt(source, 3)],
            nproc=2,
        )
    return root


def assert_same_steps(got, want, steps=range(1, STEPS + 1)):
    """Losses and gradient norms equal within 1e-5 (fp32, same seed and data); the skipped step skipped in both."""
    got, want = by_step(got), by_step(want)
    for step in steps:
        g, w = got[step], want[step]
        assert g["skipped"] == w["skipped"], step
        if w["skipped"]:
            assert math.isnan(g["loss"]) and g["grad_norm"] is None and w["grad_norm"] is None
            continue
        assert abs(g["loss"] - w["loss"]) < 1e-5, (step, g["loss"], w["loss"])
        assert abs(g["grad_norm"] - w["grad_norm"]) < 1e-5, (step, g["grad_norm"], w["grad_norm"])
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12)
        if "lambda" in w:
            assert g["lambda"] == pytest.approx(w["lambda"], abs=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["zero0-diff", "zero1-diff", "zero2-diff", "zero3-diff", "zero3-vanilla"])
def test_zero_stage_equals_megatron_at_dp2(runs, run):
    reference = "megatron-vanilla" if run.endswith("vanilla") else "megatron-diff"
    got, want = read_metrics(runs / run), read_metrics(runs / reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_same_steps(got, want)
    assert by_step(got)[3]["skipped"] and by_step(got)[6]["skipped_steps"] == 1
    # the weights moved after the skipped step: the update of step 4 was applied
    assert by_step(got)[5]["loss"] != by_step(got)[4]["loss"]
    stage = int(run[4])
    config = (runs / run / "deepspeed_config.json").read_text()
    assert f'"stage": {stage}' in config and '"train_batch_size": 8' in config and '"gradient_clipping": 1.0' in config
    log = (runs / run / "train.log").read_text()
    assert f"DeepSpeed ZeRO-{stage}" in log and "estimated memory per GPU" in log


@pytest.mark.multiproc
def test_tp2_under_zero1_equals_megatron_tp2(runs):
    """DIFF's λ and sub-layer norm are replicated on the TP ranks: their gradients are summed over TP once, and
    counted once in the gradient norm."""
    assert_same_steps(read_metrics(runs / "zero1-tp2"), read_metrics(runs / "megatron-tp2"))


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_bit_exact(runs, stage):
    full = by_step(read_metrics(runs / f"zero{stage}-diff"))
    resumed = by_step(read_metrics(runs / f"zero{stage}-resumed"))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", "grad_norm", "lr", "lambda", "tokens", "skipped_steps"):
            assert resumed[step][key] == full[step][key], (step, key)
    saved = read_trainer_state(ckpt(runs / f"zero{stage}-diff", 3))
    assert saved["layout"]["engine"] == "deepspeed" and saved["layout"]["zero_stage"] == stage
    assert saved["step"] == 3 and saved["skipped_steps"] == 1 and saved["consumed_samples"] == 24
