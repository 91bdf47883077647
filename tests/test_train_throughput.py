"""benchmarks/train_throughput.py's choices before any run: the least recomputation whose memory plan fits the card
(``--fit-gib``, ``auto``: the GPU's memory or the dry run's simulated one), DIFF V2's mirrored baseline as a kind, and
report names that keep a GPU window's reports apart."""

import argparse

import pytest
import torch

from benchmarks import train_throughput
from diff_transformer.training.accounting import estimate_memory_per_gpu
from kernels import gpu_target

H100_GIB = gpu_target.SIMULATED_GPUS["sm_90"].memory / 2**30  # 81,559 MiB: 79.6 GiB
H200_GIB = 143771 / 1024  # nvidia-smi on a lent H200: 140.4 GiB


def step_args(**changes):
    """gpu_run.sh's throughput_3b step: 3b at sequence 4096, 8 micro-batches of 1, compiled."""
    args = dict(model="3b", steps=5, micro_batches=8, micro_batch_size=1, seq_length=4096, tp=[1],
                kinds=["diff", "vanilla"], compile=["on"], fit_gib=None, overrides=["optim=adamw_3b"])
    return argparse.Namespace(**{**args, **changes})


def plan_gib(overrides):
    cfg = train_throughput.compose(overrides)
    return estimate_memory_per_gpu(cfg, torch.bfloat16, 1, 100352, "cuda")["total"]


BLOCK = ["trainer.recompute=full", "trainer.recompute_method=block"]


@pytest.mark.parametrize("kind", ["diff", "vanilla"])
def test_the_least_recomputation_that_fits_is_the_cards(kind):
    """On an H100 the fewest layers of block recomputation whose plan fits 90% of it (the plan without recomputation
    does not: the old hard-coded 75 GiB forced full recomputation); on an H200 none."""
    overrides = train_throughput.run_overrides(step_args(), 1, kind, "on", 4)
    fitted, label, gib = train_throughput.fitting_recompute(overrides, 1, H100_GIB)
    usable = 0.9 * H100_GIB
    n = int(fitted[-1].split("=")[1])
    assert fitted == [*BLOCK, f"trainer.recompute_layers={n}"] and label == f"block {n}/28" and 0 < n < 28
    assert gib == pytest.approx(plan_gib(overrides + fitted)) and gib <= usable
    assert plan_gib(overrides + [*BLOCK, f"trainer.recompute_layers={n - 1}"]) > usable  # one layer fewer does not fit
    assert plan_gib(overrides + ["trainer.recompute=selective"]) > usable
    assert plan_gib(overrides) > usable

    fitted, label, gib = train_throughput.fitting_recompute(overrides, 1, H200_GIB)
    assert label == "none" and fitted[0] == "trainer.recompute=none" and gib == pytest.approx(plan_gib(overrides))


def test_a_card_too_small_is_refused_naming_its_size_before_any_run(tmp_path, monkeypatch, capsys):
    overrides = train_throughput.run_overrides(step_args(), 1, "diff", "on", 4)
    with pytest.raises(ValueError) as refused:
        train_throughput.fitting_recompute(overrides, 1, 40.0)
    full = plan_gib(overrides + ["trainer.recompute=full"])  # the least any recomputation keeps: 60.5 GiB
    assert str(refused.value).startswith(f"no recomputation fits 40 GiB: estimated memory per GPU {full:.1f} GiB")
    assert "exceeds the 36.0 GiB usable of 40 GiB" in str(refused.value)
    assert "launch more GPUs (for more tensor or pipeline parallelism) or train a smaller model" in str(refused.value)

    out = tmp_path / "reports"
    monkeypatch.setattr("sys.argv", ["train_throughput.py", "--model", "3b", "--seq-length", "4096",
                                     "--micro-batch-size", "1", "--fit-gib", "40", "--out", str(out), "optim=adamw_3b"])
    assert train_throughput.main() == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert errors == [f"error: train_throughput.py: {refused.value}"]
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto takes a real GPU's memory there")
def test_auto_takes_the_simulated_cards_memory(monkeypatch):
    """gpu_run.sh --dry-run simulates an H100 (DIFF_ATTN_SIMULATE_GPU=sm_90): --fit-gib auto plans for its 79.6 GiB;
    without a GPU or a simulated one, auto is refused; trainer.gpu_memory_gib, train.py's budget, wins."""
    args = step_args(fit_gib="auto")
    overrides = train_throughput.run_overrides(args, 1, "diff", "on", 4)
    for arch, gib in (("sm_90", H100_GIB), ("sm_80", 80.0)):
        with gpu_target.simulate(arch) as gpu:
            assert train_throughput.fit_budget_gib(args, overrides) == (gib, f"{gpu.name}, simulated "
                                                                             "(DIFF_ATTN_SIMULATE_GPU)")
    monkeypatch.setattr(gpu_target, "_simulated", None)
    with pytest.raises(ValueError, match="--fit-gib auto takes the GPU's memory, and there is no GPU here"):
        train_throughput.fit_budget_gib(args, overrides)
    assert train_throughput.fit_budget_gib(args, overrides + ["trainer.gpu_memory_gib=141"]) == (
        141.0, "trainer.gpu_memory_gib")


def test_v2_baseline_has_v2s_query_and_kv_heads():
    """At 830m DIFF V2 has 2H = 16 query heads over Hkv = 8 KV heads; its baseline the Transformer with the same."""
    from diff_transformer.models.layer_specs import attention_heads

    args = step_args(model="830m", overrides=[])
    assert train_throughput.attention_overrides(args, "v2_baseline") == ["model.attention=vanilla",
                                                                         "model.num_kv_heads=4"]
    v2 = train_throughput.compose(["model=830m", "model.attention=diff_v2"]).model
    baseline = train_throughput.compose(["model=830m", *train_throughput.attention_overrides(args, "v2_baseline")])
    assert attention_heads(v2)[:2] == attention_heads(baseline.model)[:2] == (16, 8)


def test_a_windows_throughput_reports_have_names_of_their_own():
    """gpu_run.sh's 830m steps write into one $OUT: micro-batches of 4 (the committed tables' name), V2 and its
    baseline, micro-batches of 8, flash-attn-4."""
    names = [train_throughput.report_name(step_args(model="830m", micro_batch_size=size, kinds=kinds))
             for size, kinds in ((4, ["diff", "vanilla"]), (4, ["diff_v2", "v2_baseline"]), (8, ["diff", "vanilla"]),
                                 (4, ["diff:flash_attn4", "vanilla:sdpa", "vanilla:flash_attn4"]))]
    assert names == ["train_throughput_830m_compile-on", "train_throughput_830m_diff_v2-v2_baseline_compile-on",
                     "train_throughput_830m_mb8_compile-on", "train_throughput_830m_flash_attn4_sdpa_compile-on"]
