"""benchmarks/host_overhead.py (and benchmarks/fusions.py, benchmarks/zero_fills.py) refuses bad arguments with one error line and status 2, before any work and without
touching what is there (its end-to-end run on the CPU is a step of gpu_run.sh's dry run, tests/test_gpu_run.py)."""

import os
import subprocess
import sys

import pytest

from tests.train_runs import REPO


@pytest.mark.parametrize("script,args,message", [
    ("host_overhead.py", ["--calls", "0"], "argument --calls: '0': give a whole number of at least 1"),
    ("host_overhead.py", ["--seq-len", "many"], "argument --seq-len: 'many': give a whole number of at least 1"),
    ("host_overhead.py", ["--out", "{file}"], "--out {file}: a file, not a directory for the report"),
    ("fusions.py", ["--vocab", "0"], "argument --vocab: '0': give a whole number of at least 1"),
    ("fusions.py", ["--head-dim", "15"], "--head-dim 15: RoPE rotates pairs of features; expected an even number"),
    ("fusions.py", ["--out", "{file}"], "--out {file}: a file, not a directory for the report"),
    ("zero_fills.py", ["--micro-batches", "0"], "argument --micro-batches: '0': give a whole number of at least 1"),
    ("zero_fills.py", ["--out", "{file}"], "--out {file}: a file, not a directory for the report"),
])
def test_bad_arguments_are_refused(tmp_path, script, args, message):
    """benchmarks/host_overhead.py, benchmarks/fusions.py and benchmarks/zero_fills.py alike."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    args = [a.format(file=a_file) for a in args]
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {message.format(file=a_file)} (usage: {script} --help)"]
    assert a_file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_each_triton_kernel_is_replayed_alone_once(monkeypatch):
    """The table of launches replayed alone: each distinct kernel of the paths once, named, one launch a replay, no
    torch operation (on a CPU the launch is left out: only the replay's own Python is timed)."""
    import torch

    # the benchmark sets these at import where there is no GPU; they leave with this test (a compile check in a
    # subprocess of this worker must not inherit a simulated GPU)
    for key in ("TRITON_INTERPRET", "DIFF_ATTN_SIMULATE_GPU", "DIFF_ATTN_POISON"):
        present = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))  # recorded, so restored (or removed) after the test
        if not present:
            monkeypatch.delenv(key)
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.host_overhead import measure_launches, rope_call
    from kernels.rope import rotary

    call = rope_call(rotary, 2, 16, 8, 1, torch.float32, "cpu")
    rows = measure_launches([("RoPE", call), ("RoPE again", call)], "cpu", 2, 2)
    assert [row[0] for row in rows] == ["_rope_kernel (RoPE)"]
    label, host, synced, ops, launches, _ = rows[0]
    assert host > 0 and synced is None and ops == 0 and launches == 1
