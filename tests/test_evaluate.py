"""evaluate and analyze end to end on smoke-trained checkpoints (DIFF and vanilla, made once for the module, and a
TP=2 DIFF checkpoint with its TP=1 conversion); the NIAH generator and its scoring; training-time diagnostics; bad
inputs. The commands run as users run them (subprocesses of this worktree's code), except where noted."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.train_runs import REPO, read_metrics, run_train, train_env

SHORT = ["experiment=smoke", "optim.warmup_steps=1", "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
DEBUG_SEQ = 64
DEBUG_LAYERS = 2


def run_tool(module, *args, expect_rc=0):
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=train_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect_rc, f"{module} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """diff: 4 steps, checkpoints at 2 and 4, diagnostics on every 2 steps; vanilla: 2 steps; tp2: DIFF at TP=2 and
    its `checkpoint convert` to one TP=1 file."""
    root = tmp_path_factory.mktemp("eval_runs")
    run_train(root / "diff", SHORT + ["model.attention=diff", "trainer.max_steps=4", "checkpoint.interval=2",
                                      "trainer.eval_interval=2", "trainer.eval_iters=1",
                                      "trainer.attention_diagnostics=on"])
    run_train(root / "vanilla", SHORT + ["model.attention=vanilla", "trainer.max_steps=2", "trainer.eval_interval=0"])
    run_train(root / "tp2", SHORT + ["model.attention=diff", "trainer.max_steps=2", "trainer.eval_interval=2",
                                     "trainer.eval_iters=1", "trainer.attention_diagnostics=on", "parallel.tp=2"],
              nproc=2)
    run_tool("diff_transformer.checkpoint", "convert", root / "tp2", root / "tp2_as_tp1.pt")
    return root


def finite(x):
    return x is not None and math.isfinite(x)


# ------------------------------------------------------------------------------------------------------------------
# evaluate
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluated(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    text = out / "poem.txt"
    text.write_text("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n" * 20)
    run_tool("diff_transformer.evaluate", runs / "diff", runs / "vanilla", "--tasks", "ppl,niah", "--text", text,
             "--max-tokens", 3000, "--needles", 2, "--asked", 1, "--lengths", DEBUG_SEQ, "--depths", "0,0.5,1",
             "--samples", 2, "--out", out / "result")
    return out / "result"


def test_evaluate_writes_complete_results_for_both_runs(evaluated):
    table = (evaluated / "comparison.md").read_text()
    assert "diff @ step 4" in table and "vanilla @ step 2" in table
    for png in ("ppl_by_position.png", "niah_accuracy.png", "niah_attention.png"):
        assert (evaluated / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("diff_step_4", "vanilla_step_2"):
        result = json.loads((evaluated / name / "eval.json").read_text())
        validation = result["ppl"]["validation"]
        assert validation["tokens"] == 3000 - 1 and finite(validation["nll"])
        assert validation["perplexity"] == pytest.approx(math.exp(validation["nll"]))
        assert 5.0 < validation["nll"] < 9.0  # near log(4096) = 8.3 after a few steps
        assert len(validation["position_nll"]) == DEBUG_SEQ and all(finite(v) for v in validation["position_nll"])
        poem = result["ppl"]["text:poem.txt"]
        assert finite(poem["nll"]) and poem["tokens"] > 100
        niah = result["niah"]
        assert niah["config"]["lengths"] == [DEBUG_SEQ] and 0.0 <= niah["accuracy"] <= 1.0
        assert np.array(niah["accuracy_by_length_depth"]).shape == (1, 3)
        allocation = niah["attention_allocation"]
        assert sorted(allocation, key=int) == [str(layer) for layer in range(1, DEBUG_LAYERS + 1)]
        for shares in allocation.values():
            assert set(shares) == {"answer", "distractors", "haystack", "queries"}
            assert all(0.0 <= v <= 1.0 for v in shares.values())
            assert sum(shares.values()) == pytest.approx(1.0, abs=1e-5)  # every key belongs to one region
        uniform = niah["uniform_allocation"]  # the figure's reference: shares of the keys each answer row sees
        assert set(uniform) == set(shares) and sum(uniform.values()) == pytest.approx(1.0)
        assert 0.0 < uniform["answer"] < uniform["haystack"] < 1.0  # a needle is a sentence, the haystack most keys
        assert "The magic number for" in niah["example"]
    assert len(json.loads((evaluated / "diff_step_4" / "eval.json").read_text())["lambda"]) == DEBUG_LAYERS


def test_tp2_checkpoint_scores_as_its_tp1_conversion(runs, megatron_single_process):
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run
    from diff_transformer.evaluation.perplexity import stream_perplexity, validation_stream

    saved = resolve_run(str(runs / "tp2"))
    converted = resolve_run(str(runs / "tp2_as_tp1.pt"))
    stream, _ = validation_stream(saved.config, 1000)
    results = []
    for run in (saved, converted):
        model = load_for_inference(run)
        results.append((stream_perplexity(model, stream, batch_size=4), model.token_nll(torch.from_numpy(stream[None, :65]))))
    (ppl_tp2, nll_tp2), (ppl_tp1, nll_tp1) = results
    assert ppl_tp2.tokens == ppl_tp1.tokens == 999
    assert abs(ppl_tp2.nll - ppl_tp1.nll) < 1e-5
    assert (nll_tp2 - nll_tp1).abs().max().item() < 1e-5
    assert saved.checkpoint != converted.checkpoint and saved.step == converted.step == 2


# ------------------------------------------------------------------------------------------------------------------
# analyze
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def analyzed(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze")
    run_tool("diff_transformer.analyze", runs / "diff", runs / "vanilla", "--sequences", 2, "--out", out / "pair")
    run_tool("diff_transformer.analyze", runs / "diff", "--niah", "--needles", 2, "--asked", 1, "--sequences", 2,
             "--no-trajectory", "--out", out / "niah")
    return out


def check_layers(result, heads, differential):
    N = result["probe"]["length"]
    assert [layer["layer"] for layer in result["layers"]] == list(range(1, DEBUG_LAYERS + 1))
    for layer in result["layers"]:
        sections = {"combined", "A1", "A2"} if differential else {"combined"}
        assert set(layer["maps"]) == sections
        for metrics in layer["maps"].values():
            for name in ("entropy", "gini", "top1pct_mass", "topk_mass", "first_token_mass", "sink"):
                assert len(metrics[name]) == heads, name
            assert all(0 <= v <= math.log(N) + 1e-5 for v in metrics["entropy"])
            for name in ("gini", "top1pct_mass", "topk_mass", "first_token_mass"):
                assert all(finite(v) and -1e-6 <= v <= 1 + 1e-6 for v in metrics[name]), name
        for source in ("logits", "hidden"):
            profile = layer[source]
            assert set(profile) == {"top1", "top10", "top100", "median"}
            assert profile["top1"] >= profile["top10"] >= profile["top100"] >= 0 and finite(profile["top1"])
        assert ("differential" in layer) == differential
        if differential:
            d = layer["differential"]
            for name in ("cosine_relevant", "cosine_irrelevant"):
                assert all(finite(v) and -1e-6 <= v <= 1 + 1e-6 for v in d[name]), name
            for name in ("kl_relevant", "kl_irrelevant", "negative_mass"):
                assert all(finite(v) and v >= 0 for v in d[name]), name
            for name in ("negative_fraction", "negative_relative_mass"):
                assert all(0 <= v <= 1 for v in d[name]), name
            for name in ("effective_rank_lambda_A2", "effective_rank_A1", "effective_rank_A1_minus_lambda_A2"):
                assert all(1 <= v <= N + 1e-3 for v in d[name]), name
            assert finite(layer["lambda"])
        assert all(v is None or finite(v) for v in layer["mean"].values())


def test_analyze_writes_every_metric_for_every_layer(analyzed, runs):
    pair = analyzed / "pair"
    assert (pair / "analysis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    diff = json.loads((pair / "diff_step_4" / "analysis.json").read_text())
    vanilla = json.loads((pair / "vanilla_step_2" / "analysis.json").read_text())
    check_layers(diff, heads=2, differential=True)  # debug: H = 2 differential heads
    check_layers(vanilla, heads=4, differential=False)  # its mirror: 2H softmax heads
    assert diff["probe"] == {"source": "validation", "sequences": 2, "length": DEBUG_SEQ,
                             "relevant_keys": "each query row's top-8 keys of the combined map"}
    # λ over the run's checkpoints (steps 2 and 4), the last equal to the analysed checkpoint's
    assert [t["step"] for t in diff["lambda_trajectory"]] == [2, 4]
    assert diff["lambda_trajectory"][-1]["lambda"] == pytest.approx(diff["lambda"])
    assert diff["lambda_trajectory"][0]["lambda"] != diff["lambda_trajectory"][1]["lambda"]
    assert vanilla["lambda_trajectory"] == [] and "lambda" not in vanilla
    assert "differential/effective_rank_lambda_A2" in (pair / "comparison.md").read_text()


def test_analyze_on_niah_probes_splits_keys_at_the_needles(analyzed):
    result = json.loads((analyzed / "niah" / "analysis.json").read_text())
    assert result["probe"]["source"] == "niah" and result["probe"]["length"] == DEBUG_SEQ
    check_layers(result, heads=2, differential=True)
    assert "lambda_trajectory" not in result


# ------------------------------------------------------------------------------------------------------------------
# Training-time diagnostics
# ------------------------------------------------------------------------------------------------------------------
def test_training_logs_attention_diagnostics_on_eval_steps(runs):
    records = {r["step"]: r for r in read_metrics(runs / "diff")}
    for step in (2, 4):
        r = records[step]
        assert len(r["attn/entropy"]) == len(r["attn/sink_rate"]) == len(r["attn/max_logit"]) == DEBUG_LAYERS
        assert all(0 < e <= math.log(DEBUG_SEQ) for e in r["attn/entropy"])
        assert all(s in (0.0, 0.5, 1.0) for s in r["attn/sink_rate"])  # two heads a layer, probe of 2 sequences
        assert all(finite(m) for m in r["attn/max_logit"]) and r["attn/seconds"] > 0
    assert "attn/entropy" not in records[1] and "attn/entropy" not in records[3]
    # at TP=2 each rank holds one head of a layer: the sums over the TP group cover both
    tp2 = {r["step"]: r for r in read_metrics(runs / "tp2")}[2]
    assert len(tp2["attn/entropy"]) == DEBUG_LAYERS and all(0 < e <= math.log(DEBUG_SEQ) for e in tp2["attn/entropy"])
    assert all(s in (0.0, 0.25, 0.5, 0.75, 1.0) for s in tp2["attn/sink_rate"])
    log = (runs / "diff" / "train.log").read_text()
    assert "attention diagnostics on (trainer.attention_diagnostics=on" in log


def test_diagnostics_agree_with_the_analysis_metrics(runs, megatron_single_process):
    """The diagnostics' block-wise entropy and sink rate equal the metrics computed on the whole maps."""
    from diff_transformer import attention_metrics as am
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run
    from diff_transformer.models.attention_maps import capture_attention
    from diff_transformer.training import diagnostics

    model = load_for_inference(resolve_run(str(runs / "diff")))
    tokens = torch.randint(0, 4000, (2, DEBUG_SEQ), generator=torch.Generator().manual_seed(0))
    sums, whole = {}, {}

    def on_maps(layer, maps_for):
        diagnostics._measure_layer(sums, layer, maps_for)
        whole[layer] = maps_for(None)

    old_block = diagnostics.ROW_BLOCK
    diagnostics.ROW_BLOCK = 24  # several blocks, the last one short
    try:
        with capture_attention([model.model], on_maps):
            model.logits(tokens)
    finally:
        diagnostics.ROW_BLOCK = old_block
    for layer, maps in whole.items():
        weights = am.normalized_magnitude(maps.combined)
        entropy_sum, rows, sinks, heads, max_logit = sums[layer].values.tolist()
        assert entropy_sum / rows == pytest.approx(am.entropy(weights).mean().item(), rel=1e-5)
        assert sinks / heads == am.sink_rate(weights).item()
        assert max_logit == pytest.approx(max(x.max().item() for x in maps.logits.values()))


# ------------------------------------------------------------------------------------------------------------------
# NIAH generator and scoring
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(runs):
    from data.tokenizer import load_tokenizer
    from diff_transformer.evaluation.inference import resolve_run

    return load_tokenizer(resolve_run(str(runs / "vanilla")).tokenizer_dir)


def haystack_tokens(tokenizer):
    text = (REPO / "README.md").read_text()
    return np.array(tokenizer.encode(text), dtype=np.int64)


def test_niah_generator_is_deterministic_and_places_needles_at_their_depths(tokenizer):
    from diff_transformer.evaluation import niah

    config = niah.NiahConfig(needles=4, asked=2, lengths=(160, 256), depths=(0.0, 0.5, 1.0), samples=3, seed=7)
    hay = haystack_tokens(tokenizer)
    first, again = niah.generate(config, tokenizer, hay), niah.generate(config, tokenizer, hay)
    assert [s.tokens for s in first] == [s.tokens for s in again]
    other = niah.generate(niah.NiahConfig(**{**config.__dict__, "seed": 8}), tokenizer, hay)
    assert [s.tokens for s in first] != [s.tokens for s in other]
    assert len(first) == 2 * 3 * 3
    for sample in first:
        assert len(sample.tokens) == sample.length
        haystack_len = sum(sample.haystack_mask)
        asked = [n for n in sample.needles if n.asked]
        assert len(asked) == 2 and len(sample.queries) == 2
        # the asked needles sit together where depth·(haystack length) haystack tokens precede them
        before = sum(sample.haystack_mask[:min(n.span[0] for n in asked)])
        assert before == round(sample.depth * haystack_len)
        spans = sorted(n.span for n in asked)
        assert spans[0][1] == spans[1][0]  # adjacent
        text = tokenizer.decode(sample.tokens)
        context = tokenizer.decode(sample.tokens[:sample.queries[0].span[0]])
        for needle in sample.needles:
            sentence = f"The magic number for {needle.key} is {needle.value}."
            assert context.count(sentence) == 1  # the answer can be read from the prompt
            assert tokenizer.decode(sample.tokens[slice(*needle.span)]).strip() == sentence
        for query in sample.queries:
            needle = sample.needles[query.needle]
            assert needle.asked and tokenizer.decode(sample.tokens[slice(*query.answer)]).strip() == needle.value
        assert text.endswith(".")


def test_a_perfect_oracle_scores_one_and_a_blind_one_zero(tokenizer):
    from diff_transformer.evaluation import niah

    config = niah.NiahConfig(needles=3, asked=2, lengths=(128, 200), depths=(0.0, 0.5, 1.0), samples=2, seed=1)
    samples = niah.generate(config, tokenizer, haystack_tokens(tokenizer))
    results = niah.score(samples, niah.induction_oracle)
    assert niah.accuracy_grid(config, samples, results) == [[1.0] * 3, [1.0] * 3]
    blind = niah.score(samples, lambda tokens: torch.zeros_like(tokens))  # always predicts token 0
    assert niah.accuracy_grid(config, samples, blind) == [[0.0] * 3, [0.0] * 3]


def test_sliding_windows_score_every_target_once():
    from diff_transformer.evaluation.perplexity import sliding_windows

    for num_tokens, L, stride in ((10, 4, 2), (100, 16, 16), (17, 16, 5), (5, 16, 8), (2, 4, 1)):
        windows = sliding_windows(num_tokens, L, stride)
        scored = [t for w in windows for t in range(w.first_scored, w.stop)]
        assert scored == list(range(1, num_tokens))
        assert all(w.stop - w.start <= L + 1 and w.first_scored > w.start for w in windows)
        # after the first window, every target sees at least L − stride tokens of context
        assert all(w.first_scored - w.start >= min(L - stride, w.first_scored) for w in windows[1:])


# ------------------------------------------------------------------------------------------------------------------
# Bad input: one `error:` line naming the problem
# ------------------------------------------------------------------------------------------------------------------
def error_line(capsys, module_main, argv):
    assert module_main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_bad_inputs_give_one_error_line(runs, tmp_path, capsys):
    from diff_transformer.analyze import main as analyze_main
    from diff_transformer.evaluate import main as evaluate_main

    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    assert "is not a checkpoint" in error_line(capsys, evaluate_main, [str(empty_dir)])
    assert "is not a checkpoint" in error_line(capsys, analyze_main, [str(empty_dir)])

    saved = torch.load(runs / "tp2_as_tp1.pt", weights_only=True)
    saved["config"]["data"]["tokenizer_dir"] = str(tmp_path / "gone")
    torch.save(saved, tmp_path / "no_tokenizer.pt")
    line = error_line(capsys, evaluate_main, [str(tmp_path / "no_tokenizer.pt")])
    assert "tokenizer is missing" in line and str(tmp_path / "gone") in line

    (tmp_path / "empty.txt").write_text("")
    line = error_line(capsys, evaluate_main, [str(runs / "diff"), "--tasks", "ppl", "--text", str(tmp_path / "empty.txt")])
    assert "empty.txt is empty" in line
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    line = error_line(capsys, evaluate_main, [str(runs / "diff"), "--text", str(tmp_path / "latin1.txt")])
    assert "latin1.txt is not UTF-8" in line
    line = error_line(capsys, analyze_main, [str(runs / "diff"), "--batch", str(tmp_path / "latin1.txt")])
    assert "latin1.txt is not UTF-8" in line

    line = error_line(capsys, evaluate_main, [str(runs / "diff"), "--tasks", "niah", "--lengths", "128"])
    assert "context length 128 is above the model's maximum sequence length 64" in line
    line = error_line(capsys, analyze_main, [str(runs / "diff"), "--length", "65"])
    assert "--length 65" in line and "maximum sequence length" in line
    assert "--tasks 'ppl,mmlu'" in error_line(capsys, evaluate_main, [str(runs / "diff"), "--tasks", "ppl,mmlu"])


def test_the_command_line_prints_only_the_error(tmp_path):
    proc = run_tool("diff_transformer.evaluate", tmp_path, expect_rc=2)
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path} is not a checkpoint: give a step_* checkpoint "
                                                "directory (holding trainer_state.json), a checkpoints directory or "
                                                "run directory holding one, or a latest file"]


def test_auto_diagnostics_follow_the_cost_estimate():
    """auto: on for the quickstart (evaluations every 50 steps of 16 x 128), off for the smoke preset (every 10 steps
    of 8 x 64: the probe is then over 1% of training); on/off force it."""
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.training.accounting import model_flops_per_token
    from diff_transformer.training.diagnostics import diagnostics_enabled, estimated_cost_fraction

    def config(model, non_embedding, **trainer):
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
            "model": OmegaConf.load(REPO / "configs" / "model" / f"{model}.yaml"),
            "trainer": {"max_steps": 300, **trainer}}))
        return cfg, model_flops_per_token(cfg, non_embedding, 4096)

    quickstart = config("tiny", 1_329_024 - 4096 * 128, global_batch_size=16, eval_interval=50)
    smoke = config("debug", 363_008 - 4096 * 64, global_batch_size=8, eval_interval=10)
    assert estimated_cost_fraction(*quickstart) < 0.01 < estimated_cost_fraction(*smoke)
    assert diagnostics_enabled(*quickstart) and not diagnostics_enabled(*smoke)
    smoke[0].trainer.attention_diagnostics = "on"
    quickstart[0].trainer.attention_diagnostics = "off"
    assert diagnostics_enabled(*smoke) and not diagnostics_enabled(*quickstart)


# ------------------------------------------------------------------------------------------------------------------
# What evaluate and analyze show while they run and in their figures (in process, on made-up results)
# ------------------------------------------------------------------------------------------------------------------
def test_progress_lines_say_how_far_and_how_long(capsys):
    from diff_transformer.evaluation.report import Progress

    clock = iter([0.0, 2.0, 6.0, 12.0, 30.0])
    progress = Progress("diff: validation perplexity", 40, every=5.0, clock=lambda: next(clock))
    for _ in range(4):
        progress.update(10)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["diff: validation perplexity: 20/40 (50%), 0:06 elapsed, ETA 0:06",
                     "diff: validation perplexity: 30/40 (75%), 0:12 elapsed, ETA 0:04",
                     "diff: validation perplexity: 40/40 (100%), 0:30 elapsed, ETA 0:00"]


def test_lambda_over_training_comes_from_metrics_jsonl(tmp_path):
    from diff_transformer.evaluation.report import lambda_over_training

    rows = [{"step": s, "loss": 5.0, **({"lambda": [0.2 + s / 100, 0.5]} if s % 2 == 0 else {})} for s in range(1, 9)]
    rows.append({"step": 4, "loss": 4.0, "lambda": [9.0, 9.0]})  # replayed after a resume: the last record wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lam')
    trajectory = lambda_over_training(str(tmp_path), up_to_step=6)
    assert [t["step"] for t in trajectory] == [2, 4, 6] and trajectory[1]["lambda"] == [9.0, 9.0]
    assert lambda_over_training(None, 6) == [] and lambda_over_training(str(tmp_path / "none"), 6) == []


def test_evaluate_and_analyze_figures_colour_each_kind_and_name_the_data(tmp_path, monkeypatch):
    import matplotlib
    from matplotlib.colors import to_rgb

    from diff_transformer.evaluation import plots

    saved = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.setdefault(path.name, fig))
    data = "wiki/train"
    layers = [{"layer": i, "mean": {"combined/entropy": 1.0 + i}} for i in (1, 2)]
    results = {label: {"run": {"attention": kind, "data": data, "tokens": 2048, "seed": 1234},
                       "probe": {"source": "validation"}, "layers": layers,
                       "lambda_trajectory": [{"step": s, "lambda": [0.2, 0.3]} for s in range(1, 30)] if kind == "diff"
                       else [], "lambda_trajectory_source": "metrics.jsonl"}
               for label, kind in (("diff_step_4", "diff"), ("vanilla_step_4", "vanilla"))}
    plots.plot_analysis(results, tmp_path / "analysis.png")
    fig = saved["analysis.png"]
    entropy = fig.axes[0]
    colours = {line.get_label(): to_rgb(line.get_color()) for line in entropy.get_lines()}
    # each run's legend: its label, its kind as DIFF or Transformer, the tokens it had seen, its seed
    diff, vanilla = "diff_step_4 (DIFF, 2.05K tokens, seed 1234)", "vanilla_step_4 (Transformer, 2.05K tokens, seed 1234)"
    assert colours == {diff: to_rgb("tab:red"), vanilla: to_rgb("tab:blue")}
    assert fig._suptitle.get_text() == f"Attention per layer on validation probes (data: {data})"
    assert fig.axes[1].get_title() == "λ per layer over training (metrics.jsonl)"
    ppl = {label: {"validation": {"position_nll": [3.0, 2.5, 2.0], "perplexity": 8.0}} for label in results}
    plots.plot_position_loss(ppl, tmp_path / "ppl.png", {label: r["run"] for label, r in results.items()})
    title = saved["ppl.png"].axes[0].get_title()
    assert title == f"Loss by position (validation split of {data})"
    regions = ("answer", "distractors", "haystack", "queries")
    niah = {label: {"config": {"needles": 2, "asked": 1, "depths": [0.0, 1.0], "lengths": [64]}, "accuracy": 0.5,
                    "accuracy_by_length_depth": [[0.0, 1.0]],
                    "attention_allocation": {"1": dict.fromkeys(regions, 0.25), "2": dict.fromkeys(regions, 0.25)},
                    "uniform_allocation": dict(zip(regions, (0.05, 0.1, 0.8, 0.05)))}
            for label in results}
    run_of = {label: r["run"] for label, r in results.items()}
    plots.plot_attention_allocation(niah, tmp_path / "niah_attention.png", run_of)
    fig = saved["niah_attention.png"]
    assert [ax.get_title() for ax in fig.axes] == ["the answer needle", "the other needles", "the haystack", "the query"]
    for ax, share in zip(fig.axes, (0.05, 0.1, 0.8, 0.05)):  # each panel: a line per run in its kind's colour
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert {label: to_rgb(lines[label].get_color()) for label in (diff, vanilla)} == {
            diff: to_rgb("tab:red"), vanilla: to_rgb("tab:blue")}
        assert list(lines[plots.UNIFORM_LABEL].get_ydata()) == [share, share]  # and what uniform attention gives
    assert plots.UNIFORM_LABEL in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert fig._suptitle.get_text().endswith(f"haystack: validation split of {data})")
    plots.plot_niah_heatmaps(niah, tmp_path / "niah_accuracy.png", run_of)
    titles = [ax.get_title().split("\n")[0] for ax in saved["niah_accuracy.png"].axes]
    assert [t for t in titles if t] == [diff, vanilla]  # the colour bars have none
    assert saved["niah_accuracy.png"]._suptitle.get_text() == f"NIAH accuracy (haystack: validation split of {data})"
    for fig in saved.values():
        matplotlib.pyplot.close(fig)
