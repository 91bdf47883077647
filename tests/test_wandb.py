"""W&B offline logging against metrics.jsonl, across a NaN-guarded stop and a resume that continues the same run.

The offline ``.wandb`` file is read with wandb's own protobuf schema (``wandb.proto.wandb_internal_pb2.Record``);
wandb 0.31 ships no reader for the file, so the record framing (LevelDB log: 32 KiB blocks, 7-byte headers, records
split FIRST/MIDDLE/LAST across blocks, after a 7-byte ``:W&B`` file header) is unpacked here.
"""

import json
import math
import struct
from pathlib import Path

import pytest

from diff_transformer.training.checkpoint import LATEST_FILE, checkpoint_name, read_trainer_state
from tests.test_resume import SHORT_RUN, by_step, read_metrics
from tests.train_runs import run_train

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    payloads, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += room
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            payloads.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            payloads.append(pending + chunk)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def offline_runs(run_dir, with_details=False):
    """(run id, group, tags, {step: {key: value}}) of each offline run under the run directory, oldest first; with
    details also its display name and the keys its summary updates set."""
    runs = []
    for wandb_file in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        run_id, group, tags, history, name, summary = None, None, None, {}, None, set()
        for record in read_wandb_records(wandb_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, group, tags, name = (record.run.run_id, record.run.run_group, list(record.run.tags),
                                             record.run.display_name)
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history[record.history.step.num] = items
            elif kind == "summary":
                summary |= {item.key or "/".join(item.nested_key) for item in record.summary.update}
        runs.append((run_id, group, tags, history) + ((name, summary) if with_details else ()))
    return runs


def same_value(a, b):
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


@pytest.fixture(scope="module")
def nan_guarded_run(tmp_path_factory):
    """Steps 2, 5 and 6 poisoned (loss and gradients NaN); two bad steps in a row stop the run at step 6 with a
    checkpoint; the restart resumes from it, with the same W&B run, to step 8."""
    run = tmp_path_factory.mktemp("nan") / "run"
    common = [o for o in SHORT_RUN if not o.startswith(("trainer.max_steps", "checkpoint.interval"))] + [
        "trainer.max_steps=8", "checkpoint.interval=0", "trainer.eval_interval=4", "logging.wandb.mode=offline",
        "failures.max_consecutive_bad_steps=2",
    ]
    stopped = run_train(run, common + ["failures.inject_nan_at_steps=[2,5,6]"], expect_rc=1)
    stopped_metrics = read_metrics(run)
    resumed = run_train(run, common)
    rerun = run_train(run, common)  # finished: nothing to train, no W&B segment opened
    return run, stopped, stopped_metrics, resumed, rerun


def test_nan_steps_are_skipped_counted_and_stop_the_run_with_a_checkpoint(nan_guarded_run):
    run, stopped, metrics, *_ = nan_guarded_run
    assert "error: 2 bad steps in a row up to step 6" in stopped.stderr and "Traceback" not in stopped.stderr
    steps = by_step(metrics)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert [steps[s]["skipped"] for s in range(1, 7)] == [False, True, False, False, True, True]
    assert [steps[s]["skipped_steps"] for s in range(1, 7)] == [0, 1, 1, 1, 2, 3]
    assert steps[2]["grad_norm"] is None and math.isnan(steps[2]["loss"])
    # had the NaN gradients of step 2 been applied, every later loss would be NaN
    assert all(math.isfinite(steps[s]["loss"]) for s in (3, 4)) and math.isfinite(steps[4]["val_loss"])
    # the skipped step consumed its batch but did not advance the LR schedule
    assert steps[3]["lr"] == steps[2]["lr"]
    saved = read_trainer_state(str(run / "checkpoints" / checkpoint_name(6)))
    assert (saved["step"], saved["consumed_samples"], saved["skipped_steps"]) == (6, 24, 3)
    assert saved["bad_steps_in_a_row"] == 2 and saved["recent_losses"] == [steps[s]["loss"] for s in (1, 3, 4)]


def test_resume_after_the_stop_continues_without_duplicate_steps(nan_guarded_run):
    run, _, before, *_ = nan_guarded_run
    after = read_metrics(run)
    assert [r["step"] for r in after] == list(range(1, 9))
    for kept, original in zip(after[:6], before):  # the records up to the checkpoint stay as they were
        assert kept.keys() == original.keys() and all(same_value(kept[k], original[k]) for k in kept)
    assert all(math.isfinite(r["loss"]) for r in after[6:]) and after[-1]["skipped_steps"] == 3
    assert (run / "checkpoints" / LATEST_FILE).read_text().strip() == checkpoint_name(8)


def test_wandb_offline_history_matches_metrics_and_resume_keeps_the_run_id(nan_guarded_run):
    run, *_ = nan_guarded_run
    runs = offline_runs(run)
    assert len(runs) == 2, "one offline run per process start"
    (first_id, group, tags, first), (second_id, _, _, second) = runs
    assert first_id and first_id == second_id, "the resumed run continues the same W&B run"
    assert read_trainer_state(str(run / "checkpoints" / checkpoint_name(8)))["wandb_run_id"] == first_id
    assert group == "smoke" and {"debug", "diff"} <= set(tags)
    assert sorted(first) == [1, 2, 3, 4, 5, 6] and sorted(second) == [7, 8], "no step logged twice"
    history = {**first, **second}
    for record in read_metrics(run):
        logged = history[record["step"]]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens", "skipped", "skipped_steps", "val_loss"):
            if key in record and record[key] is not None:
                assert same_value(logged[key], record[key]), (record["step"], key, logged[key], record[key])
        for layer, lam in enumerate(record.get("lambda", []), start=1):  # λ: on logging steps
            assert logged[f"lambda/layer_{layer:02d}"] == lam


def test_wandb_runs_are_named_resumes_name_every_segment_and_a_finished_run_is_not_reopened(nan_guarded_run):
    import subprocess
    import sys

    run, _, _, resumed, rerun = nan_guarded_run
    (run_id, _, _, _, name, summary), (second_id, _, _, _, _, second_summary) = offline_runs(run, with_details=True)
    assert name == "smoke-debug-diff-seed1234"  # the sweep or experiment, size, variant and seed: not a timestamp
    # The summary holds the losses (its footer lists keys sorted, ten at most): no attn/*, lambda/* or lr first.
    assert {k for k in summary | second_summary if not k.startswith("_")} == {"loss", "val_loss"}
    pattern = f"{run}/wandb/offline-run-*-{run_id}"
    assert (f"W&B run {run_id}: 2 offline segments (one per start); upload all with: wandb sync {pattern}"
            in resumed.stdout)
    assert "already at max_steps=8" in rerun.stdout and len(offline_runs(run)) == 2
    segments = sorted(str(p) for p in run.glob(f"wandb/offline-run-*-{run_id}"))
    dry_run = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", *segments], capture_output=True,
                             text=True, timeout=120)
    assert "Would sync 2 run(s)" in dry_run.stdout + dry_run.stderr
