"""Save and resume end to end: train.py runs the debug model as users run it (python or torchrun over gloo).

Each scenario trains once uninterrupted (saving on the way) and once resumed from a mid-run checkpoint; the resumed
losses must equal the uninterrupted ones bit for bit on the same layout, and within 1e-5 across layouts.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diff_transformer.training.checkpoint import LATEST_FILE, checkpoint_name, is_complete, read_trainer_state
from tests.train_runs import REPO, read_metrics, run_train, short_document_shards, train_command, train_env

STEPS = 4  # 2N: the resumed runs start from the checkpoint at step N = 2
SHORT_RUN = [
    "experiment=smoke", f"trainer.max_steps={STEPS}", "optim.warmup_steps=1", "trainer.eval_interval=0",
    "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "checkpoint.interval=2",
    "trainer.log_interval=1",  # λ on every step's record
]




def by_step(records):
    return {r["step"]: r for r in records}


def ckpt(run_dir, step):
    return str(Path(run_dir) / "checkpoints" / checkpoint_name(step))


# ------------------------------------------------------------------------------------------------------------------
# Same layout: bit for bit; TP=2 -> TP=1: within 1e-5
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diff_tp2(tmp_path_factory):
    """DIFF at TP=2 with the distributed optimizer: uninterrupted, resumed at TP=2, resumed at TP=1; on short documents
    with document masking and per-document positions (a resume must continue the same masked samples)."""
    root = tmp_path_factory.mktemp("diff_tp2")
    documents = short_document_shards(root / "data") + ["data.document_mask=true", "data.reset_position_ids=true"]
    overrides = SHORT_RUN + documents + ["model.attention=diff", "parallel.distributed_optimizer=true"]
    run_train(root / "full", overrides + ["parallel.tp=2"], nproc=2)
    run_train(root / "resumed_tp2", overrides + ["parallel.tp=2", f"checkpoint.resume={ckpt(root / 'full', 2)}"], nproc=2)
    run_train(root / "resumed_tp1", overrides + [f"checkpoint.resume={ckpt(root / 'full', 2)}"])
    weights_only = ["checkpoint.interval=0", "checkpoint.save_at_end=false", f"checkpoint.load_weights_only={ckpt(root / 'full', 4)}"]
    run_train(root / "from_weights", overrides + weights_only)
    return root


@pytest.mark.multiproc
def test_diff_resume_same_layout_is_bit_exact(diff_tp2):
    full, resumed = by_step(read_metrics(diff_tp2 / "full")), by_step(read_metrics(diff_tp2 / "resumed_tp2"))
    assert sorted(resumed) == [3, 4], "the resumed run starts after the checkpoint's step"
    for step in (3, 4):
        for key in ("loss", "grad_norm", "lr", "lambda", "tokens"):
            assert resumed[step][key] == full[step][key], (step, key, resumed[step][key], full[step][key])


@pytest.mark.multiproc
def test_diff_resume_tp2_to_tp1_within_1e5(diff_tp2):
    full, resumed = by_step(read_metrics(diff_tp2 / "full")), by_step(read_metrics(diff_tp2 / "resumed_tp1"))
    assert sorted(resumed) == [3, 4]
    log = (diff_tp2 / "resumed_tp1" / "train.log").read_text()
    assert "layout changed (saved tp=2" in log and "tp=1 pp=1 dp=1, " in log
    for step in (3, 4):
        assert abs(resumed[step]["loss"] - full[step]["loss"]) < 1e-5
        assert resumed[step]["lr"] == full[step]["lr"]
        # λ vectors are TP-replicated parameters: resharding must restore them, not re-initialise them
        for lam_resumed, lam_full in zip(resumed[step]["lambda"], full[step]["lambda"]):
            assert abs(lam_resumed - lam_full) < 1e-5
    saved = read_trainer_state(ckpt(diff_tp2 / "resumed_tp1", 4))
    assert saved["layout"]["tp"] == 1 and saved["step"] == 4 and saved["consumed_samples"] == 4 * 4


@pytest.mark.multiproc
def test_load_weights_only_starts_a_new_run_from_trained_weights(diff_tp2):
    full, fresh = by_step(read_metrics(diff_tp2 / "full")), by_step(read_metrics(diff_tp2 / "from_weights"))
    assert sorted(fresh) == [1, 2, 3, 4], "step, schedule and data start from zero"
    assert fresh[1]["lr"] == full[1]["lr"] == 0.0 and fresh[1]["tokens"] == full[1]["tokens"]
    # the first batch again, through the weights trained for 4 steps (a TP=2 checkpoint, loaded at TP=1)
    assert fresh[1]["loss"] < full[1]["loss"] - 0.1
    assert "started from the weights of" in (diff_tp2 / "from_weights" / "train.log").read_text()


@pytest.mark.multiproc
def test_incompatible_model_config_names_the_keys(diff_tp2, tmp_path):
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.training.trainer import Trainer

    path = ckpt(diff_tp2 / "full", 2)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), read_trainer_state(path)["config"]))
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 96, 256
    cfg.model.attention_backend = "eager"  # same parameters and math: free to change
    cfg.checkpoint.resume = path
    trainer = Trainer(cfg, str(tmp_path))
    trainer.checkpoint_root = str(tmp_path / "checkpoints")
    with pytest.raises(ValueError) as err:
        trainer._checkpoint_to_load()
    message = str(err.value)
    assert "model.hidden_size: checkpoint 64, config 96" in message
    assert "model.ffn_hidden_size: checkpoint 176, config 256" in message
    assert "attention_backend" not in message and "num_layers" not in message

    # the same model at PP=2: refused before loading, since megatron-core mis-restores the tied embedding there
    cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.parallel.pp = 64, 176, 2
    with pytest.raises(ValueError, match="saved at parallel.pp=1 with the distributed optimizer and tied embeddings"):
        trainer._checkpoint_to_load()


@pytest.mark.multiproc
def test_vanilla_dp2_distributed_optimizer_resume_is_bit_exact(tmp_path):
    overrides = SHORT_RUN + ["model.attention=vanilla", "parallel.distributed_optimizer=true"]
    run_train(tmp_path / "full", overrides + ["checkpoint.async_save=true"], nproc=2)  # written in the background
    run_train(tmp_path / "resumed", overrides + [f"checkpoint.resume={ckpt(tmp_path / 'full', 2)}"], nproc=2)
    full, resumed = by_step(read_metrics(tmp_path / "full")), by_step(read_metrics(tmp_path / "resumed"))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "lr"):
            assert resumed[step][key] == full[step][key], (step, key)
    assert read_trainer_state(ckpt(tmp_path / "full", 2))["layout"]["dp"] == 2


# ------------------------------------------------------------------------------------------------------------------
# SIGKILL during a save, SIGTERM during training (under SLURM: requeue)
# ------------------------------------------------------------------------------------------------------------------
def _wait_for(predicate, timeout: float, proc, what: str, poll: float = 0.002):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited ({proc.returncode}) before {what}:\n{_tail(proc.log)}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def _tail(path) -> str:
    return Path(path).read_text()[-4000:]


def _start(run, overrides, log, env=None, **kwargs):
    """train.py in the background, its output in ``log`` (a pipe nobody reads could fill and block it)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            train_command(run, overrides), cwd=REPO, env=env or train_env(), stdout=out, stderr=subprocess.STDOUT,
            **kwargs,
        )
    proc.log = log
    return proc


def test_sigkill_during_save_then_sigterm_requeue_then_resume(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    long_run = [o for o in SHORT_RUN if not o.startswith("trainer.max_steps")] + ["trainer.max_steps=60"]

    # 1. killed (the whole process group, as a node failure would) while writing the checkpoint of step 4
    proc = _start(run, long_run, tmp_path / "killed.log", start_new_session=True)
    try:
        _wait_for(lambda: is_complete(str(root / checkpoint_name(2))), 240, proc, "the checkpoint of step 2")
        _wait_for(lambda: (root / f".{checkpoint_name(4)}.tmp").is_dir(), 60, proc, "the save of step 4 to start")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(2)
    assert not (root / checkpoint_name(4)).exists(), "a partial save must never appear under its final name"
    assert not is_complete(str(root / f".{checkpoint_name(4)}.tmp"))
    killed = by_step(read_metrics(run))
    assert max(killed) >= 3

    # 2. resumed automatically from step 2, as a SLURM job; SIGTERM mid-training (SLURM's SIGUSR1 takes the same
    # path) saves the current step, requeues the job (a stand-in scontrol records the call) and exits cleanly
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    (fake_bin / "scontrol").chmod(0o755)
    slurm_env = dict(train_env(), SLURM_JOB_ID="4242", PATH=f"{fake_bin}:{os.environ['PATH']}")
    proc = _start(run, long_run + ["checkpoint.interval=0"], tmp_path / "preempted.log", env=slurm_env)
    metrics = run / "metrics.jsonl"

    def resumed_past_step_4():
        # the killed run logged up to step 4, so a record of step 5 comes from the resumed run
        return metrics.exists() and any(line.startswith('{"step": 5,') for line in metrics.read_text().splitlines())

    try:
        _wait_for(resumed_past_step_4, 240, proc, "the resumed run to reach step 5", poll=0.01)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, _tail(proc.log)
    stopped = read_metrics(run)
    last = stopped[-1]["step"]
    assert 5 <= last < 60
    assert (root / LATEST_FILE).read_text().strip() == checkpoint_name(last), "the signal saves the current step"
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"
    assert read_trainer_state(ckpt(run, last))["consumed_samples"] == last * 4
    assert not (root / f".{checkpoint_name(4)}.tmp").exists(), "the next save removes the partial one"
    assert [r["step"] for r in stopped] == list(range(1, last + 1)), "no duplicate steps after the resume"
    # the resumed step 3 retraces the killed run's step 3 exactly: resume from the previous checkpoint is exact
    assert by_step(stopped)[3]["loss"] == killed[3]["loss"]

    # 3. the next start (the requeued job) continues from that checkpoint to the end
    run_train(run, long_run + ["checkpoint.interval=0", "checkpoint.save_at_end=false"])
    final = read_metrics(run)
    assert [r["step"] for r in final] == list(range(1, 61))
    assert by_step(final)[last]["loss"] == by_step(stopped)[last]["loss"]
    assert all(math.isfinite(r["loss"]) for r in final)


# ------------------------------------------------------------------------------------------------------------------
# Tooling: inspect and convert
# ------------------------------------------------------------------------------------------------------------------
def _checkpoint_cli_in_process(capsys, *args):
    from diff_transformer.checkpoint import main

    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def _checkpoint_cli(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "diff_transformer.checkpoint", *map(str, args)], cwd=REPO, env=train_env(),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.multiproc
def test_inspect_prints_step_layout_and_sizes(diff_tp2, capsys):
    out = _checkpoint_cli_in_process(capsys, "inspect", diff_tp2 / "full" / "checkpoints")  # its latest
    assert f"checkpoint   {ckpt(diff_tp2 / 'full', 4)}" in out
    assert "step         4 (16 samples, 0 skipped)" in out
    assert "layout       tp=2 pp=1 dp=1 world=2 distributed_optimizer=True" in out
    assert "hidden_size=64" in out and "attention=diff" in out
    info = json.loads(_checkpoint_cli_in_process(capsys, "inspect", "--json", ckpt(diff_tp2 / "full", 2)))
    assert info["step"] == 2 and info["size_bytes"] > 4 * info["num_parameters"]


@pytest.mark.multiproc
def test_convert_reshards_to_one_file_that_loads_into_a_tp1_model(diff_tp2, tmp_path, megatron_single_process):
    import torch
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.models.gpt import build_model_chunk

    # the same training, saved at TP=2 and at TP=1 (the resumed run): converted, both give the same tensors
    _checkpoint_cli("convert", ckpt(diff_tp2 / "full", 4), tmp_path / "from_tp2.pt")
    _checkpoint_cli("convert", ckpt(diff_tp2 / "resumed_tp1", 4), tmp_path / "from_tp1.pt")
    from_tp2 = torch.load(tmp_path / "from_tp2.pt", weights_only=False)
    from_tp1 = torch.load(tmp_path / "from_tp1.pt", weights_only=False)
    assert from_tp2["step"] == 4 and from_tp2["model"].keys() == from_tp1["model"].keys()
    for name, tensor in from_tp2["model"].items():
        torch.testing.assert_close(tensor, from_tp1["model"][name], rtol=0, atol=1e-5, msg=name)

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), from_tp2["config"]))
    cfg.parallel.tp = 1
    vocab = from_tp2["model"]["embedding.word_embeddings.weight"].shape[0]
    model = build_model_chunk(cfg, vocab)
    missing, unexpected = model.load_state_dict(from_tp2["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    qkv = from_tp2["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == model.decoder.layers[0].self_attention.linear_qkv.weight.shape  # full, not a TP shard
