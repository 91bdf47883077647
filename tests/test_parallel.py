"""TP=2 equals TP=1 and PP=2 equals PP=1 (same seed, same data), for DIFF and the vanilla baseline, over gloo; the
same launches check trainer.fusions: the TP=2 and PP=2 runs have every fusion on (fused RoPE, SwiGLU, cross-entropy,
the Triton DIFF epilogue in Triton's interpreter, the weight gradients accumulated into the fp32 main gradient in
their GEMM), the single-process references none, and DIFF also runs fused in one process (with a profiled step).
DIFF's runs train on short documents with document masking and per-document
positions (several documents a sample), so the document ids also cross the pipeline stages and the TP ranks. They
run DIFF on ``sdpa``, whose epilogue the fusions replace; the CPU's own choice for DIFF, ``combined`` (what ``auto``
takes here), runs at TP=2 against the same single-process reference."""

import json

import pytest

from tests.train_runs import read_metrics, run_train, short_document_shards

STEPS = 20
COMMON = ["experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=0", "optim.warmup_steps=2"]
# megatron-core's fused SwiGLU and cross-entropy are torch.compile'd: on a CPU their Python runs as written (the
# formulas under test; inductor's kernels are the GPU tier's), without minutes of compiling per process
FUSED, FUSED_ENV = ["trainer.fusions=on", "trainer.grad_accumulation_fusion=on"], {"TORCHDYNAMO_DISABLE": "1"}
PROFILED_STEP = STEPS - 1


@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory):
    documents = short_document_shards(tmp_path_factory.mktemp("short_documents")) + [
        "data.document_mask=true", "data.reset_position_ids=true"]
    runs = {"data": {"vanilla": [], "diff": documents + ["model.attention_backend=sdpa"], "diff-auto": documents}}
    for kind in ("diff", "vanilla"):
        run_dir = tmp_path_factory.mktemp(f"{kind}-tp1")
        run_train(run_dir, COMMON + runs["data"][kind] + [f"model.attention={kind}"])
        runs[kind] = read_metrics(run_dir)
    fused = tmp_path_factory.mktemp("diff-tp1-fused")
    run_train(fused, COMMON + FUSED + runs["data"]["diff"] + ["model.attention=diff",
                                                            f"trainer.profile_step={PROFILED_STEP}"], env=FUSED_ENV)
    runs["diff-fused"] = read_metrics(fused)
    runs["diff-fused-dir"] = fused
    return runs


def assert_same_losses(got_run, reference, kind, loss_tol, grad_norm_rel):
    assert [r["step"] for r in got_run] == list(range(1, STEPS + 1))
    for got, want in zip(got_run, reference):
        assert got["loss"] == pytest.approx(want["loss"], abs=loss_tol, rel=0), f"step {got['step']}"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=grad_norm_rel), f"step {got['step']}"
        if kind == "diff":  # λ is read on logging steps (smoke: every 5th)
            assert ("lambda" in got) == (got["step"] % 5 == 0)
            if "lambda" in want:
                assert len(got["lambda"]) == 2
                assert got["lambda"] == pytest.approx(want["lambda"], abs=loss_tol)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"], ids=["tp2", "pp2"])
@pytest.mark.parametrize("kind", ["diff", "vanilla"])
def test_two_way_model_parallel_with_fusions_matches_single_process_without(kind, layout, single_process_runs, tmp_path):
    run_train(tmp_path, COMMON + FUSED + single_process_runs["data"][kind] + [f"model.attention={kind}", layout],
              nproc=2, env=FUSED_ENV)
    parallel, reference = read_metrics(tmp_path), single_process_runs[kind]
    # TP's reductions add in another order (1e-6 relative in DIFF's first gradient norm); a norm near a spike
    # amplifies that over 20 steps (DIFF at TP=2, step 15: 3.2e-4 relative, the loss within 2e-6)
    assert_same_losses(parallel, reference, kind, loss_tol=1e-5, grad_norm_rel=1e-3)
    # training actually moved the weights: losses are not constant
    assert len({round(r["loss"], 4) for r in reference}) > 1
    log = (tmp_path / "train.log").read_text()
    assert ("fusions on (triton DIFF epilogue)" if kind == "diff" else "backend sdpa, fusions on)") in log
    if kind == "vanilla":
        assert "model.attention_backend=auto: sdpa (no GPU)" in log  # rank 0's decision, which every rank builds with


def test_diff_on_combined_at_tp2_matches_single_process_sdpa(single_process_runs, tmp_path):
    """auto without a GPU takes DIFF's combined map at the debug model's 64 tokens (its backward written out: λ's
    and the norm weight's gradients are partial sums over each rank's heads, summed over the TP group); TP=2 on it
    against the single-process sdpa run, within the tolerances of TP's reordered sums."""
    run_train(tmp_path, COMMON + single_process_runs["data"]["diff-auto"] + ["model.attention=diff", "parallel.tp=2"],
              nproc=2)
    assert_same_losses(read_metrics(tmp_path), single_process_runs["diff"], "diff", loss_tol=1e-5, grad_norm_rel=1e-3)
    assert "model.attention_backend=auto: combined (no GPU; 64 tokens a rank" in (tmp_path / "train.log").read_text()
    assert json.loads((tmp_path / "attention_backend.json").read_text())["backend"] == "combined"


def test_fusions_on_equal_fusions_off_in_one_process(single_process_runs):
    """20 steps of DIFF with every fusion on against the unfused run: within fp32 rounding (measured at most 4.8e-7
    in the loss and 4e-6 relative in the gradient norm)."""
    assert_same_losses(single_process_runs["diff-fused"], single_process_runs["diff"], "diff", loss_tol=5e-6,
                       grad_norm_rel=5e-5)
    run_dir = single_process_runs["diff-fused-dir"]
    profile = json.loads((run_dir / f"profile_step_{PROFILED_STEP}.json").read_text())
    seconds = profile["seconds"]
    assert profile["device"] == "cpu" and abs(sum(seconds.values()) - profile["step_time_s"]) < 1e-6
    for kind in ("GEMM", "attention", "DIFF epilogue", "norms", "optimizer"):
        assert seconds[kind] > 0, (kind, seconds)
