"""Context parallelism (``parallel.cp``, ring attention: ``diff_transformer/models/ring_attention.py``).

- In process: the ring's math on a ring of threads (fp64, against full causal attention: outputs and every gradient,
  DIFF V1's two maps, V2's one over shared K/V, the baseline's), DIFF's fused ring (``triton``, the kernel's pieces in
  Triton's interpreter, fp32) against the fused kernel over the whole sequence and the eager maps, the load-balanced
  layout, refusals, the memory plan.
- One torchrun launch of four processes (``tests/context_parallel_worker.py``): the ring around a real gloo group of
  four, the debug model at CP=4 against CP=1 (every token's loss and every gradient, fp32, every kind with a ring
  path), ten trainer steps at CP=2
  against CP=1 for diff, diff_v2 and vanilla, DIFF at CP=2 x TP=2 and CP=2 x PP=2, and a CP=1 run resumed at CP=2.
- train.py: the long-context preset at CP=2 from the CP=1 run's weights, resumed at CP=1; refused in one line.
- evaluate past the training length: in process, and under torchrun with the sequence split over two ranks.
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
from tests.train_runs import REPO, TORCHRUN, read_metrics, run_train, train_env

STEPS = 10
COMMON = ["experiment=smoke", f"trainer.max_steps={STEPS}", "trainer.eval_interval=5", "optim.warmup_steps=2"]
FP64_TOLERANCE = 1e-12  # measured: ~2e-15
LOSS_TOLERANCE = 1e-5  # measured: <= 1e-6 over ten fp32 steps


# ------------------------------------------------------------------------------------------------------------------
# The ring's math, in process: a ring of threads
# ------------------------------------------------------------------------------------------------------------------
class ThreadRing:
    """Rank ``rank`` of a ring of threads in one process (on one device): each exchange hands copies to the next
    rank's mailbox. With ``lock`` (held by the rank's thread while it computes), waiting releases it: Triton's
    interpreter is not thread-safe, so the ranks take turns, each running until it waits for its neighbour."""

    def __init__(self, mailboxes, rank, lock=None):
        self.mailboxes, self.rank, self.size, self.lock = mailboxes, rank, len(mailboxes), lock

    def exchange(self, tensors):
        # Autograd runs a CUDA backward on its one thread per device: two ranks' backward passes would queue there one
        # after the other, the first waiting for the second's message forever. run_threads keeps each rank's backward
        # on the rank's own thread, which this checks on any device.
        assert not torch.autograd.is_multithreading_enabled(), "a ring of threads needs run_threads' backward setting"
        self.mailboxes[(self.rank + 1) % self.size].put([t.clone() for t in tensors])
        mailbox, lock = self.mailboxes[self.rank], self.lock

        class Pending:
            def wait(self):
                if lock is None:
                    return mailbox.get(timeout=60)
                lock.release()
                try:
                    return mailbox.get(timeout=60)
                finally:
                    lock.acquire()

        return Pending()


def run_threads(ranks, rank_main):
    """``rank_main(rank)`` on one thread per rank, each rank's backward on its own thread (not autograd's device
    thread, which the ranks would share on one GPU); re-raises what any of them raised."""
    failures = []

    def guarded(rank):
        try:
            with torch.autograd.set_multithreading_enabled(False):
                rank_main(rank)
        except Exception as err:  # noqa: BLE001  (reported by the test thread)
            failures.append(err)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def run_thread_ring(kind, impl, ranks, dtype=torch.float64, device="cpu", chunk=4):
    """Each rank's (outputs, dq, dk, dv) on its chunks, and the full-attention reference (computed in fp64 on the
    CPU from the same inputs)."""
    q, k, v, grads_out, maps = ring_inputs(kind, ranks, dtype, chunk=chunk)
    reference = full_attention(*(t.double() for t in (q, k, v)), [g.double() for g in grads_out], maps)
    q, k, v = (t.to(device) for t in (q, k, v))
    grads_out = [g.to(device) for g in grads_out]
    mailboxes = [queue.Queue() for _ in range(ranks)]
    results = [None] * ranks

    def rank_main(rank):
        local = [context_parallel_chunks(t, ranks, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
        outs = ring_attention([local[0][:, qs] for qs, _ in maps], local[1], local[2], [kh for _, kh in maps],
                              SCALE, ThreadRing(mailboxes, rank), impl)
        torch.autograd.backward(outs, [context_parallel_chunks(g, ranks, rank, dim=2) for g in grads_out])
        results[rank] = ([o.detach() for o in outs], local[0].grad, local[1].grad, local[2].grad)

    run_threads(ranks, rank_main)
    return [[x.cpu() if torch.is_tensor(x) else [o.cpu() for o in x] for x in r] for r in results], reference


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


def assert_close_to_reference(results, reference, ranks, tolerance):
    """Relative RMS error of every rank's outputs and gradients against the fp64 reference."""
    seq = reference["dq"].shape[2]
    for rank, (outs, dq, dk, dv) in enumerate(results):
        index = load_balanced_indices(seq, ranks, rank)
        got = {f"out{m}": o for m, o in enumerate(outs)}
        got.update(dq=dq, dk=dk, dv=dv)
        for name, tensor in got.items():
            want = reference[name][:, :, index]
            error = float((tensor.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
            assert error < tolerance, (name, rank, error)


def test_ring_in_fp32_within_its_rounding():
    results, reference = run_thread_ring("diff", "sdpa", 2, torch.float32)
    assert_close_to_reference(results, reference, 2, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_ring_on_cuda_sdpa_kernels(kind, dtype):
    """The CUDA block primitive inside the ring (two threads sharing the GPU): flash for bf16 (DIFF V1's 2d-wide V in
    halves), the memory-efficient kernel for fp32, against the fp64 reference; chunks of 100 positions, so that the
    efficient kernel's LSE is padded (to multiples of 32 rows)."""
    results, reference = run_thread_ring(kind, "sdpa", 2, dtype, device="cuda", chunk=100)  # not a multiple of 32
    assert_close_to_reference(results, reference, 2, 2e-2 if dtype == torch.bfloat16 else 1e-4)


def rel_rms(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def differential_core_attention(kind, backend, epilogue="unfused", d=16, device="cpu"):
    """DIFF V1 (layer 3: λ_init 0.35, the sub-layer norm) or V2 core attention with 2H = 4 query heads of d over one
    KV group (GQA), the norm weight drawn away from ones; the same parameters at every call."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from diff_transformer.models.attention import DiffV2CoreAttention, DifferentialCoreAttention

    torch.manual_seed(11)
    heads = 2
    config = TransformerConfig(num_layers=4, hidden_size=2 * heads * d, num_attention_heads=2 * heads,
                               num_query_groups=2 if kind == "diff" else 1, kv_channels=d,
                               use_cpu_initialization=True)
    if kind == "diff_v2":
        return DiffV2CoreAttention(config, 1, AttnMaskType.causal, backend=backend, epilogue=epilogue).to(device)
    module = DifferentialCoreAttention(config, 3, AttnMaskType.causal, backend=backend, epilogue=epilogue)
    with torch.no_grad():
        module.sublayer_norm.weight.uniform_(0.5, 1.5)
    return module.to(device)


def core_attention_grads(module, tensors, grad_out):
    """The output, the gradients of q, k, v (and V2's λ logits) and of every parameter (λ's vectors, the norm weight)."""
    inputs = [t.clone().requires_grad_() for t in tensors]
    bias = inputs[3] if len(inputs) == 4 else None
    out = module(*inputs[:3], None, attention_bias=bias)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in inputs], {name: p.grad for name, p in module.named_parameters()}


def fused_ring_errors(kind, epilogue, chunk, d=16, device="cpu", dtype=torch.float32):
    """Relative RMS errors of DIFF's fused ring (model.attention_backend=triton at CP=2) on a ring of two threads
    against the fused kernel over the whole sequence of 4·chunk positions and against the eager maps in fp32 on the
    same (``dtype``-rounded) inputs: {name: (against fused, against eager)} for the output and the gradients of q, k,
    v, λ (V1's vectors, V2's logits) and the norm weight, each rank's share of a parameter's gradient summed."""
    ranks, s, b = 2, 4 * chunk, 1
    generator = torch.Generator().manual_seed(5)
    heads = (4, 2, 2) if kind == "diff" else (4, 1, 1)
    tensors = [torch.randn(s, b, h, d, generator=generator).to(dtype).to(device) for h in heads]
    if kind == "diff_v2":
        tensors.append(torch.randn(s, b, 2, generator=generator).to(dtype).to(device))  # λ's logits
    grad_out = torch.randn(s, b, (4 if kind == "diff" else 2) * d, generator=generator).to(dtype).to(device)
    want = core_attention_grads(differential_core_attention(kind, "triton", epilogue, d, device), tensors, grad_out)
    reference = core_attention_grads(differential_core_attention(kind, "eager", d=d, device=device),
                                     [t.float() for t in tensors], grad_out.float())
    mailboxes, lock, results = [queue.Queue() for _ in range(ranks)], threading.Lock(), [None] * ranks

    def rank_main(rank):
        with lock:  # the ranks take turns (Triton's interpreter is not thread-safe), each until it waits
            module = differential_core_attention(kind, "triton", epilogue, d, device)
            module.ring = ThreadRing(mailboxes, rank, lock)
            chunks = [context_parallel_chunks(t, ranks, rank, dim=0) for t in (*tensors, grad_out)]
            results[rank] = core_attention_grads(module, chunks[:-1], chunks[-1])

    run_threads(ranks, rank_main)
    out = torch.empty_like(want[0])
    grads = [torch.empty_like(g) for g in want[1]]
    for rank, (rank_out, rank_grads, _) in enumerate(results):
        index = load_balanced_indices(s, ranks, rank).to(device)
        out[index] = rank_out
        for grad, rank_grad in zip(grads, rank_grads):
            grad[index] = rank_grad
    params = {name: sum(r[2][name] for r in results) for name in want[2]}
    assert kind == "diff_v2" or {"sublayer_norm.weight", "lambda_q1"} <= set(params)
    compared = {"out": (out, want[0], reference[0])}
    compared.update({f"grad {i}": (g, w, e) for i, (g, w, e) in enumerate(zip(grads, want[1], reference[1]))})
    compared.update({name: (params[name], want[2][name], reference[2][name]) for name in params})
    return {name: (rel_rms(got, fused), rel_rms(got, eager)) for name, (got, fused, eager) in compared.items()}


@pytest.mark.parametrize("kind,epilogue", [("diff", "triton"), ("diff", "unfused"), ("diff_v2", "unfused")],
                         ids=["diff-fused-epilogue", "diff", "diff_v2"])
def test_fused_ring_equals_full_fused_attention(kind, epilogue):
    """DIFF's fused ring (the kernel's context-parallel pieces, then the epilogue once on y) in Triton's interpreter,
    fp32, chunks of 8 positions, equals the fused kernel over the whole sequence and the eager maps."""
    for name, (fused, eager) in fused_ring_errors(kind, epilogue, chunk=8).items():
        # measured: at most 7.3e-7 against the fused kernel, 2.0e-6 against the eager maps (λ's vectors)
        assert fused < 2e-5 and eager < 2e-5, (name, fused, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_fused_ring_on_cuda_in_bf16(kind):
    """The compiled pieces inside the ring (two threads sharing the GPU) in bf16, with the fused epilogue, d = 64 and
    chunks of 100 positions (not a multiple of the kernels' blocks), against the fp32 eager maps on the same bf16
    inputs; the fused kernel over the whole sequence in bf16 rounds as much."""
    for name, (fused, eager) in fused_ring_errors(kind, "triton", chunk=100, d=64, device="cuda",
                                                  dtype=torch.bfloat16).items():
        # as test_attention's bf16 backends against eager: 2e-2 for the output, 3e-2 for the gradients
        assert eager < (2e-2 if name == "out" else 3e-2), (name, fused, eager)
        assert fused < 3e-2, (name, fused, eager)


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
        (["parallel.cp=2", "model.attention_backend=flash_attn"], 2,
         r"model.attention_backend=flash_attn has no ring-attention path .* use model.attention_backend=sdpa \(or "
         r"eager, triton\)$"),
        (["parallel.cp=2", "model.attention_backend=combined"], 2,
         r"model.attention_backend=combined has no ring-attention path .* use model.attention_backend=sdpa \(or "
         r"eager, triton\)$"),
        (["parallel.cp=2", "model.attention=vanilla", "model.attention_backend=flash_attn"], 2,
         r"model.attention_backend=flash_attn has no ring-attention path .* use model.attention_backend=sdpa \(or "
         r"eager\)$"),
        (["parallel.cp=2", "engine=deepspeed", "engine.zero_stage=1"], 2,
         r"engine=deepspeed does not run context parallelism \(parallel.cp=2\); use engine=megatron"),
        (["parallel.cp=2"], 3, r"world size 3 is not divisible by parallel.tp\*parallel.pp\*parallel.cp=2"),
        (["parallel.cp=2", "trainer.attention_diagnostics=on"], 2, r"trainer.attention_diagnostics=on reads whole"),
        (["parallel.cp=2", "parallel.tp=4", "model.num_heads=4", "parallel.sequence_parallel=true",
          "model.seq_length=12"], 8, r"splits each context-parallel rank's 6 tokens .* over parallel.tp=4"),
        (["parallel.cp=0"], 1, r"parallel.cp=0 must be positive"),
    ],
    ids=["seq", "topk", "signed-mask", "dex", "flash-attn", "combined", "vanilla-flash-attn", "deepspeed", "world",
         "diagnostics", "sp", "zero"],
)
def test_bad_context_parallel_configs_are_refused(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg("experiment=smoke", *overrides), world_size=world)


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_the_fused_kernel_runs_at_cp2(kind):
    """DIFF V1 and V2 ring on the fused kernel's pieces: model.attention_backend=triton passes at parallel.cp=2."""
    validate(compose_cfg("experiment=smoke", "parallel.cp=2", f"model.attention={kind}", "model.attention_backend=triton"),
             world_size=2)


def test_train_py_refuses_flash_attn_at_cp2_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "parallel.cp=2",
         "model.attention_backend=flash_attn", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=dict(train_env(), WORLD_SIZE="2"), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.attention_backend=flash_attn has no ring-attention path" in errors[0], proc.stderr
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
    fused = activation_bytes_per_layer(compose_cfg(*LONG_3B, "parallel.cp=2", "model.attention_backend=triton"), 2,
                                       "cuda")
    # the fused ring stores y in fp32 and the LSEs, not each map's output; its kernels return a block's dQ, dK, dV in fp32
    assert fused["core"] < two["core"] and fused["ring"] > two["ring"]
    triton_problem = memory_plan_problem(compose_cfg(*LONG_3B, "parallel.cp=1", "model.attention_backend=triton"),
                                         torch.bfloat16, 8, 100352, 64, "cuda")
    assert "parallel.cp=2 (" in triton_problem  # proposed with the backend kept: triton has a ring path
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
# Over a real gloo ring: one torchrun launch of four processes
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_worker")
    command = [*TORCHRUN, "--nproc_per_node=4", str(REPO / "tests" / "context_parallel_worker.py"),
               str(root / "results.json"), str(root)]
    proc = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((root / "results.json").read_text()), root


@pytest.mark.multiproc
def test_ring_over_gloo_equals_full_attention_fp64(worker):
    results, _ = worker
    for rank, result in enumerate(results):
        for case, errors in result["ring"].items():
            assert max(errors.values()) < FP64_TOLERANCE, (rank, case, errors)
        assert len(result["ring"]) == len(KINDS) * len(IMPLEMENTATIONS)


@pytest.mark.multiproc
def test_model_at_cp4_equals_cp1_losses_and_every_gradient(worker):
    results, _ = worker
    for rank, result in enumerate(results):
        for kind, errors in result["model"].items():
            assert errors["loss"] < 1e-5, (rank, kind, errors)  # measured: <= 1e-6 on losses of ~8.3
            assert errors["grad"] < 2e-5, (rank, kind, errors)  # relative, of the worst of every parameter's gradient
            # the floor of λ's: eager and sdpa at CP=1 differ by 3.5e-5 relative on DIFF's λ gradients (the ring: 3.4e-5)
            assert errors["lambda_grad"] < 1e-4, (rank, kind, errors)
        assert set(result["model"]) == {"diff", "diff_v2", "vanilla", "vanilla_wide", "vanilla_subln",
                                        "diff+documents", "diff_v2+documents", "vanilla+documents"}


def assert_same_steps(got, want):
    want = {r["step"]: r for r in want}
    for r in got:
        w = want[r["step"]]
        assert r["loss"] == pytest.approx(w["loss"], abs=LOSS_TOLERANCE, rel=0), r["step"]
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), r["step"]
        if w.get("val_loss") is not None:
            assert r["val_loss"] == pytest.approx(w["val_loss"], abs=LOSS_TOLERANCE, rel=0), r["step"]
        if w.get("lambda") is not None:
            assert r["lambda"] == pytest.approx(w["lambda"], abs=LOSS_TOLERANCE), r["step"]


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["diff-cp2", "diff_v2-cp2", "vanilla-cp2", "diff-cp2-tp2", "diff-cp2-pp2",
                                 "diff-cp2-resumed"])
def test_trainer_steps_at_cp2_equal_cp1(worker, run):
    """Ten steps at CP=2 (alone, with TP=2 and sequence parallelism and the distributed optimizer, with PP=2 and
    selective recomputation) equal ten at CP=1; a CP=1 checkpoint of step 5 resumed at CP=2 continues the same."""
    training = worker[0][0]["training"]
    kind = run.split("-")[0]
    got, want = training[run], training[f"{kind}-cp1"]
    steps = list(range(6 if run.endswith("resumed") else 1, STEPS + 1))
    assert [r["step"] for r in got] == steps and len(want) == STEPS
    assert_same_steps(got, want)
    assert len({round(r["loss"], 4) for r in want}) > 1


# ------------------------------------------------------------------------------------------------------------------
# train.py: CP with TP and PP, resume across CP sizes, the long-context preset, evaluate past the training length
# ------------------------------------------------------------------------------------------------------------------
def ckpt(run_dir, step):
    return str(Path(run_dir) / "checkpoints" / checkpoint_name(step))


@pytest.fixture(scope="module")
def preset_runs(worker):
    """The long-context preset at CP=2 from the CP=1 DIFF run's weights (saving at step 2), then resumed at CP=1."""
    _, root = worker
    preset = ["experiment=long_context", "model=debug", "model.seq_length=128", "trainer.max_steps=4",
              "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.eval_interval=4",
              "trainer.eval_iters=1", "optim.warmup_steps=1", "checkpoint.interval=2", "logging.wandb.mode=disabled",
              f"checkpoint.load_weights_only={root / 'diff-cp1'}"]
    run_train(root / "long", preset + ["parallel.cp=2"], nproc=2)
    run_train(root / "long_cp1", preset + ["parallel.cp=1", f"checkpoint.resume={ckpt(root / 'long', 2)}"])
    return root


@pytest.mark.multiproc
def test_long_context_preset_at_cp2_resumes_at_cp1(preset_runs):
    config = (preset_runs / "long" / "config.yaml").read_text()
    assert "rope_base: 640000" in config and "seq_length: 128" in config and "cp: 2" in config
    full = read_metrics(preset_runs / "long")
    resumed = read_metrics(preset_runs / "long_cp1")
    assert [r["step"] for r in resumed] == [3, 4]
    assert_same_steps(resumed, full)
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in full[2:]]  # the data position lines up
    assert "RNG states restart" not in (preset_runs / "long_cp1" / "train.log").read_text()  # loaded, not reseeded


EVALUATE_ARGS = ["--tasks", "niah,ppl", "--seq-length", "256", "--max-tokens", "3000", "--samples", "2", "--needles",
                 "2", "--asked", "1", "--depths", "0,0.5,1", "--batch-size", "4"]


@pytest.mark.multiproc
def test_evaluate_past_the_training_length_with_and_without_cp(preset_runs, tmp_path, megatron_single_process):
    """The preset's model trained at 128 tokens, evaluated at 256: in this process, then by evaluate under torchrun
    with each sequence split over two ranks; the same seed draws the same needles and gives the same answers."""
    from diff_transformer import evaluate
    from diff_transformer.evaluation.inference import load_for_inference, resolve_run

    args = evaluate.parse_args([str(preset_runs / "long"), *EVALUATE_ARGS])
    run = resolve_run(args.runs[0])
    model = load_for_inference(run, seq_length=args.seq_length)
    whole = evaluate.evaluate_one(model, run, args, ["ppl", "niah"], evaluate.niah_config(args, run))
    command = [*TORCHRUN, "--nproc_per_node=2", "-m", "diff_transformer.evaluate", str(preset_runs / "long"),
               *EVALUATE_ARGS, "--cp", "2", "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    split = json.loads((tmp_path / "eval.json").read_text())
    assert whole["run"]["seq_length"] == 128 and whole["run"]["evaluated_length"] == 256
    assert split["run"]["context_parallel"] == 2 and split["run"]["rope_base"] == 640000
    assert max(split["niah"]["config"]["lengths"]) == 256
    position = whole["ppl"]["validation"]["position_nll"]
    assert len(position) == 256 and position[200] is not None  # losses at positions the model never trained on
    assert split["ppl"]["validation"]["nll"] == pytest.approx(whole["ppl"]["validation"]["nll"], abs=1e-6)
    assert split["ppl"]["validation"]["position_nll"] == pytest.approx(position, abs=1e-5)
    assert split["niah"]["example"] == whole["niah"]["example"]
    assert split["niah"]["accuracy_by_length_depth"] == whole["niah"]["accuracy_by_length_depth"]
    assert whole["niah"]["attention_allocation"] and split["niah"]["attention_allocation"] == {}


@pytest.mark.multiproc
def test_a_cp2_checkpoint_rebuilds_on_one_process_without_cp(preset_runs, megatron_single_process):
    """checkpoint convert, inspect and the export rebuild a checkpoint at TP=PP=CP=1: a CP=2 run's too."""
    from diff_transformer.training.checkpoint_tools import load_single_rank_model

    chunk, cfg, state = load_single_rank_model(ckpt(preset_runs / "long", 4))
    assert state["layout"]["cp"] == 2 and cfg.parallel.cp == 1 and chunk.config.context_parallel_size == 1


def test_inspect_reports_the_share_of_tokens_in_documents_a_sequence_long():
    """What long-context training learns long-range dependencies from: documents at least a sequence long."""
    import numpy as np

    from data import indexed
    from data.config import DataConfig
    from data.datasets import prepare
    from data.inspect import summarise_blend

    prefix = prepare(DataConfig()).prefixes[0]
    index = indexed.verify_shard(prefix)
    lengths = np.add.reduceat(index.sequence_lengths.astype(np.int64), index.document_indices[:-1])
    shares = [summarise_blend([prefix], None, "969,30,1", seq_length=n)[0].long_share
              for n in (1, int(np.median(lengths)), int(lengths.max()) + 1)]
    assert shares[0] == 1.0 and 0.5 <= shares[1] < 1.0 and shares[2] == 0.0  # the longer half holds >= half the tokens
    assert summarise_blend([prefix], None, "969,30,1")[0].long_share is None
