"""benchmarks/gpu_run.sh --dry-run: every step of every plan, end to end on the CPU (Triton's interpreter with the
launchers planning as on an H100), so that a GPU window runs what CI ran but for the compiler; the ledger that skips
what was measured, the deadline that skips what no longer fits, refusals."""

import os
import re
import subprocess
import sys

import pytest

from tests.train_runs import REPO

PLANS = ("fa4", "first", "second", "kernels", "long")  # the window's order: gpu_run.sh's without a plan named
STEPS = {
    "fa4": ["fa4_install", "throughput_830m_fa4_compile"],
    "first": ["throughput_830m_compile", "throughput_830m_v2_compile", "throughput_830m_mb8_compile",
              "throughput_830m_compile_graphs"],
    "second": ["throughput_3b", "kernel_sweep", "document_mask_tests", "document_mask", "eval_analyze"],
    "kernels": ["fusions", "host_overhead", "kernel_tests", "core_attention_d128", "core_attention_d96", "fa4_tests",
                "core_attention_fa4_d128", "core_attention_fa4_d96", "throughput_830m"],
    "long": ["kernel_long", "niah_long"],
}


# Each plan is its own test, under its own limit: one test for the four plans of then (900 s) took 1,120 s on a loaded
# machine, and 600 s did not finish it under a load of 20 on 2 cores (2026-11-28), where the plans alone took first
# 379 s, second 308 s, long 45 s, fa4 86 s.
PLAN_TIMEOUT_S = 900


def gpu_run(out, *args, timeout=PLAN_TIMEOUT_S, ledger="ledger.tsv"):
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, TMPDIR=str(out.parent),
               GPU_RUN_LEDGER=str(out.parent / ledger))
    return subprocess.run(["bash", "benchmarks/gpu_run.sh", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`dry_run(plan)`: that plan's dry run, run once on first use into its own $OUT; the plans share one ledger and
    one cache directory (inductor's, Triton's), as the commands of one GPU window do."""
    root = tmp_path_factory.mktemp("gpu_run")
    runs = {}

    def run(plan):
        if plan not in runs:
            runs[plan] = root / plan, gpu_run(root / plan, "--dry-run", plan)
        return runs[plan]

    return run


def summary_rows(out):
    rows = {}
    for line in (out / "gpu_run.md").read_text().splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if line.startswith("| ") and len(cells) >= 3 and cells[0] != "| step" and not cells[0].startswith("|---"):
            rows[cells[0].lstrip("| ")] = cells[1]
    return rows


@pytest.mark.parametrize("plan", [pytest.param(plan, marks=pytest.mark.timeout(PLAN_TIMEOUT_S + 60)) for plan in PLANS])
def test_every_step_of_the_plan_runs_on_the_cpu(plan, dry_run):
    out, proc = dry_run(plan)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    rows = summary_rows(out)
    assert list(rows) == STEPS[plan], rows
    assert set(rows.values()) == {"ok"}, rows
    summary = (out / "gpu_run.md").read_text()
    if plan == "first":  # the headline numbers reach the summary: each kind against its own baseline
        assert "DIFF (sdpa) compile (TorchDynamo off: eager) / Transformer (sdpa) compile" in summary
        assert ("DIFF V2 (sdpa) compile (TorchDynamo off: eager) / Transformer num_kv_heads=1 (sdpa) compile "
                "(TorchDynamo off: eager) tokens/s at TP=1") in summary
        assert "recompute none:" in summary  # --fit-gib auto, on the simulated H100
    if plan == "kernels":  # the fused kernel's row first
        assert "headline: d=128" in summary and "diff triton" in summary
    assert "step_running.log" not in {p.name for p in out.iterdir()}


@pytest.mark.timeout(len(PLANS) * (PLAN_TIMEOUT_S + 60))  # the plans' runs are the tests' above, when run with them
def test_the_plans_send_back_at_most_8_files(dry_run):
    """What a GPU machine sends back from one $OUT for all the plans: at most 8 files, the log under 16 MiB."""
    outs = [dry_run(plan)[0] for plan in PLANS]
    files = sorted({p.name for out in outs for p in out.iterdir()})
    assert len(files) <= 8, files
    assert sum((out / "gpu_run.log").stat().st_size for out in outs) < 16 * 2**20


def test_measured_steps_are_skipped_and_the_deadline_is_kept(dry_run):
    out, _ = dry_run("first")
    again = gpu_run(out, "--dry-run", "first", timeout=120)
    assert again.returncode == 0, again.stdout[-3000:]
    skipped = [line for line in again.stdout.splitlines() if line.startswith("=== ") and "measured already" in line]
    assert len(skipped) == len(STEPS["first"]), again.stdout[-3000:]
    # a fresh ledger: nothing of the second plan measured yet, and a deadline that fits none of its steps
    late = gpu_run(out.parent / "late", "--dry-run", "second", "--deadline", "30", timeout=120,
                   ledger="late_ledger.tsv")
    assert late.returncode == 1  # steps that did not run are not a success
    rows = summary_rows(out.parent / "late")
    assert all(status.startswith("skipped: ") for status in rows.values()), rows


def test_a_step_is_skipped_when_less_than_its_need_is_left(dry_run):
    """More than a third of its limit left (what once sufficed) but less than it needs: the step is skipped, not
    started into a deadline that would cut it off (two steps spent 164 s of an H100 window that way)."""
    out, _ = dry_run("first")
    code = re.search(r"code ([0-9a-f]{12})", (out / "gpu_run.md").read_text()).group(1)
    ledger = out.parent / "need_ledger.tsv"  # every step of the second plan measured but the first
    ledger.write_text("".join(f"cpu-dry-run\t{code}\t{name}\t0\t1\n" for name in STEPS["second"][1:]))
    # the dry run triples limits and needs: throughput_3b's 990 s limit, 600 s need; 400 s is more than a third of
    # the limit
    assert STEPS["second"][0] == "throughput_3b"
    proc = gpu_run(out.parent / "need", "--dry-run", "second", "--deadline", "400", timeout=120,
                   ledger="need_ledger.tsv")
    assert proc.returncode == 1, proc.stdout[-3000:]
    status = summary_rows(out.parent / "need")["throughput_3b"]
    assert re.fullmatch(r"skipped: \d+ s left of the deadline, it needs 600 s \(limit 990 s\)", status), status


def test_without_a_plan_it_runs_the_windows_order(tmp_path):
    """No plan named: every plan in the window's order (what nobody has measured, 3b, the kernel rows), here under a
    deadline that fits no step, so each says it was skipped."""
    proc = gpu_run(tmp_path / "out", "--dry-run", "--deadline", "30", timeout=300, ledger="order_ledger.tsv")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = summary_rows(tmp_path / "out")
    assert list(rows) == [name for plan in PLANS for name in STEPS[plan]], rows
    assert all(status.startswith("skipped: ") for status in rows.values()), rows


@pytest.mark.parametrize("args,message", [
    (["fist"], "unknown argument 'fist'; expected plans (fa4 first second kernels long)"),
])
def test_bad_arguments_are_refused(tmp_path, args, message):
    proc = gpu_run(tmp_path / "out", *args, timeout=60)
    assert proc.returncode == 2 and f"error: gpu_run.sh: {message}" in proc.stderr


def test_a_library_error_is_one_table_cell():
    """A failed row's error in a benchmark's table (flash-attn-4's launch refusal on an H100 came as several coloured
    lines and broke the table): one line, no colour codes, pipes escaped."""
    from benchmarks.reports import table_cell

    error = "failed: CUDADialectError: \n\x1b[91m\x1b[1merror[X]:\x1b[0m CUDA launch failed\n\n  check `.launch(|)`"
    cell = table_cell(error)
    assert cell == "failed: CUDADialectError: error[X]: CUDA launch failed check `.launch(\\|)`"
    assert len(table_cell("x" * 500)) == 200
