"""What a run says about its progress and its budget: tok/s and ETA over a window of steps (not one step's rate),
tokens seen and time elapsed, the epochs each blend entry is seen at start-up with a warning past a few, a warning
where the embeddings hold most of the parameters; and no library's notices in any command."""

import subprocess
import sys

from data.inspect import EPOCHS_WARNING, ShardSummary, epochs_lines
from diff_transformer.training import metrics
from diff_transformer.training.accounting import embedding_share_warning


def test_progress_line_rate_and_eta_are_over_a_window(tmp_path, monkeypatch):
    """A shared machine: step times swing 30x and every 10th step evaluates for 3 s. The line's tok/s is the
    window's tokens over its training time, its ETA the window's wall-clock per step (evaluations included)."""
    clock = [0.0]
    monkeypatch.setattr(metrics.time, "time", lambda: clock[0])
    writer = metrics.MetricsWriter(str(tmp_path), max_steps=200, enabled=True, window_steps=20)
    tokens_per_step = 2048
    lines = {}
    for step in range(1, 101):
        step_time = 0.05 if step % 3 else 1.5  # 41,000 vs 1,365 tok/s
        clock[0] += step_time + (3.0 if step % 10 == 0 else 0.0)
        record = {"step": step, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "step_time": step_time,
                  "tokens_per_s": tokens_per_step / step_time, "tokens": step * tokens_per_step}
        writer.log(record)
        lines[step] = writer.progress_line(record)
    window_steps = range(81, 101)  # the last 20 steps
    training = sum(0.05 if s % 3 else 1.5 for s in window_steps)
    expected_rate = tokens_per_step * len(window_steps) / training
    assert f"{expected_rate:,.0f} tok/s (last 20 steps)" in lines[100]
    per_step = sum((0.05 if s % 3 else 1.5) + (3.0 if s % 10 == 0 else 0.0) for s in range(81, 101)) / 20
    assert f"ETA {metrics.format_duration(per_step * 100)}" in lines[100]
    # steady: the ETA at step 60 and step 100 agree with the time the remaining steps take at that pace
    assert lines[60].split("ETA ")[1] == metrics.format_duration(per_step * 140)
    # what was seen so far: tokens (100 x 2048) and the wall-clock time since training began
    assert "205K tokens" in lines[100] and f"elapsed {metrics.format_duration(clock[0])}" in lines[100]
    assert metrics.format_duration(clock[0]) == "1:22"  # 33 x 1.5 s + 67 x 0.05 s + 10 x 3 s


def test_epochs_per_blend_entry_and_a_warning_past_a_few():
    small = ShardSummary("/data/wiki/train", 100, 1_000_000, [969_000, 30_000, 1_000], 0.5, {})
    large = ShardSummary("/data/web/train", 100, 100_000_000, [96_900_000, 3_000_000, 100_000], 0.5, {})
    lines, warnings = epochs_lines([small, large], train_tokens=18_000_000)
    assert lines[0].startswith("wiki/train: 9.29 epochs of its train split (969,000 tokens, weight 0.500)")
    assert lines[1].startswith("web/train: 0.09 epochs")
    assert len(warnings) == 1 and warnings[0].startswith(f"/data/wiki/train is seen 9.3 times over training (above "
                                                         f"{EPOCHS_WARNING:g} epochs")


def test_embeddings_that_dominate_the_model_are_named():
    # A 32,000-entry tokenizer on a tiny model: the embeddings hold 84% of it.
    warning = embedding_share_warning(9_800_000, 1_600_000, 32_000, 256)
    assert warning.startswith("the embeddings are 84% of the model's 9,800,000 parameters (vocabulary 32,000 x hidden "
                              "size 256)")
    assert embedding_share_warning(9_800_000, 6_000_000, 4096, 256) is None


def test_commands_show_no_library_notices():
    """megatron-core warns at import that TransformerEngine and Apex are missing (and more): every command hides it
    through diff_transformer.cli, which every entry point imports first; here data.inspect, which imports megatron."""
    from tests.train_runs import REPO, train_env

    env = {k: v for k, v in train_env().items() if k != "PYTHONWARNINGS"}  # Python's default filters, as a user has
    proc = subprocess.run([sys.executable, "-m", "data.inspect", "--bundled"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "epochs" in proc.stdout and proc.stderr == "", proc.stderr
