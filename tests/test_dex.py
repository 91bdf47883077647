"""DEX: differential attention added to a pretrained softmax model (model.attention=dex).

In process: the adapted model starts exactly equal to the base model, only the selected heads get W_D and only the
new parameters train by default, and the calibration criterion picks the heads it should on a constructed model.
End to end (train.py): a short adaptation of a smoke-trained vanilla model lowers its validation loss. (TP=2 with a
calibration over both ranks and W_D saved per head: tests/test_hf.py, from an imported Llama.)
"""

import pytest
import torch
from hydra import compose, initialize_config_dir

from diff_transformer.config import register_configs, to_object
from tests.train_runs import REPO, read_metrics, run_train

SMOKE = ["experiment=smoke", "trainer.eval_interval=0", "optim.warmup_steps=2"]
register_configs()


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_object(compose("config", overrides=["model=debug", "model.vocab_size=4096", *overrides]))


def build(cfg):
    from diff_transformer.models.gpt import build_model_chunk

    return build_model_chunk(cfg, 4096)


def logits(chunk, tokens):
    with torch.no_grad():
        return chunk(tokens, torch.arange(tokens.shape[1])[None].expand_as(tokens), None)


def dex_from(base, heads, **overrides):
    """A DEX model with ``heads`` selected, holding ``base``'s weights (its own parameters initial)."""
    from diff_transformer.models.gpt import dex_parameter_keys

    cfg = compose_cfg("model.attention=dex", *[f"model.{k}={v}" for k, v in overrides.items()])
    cfg.model.dex.heads = heads
    chunk = build(cfg)
    missing, unexpected = chunk.load_state_dict(base.state_dict(), strict=False)
    assert sorted(missing) == sorted(dex_parameter_keys(chunk)) and unexpected == []
    return chunk, cfg


def test_dex_starts_exactly_equal_to_the_base_model(megatron_single_process):
    from diff_transformer.models.gpt import dex_attention_modules

    base = build(compose_cfg("model.attention=vanilla"))
    dex, _ = dex_from(base, [[0, 1, 2, 3], [0, 1, 2, 3]])
    for module in dex_attention_modules([dex]):
        module.set_anneal_fraction(0.7)  # λ away from λ_init: W_D = 0 alone makes the start exact
    tokens = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(base, tokens), logits(dex, tokens))
    with torch.no_grad():
        dex_attention_modules([dex])[0].w_d["2"].normal_(std=0.5)
    assert not torch.allclose(logits(base, tokens), logits(dex, tokens))


def test_only_the_selected_heads_get_w_d_and_only_new_parameters_train(megatron_single_process):
    from diff_transformer.models.gpt import freeze_all_but_dex

    base = build(compose_cfg("model.attention=vanilla"))
    dex, _ = dex_from(base, [[0, 3], [1]])
    w_d = sorted(name for name, _ in dex.named_parameters() if ".w_d." in name)
    assert w_d == [
        "decoder.layers.0.self_attention.core_attention.w_d.0",
        "decoder.layers.0.self_attention.core_attention.w_d.3",
        "decoder.layers.1.self_attention.core_attention.w_d.1",
    ]
    freeze_all_but_dex(dex)
    trainable = sorted(name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
                       for name, p in dex.named_parameters() if p.requires_grad)
    assert len(trainable) == 3 + 2 * 4 and all(n.split(".")[0] in ("w_d", "core_attention") for n in trainable)


def _set_head(qkv, heads, d, head, scale_q=None, scale_k=None):
    """Scale query head ``head`` and its key head in a megatron QKV weight (no GQA: one KV head per query head)."""
    from diff_transformer.hf.convert import merge_qkv, split_qkv

    q, k, v = (t.clone().view(heads, d, -1) for t in split_qkv(qkv, heads, heads, d))
    if scale_q is not None:
        q[head] *= scale_q
    if scale_k is not None:
        k[head] *= scale_k
    return merge_qkv(q.reshape(heads * d, -1), k.reshape(heads * d, -1), v.reshape(heads * d, -1), heads, heads, d)


def test_calibration_picks_the_heads_the_criterion_names(megatron_single_process):
    """Heads with zero queries attend uniformly (normalised entropy 1) and, with their output projection columns
    zeroed, do not matter (importance 0): score 1, the highest possible. Heads with 30x queries and keys attend to
    one key (entropy near 0) and feed the output: score near -1. Layer 1 makes heads 0 and 2 the first kind,
    layer 2 heads 1 and 3; the selection with head_fraction 0.5 must be exactly those."""
    from diff_transformer.models.gpt import dex_attention_modules
    from diff_transformer.training.dex import select_heads

    base = build(compose_cfg("model.attention=vanilla"))
    heads, d = 4, 16
    sd = base.state_dict()
    for layer, noisy in ((0, (0, 2)), (1, (1, 3))):
        key = f"decoder.layers.{layer}.self_attention."
        qkv, proj = sd[key + "linear_qkv.weight"], sd[key + "linear_proj.weight"].clone()
        for h in range(heads):
            if h in noisy:
                qkv = _set_head(qkv, heads, d, h, scale_q=0.0)
                proj[:, h * d : (h + 1) * d] = 0.0
            else:
                qkv = _set_head(qkv, heads, d, h, scale_q=30.0, scale_k=30.0)
        sd[key + "linear_qkv.weight"], sd[key + "linear_proj.weight"] = qkv, proj
    base.load_state_dict(sd)
    dex, _ = dex_from(base, [[], []])
    modules = dex_attention_modules([dex])
    for module in modules:
        module.calibrating = True
    tokens = torch.randint(0, 4096, (4, 65), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(64)[None].expand(4, 64)
    dex(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().backward()
    stats = {m.layer_number: m.head_statistics() for m in modules}
    for layer, noisy in ((1, (0, 2)), (2, (1, 3))):
        for h in noisy:
            assert stats[layer][h][0] == pytest.approx(1.0, abs=1e-6) and stats[layer][h][1] == 0.0
        for h in set(range(heads)) - set(noisy):
            assert stats[layer][h][0] < 0.3 and stats[layer][h][1] > 0.0
    assert select_heads(stats, 0.5) == [[0, 2], [1, 3]]
    assert select_heads(stats, 0.25) == [[0], [1]]  # ties go to the lower index


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A smoke-trained vanilla model; DEX on it (calibrated heads) and, as the base's own validation loss, the same
    run with no head selected (only λ, which then does nothing, trains): same steps, data and validation set."""
    root = tmp_path_factory.mktemp("dex")
    run_train(root / "base", SMOKE + ["model.attention=vanilla", "trainer.max_steps=20"])
    adaptation = SMOKE + [
        "model.attention=dex", "trainer.max_steps=12", "trainer.eval_interval=12", "trainer.eval_iters=4",
        "optim.lr=1e-2", "checkpoint.save_at_end=false", f"checkpoint.load_weights_only={root / 'base'}",
        "model.dex.calibration_samples=8",
    ]
    run_train(root / "dex", adaptation + ["checkpoint.save_at_end=true"])
    run_train(root / "none", adaptation + ["model.dex.select=none"])
    run_train(root / "dex_pp2", adaptation + ["parallel.pp=2"], nproc=2)
    return root


def test_short_adaptation_lowers_the_validation_loss(adapted):
    dex, none = read_metrics(adapted / "dex")[-1], read_metrics(adapted / "none")[-1]
    assert dex["step"] == none["step"] == 12
    assert dex["val_loss"] < none["val_loss"], (dex["val_loss"], none["val_loss"])
    assert len(dex["lambda"]) == 2 and all(lam == lam for lam in dex["lambda"])
    log = (adapted / "dex" / "train.log").read_text()
    assert "DEX calibration, layer 1" in log and "only W_D and λ train" in log


def test_evaluation_loads_an_adapted_dex_model_with_its_annealed_lambda(adapted, megatron_single_process):
    """evaluate's loader and the export's loader build the same function from a DEX checkpoint (λ where the
    annealing had taken it, not λ_init)."""
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run
    from diff_transformer.training.checkpoint_tools import load_single_rank_model

    model = load_for_inference(resolve_run(str(adapted / "dex")))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    got = model.logits(tokens)
    reference, _, state = load_single_rank_model(model.run.checkpoint, torch.float32)
    assert state["step"] == 12
    fractions = {m.anneal_fraction for m in reference.modules() if hasattr(m, "anneal_fraction")}
    assert fractions and 0 not in fractions
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    torch.testing.assert_close(got, reference(tokens, positions, None), rtol=0, atol=0)


@pytest.mark.multiproc
def test_dex_at_pp2_calibrates_and_trains_as_one_process(adapted):
    """Each pipeline stage calibrates its own layers: the same heads, and the same losses step for step."""
    one, two = read_metrics(adapted / "dex"), read_metrics(adapted / "dex_pp2")
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])
    heads = [line for line in (adapted / "dex" / "train.log").read_text().splitlines() if "DEX heads per layer" in line]
    heads_pp2 = [line for line in (adapted / "dex_pp2" / "train.log").read_text().splitlines()
                 if "DEX heads per layer" in line]
    assert heads and heads[0].rsplit("): ", 1)[-1] == heads_pp2[0].rsplit("): ", 1)[-1]
