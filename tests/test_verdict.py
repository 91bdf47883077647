"""compare's verdict against seed noise, on synthetic sweeps with a known answer: no effect is called better or worse
at the test's level and no more, an effect several times the seed noise is found, one seed is undetermined; the
ratios are findings only with a verdict; token ratios from finished runs only; the best lr per cell; --out refusals;
strict JSON."""

import dataclasses
import json

import numpy as np
import pytest

from diff_transformer import compare
from diff_transformer.analysis import runs as run_records
from diff_transformer.analysis import scaling, verdict
from tests.test_compare import (
    CONSTANT_LR, MAX_STEPS, RATIO, SIZES, TOKEN_RATIO, TOKENS_PER_STEP, baseline_loss, diff_loss, strict_json, sweep,
    token_loss, write_run,
)

NOISE = 0.03  # nats: one run's final loss, seed to seed
DRAWS = 400


@dataclasses.dataclass
class FinalLoss:
    """What the verdict reads of a run."""

    variant: str
    model: str
    seed: object
    final_val_loss: float
    n: int
    name: str = ""

    def parameters(self, count):
        return self.n


def synthetic_sweep(rng, shift=0.0, seeds=3, paired=True, diff_law=None, seed_effect=0.0):
    """DIFF and the Transformer at every size, ``seeds`` each; DIFF off the Transformer's law by ``shift`` (or on
    ``diff_law``); each run off by NOISE, and by a ``seed_effect`` shared by both kinds' runs of a seed."""
    runs = []
    for n in SIZES:
        for seed in range(seeds):
            shared = rng.normal(0, seed_effect) if seed_effect else 0.0
            runs.append(FinalLoss("vanilla", f"n{n:g}", seed, float(baseline_loss(n)) + shared + rng.normal(0, NOISE), n))
            law = diff_law(n) if diff_law else baseline_loss(n) + shift
            runs.append(FinalLoss("diff", f"n{n:g}", seed if paired else f"other{seed}",
                                  float(law) + shared + rng.normal(0, NOISE), n))
    return runs


def outcomes(draws=DRAWS, first=0, **kwargs):
    found = [verdict.verdict(synthetic_sweep(np.random.default_rng(first + i), **kwargs), "diff", "vanilla")
             for i in range(draws)]
    return {o: sum(v.outcome == o for v in found) / draws for o in verdict.OUTCOMES}, found


@pytest.mark.parametrize("paired", [True, False])
def test_no_effect_is_called_better_or_worse_at_the_level(paired):
    """DIFF = the Transformer, 3 seeds per size, seed noise 0.03 nats: `indistinguishable` except in about 5% of
    sweeps (the two-sided level), both ways."""
    rate, found = outcomes(paired=paired)
    false = rate["better"] + rate["worse"]
    assert 0.01 <= false <= verdict.LEVEL + 0.035, rate
    assert rate["better"] > 0 and rate["worse"] > 0 and rate["undetermined"] == 0
    assert all(v.sizes[0].paired is paired for v in found[:3])


def test_the_interval_covers_the_true_difference_at_its_level():
    _, found = outcomes(shift=0.05, first=1000)
    covered = np.mean([v.interval[0] <= 0.05 <= v.interval[1] for v in found])
    assert 0.92 <= covered <= 0.98


@pytest.mark.parametrize("shift, expected", [(-3 * NOISE, "better"), (3 * NOISE, "worse")])
def test_an_effect_three_times_the_seed_noise_is_found(shift, expected):
    rate, _ = outcomes(draws=200, shift=shift)
    assert rate[expected] >= 0.95, rate


def test_diff_on_the_law_at_62_percent_of_the_size_is_better():
    rate, _ = outcomes(draws=100, diff_law=diff_loss)
    assert rate["better"] == 1.0


def test_pairing_by_seed_removes_the_seed_effect_both_kinds_share():
    """A 0.1-nat seed effect shared by both kinds hides a 0.04 gain from the unpaired comparison, not the paired."""
    paired, _ = outcomes(draws=50, shift=-0.04, seed_effect=0.1)
    unpaired, _ = outcomes(draws=50, shift=-0.04, seed_effect=0.1, paired=False)
    assert paired["better"] >= 0.9 and unpaired["better"] <= 0.5


def test_one_seed_or_too_few_degrees_of_freedom_is_undetermined():
    rate, found = outcomes(draws=20, seeds=1, shift=-10 * NOISE)
    assert rate["undetermined"] == 1.0 and found[0].reason.startswith("one seed at DIFF n1e+06")
    runs = synthetic_sweep(np.random.default_rng(0), shift=-10 * NOISE)
    one_short = [r for r in runs if not (r.model == "n1e+07" and r.variant == "diff" and r.seed != 0)]
    assert verdict.verdict(one_short, "diff", "vanilla").outcome == "undetermined"
    two_seeds_one_size = [r for r in synthetic_sweep(np.random.default_rng(0), seeds=2) if r.model == "n1e+06"]
    result = verdict.verdict(two_seeds_one_size, "diff", "vanilla")
    assert result.outcome == "undetermined" and "1.0 degrees of freedom" in result.reason
    assert verdict.verdict(runs, "diff", "topk").reason == "no size has runs of both"
    json.dumps(result.summary(), allow_nan=False)


def test_verdict_line_states_its_test_level_and_evidence():
    result = verdict.verdict(synthetic_sweep(np.random.default_rng(7), shift=-3 * NOISE), "diff", "vanilla")
    text = result.describe()
    assert text.startswith("verdict: DIFF better than Transformer: final val loss -0.")
    assert "95% interval" in text and "level 5%" in text and "two-sided t-test" in text
    assert "per size (DIFF − Transformer, nats): n1e+06 (1M):" in text and "(3 paired seeds)" in text
    summary = result.summary()
    assert summary["outcome"] == "better" and summary["level"] == 0.05 and summary["df"] == 10
    assert len(summary["sizes"]) == len(SIZES) and len(summary["sizes"][0]["paired_differences"]) == 3


# ------------------------------------------------------------------------------------------------------------------
# Through compare, on run directories
# ------------------------------------------------------------------------------------------------------------------
def sentinels(value, key=""):
    """Numbers in a ratio's place that stand for infinity (1e12) or are not finite."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in sentinels(v, k)]
    if isinstance(value, list):
        return [s for v in value for s in sentinels(v, key)]
    if isinstance(value, float) and ("ratio" in key or key in ("low", "high", "interval_68")) and value >= 1e6:
        return [(key, value)]
    return []


def short_sweep(root, **kwargs):
    return sweep(root, max_steps=20, eval_interval=10, tokens_per_step=1000, **kwargs)


def test_same_law_with_three_seeds_is_indistinguishable_and_withholds_the_ratios(tmp_path, capsys):
    root = short_sweep(tmp_path / "sweep", noise=NOISE, seed=4, seeds=3, diff_law=baseline_loss)
    assert compare.main([str(root), "--bootstrap", "20"]) == 0
    printed = capsys.readouterr().out
    summary = strict_json(root / "compare.json")
    assert "verdict: DIFF indistinguishable from Transformer" in printed
    assert "ratios: not distinguishable from seed noise (verdict: indistinguishable); withheld" in printed
    assert not [line for line in printed.splitlines() if "parameter ratio" in line and "%" in line]
    pair = summary["pairs"][0]
    assert pair["verdict"]["outcome"] == "indistinguishable" and pair["ratios_are_findings"] is False
    assert pair["parameter_ratios"] == [] and summary["parameter_ratios"] == [] and pair["flops"] is None
    assert len(pair["withheld_ratios"]["parameter_ratios"]) == len(SIZES)
    assert pair["verdict"]["interval_95"][0] < 0 < pair["verdict"]["interval_95"][1]
    assert sentinels(summary) == []


def test_ratios_never_hold_a_sentinel_where_refits_find_no_match():
    fit = scaling.fit_power_law(SIZES, baseline_loss(SIZES), num_bootstrap=20)
    refits = fit.bootstrap.copy()
    refits[::3, 1:] = [0.56, 0.1]  # a third of the reference's refits reach the loss at 1e-3 parameters
    refits[1::3, 0] = 10.0  # and a third sit above every loss: no size of theirs matches
    reference = dataclasses.replace(fit, bootstrap=refits)
    estimate = scaling.matching_ratio(fit, reference, 1e7)
    summary = estimate.summary()
    json.dumps(summary, allow_nan=False)
    assert sentinels(summary) == [] and summary["interval_68"] is None
    assert estimate.interval_reason.endswith("the refits do not bound the ratio")


def test_a_fit_at_its_exponent_bound_makes_the_ratio_unconstrained_as_the_legend_says():
    fit = scaling.fit_power_law(SIZES, baseline_loss(SIZES), num_bootstrap=20)
    at_bound = dataclasses.replace(fit, alpha=scaling.ALPHA_BOUNDS[1])
    estimate = scaling.matching_ratio(at_bound, fit, 1e7)
    assert estimate.summary()["unconstrained"] is True and "DIFF's exponent at its bound" in estimate.describe(
        "parameter", "parameters")


def test_ratios_print_to_two_significant_figures():
    assert [scaling.format_ratio(r) for r in (0.622, 7.998, 0.0346, 12.3, 1500)] == [
        "62%", "800%", "3.5%", "12x", "over 1000x"]


def test_token_ratio_from_cooldown_branches_not_from_evaluations_along_a_decaying_run(tmp_path):
    """wsd runs of the largest size, with cooldown branches at 3 smaller budgets, 2 seeds: L(D) on the branches'
    final losses gives the true token ratio; without the branches the decaying runs give none, and say why."""
    rng = np.random.default_rng(0)
    wsd = {"decay": "wsd", "warmup_steps": 10, "cooldown_steps": 200}
    for attention in ("diff", "vanilla"):
        for seed in (0, 1):
            source = write_run(tmp_path / "main", attention, 1e8, 0.0, follow_token_law=True, seed=seed,
                               lr_schedule=wsd, eval_interval=100)
            for steps in (250, 500, 750):
                final = float(token_loss(steps * TOKENS_PER_STEP, attention)) + rng.normal(0, 0.002)
                write_run(tmp_path / "branches", attention, 1e8, final, seed=seed, lr_schedule=wsd, max_steps=steps,
                          branch={"source_run": str(source), "source_step": steps - 50}, eval_interval=1000)
    comparison = scaling.compare_runs(run_records.load_runs([tmp_path]), num_bootstrap=40)
    pair = comparison.primary
    assert len(comparison.runs) == 4 and len(comparison.budget_runs) == 12
    assert pair.token_basis == "final losses of finished runs at several token budgets"
    assert pair.token_ratio.at == MAX_STEPS * TOKENS_PER_STEP
    assert pair.token_ratio.ratio == pytest.approx(TOKEN_RATIO, abs=0.05)
    assert pair.token_ratio.low < TOKEN_RATIO < pair.token_ratio.high or abs(pair.token_ratio.ratio - TOKEN_RATIO) < 0.02
    assert "resampled within each x (2-2 seeds each)" in pair.token_fits["diff"].bootstrap_method

    # The same runs without their branches: evaluations along a wsd (decaying) run give no token ratio.
    main = run_records.load_runs([tmp_path / "main"])
    pair = scaling.compare_runs(main, num_bootstrap=20).primary
    assert pair.token_ratio is None and "decay the learning rate" in pair.token_note
    assert "mix data with the schedule" in pair.token_note and "cooldown branches" in pair.token_note


def test_old_runs_without_a_schedule_give_no_token_ratio_from_their_evaluations(tmp_path):
    for attention in ("diff", "vanilla"):
        write_run(tmp_path, attention, 1e8, 0.0, follow_token_law=True, eval_interval=20)
    pair = scaling.compare_runs(run_records.load_runs([tmp_path]), num_bootstrap=20).primary
    assert pair.token_ratio is None and "record no lr_schedule (runs older than the key)" in pair.token_note


def test_each_cell_keeps_its_best_learning_rate_and_says_so(tmp_path, capsys):
    """DIFF is best at lr 1e-3, the Transformer at 3e-3 (their other lr 0.2 nats worse): with each kind at its best
    lr, DIFF on its better law is better; the report and the JSON name the lrs kept."""
    rng = np.random.default_rng(1)
    root = tmp_path / "sweep"
    for n in SIZES[:4]:
        for seed in range(3):
            for lr in (1e-3, 3e-3):
                bad = 0.2 if lr == 1e-3 else 0.0
                write_run(root, "vanilla", n, float(baseline_loss(n)) + bad + rng.normal(0, 0.01), seed=seed, lr=lr,
                          max_steps=20, eval_interval=10, tokens_per_step=1000)
                write_run(root, "diff", n, float(diff_loss(n)) + 0.2 - bad + rng.normal(0, 0.01), seed=seed, lr=lr,
                          max_steps=20, eval_interval=10, tokens_per_step=1000)
    assert compare.main([str(root), "--bootstrap", "20"]) == 0
    printed = capsys.readouterr().out
    summary = strict_json(root / "compare.json")
    best = {(s["variant"], s["model"]): s["best_lr"] for s in summary["lr_selection"]}
    assert set(best.values()) == {1e-3, 3e-3} and len(best) == 8
    assert all(best[("diff", m)] == 1e-3 and best[("vanilla", m)] == 3e-3 for _, m in best)
    assert {(r["variant"], r["lr"]) for r in summary["runs"]} == {("diff", 1e-3), ("vanilla", 3e-3)}
    assert "DIFF n1000000: best lr 0.001 by mean final val loss over seeds" in printed
    assert summary["verdict"]["outcome"] == "better"


def test_too_few_evaluations_is_not_called_flat(tmp_path):
    """Two evaluations in the last quarter whose loss fell by less than the threshold: no claim either way (the
    old report said "flat at the end")."""
    run_dir = write_run(tmp_path, "diff", 1e6, 5.0, max_steps=40, eval_interval=10, tokens_per_step=10)
    rows = [{"step": step, "loss": 6.0 - step / 100, "tokens": 10 * step} for step in range(1, 41)]
    for row, val_loss in zip(rows[9::10], (5.3, 5.1, 5.0005, 5.0)):
        row["val_loss"] = val_loss
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    convergence = scaling.convergence_of(run_records.load_run(run_dir))
    assert convergence.still_falling is None and "too few evaluations to tell" in convergence.describe()
    assert "flat at the end" not in convergence.describe()


# ------------------------------------------------------------------------------------------------------------------
# --out: never over a file compare did not write; a format no figure can take refused before any work
# ------------------------------------------------------------------------------------------------------------------
def test_out_with_an_extension_no_figure_takes_is_refused_before_loading(tmp_path, capsys):
    assert compare.main([str(tmp_path / "no-such-sweep"), "--out", str(tmp_path / "figure.xyz")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --out") and "'.xyz'" in error and ".png" in error and "no-such-sweep" not in error
    assert not (tmp_path / "figure.xyz").exists()


def test_out_never_replaces_a_file_compare_did_not_write(tmp_path, capsys):
    root = short_sweep(tmp_path / "sweep", noise=NOISE, seeds=2)
    out = tmp_path / "figure.png"
    for foreign in (out, out.with_suffix(".json")):
        foreign.write_text("mine")
        assert compare.main([str(root), "--out", str(out), "--bootstrap", "10"]) == 2
        assert f"{foreign} exists and was not written by compare" in capsys.readouterr().err
        assert foreign.read_text() == "mine"
        foreign.unlink()
    assert compare.main([str(root), "--out", str(out), "--bootstrap", "10"]) == 0
    assert compare.main([str(root), "--out", str(out), "--bootstrap", "10"]) == 0  # its own: rewritten
    out.write_bytes(out.read_bytes() + b"edited")  # no longer the figure compare wrote
    assert compare.main([str(root), "--out", str(out), "--bootstrap", "10"]) == 2
    assert compare.main([str(root), "--out", str(out), "--bootstrap", "10", "--force"]) == 0
    assert strict_json(out.with_suffix(".json"))["written_by"] == "diff_transformer.compare"


def test_the_default_output_in_the_sweep_directory_is_refused_when_foreign(tmp_path, capsys):
    root = short_sweep(tmp_path / "sweep", noise=NOISE, seeds=2)
    (root / "compare.json").write_text('{"notes": "a user\'s own"}')
    assert compare.main([str(root), "--bootstrap", "10"]) == 2
    assert "the default output" in capsys.readouterr().err
    (root / "compare.json").unlink()
    assert compare.main([str(root), "--bootstrap", "10"]) == 0
    assert compare.main([str(root), "--bootstrap", "10"]) == 0  # rerunning on the same sweep rewrites its own files


def test_where_the_loss_against_flops_curves_cross(tmp_path):
    """DIFF with a lower floor but a larger coefficient (E 1.6, A 2.6 against 1.8, 2.5): worse at small sizes, better
    from N = 1e8 · 2^(-1/0.35) ≈ 13.8M, i.e. 6N·D FLOPs; inside the measured range."""
    def late_winner(n):
        return 1.6 + 2.6 * (np.asarray(n) / 1e8) ** -0.35

    root = short_sweep(tmp_path / "sweep", noise=0.002, seeds=2, diff_law=late_winner)
    for run_json in root.glob("*/run.json"):
        description = json.loads(run_json.read_text())
        run_json.write_text(json.dumps({**description, "flops_per_token": 6.0 * description["num_parameters"]}))
    pair = scaling.compare_runs(run_records.load_runs([root]), num_bootstrap=20).primary
    cross = pair.flops.crossover
    tokens = 20 * 1000
    assert cross["direction"] == "starts to win" and cross["extrapolated"] is None
    assert cross["at"] == pytest.approx(6 * 1e8 * 2 ** (-1 / 0.35) * tokens, rel=0.1)
    assert cross["text"].startswith("DIFF starts to win at ≈ ") and cross["text"].endswith("(inside the measured range)")
    assert pair.verdict.outcome == "worse"  # over the sizes measured, on average


def test_the_wandb_log_holds_the_verdicts_and_only_ratios_that_are_findings(tmp_path, monkeypatch):
    """Offline: a stand-in wandb module records what log_to_wandb logs."""
    import sys
    import types

    from diff_transformer.analysis import wandb_runs

    logged = {}

    class Table:
        def __init__(self, columns):
            self.columns, self.rows = columns, []

        def add_data(self, *row):
            self.rows.append(row)

    class Run:
        url = "https://wandb.example/run"
        summary = {}

        def log(self, values):
            logged.update(values)

        def finish(self):
            pass

    fake = types.SimpleNamespace(Table=Table, Image=lambda path: path, init=lambda **kwargs: Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for law, outcome in ((diff_loss, "better"), (baseline_loss, "indistinguishable")):
        root = short_sweep(tmp_path / outcome, noise=NOISE, seed=4, seeds=3, diff_law=law)
        comparison = scaling.compare_runs(run_records.load_runs([root]), num_bootstrap=10)
        wandb_runs.log_to_wandb(comparison, tmp_path / "figure.png", "team/proj/sweep-id")
        assert [row[2] for row in logged["verdicts"].rows] == [outcome]
        assert len(logged["ratios"].rows) == (len(SIZES) if outcome == "better" else 0)
