"""The smoke experiment end to end on the bundled corpus: the loss falls and the run directory has what it should."""

import json
import math

from tests.train_runs import read_metrics, run_train


def test_smoke_experiment_loss_falls_and_run_dir_is_complete(tmp_path):
    proc = run_train(tmp_path, ["experiment=smoke"])
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 31))
    # an untrained model predicts nearly uniformly over the bundled tokenizer's 4096 tokens: the reported loss is the
    # true mean cross-entropy (not, say, divided by the number of micro-batches)
    assert abs(records[0]["loss"] - math.log(4096)) < 0.2, records[0]["loss"]
    first, last = records[:5], records[-5:]
    mean = lambda rs: sum(r["loss"] for r in rs) / len(rs)  # noqa: E731
    assert mean(last) < mean(first) - 0.5, (mean(first), mean(last))
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys() and r["tokens_per_s"] > 0
        # λ is read from the weights on logging steps only (trainer.log_interval=5 here): no host sync on the others
        assert ("lambda" in r) == (r["step"] % 5 == 0)
        assert len(r.get("lambda", [0, 0])) == 2
    assert records[0]["lr"] < records[4]["lr"]  # warm-up
    assert (tmp_path / "config.yaml").read_text().count("attention: diff") == 1
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["model"] == "debug" and info["num_parameters"] > 0
    assert info["data_source"] == "the bundled corpus (Shakespeare, King James Bible)"  # what figures' titles say
    log = (tmp_path / "train.log").read_text()
    assert "parameters" in log and "estimated memory per GPU" in log
    assert "step 30/30" in log and "tok/s (last 20 steps)" in log and "ETA" in log  # rate and ETA over a window
    assert "epochs of its train split" in log  # how often the run sees its data, said before it starts
    # a quiet start: a short summary before the first progress line, the whole config only in the run directory
    start = proc.stdout.split("| loss ")[0].splitlines()[:-1]
    assert len(start) + len(proc.stderr.splitlines()) <= 25, proc.stdout
    for what in ("config: ", "model debug DIFF (", "data: ", "layout: ", "estimated memory per GPU", "attention_backend"):
        assert any(what in line for line in start), (what, start)
    assert f"config: {tmp_path / 'config.yaml'} (resolved)" in proc.stdout and "overwrite_run" not in proc.stdout
    assert "overwrite_run: false" in (tmp_path / "config.yaml").read_text()
    progress = next(line for line in proc.stdout.splitlines() if "step 5/30" in line)
    assert "2.56K tokens" in progress and "elapsed 0:" in progress  # 5 steps of 8 x 64 tokens
