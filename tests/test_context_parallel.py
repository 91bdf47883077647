"""Context parallelism (``parallel.cp``, ring attention: ``diff_transformer/models/ring_attention.py``).

- In process: the ring's math on a ring of threads (fp64, against full causal attention: outputs and every gradient,
  DIFF V1's two maps, V2's one over shared K/V, the baseline's), the load-balanced layout, refusals, the memory plan.
- One torchrun launch of two processes (``tests/context_parallel_worker.py``): the ring over a real gloo group, the
  debug model at CP=2 against CP=1 (every token's loss and every gradient, fp32), ten trainer steps at CP=2 against
  CP=1 for diff, diff_v2 and vanilla.
- train.py: CP=2 with TP=2 (sequence parallelism, distributed optimizer) for ten steps, and CP=2 with PP=2 (selective
  recomputation) resumed from a CP=1 checkpoint, against the uninterrupted CP=1 run; the long-context preset at CP=2
  from that run's weights, resumed at CP=1; evaluate past the training length with and without CP.
"""

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from diff_transformer.config import validate
from diff_transformer.models.ring_attention import (
    IMPLEMENTATIONS,
    context_parallel_chunks,
    load_balanced_indices,
    ring_attention,
)
from diff_transformer.training.checkpoint import checkpoint_name
from tests.ring_reference import KINDS, SCALE, full_attention, ring_inputs
from tests.test_config import compose_cfg
from tests.train_runs import REPO, read_metrics, run_train, train_env

STEPS = 10
COMMON = ["experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=5", "optim.warmup_steps=2"]
FP64_TOLERANCE = 1e-12  # measured: ~2e-15
LOSS_TOLERANCE = 1e-5  # measured: <= 1e-6 over ten fp32 steps


# ------------------------------------------------------------------------------------------------------------------
# The ring's math, in process: a ring of threads
# ------------------------------------------------------------------------------------------------------------------
class ThreadRing:
    """Rank ``rank`` of a ring of threads in one process: each exchange hands copies to the next rank's mailbox."""

    def __init__(self, mailboxes, rank):
        self.mailboxes, self.rank, self.size = mailboxes, rank, len(mailboxes)

    def exchange(self, tensors):
        self.mailboxes[(self.rank + 1) % self.size].put([t.clone() for t in tensors])
        mailbox = self.mailboxes[self.rank]

        class Pending:
            def wait(self):
                return mailbox.get(timeout=60)

        return Pending()


def run_thread_ring(kind, impl, ranks, dtype=torch.float64):
    """Each rank's (outputs, dq, dk, dv) on its chunks, and the full-attention reference."""
    q, k, v, grads_out, maps = ring_inputs(kind, ranks, dtype)
    mailboxes = [queue.Queue() for _ in range(ranks)]
    results, failures = [None] * ranks, []

    def rank_main(rank):
        try:
            local = [context_parallel_chunks(t, ranks, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
            outs = ring_attention([local[0][:, qs] for qs, _ in maps], local[1], local[2], [kh for _, kh in maps],
                                  SCALE, ThreadRing(mailboxes, rank), impl)
            torch.autograd.backward(outs, [context_parallel_chunks(g, ranks, rank, dim=2) for g in grads_out])
            results[rank] = ([o.detach() for o in outs], local[0].grad, local[1].grad, local[2].grad)
        except Exception as err:  # noqa: BLE001  (reported by the test thread)
            failures.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    return results, full_attention(q, k, v, grads_out, maps)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_ring_attention_equals_full_causal_attention_fp64(kind, impl, ranks):
    results, reference = run_thread_ring(kind, impl, ranks)
    seq = reference["dq"].shape[2]
    for rank, (outs, dq, dk, dv) in enumerate(results):
        index = load_balanced_indices(seq, ranks, rank)
        for m, out in enumerate(outs):
            torch.testing.assert_close(out, reference[f"out{m}"][:, :, index], rtol=0, atol=FP64_TOLERANCE)
        for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
            torch.testing.assert_close(grad, reference[name][:, :, index], rtol=0, atol=FP64_TOLERANCE,
                                       msg=f"{name} of rank {rank}")


def test_ring_in_fp32_within_its_rounding():
    results, reference = run_thread_ring("diff", "sdpa", 2, torch.float32)
    for rank, (outs, dq, dk, dv) in enumerate(results):
        index = load_balanced_indices(reference["dq"].shape[2], 2, rank)
        torch.testing.assert_close(outs[0], reference["out0"][:, :, index].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dk, reference["dk"][:, :, index].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_load_balanced_chunks_cover_the_sequence_evenly(cp):
    seq, c = 32, 32 // (2 * cp)
    layouts = [load_balanced_indices(seq, cp, r).tolist() for r in range(cp)]
    assert sorted(i for layout in layouts for i in layout) == list(range(seq))
    for r, layout in enumerate(layouts):  # chunk r and chunk 2·cp−1−r: every rank's causal work is the same
        assert layout == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    tokens = torch.arange(2 * seq).view(2, seq)
    assert context_parallel_chunks(tokens, cp, cp - 1, dim=1).tolist() == [layouts[-1], [seq + i for i in layouts[-1]]]


def test_ring_exchange_refuses_a_tensor_the_group_cannot_carry(monkeypatch):
    from diff_transformer import distributed

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="ring_exchange: a cpu tensor cannot be sent around a nccl group"):
        distributed.ring_exchange([torch.zeros(2)], group="a group")


# ------------------------------------------------------------------------------------------------------------------
# Refusals (one line each, before any process group) and the memory plan
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.cp=2", "model.seq_length=66"], 2, r"model.seq_length=66 is not divisible by 2\*parallel.cp=4"),
        (["parallel.cp=2", "model.attention=topk"], 2,
         r"model.attention=topk has no ring-attention path for context parallelism \(parallel.cp=2\); use one of diff, "
         r"vanilla, diff_v2, vanilla_subln, vanilla_wide"),
        (["parallel.cp=2", "model.attention=signed_mask"], 2, r"model.attention=signed_mask has no ring-attention path"),
        (["parallel.cp=2", "model.attention=dex"], 2, r"model.attention=dex has no ring-attention path .*calibration"),
        (["parallel.cp=2", "model.attention_backend=triton"], 2,
         r"model.attention_backend=triton has no ring-attention path .* use model.attention_backend=sdpa"),
        (["parallel.cp=2", "model.attention=vanilla", "model.attention_backend=flash_attn"], 2,
         r"model.attention_backend=flash_attn has no ring-attention path"),
        (["parallel.cp=2", "engine=deepspeed", "engine.zero_stage=1"], 2,
         r"engine=deepspeed does not run context parallelism \(parallel.cp=2\); use engine=megatron"),
        (["parallel.cp=2"], 3, r"world size 3 is not divisible by parallel.tp\*parallel.pp\*parallel.cp=2"),
        (["parallel.cp=2", "trainer.attention_diagnostics=on"], 2, r"trainer.attention_diagnostics=on reads whole"),
        (["parallel.cp=2", "parallel.tp=4", "model.num_heads=4", "parallel.sequence_parallel=true",
          "model.seq_length=12"], 8, r"splits each context-parallel rank's 6 tokens .* over parallel.tp=4"),
        (["parallel.cp=0"], 1, r"parallel.cp=0 must be positive"),
    ],
    ids=["seq", "topk", "signed-mask", "dex", "triton", "flash-attn", "deepspeed", "world", "diagnostics", "sp", "zero"],
)
def test_bad_context_parallel_configs_are_refused(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg("experiment=smoke", *overrides), world_size=world)


def test_train_py_refuses_triton_at_cp2_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "parallel.cp=2", "model.attention_backend=triton",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=dict(train_env(), WORLD_SIZE="2"), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.attention_backend=triton has no ring-attention path" in errors[0], proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


LONG_3B = ["experiment=long_context", "model=3b", "checkpoint.load_weights_only=/", "trainer.gpu_memory_gib=80"]


def test_memory_plan_divides_activations_and_proposes_context_parallelism():
    from diff_transformer.training.accounting import (
        activation_bytes_per_layer,
        choose_context_parallel,
        estimate_memory_per_gpu,
        memory_plan_problem,
    )

    cfg = compose_cfg(*LONG_3B, "parallel.cp=1")
    cfg2 = compose_cfg(*LONG_3B, "parallel.cp=2")
    one, two = (activation_bytes_per_layer(c, 2, "cuda") for c in (cfg, cfg2))
    for kind in ("selective", "input", "working"):  # every tensor of a layer but the core attention's: per token
        assert two[kind] == pytest.approx(one[kind] / 2), kind
    assert two["full"] < 0.6 * one["full"]  # the ring keeps per-map outputs and LSEs instead of the kernel's
    assert one["ring"] == 0 and two["ring"] > 0  # K/V in flight and dK/dV accumulating: one layer at a time
    estimates = {cp: estimate_memory_per_gpu(compose_cfg(*LONG_3B, f"parallel.cp={cp}"), torch.bfloat16, 8, 100352,
                                             "cuda") for cp in (1, 2, 4, 8)}
    assert [estimates[cp]["logits"] for cp in (2, 4, 8)] == pytest.approx([estimates[1]["logits"] / cp for cp in (2, 4, 8)])
    assert estimates[2]["optimizer"] == estimates[1]["optimizer"]  # sharded over DP×CP, whose product stays 8
    problem = memory_plan_problem(cfg, torch.bfloat16, 8, 100352, 64, "cuda")
    assert f"parallel.cp=2 ({estimates[2]['total']:.1f} GiB)" in problem
    for budget in (80, 64, 48, 40):  # parallel.cp=null: the smallest CP whose estimate fits 90% of the budget
        chosen = choose_context_parallel(compose_cfg(*LONG_3B, f"trainer.gpu_memory_gib={budget}"), torch.bfloat16,
                                         8, 100352, "cuda")
        assert estimates[chosen]["total"] <= 0.9 * budget
        assert chosen == 1 or estimates[chosen // 2]["total"] > 0.9 * budget


def test_long_context_preset_is_the_papers_recipe():
    cfg = compose_cfg(*LONG_3B)
    assert (cfg.model.seq_length, cfg.model.rope_base, cfg.parallel.cp) == (65536, 640000, None)
    assert cfg.trainer.max_steps * cfg.trainer.global_batch_size * cfg.model.seq_length == pytest.approx(1.5e9, rel=0.01)
    validate(cfg, world_size=8)


# ------------------------------------------------------------------------------------------------------------------
# Over a real gloo ring: one torchrun launch of two processes
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from diff_transformer.distributed import free_port

    root = tmp_path_factory.mktemp("cp_worker")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(REPO / "tests" / "context_parallel_worker.py"),
               str(root / "results.json"), str(root)]
    proc = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((root / "results.json").read_text())


@pytest.mark.multiproc
def test_ring_over_gloo_equals_full_attention_fp64(worker):
    for rank, results in enumerate(worker):
        for case, errors in results["ring"].items():
            assert max(errors.values()) < FP64_TOLERANCE, (rank, case, errors)
        assert len(results["ring"]) == len(KINDS) * len(IMPLEMENTATIONS)


@pytest.mark.multiproc
def test_model_at_cp2_equals_cp1_losses_and_every_gradient(worker):
    for rank, results in enumerate(worker):
        for kind, errors in results["model"].items():
            assert errors["loss"] < 1e-5, (rank, kind, errors)  # measured: <= 1e-6 on losses of ~8.3
            assert errors["grad"] < 2e-5, (rank, kind, errors)  # relative, of the worst of every parameter's gradient
        assert set(results["model"]) == {"diff", "diff_v2", "vanilla"}


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["diff", "diff_v2", "vanilla"])
def test_ten_trainer_steps_at_cp2_equal_cp1(worker, kind):
    split, whole = worker[0]["training"][f"{kind}-cp2"], worker[0]["training"][f"{kind}-cp1"]
    assert len(split) == len(whole) == STEPS
    for step, (got, want) in enumerate(zip(split, whole), start=1):
        assert got["loss"] == pytest.approx(want["loss"], abs=LOSS_TOLERANCE, rel=0), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), step
        if want["val_loss"] is not None:
            assert got["val_loss"] == pytest.approx(want["val_loss"], abs=LOSS_TOLERANCE, rel=0), step
        if kind == "diff":
            assert got["lambda"] == pytest.approx(want["lambda"], abs=LOSS_TOLERANCE)
    assert len({round(r["loss"], 4) for r in whole}) > 1


# ------------------------------------------------------------------------------------------------------------------
# train.py: CP with TP and PP, resume across CP sizes, the long-context preset, evaluate past the training length
# ------------------------------------------------------------------------------------------------------------------
def ckpt(run_dir, step):
    return str(Path(run_dir) / "checkpoints" / checkpoint_name(step))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DIFF at CP=1 (saving at step 5), the same at CP=2 x TP=2 and CP=2 x PP=2 from its step 5, the long-context
    preset at CP=2 from its weights (saving at step 2), and that run resumed at CP=1 from step 2."""
    root = tmp_path_factory.mktemp("cp_runs")
    run_train(root / "cp1", COMMON + ["checkpoint.interval=5"])
    run_train(root / "cp2_tp2", COMMON + ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                          "parallel.distributed_optimizer=true", "checkpoint.save_at_end=false"],
              nproc=4)
    run_train(root / "cp2_pp2", COMMON + ["parallel.cp=2", "parallel.pp=2", "trainer.recompute=selective",
                                          "checkpoint.save_at_end=false", f"checkpoint.resume={ckpt(root / 'cp1', 5)}"],
              nproc=4)
    preset = ["experiment=long_context", "model=debug", "model.seq_length=128", "trainer.max_steps=4",
              "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.eval_interval=4",
              "trainer.eval_iters=1", "optim.warmup_steps=1", "checkpoint.interval=2", "logging.wandb.mode=disabled",
              f"checkpoint.load_weights_only={root / 'cp1'}"]
    run_train(root / "long", preset + ["parallel.cp=2"], nproc=2)
    run_train(root / "long_cp1", preset + ["parallel.cp=1", f"checkpoint.resume={ckpt(root / 'long', 2)}"])
    return root


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["cp2_tp2", "cp2_pp2"])
def test_cp2_with_tp2_or_pp2_equals_cp1(runs, layout):
    reference = {r["step"]: r for r in read_metrics(runs / "cp1")}
    got = read_metrics(runs / layout)
    assert [r["step"] for r in got] == list(range(1 if layout == "cp2_tp2" else 6, STEPS + 1))
    for r in got:  # cp2_pp2 resumed from the CP=1 checkpoint of step 5: data position and RNG line up across CP
        want = reference[r["step"]]
        assert r["loss"] == pytest.approx(want["loss"], abs=LOSS_TOLERANCE, rel=0), r["step"]
        assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), r["step"]
        assert r["lambda"] == pytest.approx(want["lambda"], abs=LOSS_TOLERANCE), r["step"]
        if "val_loss" in want:
            assert r["val_loss"] == pytest.approx(want["val_loss"], abs=LOSS_TOLERANCE, rel=0), r["step"]


@pytest.mark.multiproc
def test_long_context_preset_at_cp2_resumes_at_cp1(runs):
    config = (runs / "long" / "config.yaml").read_text()
    assert "rope_base: 640000" in config and "seq_length: 128" in config and "cp: 2" in config
    full = {r["step"]: r for r in read_metrics(runs / "long")}
    resumed = read_metrics(runs / "long_cp1")
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        for key in ("loss", "val_loss"):
            if key in full[r["step"]]:
                assert r[key] == pytest.approx(full[r["step"]][key], abs=LOSS_TOLERANCE, rel=0), (r["step"], key)
        assert r["grad_norm"] == pytest.approx(full[r["step"]]["grad_norm"], rel=1e-4)
        assert r["tokens"] == full[r["step"]]["tokens"]


def evaluate(run, out, nproc=1, extra=()):
    from diff_transformer.distributed import free_port

    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}"]
    command = launcher + ["-m", "diff_transformer.evaluate", str(run), "--tasks", "niah,ppl", "--seq-length", "256",
                          "--max-tokens", "3000", "--samples", "2", "--needles", "2", "--asked", "1",
                          "--depths", "0,0.5,1", "--batch-size", "4", "--out", str(out), *extra]
    proc = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((out / "eval.json").read_text())


@pytest.mark.multiproc
def test_evaluate_past_the_training_length_with_and_without_cp(runs, tmp_path):
    """The preset's model trained at 128 tokens, evaluated at 256: one process, then the sequence split over two."""
    whole = evaluate(runs / "long", tmp_path / "whole")
    split = evaluate(runs / "long", tmp_path / "split", nproc=2, extra=["--cp", "2"])
    assert whole["run"]["seq_length"] == 128 and whole["run"]["evaluated_length"] == 256
    assert split["run"]["context_parallel"] == 2 and whole["run"]["rope_base"] == 640000
    assert max(whole["niah"]["config"]["lengths"]) == 256
    position = whole["ppl"]["validation"]["position_nll"]
    assert len(position) == 256 and position[200] is not None  # losses at positions the model never trained on
    assert split["ppl"]["validation"]["nll"] == pytest.approx(whole["ppl"]["validation"]["nll"], abs=1e-6)
    assert split["ppl"]["validation"]["position_nll"] == pytest.approx(position, abs=1e-5)
    # the same seed draws the same needles: the same prompts, the same greedy answers
    assert split["niah"]["example"] == whole["niah"]["example"]
    assert split["niah"]["accuracy_by_length_depth"] == whole["niah"]["accuracy_by_length_depth"]
    assert whole["niah"]["attention_allocation"] and split["niah"]["attention_allocation"] == {}
