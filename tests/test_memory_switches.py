"""The switches that make large models fit and run fast, each against the run without it: activation recomputation
(selective and full, DIFF and the baseline), sequence parallelism at TP=2, overlapped data-parallel communication at
DP=2 (with and without the distributed optimizer), and the memory plan that names the switches a too-big launch
needs."""

import contextlib
from pathlib import Path

import pytest
import torch

from diff_transformer.training.checkpoint import checkpoint_name
from tests.train_runs import read_metrics, run_train

STEPS = 5
COMMON = ["experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=0", "optim.warmup_steps=2"]
NO_SAVES = ["checkpoint.interval=0", "checkpoint.save_at_end=false"]


def compose_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "configs"), version_base="1.3"):
        return to_object(compose("config", overrides=list(overrides)))


# ------------------------------------------------------------------------------------------------------------------
# Activation recomputation (in process: the model alone, five optimizer steps on fixed batches)
# ------------------------------------------------------------------------------------------------------------------
RECOMPUTE = {
    "selective": ["trainer.recompute=selective"],
    "full-uniform": ["trainer.recompute=full"],
    "full-block": ["trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_layers=1"],
}
VOCAB, BATCH, SEQ = 256, 4, 128


def _train_five_steps(kind, backend, overrides):
    """Losses and gradient norms of five AdamW steps, the peak bytes torch allocated during the first forward and
    backward, the config and the number of parameters."""
    from diff_transformer.models.gpt import build_model_chunk
    from diff_transformer.training.accounting import PeakMemory

    cfg = compose_cfg(
        "model=debug", f"model.seq_length={SEQ}", f"model.attention={kind}", f"model.attention_backend={backend}",
        f"trainer.micro_batch_size={BATCH}", f"model.vocab_size={VOCAB}", *overrides,
    )
    model = build_model_chunk(cfg, VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    losses, norms, peak = [], [], None
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        optimizer.zero_grad()
        with PeakMemory() if step == 0 else contextlib.nullcontext() as measured:
            loss = model(tokens, positions, None, labels=tokens).mean()
            loss.backward()
        if step == 0:
            peak = measured.bytes
        norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))))
        losses.append(loss.item())
        optimizer.step()
    return losses, norms, peak, cfg, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def without_recompute(megatron_single_process):
    cache = {}

    def get(kind, backend):
        if (kind, backend) not in cache:
            cache[kind, backend] = _train_five_steps(kind, backend, [])
        return cache[kind, backend]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains nothing from threads, and loses much on a busy machine
    yield get
    torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", list(RECOMPUTE))
@pytest.mark.parametrize("kind, backend", [("diff", "sdpa"), ("diff", "eager"), ("vanilla", "eager")])
def test_recompute_is_exact_and_saves_what_the_estimate_says(kind, backend, mode, without_recompute):
    from diff_transformer.training.accounting import GIB, estimate_memory_per_gpu

    ref_losses, ref_norms, ref_peak, ref_cfg, _ = without_recompute(kind, backend)
    losses, norms, peak, cfg, params = _train_five_steps(kind, backend, RECOMPUTE[mode])
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=0)
    assert norms == pytest.approx(ref_norms, abs=1e-6, rel=0)
    assert len(set(losses)) == STEPS  # the weights moved

    def estimate(c):  # activations and logits, and here the parameters' .grad (there is no DDP buffer)
        e = estimate_memory_per_gpu(c, torch.float32, 1, VOCAB, "cpu")
        return (e["activations"] + e["logits"]) * GIB + 4 * params

    # the measured peak falls by at least half of what the estimate says recomputation saves...
    estimated_saving = estimate(ref_cfg) - estimate(cfg)
    assert estimated_saving > 0.1 * ref_peak
    assert peak < ref_peak - 0.5 * estimated_saving, (peak, ref_peak, estimated_saving)
    # ...and the estimate is within 20% of the measured peak
    assert 0.8 < estimate(cfg) / peak < 1.2, (estimate(cfg), peak)


def test_selective_recompute_is_off_for_fused_kernels_and_full_follows_the_method():
    from diff_transformer.models.gpt import recompute_settings

    assert recompute_settings(compose_cfg("trainer.recompute=selective", "model.attention_backend=triton")) == {}
    assert recompute_settings(compose_cfg("trainer.recompute=selective")) == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn"],
    }
    assert recompute_settings(compose_cfg("model=tiny", "trainer.recompute=full", "parallel.pp=2")) == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
    }
    assert recompute_settings(
        compose_cfg("model=tiny", "trainer.recompute=full", "trainer.recompute_method=block", "parallel.pp=2")
    )["recompute_num_layers"] == 2  # block, by default every layer of the stage


# ------------------------------------------------------------------------------------------------------------------
# Sequence parallelism at TP=2 (train.py under torchrun over gloo)
# ------------------------------------------------------------------------------------------------------------------
SAVE_AT_3 = ["checkpoint.interval=3", "checkpoint.save_at_end=false"]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """TP=1 and TP=2 with sequence parallelism, both kinds; DIFF also at TP=2 without it (the TP=2 runs save at step
    3), and resumed from each TP=2 checkpoint with sequence parallelism switched. (The baseline's TP=2 without
    sequence parallelism equals its TP=1 run in tests/test_parallel.py.)"""
    root = tmp_path_factory.mktemp("tp")
    for kind in ("diff", "vanilla"):
        run_train(root / f"{kind}-tp1", COMMON + NO_SAVES + [f"model.attention={kind}"])
        saves = SAVE_AT_3 if kind == "diff" else NO_SAVES
        run_train(root / f"{kind}-tp2-sp", COMMON + saves + [f"model.attention={kind}", "parallel.tp=2",
                                                             "parallel.sequence_parallel=true"], nproc=2)
    run_train(root / "diff-tp2", COMMON + SAVE_AT_3 + ["model.attention=diff", "parallel.tp=2"], nproc=2)
    for source, sequence_parallel in (("diff-tp2-sp", "false"), ("diff-tp2", "true")):
        checkpoint = root / source / "checkpoints" / checkpoint_name(3)
        run_train(
            root / f"diff-resumed-from-{source}", COMMON + NO_SAVES + [
                "model.attention=diff", "parallel.tp=2", f"parallel.sequence_parallel={sequence_parallel}",
                f"checkpoint.resume={checkpoint}",
            ], nproc=2,
        )
    return root


def _assert_same_run(got, want, tol, grad_norm_rel=None, steps=range(1, STEPS + 1)):
    got, want = {r["step"]: r for r in got}, {r["step"]: r for r in want}
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=tol, rel=0), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=grad_norm_rel or tol), step
        if "lambda" in want[step]:
            assert got[step]["lambda"] == pytest.approx(want[step]["lambda"], abs=tol), step


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["diff", "vanilla"])
def test_sequence_parallel_equals_tp2_without_it_and_tp1(kind, tp_runs):
    sp = read_metrics(tp_runs / f"{kind}-tp2-sp")
    if kind == "diff":  # λ and the sub-layer norm: summed over TP once, not also as sequence-parallel norms
        _assert_same_run(sp, read_metrics(tp_runs / "diff-tp2"), 1e-5)
    # TP=2's gradient norm differs from TP=1's in the 5th digit (reduction order), as in tests/test_parallel.py
    _assert_same_run(sp, read_metrics(tp_runs / f"{kind}-tp1"), 1e-5, grad_norm_rel=1e-4)
    assert "sequence parallel on" in (tp_runs / f"{kind}-tp2-sp" / "train.log").read_text()


@pytest.mark.multiproc
@pytest.mark.parametrize("source, target", [("diff-tp2-sp", "diff-tp2"), ("diff-tp2", "diff-tp2-sp")],
                         ids=["with-to-without", "without-to-with"])
def test_checkpoints_resume_across_the_sequence_parallel_switch(source, target, tp_runs):
    resumed = read_metrics(tp_runs / f"diff-resumed-from-{source}")
    _assert_same_run(resumed, read_metrics(tp_runs / target), 1e-5, steps=range(4, STEPS + 1))
    assert f"resumed from {tp_runs / source}" in (tp_runs / f"diff-resumed-from-{source}" / "train.log").read_text()


# ------------------------------------------------------------------------------------------------------------------
# Overlapped data-parallel communication at DP=2
# ------------------------------------------------------------------------------------------------------------------
# two micro-batches per rank (gradients accumulate without communication before the last one's backward reduces
# them), and buckets of 20,000 parameters, so that the debug model's reduction runs in many overlapped pieces
DP2 = COMMON + NO_SAVES + ["model.attention=diff", "trainer.micro_batch_size=2", "parallel.ddp_bucket_size=20000"]
OVERLAP = ["parallel.overlap_grad_reduce=true"]
# The distributed optimizer shards each bucket over the DP ranks, so another bucketing (megatron uses one bucket
# when nothing overlaps) sums the gradient norm in another order: last-bit differences that clipping would carry into
# the weights. Without clipping the update does not read the norm, and the runs are identical.
DIST_OPT = ["parallel.distributed_optimizer=true", "optim.clip_grad=0"]


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2")
    variants = {
        "ddp": [],
        "ddp-overlap": OVERLAP,
        "distopt": DIST_OPT,
        "distopt-overlap": DIST_OPT + OVERLAP + ["parallel.overlap_param_gather=true"],
    }
    for name, extra in variants.items():
        run_train(root / name, DP2 + extra, nproc=2)
    return root


@pytest.mark.multiproc
@pytest.mark.parametrize("variant", ["ddp", "distopt"])
def test_overlapped_communication_gives_identical_losses(variant, dp2_runs):
    off, on = read_metrics(dp2_runs / variant), read_metrics(dp2_runs / f"{variant}-overlap")
    assert [r["step"] for r in on] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    # (with the distributed optimizer the norm is summed shard by shard: bucketing changes the order, the 6th digit)
    assert [r["grad_norm"] for r in on] == pytest.approx([r["grad_norm"] for r in off], rel=1e-5)
    if variant == "ddp":
        assert [r.get("lambda") for r in on] == [r.get("lambda") for r in off]
    else:
        # the parameter all-gather waits for the next forward; λ is read (after gathering early) on logging steps
        logged = [r for r in on if "lambda" in r]
        assert [r["step"] for r in logged] == [STEPS]
        assert logged[0]["lambda"] == off[-1]["lambda"]
    log = (dp2_runs / f"{variant}-overlap" / "train.log").read_text()
    assert "overlapped grad reduce on" in log


# ------------------------------------------------------------------------------------------------------------------
# The memory plan
# ------------------------------------------------------------------------------------------------------------------
def test_parameters_per_stage_match_the_built_model(megatron_single_process):
    from diff_transformer.models.gpt import build_model_chunk, count_parameters
    from diff_transformer.training.accounting import parameters_per_stage

    kinds = [["model=debug", f"model.attention={kind}"]
             for kind in ("vanilla", "diff_v2", "vanilla_subln", "vanilla_wide", "topk", "signed_mask")]
    for overrides in (["model=tiny"], ["model=3b"], ["model=830m", "model.num_kv_heads=2", "model.share_embeddings=false"],
                      ["model=debug", "model.lambda_learnable=false"], *kinds):
        cfg = compose_cfg(*overrides, "model.vocab_size=4096")
        with torch.device("meta"):
            model = build_model_chunk(cfg, 4096, perform_init=False)
        assert parameters_per_stage(cfg, 4096)["first"] == count_parameters([model]), overrides


THREE_B = ["model=3b", "optim=adamw_3b", "trainer.global_batch_size=1024", "trainer.micro_batch_size=4"]


def _estimate(*overrides, world=8):
    from diff_transformer.training.accounting import estimate_memory_per_gpu

    return estimate_memory_per_gpu(compose_cfg(*THREE_B, *overrides), torch.bfloat16, world, 100352, "cuda")


def test_the_estimate_accounts_for_every_switch():
    base = _estimate()
    for changes in (["trainer.recompute=selective"], ["trainer.recompute=full"], ["trainer.micro_batch_size=2"],
                    ["parallel.distributed_optimizer=true"], ["parallel.tp=2"], ["parallel.pp=2"]):
        assert _estimate(*changes)["total"] < base["total"], changes
    tp2 = _estimate("parallel.tp=2")
    assert _estimate("parallel.tp=2", "parallel.sequence_parallel=true")["activations"] < tp2["activations"]
    # full recomputation of every layer keeps less than recomputing only the first half of each stage's layers
    half = _estimate("trainer.recompute=full", "trainer.recompute_method=block", "trainer.recompute_layers=14")
    assert _estimate("trainer.recompute=full")["activations"] < half["activations"] < base["activations"]
    # the fused kernel keeps no maps: selective recomputation has nothing to drop
    triton = _estimate("model.attention_backend=triton")
    assert _estimate("model.attention_backend=triton", "trainer.recompute=selective") == triton
    # eager attention keeps fp32 maps, which selective recomputation drops
    assert _estimate("model.attention_backend=eager")["activations"] > 3 * base["activations"]
    assert _estimate("model.attention_backend=eager", "trainer.recompute=selective")["activations"] < (
        1.1 * _estimate("trainer.recompute=selective")["activations"]
    )


def test_memory_plan_names_each_switch_that_fits_with_its_estimate():
    from diff_transformer.training.accounting import memory_plan_problem

    cfg = compose_cfg(*THREE_B, "parallel.distributed_optimizer=true")
    base = _estimate("parallel.distributed_optimizer=true")
    message = memory_plan_problem(cfg, torch.bfloat16, 8, 100352, 64.0, device="cuda")
    assert message.startswith(f"estimated memory per GPU {base['total']:.1f} GiB (weights ")
    assert "exceeds the 57.6 GiB usable of 64 GiB" in message
    fits = message.split("; each of these fits: ")[1].split(", ")
    full = _estimate("parallel.distributed_optimizer=true", "trainer.recompute=full")["total"]
    mbs1 = _estimate("parallel.distributed_optimizer=true", "trainer.micro_batch_size=1")["total"]
    tp2 = _estimate("parallel.distributed_optimizer=true", "parallel.tp=2", "parallel.sequence_parallel=true")["total"]
    assert fits == [
        f"trainer.recompute=full ({full:.1f} GiB)",  # micro-batch 2 does not fit: the largest that fits is named
        f"trainer.micro_batch_size=1 ({mbs1:.1f} GiB)",
        f"parallel.tp=2 parallel.sequence_parallel=true ({tp2:.1f} GiB)",
    ]
    assert memory_plan_problem(cfg, torch.bfloat16, 8, 100352, 141.0, device="cuda") is None  # fits an H200


def test_memory_plan_combines_switches_when_none_fits_alone():
    from diff_transformer.training.accounting import memory_plan_problem

    cfg = compose_cfg(*THREE_B)
    message = memory_plan_problem(cfg, torch.bfloat16, 8, 100352, 36.0, device="cuda")
    together = message.split("no single switch fits, these together do (each estimate with those before it): ")[1]
    # full recomputation replaces the selective one tried before it
    assert [part.split(" (")[0] for part in together.split(", ")] == [
        "parallel.distributed_optimizer=true", "trainer.recompute=full", "trainer.micro_batch_size=2",
    ]
    message = memory_plan_problem(cfg, torch.bfloat16, 1, 100352, 24.0, device="cuda")
    assert "not even all switches together fit at 1 GPUs" in message


def test_train_py_refuses_a_launch_that_cannot_fit(tmp_path):
    # 830M at micro-batch 4 on one process (fp32 on a CPU) within a stated 40 GiB
    proc = run_train(
        tmp_path, ["model=830m", "trainer.max_steps=10", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                   "optim.warmup_steps=1", "trainer.gpu_memory_gib=40", "logging.wandb.mode=disabled"],
        expect_rc=2,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "exceeds the 36.0 GiB usable of 40 GiB" in errors[0]
    assert "each of these fits: trainer.recompute=full (" in errors[0]
    assert not (tmp_path / "metrics.jsonl").exists()
