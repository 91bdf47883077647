"""Every attention kind beyond DIFF V1 and its baseline, through train.py over gloo: TP=2 equals TP=1, a TP=2
checkpoint resumes at TP=1 with the same losses, and `checkpoint convert` turns TP=2 and TP=1 checkpoints of the same
training into the same full tensors. DIFF V2 also starts identically at TP=1, TP=2 and PP=2.

Per kind, one run at TP=2 (4 steps, checkpoints at 2 and 4) and one at TP=1 resumed from its step 2: steps 3 and 4
are then computed from the same state on both layouts, and the step-4 checkpoints hold the weights after two
optimizer steps on each layout (a gradient that is not summed over the TP ranks shows up there, also through Adam).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diff_transformer.training.checkpoint import checkpoint_name
from tests.train_runs import REPO, read_metrics, run_train, train_env

KINDS = ("diff_v2", "vanilla_subln", "vanilla_wide", "topk", "signed_mask")
STEPS = 4
COMMON = [
    "experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=0", "optim.warmup_steps=1",
    "trainer.micro_batch_size=2", "trainer.global_batch_size=4",
]
SAVING = ["checkpoint.interval=2"]
NOT_SAVING = ["checkpoint.interval=0", "checkpoint.save_at_end=false"]
# topk with k below the debug model's 64 positions, so that the sparsity is exercised
KIND_OVERRIDES = {"topk": ["model.topk=8"]}


def ckpt(run_dir, step):
    return str(Path(run_dir) / "checkpoints" / checkpoint_name(step))


def convert_all(pairs):
    """`checkpoint convert` for each (checkpoint, output) in one process (as the CLI does it, once per pair)."""
    script = (
        "import sys\nfrom diff_transformer.checkpoint import main\n"
        "pairs = sys.argv[1:]\n"
        "for src, out in zip(pairs[::2], pairs[1::2]):\n"
        "    assert main(['convert', src, out]) == 0, src\n"
    )
    args = [str(x) for pair in pairs for x in pair]
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=train_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def kind_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    for kind in KINDS:
        base = COMMON + [f"model.attention={kind}"] + KIND_OVERRIDES.get(kind, [])
        run_train(root / kind / "tp2", base + SAVING + ["parallel.tp=2"], nproc=2)
        run_train(root / kind / "resumed_tp1", base + SAVING + [f"checkpoint.resume={ckpt(root / kind / 'tp2', 2)}"])
    v2 = COMMON + ["model.attention=diff_v2"] + NOT_SAVING
    run_train(root / "diff_v2" / "tp1", v2)
    run_train(root / "diff_v2" / "pp2", v2 + ["parallel.pp=2"], nproc=2)
    convert_all(
        (ckpt(root / kind / run, STEPS), root / kind / f"{run}.pt") for kind in KINDS for run in ("tp2", "resumed_tp1")
    )
    return root


def _assert_same_steps(got, want, steps):
    got, want = {r["step"]: r for r in got}, {r["step"]: r for r in want}
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5, rel=0), f"step {step}"
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), f"step {step}"


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_checkpoint_resumes_at_tp1_with_the_same_losses(kind, kind_runs):
    tp2, resumed = read_metrics(kind_runs / kind / "tp2"), read_metrics(kind_runs / kind / "resumed_tp1")
    assert [r["step"] for r in resumed] == [3, 4]
    _assert_same_steps(resumed, tp2, (3, 4))
    assert len({round(r["loss"], 4) for r in tp2}) > 1
    described = [json.loads((kind_runs / kind / run / "run.json").read_text()) for run in ("tp2", "resumed_tp1")]
    assert described[0]["num_parameters"] == described[1]["num_parameters"], "replicated parameters counted once"


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_diff_v2_at_tp2_and_pp2_matches_tp1_from_the_first_step(layout, kind_runs):
    got, want = read_metrics(kind_runs / "diff_v2" / layout), read_metrics(kind_runs / "diff_v2" / "tp1")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    _assert_same_steps(got, want, range(1, STEPS + 1))


@pytest.mark.multiproc
def test_diff_v2_logs_per_token_lambda_on_logging_steps_equal_across_layouts(kind_runs):
    """λ's mean and spread per layer on the logging step (the last; smoke logs every 5) and on no other, the same
    whether the heads are split over TP ranks or the layers over pipeline stages; run.json names V2's baseline."""
    logged = {}
    for layout in ("tp1", "tp2", "pp2"):
        rows = read_metrics(kind_runs / "diff_v2" / layout)
        assert [r["step"] for r in rows if "lambda_mean" in r] == [STEPS], layout
        logged[layout] = rows[-1]
    for layout in ("tp2", "pp2"):
        for key in ("lambda_mean", "lambda_std"):
            assert logged[layout][key] == pytest.approx(logged["tp1"][key], abs=1e-5), (layout, key)
    means, stds = logged["tp1"]["lambda_mean"], logged["tp1"]["lambda_std"]
    assert len(means) == len(stds) == 2 and all(0 < m < 1 for m in means) and all(0 < s < 0.5 for s in stds)
    described = json.loads((kind_runs / "diff_v2" / "tp1" / "run.json").read_text())
    assert described["baseline_variant"] == "vanilla num_kv_heads=1"  # debug: H = Hkv = 2


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", KINDS)
def test_convert_gives_full_tensors_equal_across_layouts(kind, kind_runs, megatron_single_process):
    import torch
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.models.gpt import build_model_chunk

    from_tp2 = torch.load(kind_runs / kind / "tp2.pt", weights_only=False)
    from_tp1 = torch.load(kind_runs / kind / "resumed_tp1.pt", weights_only=False)
    assert from_tp2["step"] == from_tp1["step"] == STEPS and from_tp2["model"].keys() == from_tp1["model"].keys()
    for name, tensor in from_tp2["model"].items():
        torch.testing.assert_close(tensor, from_tp1["model"][name], rtol=0, atol=1e-5, msg=name)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), from_tp2["config"]))
    model = build_model_chunk(cfg, from_tp2["model"]["embedding.word_embeddings.weight"].shape[0])
    missing, unexpected = model.load_state_dict(from_tp2["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    weights = from_tp2["model"]
    E, H, d = 64, 2, 16  # the debug model
    if kind == "diff_v2":  # W_λ and the output projection from H·d, whole (TP-sharded on save, gathered on load)
        assert weights["decoder.layers.1.self_attention.linear_lambda.weight"].shape == (H, E)
        assert weights["decoder.layers.1.self_attention.linear_proj.weight"].shape == (E, H * d)
        assert weights["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((2 * H + 2 * H) * d, E)
    if kind == "signed_mask":  # replicated on TP ranks: every head's logits, moved by training
        logits = weights["decoder.layers.0.self_attention.core_attention.mask_logits"]
        assert logits.shape == (2 * H, 32) and not torch.all(logits == -3.0)
    if kind == "vanilla_wide":
        assert weights["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((H + 2 * H) * 2 * d, E)
