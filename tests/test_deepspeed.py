"""engine=deepspeed against engine=megatron, end to end through train.py (torchrun over gloo, 2 processes).

One module fixture trains each configuration once; the tests read what the runs wrote. Every run of 6 steps skips
step 3 (an injected NaN loss: the bad-step guard must drop the update under every ZeRO stage as megatron-core does)
and validates at steps 3 and 6; the ZeRO-2 and ZeRO-3 runs save at step 3 for the resume tests.
"""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diff_transformer.training.checkpoint import checkpoint_name, read_trainer_state
from tests.train_runs import REPO, read_metrics, run_train, train_env

STEPS = 6
COMMON = [
    "experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=3", "trainer.eval_iters=1",
    "optim.warmup_steps=2",
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
        # optimizer states, their fp32 gradient partitions and the Adam step on the host; the step is torch's
        # AdamW there (DeepSpeed's CPU Adam takes ~100 s to JIT-compile on the 2-core CI machine)
        "zero2-offload": COMMON + DS + [
            "engine.zero_stage=2", "engine.offload_optimizer=cpu", "+engine.extra.zero_force_ds_cpu_optimizer=false",
            "+engine.extra.optimizer={params: {torch_adam: true}}",
        ],
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


def assert_same_steps(got, want, norm_rel=5e-5, steps=range(1, STEPS + 1)):
    """Losses within 1e-5 (fp32, same seed and data) and the same learning rates; the skipped step skipped in both.

    Gradient norms within ``norm_rel``: megatron-core without APEX sums the squares of its norm in fp32 (its local
    multi_tensor_l2norm), DeepSpeed in fp64, and on the same gradients they were measured up to 1.7e-5 apart
    (relative) while the losses agreed to 1e-7; DeepSpeed's stages agree with each other to 1e-6."""
    got, want = by_step(got), by_step(want)
    for step in steps:
        g, w = got[step], want[step]
        assert g["skipped"] == w["skipped"], step
        assert ("val_loss" in g) == ("val_loss" in w), step
        if w["skipped"]:
            assert math.isnan(g["loss"]) and g["grad_norm"] is None and w["grad_norm"] is None
            continue
        assert abs(g["loss"] - w["loss"]) < 1e-5, (step, g["loss"], w["loss"])
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=norm_rel), step
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12)
        if "val_loss" in w:
            assert abs(g["val_loss"] - w["val_loss"]) < 1e-5, step
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
    if stage == 3:  # built partitioned: after construction no rank holds more than its half of the parameters
        held, whole = map(parse_int, re.search(r"a rank holds at most ([\d,]+) of the ([\d,]+) parameter", log).groups())
        assert whole > 300_000 and held <= whole / 2 + 64, (held, whole)


def parse_int(text):
    return int(text.replace(",", ""))


@pytest.mark.multiproc
def test_zero_stages_agree_with_each_other(runs):
    """The same gradients under every stage: the norms DeepSpeed reports (fp64 sums) agree to 1e-6 (measured), far
    below their distance to megatron-core's fp32 sums."""
    reference = read_metrics(runs / "zero1-diff")
    for run in ("zero0-diff", "zero2-diff", "zero3-diff"):
        assert_same_steps(read_metrics(runs / run), reference, norm_rel=5e-6)


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
        for key in ("loss", "grad_norm", "lr", "lambda", "tokens", "skipped_steps"):  # λ: on logging steps (5, 6)
            assert resumed[step].get(key) == full[step].get(key), (step, key)
    assert "lambda" in resumed[5] and "lambda" in resumed[6]
    assert resumed[6]["val_loss"] == full[6]["val_loss"]
    saved = read_trainer_state(ckpt(runs / f"zero{stage}-diff", 3))
    assert saved["layout"]["engine"] == "deepspeed" and saved["layout"]["zero_stage"] == stage
    assert saved["step"] == 3 and saved["skipped_steps"] == 1 and saved["consumed_samples"] == 24


@pytest.mark.multiproc
def test_cpu_optimizer_offload_at_stage2_trains_as_without(runs):
    assert_same_steps(read_metrics(runs / "zero2-offload"), read_metrics(runs / "zero2-diff"), norm_rel=1e-6)
    config = (runs / "zero2-offload" / "deepspeed_config.json").read_text()
    assert '"offload_optimizer": {' in config and '"device": "cpu"' in config
    assert '"zero_force_ds_cpu_optimizer": false' in config  # engine.extra, merged into the generated JSON
    assert "on the host" in (runs / "zero2-offload" / "train.log").read_text()


# ------------------------------------------------------------------------------------------------------------------
# NVMe offload: DeepSpeed's async I/O op swaps the parameter partitions and the optimizer state to a directory
# ------------------------------------------------------------------------------------------------------------------
# DeepSpeed swaps only tensors of 1 MiB or more (swap_tensor/utils.py, MIN_AIO_BYTES); the debug model widened to 256
# gives the embedding's partition (2 MiB) and the weight-decayed optimizer group (5 MiB) something to swap at DP=2,
# while the 1-D weights' group stays in memory: both kinds of state cross the resume.
WIDE = ["model.hidden_size=256", "model.ffn_hidden_size=704"]
NVME = DS + [
    "engine.zero_stage=3", "engine.offload_optimizer=nvme", "engine.offload_param=nvme",
    # the optimizer step on the host is torch's AdamW, as for CPU offload above (DeepSpeed's CPU Adam compiles ~100 s)
    "+engine.extra.zero_force_ds_cpu_optimizer=false", "+engine.extra.optimizer={params: {torch_adam: true}}",
    # five parameter swap buffers of 1e6 elements (DeepSpeed's default 1e8 pins 2 GB of host memory a rank)
    "+engine.extra.zero_optimization.offload_param.buffer_size=1000000",
]


# Compiling DeepSpeed's async_io op (and its pin_memory op) takes ~270 CPU-seconds, 3.4 minutes on 2 cores: the NVMe
# tests run where it is compiled already (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), or compile it
# once when this is set to 1.
BUILD_AIO_ENV = "DIFF_TRANSFORMER_BUILD_AIO"


def async_io_op_compiled() -> bool:
    import os

    from torch.utils.cpp_extension import _get_build_directory

    return all(os.path.exists(Path(_get_build_directory(op, False), f"{op}.so")) for op in ("pin_memory", "async_io"))


@pytest.fixture(scope="module")
def nvme_runs(tmp_path_factory):
    """ZeRO-3 of the widened model without offload; with both offloads on NVMe (a local directory here), saving at
    step 3; and that run resumed from step 3 with another swap directory. DeepSpeed's async_io op is loaded here
    once (compiled first with DIFF_TRANSFORMER_BUILD_AIO=1), before the ranks load it."""
    import os

    from diff_transformer.training.deepspeed_engine import import_deepspeed

    import_deepspeed()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op cannot build here: libaio is missing (apt-get install libaio-dev; "
                    ".ci/run installs it when run as root)")
    if not async_io_op_compiled() and os.environ.get(BUILD_AIO_ENV) != "1":
        pytest.skip(f"DeepSpeed's async_io op is not compiled in TORCH_EXTENSIONS_DIR (~270 CPU-seconds, 3.4 minutes "
                    f"on 2 cores): set {BUILD_AIO_ENV}=1 to compile it once and run the NVMe offload tests")
    AsyncIOBuilder().load(verbose=False)
    root = tmp_path_factory.mktemp("nvme")
    run_train(root / "zero3-wide", WIDE + COMMON + DS + ["engine.zero_stage=3"], nproc=2)
    run_train(root / "nvme", WIDE + COMMON + NVME + SAVE_AT_3 + [f"engine.nvme_path={root / 'swap'}"], nproc=2)
    run_train(
        root / "nvme-resumed",
        WIDE + COMMON + NVME + [f"engine.nvme_path={root / 'swap-resumed'}", "checkpoint.resume=" + ckpt(root / "nvme", 3)],
        nproc=2,
    )
    return root


@pytest.mark.multiproc
def test_nvme_offload_of_parameters_and_optimizer_trains_as_without(nvme_runs):
    assert_same_steps(read_metrics(nvme_runs / "nvme"), read_metrics(nvme_runs / "zero3-wide"), norm_rel=1e-6)
    config = (nvme_runs / "nvme" / "deepspeed_config.json").read_text()
    assert config.count('"device": "nvme"') == 2 and str(nvme_runs / "swap") in config
    # the swaps happened: the optimizer's states were written to the directory (and travel in the checkpoint), and
    # after construction each rank kept less than its ZeRO-3 half (the embedding's partition went to the directory)
    swapped = sorted(p.name for p in (nvme_runs / "swap" / "zero_stage_3" / "optimizer" / "rank0").iterdir())
    assert any(name.startswith("exp_avg-") for name in swapped) and any(name.startswith("exp_avg_sq-") for name in swapped)
    saved = {p.name for p in Path(ckpt(nvme_runs / "nvme", 3), "offloaded_tensors", "rank00").iterdir()}
    assert {name for name in swapped if "gradient" not in name} == saved
    log = (nvme_runs / "nvme" / "train.log").read_text()
    held, whole = map(parse_int, re.search(r"a rank holds at most ([\d,]+) of the ([\d,]+) parameter", log).groups())
    assert held < whole / 2 - 4096 * 256 / 4, (held, whole)


@pytest.mark.multiproc
def test_nvme_offload_resumes_bit_exact(nvme_runs):
    """DeepSpeed's own load leaves Adam's moments and step count, the sub-group too small to swap and the persistent
    parameters at their initial values (compat.restore_nvme_optimizer_memory_state completes it)."""
    full = by_step(read_metrics(nvme_runs / "nvme"))
    resumed = by_step(read_metrics(nvme_runs / "nvme-resumed"))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", "grad_norm", "lr", "skipped_steps"):
            assert resumed[step][key] == full[step][key], (step, key)
        assert resumed[step].get("lambda") == full[step].get("lambda"), step  # logged on logging steps only
    assert resumed[6]["val_loss"] == full[6]["val_loss"] and "lambda" in resumed[6]


# ------------------------------------------------------------------------------------------------------------------
# ZeRO-3 built partitioned: the same initial weights as without, for every kind's own parameters
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["diff", "diff_v2", "signed_mask", "vanilla_subln", "dex"])
def test_zero3_construction_partitions_every_parameter_with_todays_initial_weights(
    attention, megatron_single_process, monkeypatch
):
    """Under deepspeed.zero.Init (a world of one here: partitions of the whole; DP=2 partitions are checked on the
    ZeRO-3 run's log above) every parameter is a ZeRO-3 partition once the model is built, its gathered values are
    bit for bit build_model_chunk's for the same seed (λ vectors, sub-layer norm, V2's λ projection, signed-mask
    logits, DEX's W_D), and the optimizer groups (no weight decay on 1-D weights) are the same as without."""
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.zero import GatheredParameters

    from diff_transformer.models.gpt import build_model_chunk
    from diff_transformer.training.deepspeed_engine import build_partitioned_chunk, deepspeed_config, param_groups

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(F, "linear", F.linear)  # zero.Init swaps in its own linear for good: restored after the test
    cfg = compose_cfg("model=debug", "model.vocab_size=4096", f"model.attention={attention}", "engine=deepspeed",
                      "engine.zero_stage=3", "trainer.global_batch_size=2", "trainer.micro_batch_size=2")
    if attention == "dex":
        cfg.model.dex.heads = [[0, 2], [1]]
    want = build_model_chunk(cfg, 4096)
    chunk = build_partitioned_chunk(cfg, 4096, torch.float32, deepspeed_config(cfg, torch.float32, 1))
    params = list(chunk.parameters())
    assert all(hasattr(p, "ds_id") and p.data.numel() == 0 for p in params)
    with GatheredParameters(params):
        got = {k: v.clone() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    expected = {k: v for k, v in want.state_dict().items() if not k.endswith("_extra_state")}
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch_equal(got[name], tensor), name
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    o = cfg.optim
    ours = param_groups(chunk, o)  # megatron-core's own rule, on the whole model, is the reference
    theirs = _get_param_groups([want], OptimizerConfig(lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay), None)
    names = {id(p): n for n, p in chunk.named_parameters()} | {id(p): n for n, p in want.named_parameters()}
    assert [(g["wd_mult"], [names[id(p)] for p in g["params"]]) for g in ours] == [
        (g["wd_mult"], [names[id(p)] for p in g["params"]]) for g in theirs
    ]
    assert {g["wd_mult"] for g in ours} == {0.0, 1.0}


# ------------------------------------------------------------------------------------------------------------------
# Moving between engines: convert, weights only, and the refusals that name the way
# ------------------------------------------------------------------------------------------------------------------
def _checkpoint_cli(*args, expect_rc=0):
    proc = subprocess.run(
        [sys.executable, "-m", "diff_transformer.checkpoint", *map(str, args)], cwd=REPO, env=train_env(),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == expect_rc, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def converted(runs):
    """The ZeRO-3 run's last checkpoint (step 6) as torch_dist, and a megatron-engine run started from it."""
    out = runs / "zero3-torch_dist"
    _checkpoint_cli("convert", runs / "zero3-diff" / "checkpoints", out, "--to", "torch_dist")
    first_step = ["trainer.max_steps=1", "optim.warmup_steps=0", f"checkpoint.load_weights_only={out}"]
    run_train(runs / "megatron-from-zero3", COMMON + first_step)
    # ZeRO-3 at TP=2 from the same weights: gathered, loaded per TP rank and partitioned again before DeepSpeed starts
    run_train(runs / "zero3-tp2-from-zero3", COMMON + DS + ["engine.zero_stage=3", "parallel.tp=2"] + first_step, nproc=2)
    return out


@pytest.mark.multiproc
def test_zero3_checkpoint_converts_to_torch_dist_with_identical_weights(runs, converted, megatron_single_process):
    """The converted weights, loaded as engine=megatron loads them, equal DeepSpeed's own reconstruction of the ZeRO-3
    partitions (its zero_to_fp32) bit for bit; engine=megatron trains from them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.models.gpt import build_model_chunk
    from diff_transformer.training.checkpoint_tools import load_torch_dist_weights
    from diff_transformer.training.deepspeed_engine import load_weights_into_chunk

    step6 = ckpt(runs / "zero3-diff", 6)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(Path(step6).parent), tag=Path(step6).name)
    saved = read_trainer_state(str(converted))
    assert saved["weights_only"] and saved["layout"]["engine"] == "megatron" and saved["step"] == 6
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), saved["config"]))
    chunk = build_model_chunk(cfg, reference["embedding.word_embeddings.weight"].shape[0], perform_init=False)
    load_torch_dist_weights(chunk, str(converted))
    loaded = {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch_equal(loaded[name], tensor), name
    # what engine=deepspeed loads for checkpoint.load_weights_only: the same, from the ZeRO-3 files or the conversion
    for source in (step6, str(converted)):
        chunk = build_model_chunk(cfg, reference["embedding.word_embeddings.weight"].shape[0], perform_init=False)
        load_weights_into_chunk(chunk, source)
        for name, tensor in chunk.state_dict().items():
            assert name.endswith("_extra_state") or torch_equal(tensor, reference[name]), (source, name)
    # the weights are the trained ones: engine=megatron's first step on them is far below the fresh run's
    first = read_metrics(runs / "megatron-from-zero3")[0]
    assert first["loss"] < read_metrics(runs / "megatron-diff")[0]["loss"] - 0.05
    assert "started from the weights of" in (runs / "megatron-from-zero3" / "train.log").read_text()
    out = _checkpoint_cli("inspect", converted).stdout
    assert "weights only, converted from engine=deepspeed checkpoint" in out
    out = _checkpoint_cli("inspect", step6).stdout
    assert "engine       deepspeed ZeRO-3 (offload optimizer none, parameters none)" in out


@pytest.mark.multiproc
def test_zero3_at_tp2_starts_from_weights_only_as_megatron_does(runs, converted):
    """checkpoint.load_weights_only under ZeRO-3, which builds the model partitioned: the first step on the loaded
    weights equals engine=megatron's on the same weights (TP=1, one process: the same global batch)."""
    assert_same_steps(read_metrics(runs / "zero3-tp2-from-zero3"), read_metrics(runs / "megatron-from-zero3"),
                      steps=[1])
    log = (runs / "zero3-tp2-from-zero3" / "train.log").read_text()
    assert "started from the weights of" in log and "model built partitioned" in log


def torch_equal(a, b):
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.multiproc
def test_refusals_name_both_values_and_the_convert_command(runs, converted, tmp_path):
    """Resuming across engines, ZeRO stages or world sizes, or a weights-only checkpoint, is refused before anything
    loads, naming what differs and the way: the convert command or checkpoint.load_weights_only."""
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.training.engines import create_trainer

    step3 = ckpt(runs / "zero3-diff", 3)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), read_trainer_state(step3)["config"]))

    def refusal(**changes):
        c = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), changes))
        trainer = create_trainer(c, str(tmp_path))
        trainer.checkpoint_root = str(tmp_path / "checkpoints")
        with pytest.raises(ValueError) as err:
            trainer._checkpoint_to_load()
        return str(err.value)

    convert = f"python -m diff_transformer.checkpoint convert {step3} OUT --to torch_dist"
    message = refusal(checkpoint={"resume": step3}, engine={"zero_stage": 2})
    assert "saved with engine.zero_stage=3, the run has engine.zero_stage=2" in message and convert in message
    message = refusal(checkpoint={"resume": step3}, parallel={"tp": 2})
    assert "saved with parallel.tp=1, the run has parallel.tp=2" in message and convert in message
    message = refusal(checkpoint={"resume": step3}, engine={"name": "megatron", "zero_stage": None})
    assert "saved by engine=deepspeed, the run uses engine=megatron" in message and convert in message
    message = refusal(checkpoint={"load_weights_only": step3}, engine={"name": "megatron", "zero_stage": None})
    assert "engine=megatron loads torch_dist checkpoints" in message and convert in message
    message = refusal(checkpoint={"resume": step3})  # this process is a world of one
    assert "saved by a world of 2 processes, the run has 1" in message and convert in message
    message = refusal(checkpoint={"resume": str(converted)})
    assert "holds weights only" in message and f"checkpoint.load_weights_only={converted}" in message


# ------------------------------------------------------------------------------------------------------------------
# Bad input: one error naming the key, before any process group starts
# ------------------------------------------------------------------------------------------------------------------
def compose_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["engine=deepspeed", "engine.zero_stage=4"], 1, r"engine.zero_stage=4 is unknown; use 0, 1, 2 or 3"),
        (["engine=deepspeed", "engine.zero_stage=2", "engine.offload_optimizer=nvme"], 1,
         r"engine.offload_optimizer=nvme needs engine.nvme_path \(a directory on a local NVMe drive"),
        (["engine=deepspeed", "engine.zero_stage=2", "engine.offload_optimizer=nvme", "engine.nvme_path=/nvme"], 1,
         r"engine.offload_optimizer=nvme needs engine.zero_stage=3 \(DeepSpeed swaps optimizer states to NVMe at "
         r"stage 3 only; at stage 2 it keeps them in host memory\)"),
        (["engine=deepspeed", "engine.zero_stage=2", "engine.offload_param=cpu"], 1,
         r"engine.offload_param=cpu needs engine.zero_stage=3 .*the run has engine.zero_stage=2"),
        (["engine=deepspeed", "engine.zero_stage=0", "engine.offload_optimizer=cpu"], 1,
         r"engine.offload_optimizer=cpu needs engine.zero_stage >= 1"),
        (["engine=deepspeed", "engine.offload_optimizer=disk"], 1, r"engine.offload_optimizer='disk' is unknown"),
        (["engine=deepspeed", "parallel.pp=2"], 2,
         r"engine=deepspeed does not run pipeline parallelism \(parallel.pp=2\); use engine=megatron for PP"),
        (["engine=deepspeed", "parallel.distributed_optimizer=true"], 2,
         r"parallel.distributed_optimizer=true is megatron-core's .*engine.zero_stage >= 1"),
        (["engine=deepspeed", "checkpoint.async_save=true"], 1, r"checkpoint.async_save=true .*engine=deepspeed"),
        (["engine.zero_stage=3"], 1, r"engine.zero_stage=3 applies to engine=deepspeed only"),
        (["engine.name=colossal"], 1, r"engine='colossal' is unknown; use one of megatron, deepspeed"),
    ],
    ids=["stage", "nvme-path", "nvme-optimizer-stage", "param-offload-stage", "optimizer-offload-stage0", "offload-device", "pp",
         "distributed-optimizer", "async-save", "megatron-zero-stage", "engine"],
)
def test_bad_engine_configs_are_refused_naming_the_key(overrides, world, message):
    from diff_transformer.config import validate

    cfg = compose_cfg("experiment=smoke", *overrides)
    with pytest.raises(ValueError, match=message):
        validate(cfg, world_size=world)


def test_deepspeed_that_lacks_a_feature_is_refused(monkeypatch):
    """A release older than the one the engine is written for, or an op the setting needs that cannot build here."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    from diff_transformer.training import deepspeed_engine

    deepspeed = deepspeed_engine.import_deepspeed()
    cfg = compose_cfg("experiment=smoke", "engine=deepspeed", "engine.zero_stage=3", "engine.offload_param=nvme",
                      "engine.offload_optimizer=cpu", "engine.nvme_path=/tmp/nvme")
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    monkeypatch.setattr(CPUAdamBuilder, "is_compatible", lambda self, verbose=False: True)
    with pytest.raises(ValueError, match=r"engine.offload_param=nvme needs DeepSpeed's async_io op, which deepspeed "
                                         r".* cannot build on this machine \(it needs libaio"):
        deepspeed_engine.check_deepspeed_support(cfg)
    monkeypatch.setattr(CPUAdamBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(ValueError, match=r"engine.offload_optimizer=cpu steps the optimizer with DeepSpeed's CPU Adam"):
        deepspeed_engine.check_deepspeed_support(cfg)
    monkeypatch.setattr(deepspeed, "__version__", "0.14.0")
    with pytest.raises(ValueError, match=r"engine=deepspeed needs deepspeed>=0.19.8, but 0.14.0 is installed"):
        deepspeed_engine.check_deepspeed_support(cfg)


def test_train_py_refuses_in_one_line_before_any_process_group(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "engine=deepspeed", "parallel.pp=2",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: engine=deepspeed does not run pipeline parallelism (parallel.pp=2); use engine=megatron "
                      "for PP, or parallel.pp=1"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------------------------
# The memory estimate and plan per ZeRO stage and offload
# ------------------------------------------------------------------------------------------------------------------
def test_memory_estimate_falls_with_each_stage_and_offload_and_the_plan_names_them():
    import torch

    from diff_transformer.training.accounting import estimate_memory_per_gpu, memory_plan_problem

    base = ["model=3b", "optim=adamw_3b", "trainer.micro_batch_size=1", "trainer.global_batch_size=64",
            "trainer.recompute=full", "model.vocab_size=100352"]

    def estimate(*overrides, world=8):
        return estimate_memory_per_gpu(compose_cfg(*base, *overrides), torch.bfloat16, world, 100352, "cuda")

    stages = [estimate("engine=deepspeed", f"engine.zero_stage={s}") for s in range(4)]
    assert [round(s["total"], 1) for s in stages] == sorted((round(s["total"], 1) for s in stages), reverse=True)
    assert stages[1]["optimizer"] == pytest.approx(stages[0]["optimizer"])  # bf16 at stage 0 splits it already
    assert stages[2]["grads"] < stages[1]["grads"] and stages[3]["weights"] < stages[2]["weights"] / 4
    offloaded = estimate("engine=deepspeed", "engine.zero_stage=3", "engine.offload_optimizer=cpu",
                         "engine.offload_param=cpu", world=2)
    assert offloaded["optimizer"] == 0 and offloaded["host"] > 30 and offloaded["total"] < 5
    # 3B on 2 GPUs of 24 GiB: ZeRO-1 does not fit; the plan names the stage and offload that do
    cfg = compose_cfg(*base, "engine=deepspeed", "engine.zero_stage=1", "trainer.gpu_memory_gib=24")
    problem = memory_plan_problem(cfg, torch.bfloat16, 2, 100352, 24, "cuda")
    assert problem.startswith("estimated memory per GPU")
    assert "engine.zero_stage=3 engine.offload_optimizer=cpu engine.offload_param=cpu (3.4 GiB)" in problem
    assert "parallel.distributed_optimizer" not in problem and "parallel.pp" not in problem
