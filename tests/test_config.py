"""Config composition, the paper's sizes, parameter parity with the baseline, and refusal of bad configs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError

from diff_transformer.config import register_configs, to_object, validate

REPO = Path(__file__).resolve().parent.parent
register_configs()

# Table 10 of the paper (and its 3B model), in parameters.
PAPER_SIZES = {"830m": 830e6, "1.4b": 1.4e9, "2.8b": 2.8e9, "6.8b": 6.8e9, "13.1b": 13.1e9}


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(compose("config", overrides=list(overrides)))


def count_on_meta(cfg):
    from diff_transformer.models.gpt import build_model_chunk, count_parameters

    with torch.device("meta"):
        model = build_model_chunk(cfg, cfg.model.vocab_size, perform_init=False)
    return count_parameters([model]), model


@pytest.mark.parametrize("size", list(PAPER_SIZES))
def test_paper_sizes_match_the_paper(size, megatron_single_process):
    cfg = compose_cfg(f"model={size}")
    count, model = count_on_meta(cfg)
    assert abs(count - PAPER_SIZES[size]) / PAPER_SIZES[size] < 0.03, f"{size}: {count:,}"
    assert next(model.parameters()).device.type == "meta"


def test_3b_has_the_papers_shape(megatron_single_process):
    # The paper's "3B": 28 layers, hidden 3072, FFN 8192, 12 DIFF heads of 128, vocabulary 100,288 (tied).
    cfg = compose_cfg("model=3b", "optim=adamw_3b")
    count, _ = count_on_meta(cfg)
    per_layer = 4 * 3072**2 + 3 * 3072 * 8192 + 2 * 3072 + 6 * 128
    assert count == 28 * per_layer + 100288 * 3072 + 3072
    assert (cfg.model.seq_length, cfg.optim.lr, cfg.optim.beta2) == (4096, 3.2e-4, 0.95)


@pytest.mark.parametrize("size", ["debug", "tiny", "1.4b"])
def test_diff_and_baseline_have_equal_parameters(size, megatron_single_process):
    diff, _ = count_on_meta(compose_cfg(f"model={size}", "model.vocab_size=4096"))
    vanilla, _ = count_on_meta(compose_cfg(f"model={size}", "model.attention=vanilla", "model.vocab_size=4096"))
    cfg = compose_cfg(f"model={size}")
    d = cfg.model.hidden_size // (2 * cfg.model.num_heads)
    # equal projections; DIFF adds only its four λ vectors and the sub-layer norm weight (6d) per layer
    assert diff - vanilla == cfg.model.num_layers * 6 * d


KINDS = ("diff", "vanilla", "diff_v2", "vanilla_subln", "vanilla_wide", "topk", "signed_mask")


@pytest.mark.parametrize("size", ["debug", "tiny"])
def test_every_kind_has_the_parameter_count_it_states(size, megatron_single_process):
    """attention_parameters_per_layer (what the trainer prints for a model it does not build) equals the built
    model for every kind; vanilla_wide has DIFF's projections (DIFF adds 6d per layer, as against vanilla)."""
    from diff_transformer.models.gpt import attention_parameters_per_layer

    counts, models = {}, {}
    for kind in KINDS + ("diff lambda_learnable=false", "diff sublayer_norm=false"):
        overrides = [f"model.{'attention=' if i == 0 else ''}{part}" for i, part in enumerate(kind.split())]
        cfg = compose_cfg(f"model={size}", "model.vocab_size=4096", *overrides)
        counts[kind], model = count_on_meta(cfg)
        models[kind] = cfg.model
    L = models["diff"].num_layers
    d = models["diff"].hidden_size // (2 * models["diff"].num_heads)
    for kind, m in models.items():
        assert counts[kind] - counts["vanilla"] == L * (
            attention_parameters_per_layer(m) - attention_parameters_per_layer(models["vanilla"])
        ), kind
    assert counts["vanilla_wide"] == counts["vanilla"] == counts["diff"] - L * 6 * d
    assert counts["diff lambda_learnable=false"] == counts["diff"] - L * 4 * d
    assert counts["vanilla_subln"] == counts["vanilla"] + L * d


def test_vanilla_wide_has_half_the_heads_twice_as_wide(megatron_single_process):
    cfg = compose_cfg("model=tiny", "model.attention=vanilla_wide", "model.vocab_size=4096")
    _, model = count_on_meta(cfg)
    attn = model.decoder.layers[0].self_attention
    assert (attn.config.num_attention_heads, attn.config.num_query_groups, attn.config.kv_channels) == (2, 2, 64)


@pytest.mark.parametrize("size", ["debug", "tiny", "830m"])
def test_diff_v2_and_its_baseline(size, megatron_single_process):
    """V2 (2H query heads of d over Hkv KV heads, Wo from H·d, W_λ: E→H) against its baseline, the Transformer with
    the same hidden size, 2H query heads of d and Hkv KV heads: equal Q, K, V; V2's Wo is H·d·E smaller; W_λ adds E·H."""
    from diff_transformer.models.gpt import v2_baseline

    v2_cfg = compose_cfg(f"model={size}", "model.attention=diff_v2", "model.vocab_size=4096")
    baseline_model, overrides = v2_baseline(v2_cfg.model)
    m = v2_cfg.model
    kv = m.num_kv_heads or m.num_heads
    assert overrides == f"model.attention=vanilla model.num_kv_heads={kv // 2}"
    baseline_cfg = compose_cfg(f"model={size}", "model.vocab_size=4096", *overrides.split())
    assert baseline_cfg.model == baseline_model
    v2, v2_model = count_on_meta(v2_cfg)
    baseline, baseline_net = count_on_meta(baseline_cfg)
    E, H, d, L = m.hidden_size, m.num_heads, m.hidden_size // (2 * m.num_heads), m.num_layers
    assert v2 - baseline == L * (E * H - H * d * E)
    v2_attn, base_attn = v2_model.decoder.layers[0].self_attention, baseline_net.decoder.layers[0].self_attention
    assert v2_attn.linear_qkv.weight.shape == base_attn.linear_qkv.weight.shape == ((2 * H + 2 * kv) * d, E)
    assert v2_attn.linear_proj.weight.shape == (E, H * d) and base_attn.linear_proj.weight.shape == (E, 2 * H * d)
    assert v2_attn.linear_lambda.weight.shape == (H, E)


def test_ablation_sweep_variants_are_valid_and_distinct():
    from diff_transformer.models.layer_specs import variant_label

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        sweep = compose("config", overrides=["+sweep=ablations"], return_hydra_config=True)
        variants = sweep.hydra.sweeper.params["+sweep/ablation"].split(",")
        assert sweep.hydra.sweeper.params["seed"] == "1,2,3"
        labels = []
        for variant in variants:
            cfg = to_object(compose("config", overrides=["+sweep=ablations", f"+sweep/ablation={variant}"]))
            validate(cfg, world_size=1)
            assert (cfg.model.name, cfg.trainer.max_steps, cfg.data.source) == ("ablation", 200, "bundled")
            labels.append(variant_label(cfg.model))
    assert len(set(labels)) == len(variants) == 12
    assert {"diff sublayer_norm=false", "diff lambda_init=1.0 lambda_learnable=false", "diff lambda_init=0.8",
            "diff lambda_init=0.5", "topk topk=32", "vanilla num_kv_heads=1", "diff_v2"} <= set(labels)


def test_lambda_init_uses_global_layer_numbers(megatron_single_process):
    from diff_transformer.models.attention import lambda_init_for_layer
    from diff_transformer.models.gpt import diff_attention_modules

    _, model = count_on_meta(compose_cfg("model=tiny", "model.vocab_size=4096"))
    mods = diff_attention_modules([model])
    assert [m.layer_number for m in mods] == [1, 2, 3, 4]
    assert [m.lambda_init for m in mods] == [lambda_init_for_layer(i) for i in range(1, 5)]


def test_experiment_presets_compose():
    smoke = compose_cfg("experiment=smoke")
    assert (smoke.name, smoke.model.name, smoke.trainer.max_steps) == ("smoke", "debug", 30)
    quick = compose_cfg("experiment=quickstart", "model.attention=vanilla")
    assert (quick.model.name, quick.model.attention) == ("tiny", "vanilla")
    validate(smoke, world_size=1)
    validate(compose_cfg("model=13.1b", "optim=adamw_large", "parallel.tp=4", "parallel.pp=4"), world_size=64)


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["model=tiny", "parallel.tp=4"], 4,
         r"parallel.tp=4 does not divide model.num_heads=2 .*pair.*use 1, 2"),
        (["model=830m", "parallel.tp=3"], 3, r"parallel.tp=3 does not divide model.num_heads=8.*use 1, 2, 4, 8"),
        (["model=tiny", "parallel.pp=3"], 3, r"parallel.pp=3 does not divide model.num_layers=4; use 1, 2, 4"),
        (["model=tiny", "parallel.tp=2"], 3, r"world size 3 is not divisible by parallel.tp\*parallel.pp=2"),
        (["trainer.global_batch_size=12", "trainer.micro_batch_size=4"], 2,
         r"trainer.global_batch_size=12 is not divisible by trainer.micro_batch_size=4 x data-parallel size 2"),
        (["model.attention=sparse"], 1, r"model.attention='sparse' is unknown; use one of diff, vanilla"),
        (["model.attention_backend=xformers"], 1, r"attention_backend='xformers' is unknown"),
        (["trainer.precision=fp8"], 1, r"trainer.precision='fp8' is unknown"),
        (["model.num_kv_heads=3", "model=830m"], 1, r"model.num_kv_heads=3 must divide model.num_heads=8"),
        (["trainer.max_steps=10", "optim.warmup_steps=10"], 1,
         r"optim.warmup_steps=10 must lie in \[0, trainer.max_steps=10\)"),
        (["model.attention=topk", "model.topk=0"], 1, r"model.topk=0 must be >= 1"),
        (["model.attention=topk", "model.topk=-3"], 1, r"model.topk=-3 must be >= 1"),
        (["model=830m", "model.attention=diff_v2", "model.num_kv_heads=3"], 1,
         r"model.num_kv_heads=3 must divide model.num_heads=8 \(DIFF V2 subtracts query heads 2h and 2h\+1, "
         r"which must share one KV head\); use 1, 2, 4, 8"),
        (["model=830m", "model.attention=diff_v2", "model.num_kv_heads=2", "parallel.tp=4"], 4,
         r"parallel.tp=4 does not divide model.num_kv_heads=2"),
        (["model.attention=vanilla", "model.lambda_learnable=false"], 1,
         r"model.lambda_learnable=false does not apply to model.attention=vanilla \(only to diff\); leave it unset"),
        (["model.attention=diff_v2", "model.lambda_learnable=false"], 1,
         r"model.lambda_learnable=false does not apply to model.attention=diff_v2 \(only to diff\)"),
        (["model.attention=diff_v2", "model.lambda_init=0.8"], 1,
         r"model.lambda_init=0.8 does not apply to model.attention=diff_v2 \(only to diff, vanilla_subln, dex\)"),
        (["model.attention=vanilla_wide", "model.sublayer_norm=false"], 1,
         r"model.sublayer_norm=false does not apply to model.attention=vanilla_wide \(only to diff\)"),
        (["model.attention=signed_mask", "model.topk=8"], 1, r"model.topk=8 does not apply to model.attention=signed_mask"),
        (["model.lambda_init=1.0"], 1, r"model.lambda_init=1.0 makes the output multiplier .* zero or negative; "
                                       r"to fix DIFF's λ at 1 use model.lambda_learnable=false"),
        (["model.attention=topk", "model.attention_backend=triton"], 1,
         r"model.attention=topk does not run on model.attention_backend=triton; use eager, sdpa"),
        (["model.attention=vanilla", "model.attention_backend=triton"], 1,
         r"model.attention=vanilla does not run on model.attention_backend=triton; use eager, sdpa, flash_attn"),
        (["parallel.sequence_parallel=true"], 1,
         r"parallel.sequence_parallel=true needs tensor parallelism \(parallel.tp=1\)"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=129"], 2,
         r"model.seq_length=129 is not divisible by parallel.tp=2"),
        (["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"], 2,
         r"overlap_param_gather=true overlaps the distributed optimizer's .*parallel.distributed_optimizer=true"),
        (["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true"], 2,
         r"overlap_param_gather=true needs parallel.overlap_grad_reduce=true"),
        (["trainer.recompute=partial"], 1, r"trainer.recompute='partial' is unknown; use one of none, selective, full"),
        (["trainer.recompute=full", "trainer.recompute_layers=3"], 1,
         r"trainer.recompute_layers=3 must divide the 4 layers of a pipeline stage .*use 1, 2, 4"),
        (["trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_layers=3", "parallel.pp=2"],
         2, r"trainer.recompute_layers=3 must lie in \[0, 2\]"),
        (["trainer.recompute=selective", "trainer.recompute_layers=2"], 1,
         r"trainer.recompute_layers=2 applies to trainer.recompute=full only"),
    ],
    ids=["heads-tp", "heads-tp3", "layers-pp", "world", "batch", "attention", "backend", "precision", "kv-heads",
         "warmup", "topk-0", "topk-negative", "v2-kv-heads", "v2-tp-kv", "learnable-vanilla", "learnable-v2",
         "lambda-init-v2", "subln-wide", "topk-signed", "lambda-init-1", "topk-triton", "vanilla-triton",
         "sp-tp1", "sp-seq", "param-gather-distopt", "param-gather-grad", "recompute", "recompute-uniform",
         "recompute-block", "recompute-layers-selective"],
)
def test_bad_configs_are_refused_naming_the_value(overrides, world, message):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ValueError, match=message):
        validate(cfg, world_size=world)


@pytest.mark.parametrize("backend,package", [("flash_attn", "the flash-attn package"),
                                             ("flash_attn4", "the flash-attn-4 package")])
def test_a_flash_backend_needs_its_library_before_anything_runs(backend, package):
    """Named explicitly, a FlashAttention backend whose library is missing is refused at validation, naming the
    package and the alternatives; with the library importable (its CPU stand-in) the same config validates."""
    from diff_transformer.models.attention.base import flash_library_installed
    from tests.flash_stand_in import installed

    cfg = compose_cfg(f"model.attention_backend={backend}")
    if not flash_library_installed(backend):
        with pytest.raises(ValueError, match=rf"model.attention_backend={backend} needs {package} .*not installed "
                                             r"here; use model.attention_backend=auto or sdpa"):
            validate(cfg, world_size=1)
    with installed():
        validate(cfg, world_size=1)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.attention=topk", "model.topk=100000"],  # at or beyond the sequence: equals vanilla
        ["model.lambda_learnable=false", "model.lambda_init=1.0"],  # the review's λ = 1
        ["model.lambda_learnable=false"],
        ["model.attention=vanilla_subln", "model.lambda_init=0.8"],
        ["model.attention=diff_v2", "model.attention_backend=triton", "parallel.tp=2"],
        ["model.attention=signed_mask", "model.attention_backend=eager"],
    ],
    ids=["topk-long", "lambda-1", "frozen", "subln-fixed", "v2-triton-tp2", "signed-eager"],
)
def test_good_variant_configs_are_accepted(overrides):
    validate(compose_cfg(*overrides), world_size=2)


def test_unknown_keys_are_refused():
    with pytest.raises(ConfigCompositionException, match="num_head"):
        compose_cfg("model.num_head=4")
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_cfg("trainer.max_step=4")


def test_train_py_refuses_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "parallel.tp=3", f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: parallel.tp=3 does not divide model.num_heads=2" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_train_py_refuses_a_key_the_kind_does_not_read_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "model.attention=vanilla",
         "model.lambda_learnable=false", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: model.lambda_learnable=false does not apply to model.attention=vanilla (only to diff); "
                      "leave it unset"]


def test_data_group_selects_the_source():
    assert compose_cfg().data.source == "bundled"
    shards = compose_cfg("data=shards")
    with pytest.raises(ValueError, match="data.source='shards' needs data.blend"):
        shards.data.validate()


# ------------------------------------------------------------------------------------------------------------------
# optim.decay=wsd and cooldown branches: the schedule against its formula, bad values refused
# ------------------------------------------------------------------------------------------------------------------
def wsd_reference(t, lr, lr_min, warmup, cooldown, total):
    """Hägele et al. 2024's warmup-stable-decay with the (1 - sqrt) cooldown, written out: lr after t updates."""
    start = total - cooldown
    if t <= warmup:
        return lr * t / warmup
    if t <= start:
        return lr
    return lr_min + (lr - lr_min) * (1 - ((t - start) / cooldown) ** 0.5)


@pytest.mark.parametrize("overrides,cooldown", [([], 20), (["optim.cooldown_steps=7"], 7),
                                                (["optim.cooldown_fraction=0.5"], 50)])
def test_wsd_schedule_follows_the_one_minus_sqrt_formula(overrides, cooldown):
    from types import SimpleNamespace

    from diff_transformer.training.trainer import Trainer

    cfg = compose_cfg("trainer.max_steps=100", "optim.warmup_steps=10", "optim.decay=wsd", "optim.lr=3e-3",
                      "optim.min_lr=1e-4", *overrides)
    validate(cfg, world_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = Trainer._lr_scheduler(SimpleNamespace(cfg=cfg), optimizer)
    lrs = []
    for t in range(101):
        lrs.append(optimizer.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(wsd_reference(t, 3e-3, 1e-4, 10, cooldown, 100), rel=1e-12, abs=1e-15), t
        scheduler.step(increment=1)
    assert lrs[100 - cooldown] == 3e-3 > lrs[101 - cooldown] and lrs[100] == pytest.approx(1e-4)


@pytest.mark.parametrize("overrides,message", [
    (["optim.decay=step"], r"optim.decay='step' is unknown; use one of linear, cosine, constant, wsd"),
    (["optim.decay=wsd", "optim.cooldown_fraction=1.0"], r"optim.cooldown_fraction=1.0 must lie in \(0, 1\)"),
    (["optim.decay=wsd", "optim.cooldown_fraction=0"], r"optim.cooldown_fraction=0.0 must lie in \(0, 1\)"),
    (["optim.decay=wsd", "trainer.max_steps=20", "optim.warmup_steps=5", "optim.cooldown_steps=16"],
     r"optim.cooldown_steps=16 must lie in \[1, 15\]"),
    (["checkpoint.branch_step=8"], r"checkpoint.branch_step=8 needs checkpoint.branch_from"),
    (["checkpoint.branch_from=/tmp"], r"cooldown branch and needs optim.decay=wsd, not optim.decay=linear"),
    (["optim.decay=wsd", "trainer.max_steps=40", "optim.warmup_steps=4", "checkpoint.branch_from=/tmp",
      "checkpoint.branch_step=33"], r"checkpoint.branch_step=33 must lie in \[1, 32\]"),
], ids=["decay", "fraction-1", "fraction-0", "cooldown-steps", "step-without-source", "branch-not-wsd", "step-late"])
def test_bad_schedule_and_branch_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(*overrides), world_size=1)


def fake_source(root, steps, max_steps=40, **changes):
    """A source run directory whose checkpoints hold only trainer_state.json: what resolve_branch reads."""
    import json

    from diff_transformer.training.checkpoint_files import checkpoint_name

    config = {"seed": 1234, "trainer": {"max_steps": max_steps, "global_batch_size": 8},
              "optim": {"lr": 3e-3, "warmup_steps": 4, "decay": "wsd", "cooldown_fraction": 0.2,
                        "cooldown_steps": None}}
    for key, value in changes.items():
        section, name = key.split("__")
        config[section][name] = value
    for step in steps:
        path = root / "checkpoints" / checkpoint_name(step)
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "config": config}))
    return root


BRANCH = ["experiment=smoke", "optim.decay=wsd", "optim.warmup_steps=4", "optim.lr=3e-3", "seed=1234"]


@pytest.mark.parametrize("steps,overrides,changes,message", [
    ([8, 24], ["trainer.max_steps=20"], {}, r"checkpoint.branch_step=16 .*has no checkpoint in .* \(steps: 8, 24\)"),
    ([16, 40], ["trainer.max_steps=50", "checkpoint.branch_step=40"], {},
     r"checkpoint.branch_step=40 lies in the source's cooldown \(it cools down from step 32 of 40\)"),
    ([16], ["trainer.max_steps=20"], {"optim__lr": 1e-3}, r"optim.lr=0.003 \(the source's 0.001\)"),
    ([16], ["trainer.max_steps=45", "checkpoint.branch_step=16"], {},
     r"trainer.max_steps=45 must lie in \(16, 40\]: after the branch step and within the source's"),
], ids=["no-checkpoint", "in-cooldown", "other-lr", "past-source"])
def test_a_branch_refuses_a_source_it_cannot_continue(tmp_path, steps, overrides, changes, message):
    from diff_transformer.training.branching import resolve_branch

    source = fake_source(tmp_path / "trunk", steps, **changes)
    cfg = compose_cfg(*BRANCH, f"checkpoint.branch_from={source}", *overrides)
    validate(cfg, world_size=1)
    with pytest.raises(ValueError, match=message):
        resolve_branch(cfg, str(tmp_path / "branch"))


def test_a_branch_starts_where_its_cooldown_begins_by_default(tmp_path):
    from diff_transformer.training.branching import resolve_branch

    source = fake_source(tmp_path / "trunk", [8, 16, 24])
    branch = resolve_branch(compose_cfg(*BRANCH, f"checkpoint.branch_from={source}", "trainer.max_steps=20"))
    assert (branch.step, branch.max_steps, branch.run_dir) == (16, 40, str(source))
    assert branch.record() == {"source_run": str(source), "source_step": 16}
    named = resolve_branch(compose_cfg(*BRANCH, f"checkpoint.branch_from={branch.checkpoint}", "trainer.max_steps=30"))
    assert (named.step, named.run_dir) == (16, str(source)), "a step_* checkpoint names its run and step"


# ------------------------------------------------------------------------------------------------------------------
# Sweep presets: seeds in every subdir, WSD trunks before their branches, an lr grid with unique subdirs
# ------------------------------------------------------------------------------------------------------------------
def sweep_jobs(preset, *extra):
    """(hydra config of the sweep, [composed job config, ...]) in the order Hydra's basic sweeper launches them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        sweep = compose("config", overrides=[f"+sweep={preset}", *extra], return_hydra_config=True)
        params = [f"{k}={v}" for k, v in sweep.hydra.sweeper.params.items()] + [f"+sweep={preset}", *extra]
        jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params), None)[0]
        return sweep, [compose("config", overrides=job, return_hydra_config=True) for job in jobs]


def test_tiny_sweep_has_three_seeds_and_a_subdir_per_seed():
    sweep, jobs = sweep_jobs("tiny")
    assert sweep.hydra.sweeper.params["seed"] == "1,2,3" and len(jobs) == 18
    subdirs = {job.hydra.sweep.subdir for job in jobs}
    assert len(subdirs) == 18 and "scale_1m-diff-seed2" in subdirs


def test_lr_grid_gives_each_lr_its_own_subdir():
    _, jobs = sweep_jobs("tiny_lr", "model=scale_1m", "model.attention=diff", "seed=1")
    assert [job.optim.lr for job in jobs] == [1e-3, 2e-3, 4e-3]
    assert len({job.hydra.sweep.subdir for job in jobs}) == 3


def test_wsd_sweep_runs_each_trunk_before_its_branches_from_saved_stable_checkpoints():
    from diff_transformer.config import cooldown_steps
    from diff_transformer.training.checkpoint_files import checkpoints_to_delete

    _, jobs = sweep_jobs("tiny_wsd", "model=scale_1m", "model.attention=diff")
    assert len(jobs) == 9
    trunks = {}
    for job in jobs:
        source = OmegaConf.to_container(job.checkpoint)["branch_from"]
        subdir = job.hydra.sweep.subdir
        with open_dict(job):
            del job["hydra"]
            job.checkpoint.branch_from = source and "/trunk"  # the sweep directory is Hydra's at launch
        cfg = to_object(job)
        validate(cfg, world_size=1)
        key = (cfg.model.name, cfg.seed)
        if source is None:
            trunks[key] = cfg
            assert subdir == f"scale_1m-diff-seed{cfg.seed}"
            continue
        trunk = trunks[key]  # launched before its branches
        assert source == "${hydra:sweep.dir}/${model.name}-${model.attention}-seed${seed}"
        assert subdir == f"scale_1m-diff-seed{cfg.seed}-steps{cfg.trainer.max_steps}"
        start = cfg.trainer.max_steps - cooldown_steps(cfg.optim, cfg.trainer.max_steps)
        trunk_steps = range(trunk.checkpoint.interval, trunk.trainer.max_steps + 1, trunk.checkpoint.interval)
        kept = set(trunk_steps) - set(checkpoints_to_delete(list(trunk_steps), trunk.checkpoint.keep_last,
                                                            trunk.checkpoint.keep_every))
        assert start in kept and start <= trunk.trainer.max_steps - cooldown_steps(trunk.optim, trunk.trainer.max_steps)
    assert sorted({job.trainer.max_steps for job in jobs}) == [20, 40, 80]
    plain = sum(t.trainer.max_steps for t in trunks.values())
    extra = sum(0.2 * job.trainer.max_steps for job in jobs if job.checkpoint.branch_from is not None)
    assert (plain + extra) / plain == pytest.approx(1.15)
