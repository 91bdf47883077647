"""compare: scaling-law fits recover known laws, ratios match their closed form, mismatched runs are refused."""

import json

import numpy as np
import pytest

from diff_transformer import compare
from diff_transformer.analysis import plots, scaling, wandb_runs
from diff_transformer.analysis import runs as run_records

# A baseline law, and DIFF defined to match the baseline at 1/RATIO times its size: L_diff(N) = L_base(N / RATIO).
E, A, ALPHA = 1.8, 2.5, 0.35
RATIO = 0.622
N_REF = 1e8
SIZES = [1e6, 3e6, 1e7, 3e7, 1e8]
# Along one run: L(D) = E_D + B (D / D_REF)^-BETA, DIFF needing TOKEN_RATIO of the baseline's tokens.
E_D, B, BETA, D_REF = 2.0, 1.2, 0.5, 1e7
TOKEN_RATIO = 0.637
TOKENS_PER_STEP = 4096
MAX_STEPS = 1000


def baseline_loss(n):
    return E + A * (np.asarray(n) / N_REF) ** -ALPHA


def diff_loss(n):
    return baseline_loss(np.asarray(n) / RATIO)


def token_loss(d, attention):
    d = np.asarray(d, dtype=np.float64)
    if attention == "diff":
        d = d / TOKEN_RATIO
    return E_D + B * (d / D_REF) ** -BETA


def write_run(root, attention, n, final_val_loss, *, noise=0.0, rng=None, data="corpus-v1", max_steps=MAX_STEPS,
              stop_at=None, tokens_per_step=TOKENS_PER_STEP, eval_interval=50, follow_token_law=False,
              variant=None, baseline_variant=None, data_source=None, model=None, seed=None, lr=None,
              lr_schedule=None, branch=None, flops_per_token=None, device=None, tokens_per_s=1e4, sweep_id=None):
    """A run directory as train.py writes it; validation losses have the token law's shape, ending at final_val_loss
    (or following the token law exactly when follow_token_law). The keys of newer runs (seed, lr, lr_schedule,
    branch, flops_per_token, device, sweep) are written only when given, as older runs lack them."""
    name = f"n{int(n)}_{(variant or attention).replace(' ', '_')}"
    name += "".join(f"_{tag}{value}" for tag, value in (("seed", seed), ("lr", lr)) if value is not None)
    name += f"_steps{max_steps}" if branch else ""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    description = {
        "name": "synthetic", "model": model or f"n{int(n)}", "attention": attention, "num_parameters": int(n),
        "num_non_embedding_parameters": int(n) // 2, "tokens_per_step": tokens_per_step,
        "seq_length": 128, "data": {"corpus": data}, "max_steps": max_steps,
    }
    if variant:
        description["variant"] = variant
    if baseline_variant:
        description["baseline_variant"] = baseline_variant
    if data_source:
        description["data_source"] = data_source
    for key, value in (("seed", seed), ("lr", lr), ("lr_schedule", lr_schedule), ("branch", branch),
                       ("flops_per_token", flops_per_token), ("device", device)):
        if value is not None:
            description[key] = value
    if sweep_id is not None:
        description["sweep"] = {"id": sweep_id, "dir": str(root)}
    (run_dir / "run.json").write_text(json.dumps(description))
    last = stop_at or max_steps
    # The token law's shape along the run, shifted so the last evaluation lands on this size's final loss.
    shift = 0.0 if follow_token_law else final_val_loss - token_loss(max_steps * tokens_per_step, attention)
    first = branch["source_step"] + 1 if branch else 1  # a branch logs only its own steps
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(first, last + 1):
            tokens = step * tokens_per_step
            row = {"step": step, "loss": float(token_loss(tokens, attention) + shift + 0.05), "lr": 1e-3,
                   "grad_norm": 1.0, "tokens_per_s": tokens_per_s, "tokens": tokens}
            if step % eval_interval == 0 or step == max_steps:
                val = float(token_loss(tokens, attention) + shift)
                if rng is not None:
                    val += rng.normal(0, noise)
                row["val_loss"] = val
            f.write(json.dumps(row) + "\n")
    return run_dir


def sweep(root, noise=0.0, seed=0, seeds=None, diff_law=diff_loss, **kwargs):
    """Every size of both kinds: one run each without a recorded seed, or ``seeds`` runs each (seeds 0, 1, ...),
    each final loss off its law by ``noise`` (a standard deviation)."""
    rng = np.random.default_rng(seed)
    for n in SIZES:
        for replicate in ([None] if seeds is None else range(seeds)):
            write_run(root, "vanilla", n, float(baseline_loss(n)) + rng.normal(0, noise), seed=replicate, **kwargs)
            write_run(root, "diff", n, float(diff_law(n)) + rng.normal(0, noise), seed=replicate, **kwargs)
    return root


def test_fit_recovers_exact_power_law():
    n = np.geomspace(1e6, 1e9, 6)
    fit = scaling.fit_power_law(n, baseline_loss(n))
    assert fit.E == pytest.approx(E, rel=1e-5)
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-5)
    assert fit.A_unscaled == pytest.approx(A * N_REF**ALPHA, rel=1e-4)
    np.testing.assert_allclose(fit(n), baseline_loss(n), rtol=1e-7)
    np.testing.assert_allclose(fit.inverse(baseline_loss(n)), n, rtol=1e-5)
    assert np.isnan(fit.inverse(E - 0.1))


def test_fit_bootstrap_intervals_cover_truth_under_noise():
    """Over repeated noisy draws the 68% bootstrap interval of alpha holds the true alpha about as often as it says
    (the residual bootstrap of 8 points runs a little narrow)."""
    n = np.geomspace(1e6, 1e9, 8)
    covered = 0
    trials = 12
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        fit = scaling.fit_power_law(n, baseline_loss(n) + rng.normal(0, 0.01, len(n)), num_bootstrap=40)
        low, high = fit.interval("alpha")
        covered += low <= ALPHA <= high
        assert "residuals resampled over the 8 sizes" in fit.bootstrap_method
    assert 0.4 * trials <= covered <= 0.95 * trials


def test_fits_need_more_sizes_than_parameters():
    """E + A·N^-α needs 4 sizes; 3 give only the reduced form with E fixed, named as such; 2 give none."""
    with pytest.raises(scaling.FitRefused, match="needs ≥ 4 sizes; have 3"):
        scaling.fit_power_law(SIZES[:3], baseline_loss(SIZES[:3]))
    notes = []
    fit, reason = scaling.fit_supported_law(SIZES[:3], baseline_loss(SIZES[:3]), "vanilla", notes)
    assert fit.fixed_E == 0 and fit.form("N") == "A·N^-α (E fixed at 0)" and reason is None
    assert notes == ["vanilla: a fit of E + A·N^-α needs ≥ 4 sizes; have 3: fitted the reduced form A·N^-α "
                     "(E fixed at 0) instead"]
    fit, reason = scaling.fit_supported_law(SIZES[:2], baseline_loss(SIZES[:2]), "vanilla", notes)
    assert fit is None and reason == "fit needs ≥ 4 sizes (≥ 3 for A·N^-α with E fixed at 0); have 2"
    fixed = scaling.fit_power_law(SIZES[:3], baseline_loss(SIZES[:3]), fixed_E=E)
    assert fixed.alpha == pytest.approx(ALPHA, rel=1e-6) and fixed.interval("E") is None
    with pytest.raises(scaling.FitRefused, match="do not fall"):
        scaling.fit_power_law(SIZES, baseline_loss(SIZES)[::-1])


def test_seeds_are_resampled_within_each_size():
    n = np.repeat(SIZES[:4], 3)
    loss = baseline_loss(n) + np.random.default_rng(0).normal(0, 0.005, len(n))
    fit = scaling.fit_power_law(n, loss, num_bootstrap=50)
    assert fit.bootstrap_method == "the 12 sizes resampled within each x (3-3 seeds each)"
    assert fit.num_x == 4 and fit.num_points == 12 and fit.interval("E") is not None


def test_matching_ratio_closed_form():
    n = np.geomspace(1e6, 1e9, 6)
    diff_fit = scaling.fit_power_law(n, diff_loss(n))
    base_fit = scaling.fit_power_law(n, baseline_loss(n))
    for at in (3e6, 6.8e8):
        estimate = scaling.matching_ratio(diff_fit, base_fit, at)
        assert estimate.ratio == pytest.approx(RATIO, rel=1e-4)
        assert estimate.loss == pytest.approx(float(diff_loss(at)), rel=1e-6)


def test_sweep_directory_end_to_end(tmp_path, capsys):
    """3 seeds per size, DIFF matching the Transformer at 62% of its size: the verdict is better, and the ratios in
    parameters, FLOPs (6N per token: the parameter ratio again) and device time (time per token ∝ N: again) are
    findings; the runs record no lr_schedule, so no token ratio comes from evaluations along one run."""
    root = sweep(tmp_path / "sweep", noise=0.004, seed=1, seeds=3, rng=np.random.default_rng(2), device="cpu")
    for run_json in root.glob("*/run.json"):  # FLOPs per token 6N and throughput 1e13/N tokens/s
        description = json.loads(run_json.read_text())
        description["flops_per_token"] = 6.0 * description["num_parameters"]
        run_json.write_text(json.dumps(description))
        metrics = run_json.parent / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**row, "tokens_per_s": 1e13 / description["num_parameters"]}) + "\n"
                                   for row in rows))
    out = tmp_path / "figure.png"
    assert compare.main([str(root), "--out", str(out), "--at", "6.8e9", "--bootstrap", "50"]) == 0
    printed = capsys.readouterr().out
    summary = strict_json(out.with_suffix(".json"))
    assert out.stat().st_size > 20_000
    assert len(summary["runs"]) == 3 * 2 * len(SIZES)
    assert summary["verdict"]["outcome"] == "better" and summary["pairs"][0]["ratios_are_findings"] is True
    assert "verdict: DIFF better than Transformer" in printed
    pair = summary["pairs"][0]
    for cost in ("flops", "device_time"):
        assert [r["ratio"] for r in pair[cost]["ratios"]] == pytest.approx([RATIO] * len(SIZES), rel=0.05), cost
    assert pair["flops"]["crossover"]["at"] is None and "DIFF wins throughout" in pair["flops"]["crossover"]["text"]
    assert "FLOPs ratio" in printed and "device seconds ratio" in printed
    ratios = summary["parameter_ratios"]
    assert [r["at"] for r in ratios] == SIZES + [6.8e9]  # the trained sizes, then the one asked for
    for r in ratios:
        # Noisy points: the estimate lies near the truth and its 68% interval is not wider than the noise allows.
        assert abs(r["ratio"] - RATIO) < max(3 * r["std"], 0.02), r
        assert 0 < r["std"] < 0.3 and r["interval_68"] == [r["low"], r["high"]]
    # DIFF at 100M matches the Transformer at 161M, past the largest trained; 6.8B lies past both.
    assert [r["extrapolated"] for r in ratios[3:5]] == [
        None, "the Transformer at 161M parameters lies above its measured range (1M-100M)"]
    assert ratios[5]["extrapolated"].startswith("DIFF at 6.8B parameters lies above its measured range (1M-100M); "
                                                "the Transformer at 1")
    assert summary["token_ratio"] is None and "record no lr_schedule" in pair["token_note"]
    assert "parameter ratio 6" in printed and "no token ratio" in printed


def test_exact_sweep_recovers_both_ratios(tmp_path):
    runs = run_records.load_runs([sweep(tmp_path / "sweep")])
    comparison = scaling.compare_runs(runs, num_bootstrap=30)
    assert comparison.size_fits["vanilla"].alpha == pytest.approx(ALPHA, rel=1e-4)
    assert comparison.size_fits["vanilla"].E == pytest.approx(E, rel=1e-4)
    assert [r.ratio for r in comparison.parameter_ratios] == pytest.approx([RATIO] * len(SIZES), rel=1e-3)


CONSTANT_LR = {"decay": "constant", "warmup_steps": 0, "cooldown_steps": None}


@pytest.mark.parametrize("noise", [0.0, 0.003])
def test_token_ratio_along_one_run_at_a_constant_learning_rate(tmp_path, noise):
    rng = np.random.default_rng(3) if noise else None
    for attention in ("diff", "vanilla"):
        write_run(tmp_path, attention, 1e8, 0.0, follow_token_law=True, noise=noise, rng=rng, eval_interval=20,
                  lr_schedule=CONSTANT_LR)
    comparison = scaling.compare_runs(run_records.load_runs([tmp_path]), num_bootstrap=30)
    assert comparison.primary.token_basis == "evaluations along one run at a constant learning rate"
    assert "fit needs ≥ 4 sizes (≥ 3 for A·N^-α with E fixed at 0); have 1" in comparison.notes[0]
    estimate = comparison.token_ratio
    assert estimate.at == MAX_STEPS * TOKENS_PER_STEP
    if noise:
        assert abs(estimate.ratio - TOKEN_RATIO) < max(3 * estimate.std, 0.01) and estimate.std < 0.1
        assert estimate.low < estimate.ratio < estimate.high
    else:
        assert estimate.ratio == pytest.approx(TOKEN_RATIO, rel=1e-4)
        assert comparison.token_fits["diff"].alpha == pytest.approx(BETA, rel=1e-4)
        assert comparison.token_fits["vanilla"].E == pytest.approx(E_D, rel=1e-4)


# Variants of a sweep: (attention, variant label, baseline_variant in run.json, the size at which it matches the
# baseline law, as a fraction of the baseline's: L_v(N) = L_vanilla(N / SIZE_FACTOR)).
V2_BASELINE = "vanilla num_kv_heads=1"
VARIANTS = [
    ("vanilla", "vanilla", None, 1.0),
    ("diff", "diff", None, RATIO),
    ("diff_v2", "diff_v2", V2_BASELINE, 0.8),
    ("vanilla", V2_BASELINE, None, 1.1),
    ("topk", "topk topk=8", None, 0.9),
]


def variant_sweep(root):
    for attention, variant, baseline_variant, factor in VARIANTS:
        for n in SIZES:
            write_run(root, attention, n, float(baseline_loss(n / factor)), variant=variant,
                      baseline_variant=baseline_variant, lr_schedule=CONSTANT_LR)
    return root


def test_every_variant_is_fitted_against_its_reference_and_v2_against_its_own_baseline(tmp_path, capsys):
    factor = {variant: f for _, variant, _, f in VARIANTS}
    comparison = scaling.compare_runs(run_records.load_runs([variant_sweep(tmp_path / "sweep")]), num_bootstrap=30)
    assert set(comparison.size_fits) == set(factor)
    pairs = {pair.variant: pair for pair in comparison.pairs}
    assert comparison.pairs[0].variant == "diff"  # the figure's pair: DIFF against the reference
    assert {v: p.reference for v, p in pairs.items()} == {
        "diff": "vanilla", "diff_v2": V2_BASELINE, V2_BASELINE: "vanilla", "topk topk=8": "vanilla"}
    for variant, pair in pairs.items():
        expected = factor[variant] / factor[pair.reference]
        assert [r.ratio for r in pair.parameter_ratios] == pytest.approx([expected] * len(SIZES), rel=1e-3), variant
        assert pair.token_model == "n100000000" and pair.token_ratio is not None
        assert pair.verdict.outcome == "undetermined"  # one seed per size

    # --reference: every variant against diff, but V2 still against its own baseline; a reference not trained: refused
    out = tmp_path / "figure.png"
    assert compare.main([str(tmp_path / "sweep"), "--reference", "diff", "--out", str(out), "--bootstrap", "30"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(out.with_suffix(".json").read_text())
    # One seed per size: every ratio is withheld from the findings, kept under withheld_ratios.
    assert all(p["parameter_ratios"] == [] and p["verdict"]["outcome"] == "undetermined" for p in summary["pairs"])
    ratios = {(p["variant"], p["reference"]): p["withheld_ratios"]["parameter_ratios"][0]["ratio"]
              for p in summary["pairs"]}
    assert ratios == pytest.approx({("vanilla", "diff"): 1 / RATIO, ("diff_v2", V2_BASELINE): 0.8 / 1.1,
                                    (V2_BASELINE, "diff"): 1.1 / RATIO, ("topk topk=8", "diff"): 0.9 / RATIO}, rel=1e-3)
    assert "DIFF V2 against Transformer num_kv_heads=1:" in printed and "topk topk=8 against DIFF:" in printed
    assert compare.main([str(tmp_path / "sweep"), "--reference", "dex", "--out", str(out)]) == 2
    assert "--reference 'dex' is not a variant of these runs" in capsys.readouterr().err

    # Without its own baseline, V2 is compared with the reference, and the report says so.
    runs = [r for r in run_records.load_runs([tmp_path / "sweep"]) if r.variant != V2_BASELINE]
    comparison = scaling.compare_runs(runs, num_bootstrap=30)
    v2 = next(p for p in comparison.pairs if p.variant == "diff_v2")
    assert v2.reference == "vanilla" and v2.parameter_ratios[0].ratio == pytest.approx(0.8, rel=1e-3)
    assert any("its own baseline (vanilla num_kv_heads=1) was not trained" in note for note in comparison.notes)


def test_a_size_that_breaks_the_power_law_leaves_a_note_not_a_crash(tmp_path):
    root = tmp_path / "sweep"
    for n in SIZES:
        write_run(root, "vanilla", n, float(baseline_loss(n)))
        write_run(root, "diff", n, 3.0 + n / 1e8)  # larger models worse: no falling power law fits
    comparison = scaling.compare_runs(run_records.load_runs([root]), num_bootstrap=30)
    assert "diff" not in comparison.size_fits and "vanilla" in comparison.size_fits
    assert any(note.startswith("DIFF: no fit: losses") for note in comparison.notes)
    assert comparison.size_fit_reasons["diff"].startswith("losses")
    assert comparison.parameter_ratios == []
    plots.plot_comparison(comparison, tmp_path / "figure.png")


def test_refuses_mismatched_data_naming_the_run(tmp_path):
    root = sweep(tmp_path / "sweep")
    write_run(root / "odd", "diff", 5e7, float(diff_loss(5e7)), data="other-corpus")
    with pytest.raises(run_records.RunMismatchError, match=r"differ in data.*n50000000_diff \(\S*odd/n50000000_diff\) has") as error:
        scaling.compare_runs(run_records.load_runs([root]))
    assert "other-corpus" in str(error.value)
    assert compare.main([str(root), "--out", str(tmp_path / "x.png")]) == 2


def test_refuses_mismatched_token_budget_naming_the_run(tmp_path):
    root = sweep(tmp_path / "sweep")
    write_run(root / "short", "vanilla", 5e7, float(baseline_loss(5e7)), max_steps=500)
    with pytest.raises(run_records.RunMismatchError, match=r"token budget.*n50000000_vanilla \(\S*short/n50000000_vanilla\) has 2,048,000 tokens"):
        scaling.compare_runs(run_records.load_runs([root]))


def test_refuses_unfinished_run_unless_allowed(tmp_path):
    root = sweep(tmp_path / "sweep")
    write_run(root / "cut", "diff", 5e7, float(diff_loss(5e7)), stop_at=700)
    runs = run_records.load_runs([root])
    with pytest.raises(run_records.RunMismatchError, match=r"not finished: n50000000_diff \(\S*cut/n50000000_diff, step 700 of 1000\)"):
        scaling.compare_runs(runs)
    scaling.compare_runs(runs, require_finished=False, num_bootstrap=30)


def test_replayed_steps_keep_last_record_and_truncated_tail_is_skipped(tmp_path):
    run_dir = write_run(tmp_path, "diff", 1e6, 3.0, max_steps=4, eval_interval=2)
    with open(run_dir / "metrics.jsonl", "a") as f:
        # A resume replays step 3 and 4 from the last checkpoint; a killed job leaves half a line.
        f.write(json.dumps({"step": 3, "loss": 9.0, "tokens": 3 * TOKENS_PER_STEP}) + "\n")
        f.write(json.dumps({"step": 4, "loss": 8.0, "val_loss": 7.0, "tokens": 4 * TOKENS_PER_STEP}) + "\n")
        f.write('{"step": 5, "lo')
    run = run_records.load_run(run_dir)
    assert run.steps.tolist() == [1, 2, 3, 4]
    assert run.train_loss[2:].tolist() == [9.0, 8.0]
    assert run.val_steps.tolist() == [2, 4] and run.final_val_loss == 7.0


def test_wandb_runs_are_read_like_run_directories():
    class FakeRun:
        def __init__(self, attention, n):
            self.name = f"{attention}-{n}"
            self.id = self.name
            self.config = {"model": {"name": f"n{n}", "attention": attention}, "trainer": {"max_steps": 2},
                           "data": {"corpus": "c"},
                           "run": {"num_parameters": n, "tokens_per_step": 10, "seq_length": 5}}
            self.summary = {}

        def scan_history(self, keys=None):
            yield {"_step": 1, "loss": 4.0, "tokens": 10}
            yield {"_step": 2, "loss": 3.0, "val_loss": float(baseline_loss(self.config["run"]["num_parameters"])), "tokens": 20}

    class FakeApi:
        def runs(self, path, filters):
            assert path == "team/proj" and filters == {"group": "sweep-1"}
            return [FakeRun(kind, n) for kind in ("diff", "vanilla")
                    for n in (1_000_000, 3_000_000, 10_000_000, 30_000_000)]

    runs = wandb_runs.load_wandb_runs("team/proj/sweep-1", api=FakeApi())
    assert wandb_runs.sweep_filter("sweep:2026-11-28_04-00-00-ab12") == {"tags": {"$in": ["sweep:2026-11-28_04-00-00-ab12"]}}
    assert {(r.attention, r.model, r.num_parameters, r.token_budget) for r in runs} >= {("diff", "n1000000", 1_000_000, 20)}
    comparison = scaling.compare_runs(runs, num_bootstrap=30)
    assert comparison.size_fits["vanilla"].E == pytest.approx(E, rel=1e-3)
    with pytest.raises(ValueError, match="ENTITY/PROJECT/GROUP"):
        wandb_runs.load_wandb_runs("team/proj", api=FakeApi())


# ------------------------------------------------------------------------------------------------------------------
# --table: the seed spread of every variant
# ------------------------------------------------------------------------------------------------------------------
def write_seeded_run(root, variant, seed, final_val_loss, attention=None):
    run_dir = root / f"{variant.replace(' ', '_')}-seed{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "name": "ablations", "model": "tiny", "attention": attention or variant.split()[0], "variant": variant,
        "seed": seed, "num_parameters": 1000, "tokens_per_step": 10, "seq_length": 5, "data": {"corpus": "x"},
        "max_steps": 2,
    }))
    rows = [{"step": 1, "loss": 9.0, "tokens": 10}, {"step": 2, "loss": 8.0, "tokens": 20, "val_loss": final_val_loss}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_groups_variants_over_seeds_and_pairs_them_by_seed(tmp_path, capsys):
    """A seed effect shared by every variant (the data order) cancels in the paired differences: a 0.01 shift under a
    0.1 seed-to-seed spread is found, a variant equal up to 1e-3 jitter is not."""
    seed_effect = {1: 0.0, 2: 0.1, 3: -0.1}
    jitter = {1: 0.001, 2: -0.0005, 3: 0.0}
    for seed, shared in seed_effect.items():
        write_seeded_run(tmp_path, "vanilla", seed, 5.0 + shared)
        write_seeded_run(tmp_path, "diff", seed, 4.99 + shared + jitter[seed] / 10)
        write_seeded_run(tmp_path, "diff lambda_init=1.0 lambda_learnable=false", seed, 5.0 + shared + jitter[seed])
    write_seeded_run(tmp_path, "topk topk=32", 1, 5.2)  # one seed only
    assert compare.main([str(tmp_path), "--table", "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in lines[1:]] == [
        "Transformer", "DIFF", "DIFF lambda_init=1.0 lambda_learnable=false", "topk topk=32"]
    assert "Δ vs Transformer" in lines[0] and "Δ vs DIFF" in lines[0]
    assert "5.0000 ± 0.1000" in lines[1]
    assert "-0.0100 ±" in lines[2] and "outside noise" in lines[2]
    frozen = lines[3].split(" | ")
    assert "inside noise" in frozen[5] and "outside noise" in frozen[6]  # vs vanilla: jitter; vs diff: +0.01
    assert "(1 seed)" in lines[4]
    summary_file = json.loads((tmp_path / "t.json").read_text())
    summary = summary_file["variants"]
    assert summary[0]["variant"] == "vanilla" and summary[0]["seeds"] == [1, 2, 3]
    assert summary[1]["deltas"]["vanilla"]["outside_noise"] is True
    assert (tmp_path / "t.png").stat().st_size > 0
    assert summary_file["written_by"] == "diff_transformer.compare" and summary_file["figure"]["path"] == "t.png"
    assert summary[3]["std"] is None and summary[3]["std_reason"] == "one seed"  # never NaN in the JSON


def test_table_refuses_two_runs_with_the_same_seed(tmp_path, capsys):
    write_seeded_run(tmp_path / "a", "vanilla", 1, 5.0)
    write_seeded_run(tmp_path / "b", "vanilla", 1, 5.1)
    assert compare.main([str(tmp_path), "--table", "--out", str(tmp_path / "t.png")]) == 2
    assert "two runs of vanilla (tiny) with seed 1" in capsys.readouterr().err


def test_runs_of_every_kind_load_and_old_runs_fall_back_to_their_kind(tmp_path):
    write_seeded_run(tmp_path, "signed_mask", 1, 5.0)
    write_run(tmp_path, "vanilla", 1e6, 5.0, max_steps=2, tokens_per_step=10, eval_interval=1)  # no variant, no seed
    runs = sorted(run_records.load_runs([tmp_path]), key=lambda r: r.variant)
    assert [(r.attention, r.variant, r.seed) for r in runs] == [("signed_mask", "signed_mask", 1), ("vanilla", "vanilla", None)]


# ------------------------------------------------------------------------------------------------------------------
# What a researcher reads: no NaN, no fit through as many points as parameters, extrapolation marked, convergence
# ------------------------------------------------------------------------------------------------------------------
# The first three sizes of docs/tiny_sweep.json: non-embedding parameters and final validation losses.
TINY_3 = {"diff": [(804736, 5.759966), (1771968, 5.652569), (3956416, 5.620125)],
          "vanilla": [(803968, 5.550559), (1771200, 5.383466), (3955456, 5.420916)]}
SHARDS = "wiki/train"


def strict_json(path):
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_three_size_sweep_prints_no_nan_fits_the_reduced_form_and_marks_extrapolation(tmp_path, capsys):
    for kind, points in TINY_3.items():
        for model, (n, final) in zip(("scale_1m", "scale_3m", "scale_5m"), points):
            write_run(tmp_path / "sweep", kind, n, final, max_steps=100, eval_interval=10, data_source=SHARDS,
                      model=model)
    out = tmp_path / "compare.png"
    assert compare.main([str(tmp_path / "sweep"), "--out", str(out), "--bootstrap", "40"]) == 0
    printed = capsys.readouterr().out
    assert "nan" not in printed.lower()
    for kind in ("DIFF", "Transformer"):
        assert (f"{kind}: a fit of E + A·N^-α needs ≥ 4 sizes; have 3: fitted the reduced form A·N^-α (E fixed at 0) "
                "instead") in printed
    # One seed per size: no verdict, so no ratio in the report, only why.
    assert "verdict: DIFF undetermined against Transformer: one seed at DIFF scale_1m" in printed
    assert not [line for line in printed.splitlines() if "parameter ratio" in line and "%" in line]
    assert "ratios: the verdict is undetermined" in printed and "withheld" in printed
    assert "still falling at the end" in printed and "tokens per parameter (≈20 is compute-optimal)" in printed
    assert f"data: {SHARDS}" in printed
    summary = strict_json(out.with_suffix(".json"))
    assert "stderr" not in json.dumps(summary)
    assert {k: f["form"] for k, f in summary["size_fits"].items()} == {"diff": "A·x^-α (E fixed at 0)",
                                                                       "vanilla": "A·x^-α (E fixed at 0)"}
    # 3 points for 2 parameters: 1 residual degree of freedom, so no interval (the bootstrap would invent one).
    assert summary["size_fits"]["diff"]["interval_reason"].startswith("3 points for 2 parameters leave 1 residual")
    assert summary["parameter_ratios"] == [] and summary["verdict"]["outcome"] == "undetermined"
    withheld = summary["pairs"][0]["withheld_ratios"]
    assert withheld["reason"].startswith("the verdict is undetermined (one seed at")
    first = withheld["parameter_ratios"][0]
    assert first["interval_68"] is None and "residual degree of freedom" in first["interval_reason"]
    # DIFF at its smallest size is worse than every Transformer trained: the match lies below the measured sizes.
    assert "lies below its measured range (804K-3.96M)" in first["extrapolated"]
    assert all(r["convergence"]["still_falling"] for r in summary["runs"])
    assert summary["convergence_note"].startswith("6 of 6 runs still falling at the end")


def test_no_ratio_where_the_reference_never_reaches_the_loss_and_null_has_a_reason(tmp_path):
    diff_fit = scaling.fit_power_law(SIZES, baseline_loss(SIZES) - 0.5, num_bootstrap=20)  # below E everywhere
    base_fit = scaling.fit_power_law(SIZES, baseline_loss(SIZES), num_bootstrap=20)
    estimate = scaling.matching_ratio(diff_fit, base_fit, 1e13)
    assert estimate.ratio is None and "at or below the Transformer's fitted asymptote" in estimate.reason
    assert "nan" not in estimate.describe("parameter", "parameters").lower()
    json.dumps(estimate.summary(), allow_nan=False)


def figure_runs(root, count):
    """count runs (1, 2, 3, 4 or 8) of DIFF and the Transformer on shards, as a user's sweep would leave them."""
    sizes = {1: [("diff", 0)], 2: [("diff", 0), ("vanilla", 0)], 3: [("diff", 0), ("vanilla", 0), ("diff", 1)],
             4: [(k, i) for i in range(2) for k in ("diff", "vanilla")],
             8: [(k, i) for i in range(4) for k in ("diff", "vanilla")]}[count]
    for kind, i in sizes:
        n = SIZES[i]
        final = float(diff_loss(n) if kind == "diff" else baseline_loss(n))
        write_run(root, kind, n, final, max_steps=100, eval_interval=10, data_source=SHARDS)
    return run_records.load_runs([root])


def overlapping_tick_labels(fig):
    renderer = fig.canvas.get_renderer()
    overlaps = []
    for ax in fig.axes:
        for axis, (low, high), along in ((ax.xaxis, ax.get_xlim(), 0), (ax.yaxis, ax.get_ylim(), 1)):
            shown = [t for t in axis.get_ticklabels() if t.get_text() and t.get_visible()
                     and min(low, high) <= t.get_position()[along] <= max(low, high)]
            boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: (b.x0, b.y0))
            overlaps += [(ax.get_title(), a, b) for a, b in zip(boxes, boxes[1:]) if a.overlaps(b)]
    return overlaps


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_comparison_figure_at_any_run_count_says_what_it_shows(tmp_path, count):
    import matplotlib.text
    from matplotlib.colors import to_rgb

    comparison = scaling.compare_runs(figure_runs(tmp_path, count), num_bootstrap=20)
    fig = plots.comparison_figure(comparison)
    fig.canvas.draw()
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]
    assert not [t for t in texts if "nan" in t.lower()]
    assert SHARDS in fig._suptitle.get_text() and not [t for t in texts if "bundled" in t]
    assert "1 seed per size" in fig._suptitle.get_text() and "tokens per run" in fig._suptitle.get_text()
    assert any("Verdict: DIFF undetermined against Transformer" in t for t in texts) or count == 1
    assert overlapping_tick_labels(fig) == []
    loss_panel, size_panel, token_panel = fig.axes
    # One colour per kind: DIFF's curves red, the Transformer's blue, whatever the sizes.
    for line in loss_panel.get_legend().get_lines():
        red, _, blue = to_rgb(line.get_color())
        name = line.get_label() or ""
        assert (red > blue) if name.startswith("DIFF") else (blue > red), name
    legend_names = [t.get_text() for t in loss_panel.get_legend().get_texts()]
    assert len(legend_names) == count and all(n.startswith(("DIFF ", "Transformer ")) for n in legend_names)
    # A panel that cannot be drawn says why, in the panel.
    if count < 8:
        notes = [t.get_text().replace("\n", " ") for t in size_panel.texts if "no scaling fit" in t.get_text()]
        assert len(notes) == 1 and notes[0].startswith("no scaling fit: DIFF") and "fit needs ≥ 4 sizes" in notes[0]
    else:
        assert "L(N) = E + A·N^-α" in size_panel.get_title()
    if count == 1:
        assert any("no token fit" in t.get_text() for t in token_panel.texts)
    # Titles and legends agree: the data panel's law and its legend name the same exponent.
    for panel, exponent in ((size_panel, "α"), (token_panel, "β")):
        entries = [t.get_text() for t in panel.get_legend().get_texts()] if panel.get_legend() else []
        fits = [e for e in entries if " fit" in e]
        assert all(f"{exponent}=" in e for e in fits), entries
        if fits:
            assert exponent in panel.get_title()
    if count == 8:
        assert any("Convergence: 8 of 8 runs still falling" in t for t in texts)
    plots._pyplot().close(fig)


def test_quickstart_figure_names_the_data_it_trained_on(tmp_path):
    from data.config import DataConfig
    from diff_transformer import quickstart

    assert DataConfig("shards", "tok", ["/data/wiki/train", "/data/books/part"]).describe() == \
        "wiki/train, books/part"  # run.json's data_source
    assert DataConfig("shards", "tok", ["shards/mytext"]).describe() == "shards/mytext"  # no "shards shards/mytext"
    assert "bundled corpus" in DataConfig().describe()
    run_dir = write_run(tmp_path, "diff", 1e6, 5.0, max_steps=20, eval_interval=10, data_source=SHARDS)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fig = plots.loss_curves_figure({"diff": records, "vanilla": records}, quickstart.trained_on(run_dir))
    assert fig._suptitle.get_text() == f"tiny DIFF vs its mirrored baseline (CPU) (data: {SHARDS})"
    plots._pyplot().close(fig)
