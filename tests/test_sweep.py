"""Sweeps end to end: a WSD sweep's trunk and cooldown branches, a rerun that skips finished runs and resumes the
others, the sweep directory's owner check, and one W&B group per sweep invocation."""

import json
from pathlib import Path

import pytest

from diff_transformer.training.sweep import SweepDirectoryRefused, check_sweep_directory, finished_run
from tests.test_wandb import offline_runs
from tests.train_runs import read_metrics, run_train

# the tiny WSD preset on the debug model: one trunk of 80 steps, branches finished at 20 and 40 steps
TINY_WSD = ["-m", "+sweep=tiny_wsd", "model=debug", "model.attention=diff", "seed=1", "trainer.micro_batch_size=8",
            "trainer.global_batch_size=8", "trainer.eval_interval=20", "trainer.eval_iters=2",
            "logging.wandb.mode=offline"]
TRUNKS_ONLY = "sweep/tiny_budget@_global_=full"
TINY = ["-m", "+sweep=tiny", "model=debug", "model.attention=diff", "seed=1,2", "trainer.max_steps=4",
        "optim.warmup_steps=1", "trainer.micro_batch_size=4", "trainer.global_batch_size=4", "trainer.eval_interval=0",
        "logging.wandb.mode=offline"]


def sweep(sweep_dir, overrides, expect_rc=0):
    """train.py -m into ``sweep_dir`` (run_train's hydra.run.dir is unused by a multirun)."""
    return run_train(sweep_dir / "unused", [*overrides, f"hydra.sweep.dir={sweep_dir}"], expect_rc=expect_rc)


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def by_step(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def wsd_sweep(tmp_path_factory):
    """The trunks first (as with a parallel launcher), then the whole command (the trunk skipped, the branches run),
    then the whole command again (all skipped); and a plain run with the 20-step budget's own schedule."""
    root = tmp_path_factory.mktemp("wsd")
    trunks = sweep(root / "sweep", TINY_WSD + [TRUNKS_ONLY])
    trunk = root / "sweep" / "debug-diff-seed1"
    before = tree(trunk)
    branches = sweep(root / "sweep", TINY_WSD)
    after = tree(trunk)
    rerun = sweep(root / "sweep", TINY_WSD)
    plain = [o for o in TINY_WSD if o not in ("-m", "seed=1")] + ["seed=1", "trainer.max_steps=20"]
    run_train(root / "plain", plain)
    return root, trunks, branches, rerun, before, after


def test_the_wsd_sweep_prints_its_cost_and_writes_a_run_per_budget(wsd_sweep):
    root, trunks, branches, *_ = wsd_sweep
    assert "1 runs" in trunks.stdout and "3 runs" in branches.stdout
    assert "2 cooldown branches" in branches.stdout and "1.15x the plain sweep's tokens" in branches.stdout
    names = sorted(p.name for p in (root / "sweep").iterdir())
    assert names == ["debug-diff-seed1", "debug-diff-seed1-steps20", "debug-diff-seed1-steps40", "multirun.yaml",
                     "sweep.json"]
    sweep_id = json.loads((root / "sweep" / "sweep.json").read_text())["id"]
    for name, source_step in (("debug-diff-seed1", None), ("debug-diff-seed1-steps20", 16),
                              ("debug-diff-seed1-steps40", 32)):
        info = json.loads((root / "sweep" / name / "run.json").read_text())
        assert info["sweep"] == {"id": sweep_id, "dir": str(root / "sweep")}
        assert info["lr_schedule"]["decay"] == "wsd" and info["lr"] == 2e-3
        assert info["branch"] == (None if source_step is None else
                                  {"source_run": str(root / "sweep" / "debug-diff-seed1"), "source_step": source_step})
        assert max(by_step(root / "sweep" / name)) == info["max_steps"]


def test_a_branch_equals_a_run_with_its_schedule_and_leaves_the_source_untouched(wsd_sweep):
    root, *_, before, after = wsd_sweep
    assert after == before, "the source run directory is byte-identical"
    branch, plain = by_step(root / "sweep" / "debug-diff-seed1-steps20"), by_step(root / "plain")
    trunk = by_step(root / "sweep" / "debug-diff-seed1")
    assert sorted(branch) == [17, 18, 19, 20] and "val_loss" in branch[20]
    for step in branch:
        assert (branch[step]["loss"], branch[step]["lr"]) == (plain[step]["loss"], plain[step]["lr"]), step
    assert branch[20]["val_loss"] == plain[20]["val_loss"]
    assert trunk[19]["lr"] == 2e-3 > branch[19]["lr"] and trunk[20]["loss"] != branch[20]["loss"], "not vacuous"


def test_a_rerun_skips_the_finished_runs(wsd_sweep):
    root, _, branches, rerun, *_ = wsd_sweep
    assert f"skip: {root / 'sweep' / 'debug-diff-seed1'} finished" in branches.stdout
    skipped = [line for line in rerun.stdout.splitlines() if line.startswith("skip: ")]
    assert len(skipped) == 3 and "continuing" in rerun.stdout


@pytest.fixture(scope="module")
def plain_sweeps(tmp_path_factory):
    """The same command twice into two sweep directories, then the first again with more steps."""
    root = tmp_path_factory.mktemp("plain")
    first, second = sweep(root / "a", TINY), sweep(root / "b", TINY)
    longer = sweep(root / "a", [o if o != "trainer.max_steps=4" else "trainer.max_steps=6" for o in TINY])
    return root, first, second, longer


def test_a_rerun_resumes_an_unfinished_run_from_its_checkpoint(plain_sweeps):
    root, *_, longer = plain_sweeps
    for seed in (1, 2):
        run = root / "a" / f"debug-diff-seed{seed}"
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
        assert "resumed from" in (run / "train.log").read_text()
    assert "skip:" not in longer.stdout


def test_each_sweep_invocation_is_its_own_wandb_group_with_unique_run_names(plain_sweeps):
    root, *_ = plain_sweeps
    seen = {}
    for sweep_dir in ("a", "b"):
        sweep_id = json.loads((root / sweep_dir / "sweep.json").read_text())["id"]
        for seed in (1, 2):
            runs = offline_runs(root / sweep_dir / f"debug-diff-seed{seed}", with_details=True)
            for _, group, tags, _, name, _ in runs:
                assert group == sweep_id and f"sweep:{sweep_id}" in tags and f"seed:{seed}" in tags
                assert "data:the bundled corpus (Shakespeare, King James Bible)" in tags
                assert name == f"{sweep_id}/debug-diff-seed{seed}"
                seen.setdefault(sweep_dir, set()).add(name)
    assert len(seen["a"] | seen["b"]) == 4, "run names differ across the two invocations"


# ------------------------------------------------------------------------------------------------------------------
# The sweep directory's owner check (no training)
# ------------------------------------------------------------------------------------------------------------------
def test_someone_elses_sweep_directory_is_refused_before_anything_is_written(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    proc = sweep(foreign, TINY, expect_rc=2)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: sweep directory {foreign} holds files no run")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "multirun.yaml").write_text("hydra:\n  job:\n    name: my_app\nname: x\n")
    with pytest.raises(SweepDirectoryRefused, match=r"holds another sweep \(multirun.yaml of program my_app"):
        check_sweep_directory(str(other), "tiny-sweep", "train")
    (other / "multirun.yaml").write_text("hydra:\n  job:\n    name: train\nname: tiny-sweep\n")
    (other / "scale_1m-diff-seed1").mkdir()
    (other / "scale_1m-diff-seed1" / "metrics.jsonl").write_text("")
    assert check_sweep_directory(str(other), "tiny-sweep", "train")["id"] == "tiny-sweep-other", \
        "a sweep from before sweep ids continues under its directory's name"


def test_a_run_directory_holding_another_run_is_refused(tmp_path):
    from types import SimpleNamespace as NS

    (tmp_path / "run.json").write_text(json.dumps({"model": "debug", "attention": "diff", "seed": 1, "lr": 1e-3}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4}) + "\n")
    cfg = NS(model=NS(name="debug", attention="diff"), seed=1, optim=NS(lr=1e-3), trainer=NS(max_steps=4))
    assert finished_run(cfg, str(tmp_path)).startswith(f"skip: {tmp_path} finished")
    cfg.trainer.max_steps = 6
    assert finished_run(cfg, str(tmp_path)) is None
    cfg.optim.lr = 2e-3
    with pytest.raises(ValueError, match=r"holds another run \(lr 0.001 \(this run: 0.002\)\).*lr\$\{optim.lr\}"):
        finished_run(cfg, str(tmp_path))
