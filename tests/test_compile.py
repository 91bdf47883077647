"""trainer.compile: every TransformerLayer under torch.compile (inductor, C++ on a CPU), its core attention in the
layer's graph where dynamo traces it (sdpa), eager otherwise.

The compiled model gives the eager model's loss and gradients over a few training steps (DIFF V1 on sdpa, its core
attention in the graph; the baseline under selective recomputation, its core attention eager), dynamo compiles each
layer with no graph break (DIFF) or none but the core attention's (the baseline), evaluation and the attention capture
hooks run eagerly, train.py logs the compiling first step, and what compile cannot run with is refused."""

import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_config import compose_cfg
from tests.train_runs import REPO, read_metrics, run_train, train_env

VOCAB, BATCH, SEQ, STEPS = 128, 2, 32, 3
# The error floor, measured on the 2-core CPU (torch 2.13, inductor's C++ backend, fp32), the largest over these
# STEPS steps: the loss equal bit for bit (relative error 0) for both kinds; the relative RMS error of a parameter's
# gradient against eager at most 5.1e-7 (diff, its core attention in the graph; vanilla 4.3e-7: linear_fc1.weight),
# except DIFF's λ vectors, 6.9e-5: each λ gradient is one sum over every output of the layer, with cancellation, and
# against an fp64 run of the same steps eager's own error is 3.0e-5 and the compiled one's 3.9e-5 (inductor fuses the
# epilogue's sums in another order). DIFF on flash_attn4 (its stand-in as the custom operators in inductor's graph):
# loss 0, gradients 4.4e-7, λ 4.6e-5. Tolerances ~4-5x those.
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 2e-6
LAMBDA_GRAD_TOLERANCE = 3e-4


def debug_cfg(kind, recompute="none", backend="sdpa"):
    from diff_transformer.config import Config

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "debug", "attention": kind, "attention_backend": backend, "num_layers": 2, "hidden_size": 64,
                  "num_heads": 2, "ffn_hidden_size": 176, "seq_length": SEQ},
        "trainer": {"max_steps": STEPS, "global_batch_size": BATCH, "compile": True, "recompute": recompute},
    }))


def rel_rms(got, want):
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kind,recompute,backend", [
    ("diff", "none", "sdpa"), ("vanilla", "selective", "sdpa"), ("diff", "none", "flash_attn4"),
], ids=["diff-attention-in-graph", "vanilla-selective-attention-eager", "diff-flash_attn4-in-graph"])
def test_compiled_layers_give_the_eager_loss_and_gradients(kind, recompute, backend, megatron_single_process):
    """Both models start from the same weights and take the same steps (the eager gradients), so each step measures
    the compiled layers' error afresh; the test fails if compile_layers compiled nothing (no dynamo graphs).
    flash_attn4 (its stand-in, tests/flash_stand_in.py) runs in inductor's graph as its custom operators, forward and
    backward: the path a GPU's trainer.compile takes with model.attention_backend=flash_attn4, but for the library."""
    from tests.flash_stand_in import installed

    if backend != "flash_attn4":
        _compiled_against_eager(kind, recompute, backend)
        return
    with installed() as calls:
        from flash_attn import _reference

        _compiled_against_eager(kind, recompute, backend)
        backward = list(_reference.BACKWARD)
    # the eager model's 2 layers and the compiled model's 2, forward and backward, every step (evaluation: 4 more)
    assert [entry for _, entry, *_ in calls].count("func") == 2 * 2 * STEPS + 4 and len(backward) == 2 * 2 * STEPS, \
        (len(calls), len(backward))


def _compiled_against_eager(kind, recompute, backend):
    from diff_transformer.models.attention_maps import capture_attention
    from diff_transformer.models.gpt import build_model_chunk, compile_layers, core_attention_in_graph

    cfg = debug_cfg(kind, recompute, backend)
    eager, compiled = build_model_chunk(cfg, VOCAB), build_model_chunk(cfg, VOCAB)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_layers(compiled) == 2
    in_graph = recompute == "none"  # selective recomputation checkpoints the core attention: eager, out of the graph
    assert core_attention_in_graph(compiled) == (2 if in_graph else 0)
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss_errors, grad_errors, lambda_errors = [], [], [0.0]
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(tokens, positions, None, labels=tokens).mean()
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (loss, grads), (compiled_loss, compiled_grads) = results
        loss_errors.append(abs((compiled_loss - loss) / loss).item())
        for name in grads:
            (lambda_errors if ".lambda_" in name else grad_errors).append(rel_rms(compiled_grads[name], grads[name]))
        with torch.no_grad():  # both step on the eager gradients: the weights stay equal, each step measures afresh
            for model in (eager, compiled):
                for name, p in model.named_parameters():
                    p -= 0.05 * grads[name]
    print(f"{kind} on {backend}: loss relative error {max(loss_errors):.2e}, gradients relative RMS error {max(grad_errors):.2e} "
          f"(λ {max(lambda_errors):.2e})")
    assert max(loss_errors) <= LOSS_TOLERANCE, loss_errors
    assert max(grad_errors) <= GRAD_TOLERANCE and max(lambda_errors) <= LAMBDA_GRAD_TOLERANCE, (grad_errors, lambda_errors)

    # compiled indeed: dynamo made graphs of the layers (one set shared by both), with no graph break where the core
    # attention is in the graph, broken only at the core attention where it runs eagerly
    stats, breaks = torch._dynamo.utils.counters["stats"], torch._dynamo.utils.counters["graph_break"]
    assert stats["unique_graphs"] >= (1 if in_graph else 2) and stats["calls_captured"] > 20, dict(stats)
    if in_graph:
        assert not breaks, list(breaks)
    else:
        assert breaks and all("torch.compiler.disable" in reason for reason in breaks), list(breaks)
    assert all(layer._compiled_call_impl is not None for layer in compiled.decoder.layers)

    # evaluation runs eagerly, so that the capture hooks (registered after compiling) see every layer
    eager.eval(), compiled.eval()
    graphs = stats["unique_graphs"]
    with torch.no_grad():
        want = eager(tokens, positions, None)
        seen = []
        with capture_attention([compiled], lambda layer, maps_for: seen.append(layer)):
            got = compiled(tokens, positions, None)
    assert seen == [1, 2] and stats["unique_graphs"] == graphs
    assert rel_rms(got, want) < 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("kind,backend,learnable", [
    ("diff", "sdpa", True), ("diff", "combined", True), ("diff", "sdpa", False), ("diff_v2", "sdpa", True),
    ("vanilla_subln", "sdpa", True), ("vanilla", "sdpa", True), ("diff", "flash_attn4", True),
    ("vanilla", "flash_attn4", True),
], ids=["diff-sdpa", "diff-combined", "diff-frozen-lambda", "diff_v2", "vanilla_subln", "vanilla", "diff-flash_attn4",
        "vanilla-flash_attn4"])
def test_every_layer_shares_one_graph_with_its_core_attention_in_it(kind, backend, learnable, monkeypatch,
                                                                     megatron_single_process):
    """Layers differ in λ_init and the output factor (1 − λ_init): as a module's Python floats they would be guards,
    one recompilation per layer and, past dynamo's recompile limit of 8, the rest eager; as buffers they are data, and
    three layers share one graph with no break (dynamo's guards alone, so backend="eager": no inductor). flash-attn-4
    (its stand-in, tests/flash_stand_in.py) is in the graph as its custom operators, forward and backward."""
    from tests.flash_stand_in import installed

    if backend != "flash_attn4":
        _one_graph_for_three_layers(kind, backend, learnable, monkeypatch)
        return
    with installed() as calls:
        from flash_attn import _reference

        _one_graph_for_three_layers(kind, backend, learnable, monkeypatch)
        backward = list(_reference.BACKWARD)
    assert [entry for _, entry, *_ in calls] == ["func"] * 3 and len(backward) == 3, (calls, backward)


def _one_graph_for_three_layers(kind, backend, learnable, monkeypatch):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from diff_transformer.models.gpt import build_model_chunk, compile_layers, core_attention_in_graph

    monkeypatch.setattr(TransformerLayer, "compile",
                        lambda self, **kwargs: torch.nn.Module.compile(self, backend="eager", **kwargs))
    cfg = debug_cfg(kind)
    cfg.model.attention_backend, cfg.model.num_layers = backend, 3
    if not learnable:
        cfg.model.lambda_learnable = False
    model = build_model_chunk(cfg, VOCAB)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_layers(model) == 3 and core_attention_in_graph(model) == 3
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens).mean().backward()
    stats, breaks = torch._dynamo.utils.counters["stats"], torch._dynamo.utils.counters["graph_break"]
    assert stats["unique_graphs"] == 1 and not breaks, (dict(stats), list(breaks))
    torch._dynamo.reset()


def test_train_py_logs_the_compiling_first_step(tmp_path):
    """The trainer compiles the layers before DDP, logs the first step's time once, and its evaluation and attention
    diagnostics run (eagerly); with trainer.grad_accumulation_fusion on (auto's choice on a GPU) the compiled layers'
    linear layers leave their weight gradients to DDP's hook, which keeps each layer one graph
    (test_cuda_graphs.py counts the graphs), and the output layer keeps the fusion."""
    run_dir = tmp_path / "run"
    run_train(run_dir, ["experiment=smoke", "trainer.max_steps=3", "optim.warmup_steps=1", "trainer.eval_interval=3",
                        "trainer.eval_iters=1", "trainer.attention_diagnostics=on", "trainer.compile=true",
                        "trainer.grad_accumulation_fusion=on", "checkpoint.save_at_end=false"])
    log = (run_dir / "train.log").read_text()
    assert "trainer.compile: 2 layers of this rank under torch.compile" in log
    assert log.count("trainer.compile: the first step of this process (step 1), which compiled the layers, took") == 1
    assert "trainer.compile: the compiled layers' 8 linear layers leave their weight gradients to DDP's hook" in log
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in records)
    assert len(records[-1]["attn/entropy"]) == 2 and math.isfinite(records[-1]["val_loss"])
    assert OmegaConf.load(run_dir / "config.yaml").trainer.compile is True


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["engine=deepspeed"], r"trainer.compile=true compiles the layers of engine=megatron only; engine=deepspeed"),
        (["parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
          "parallel.overlap_param_gather=true"],
         r"trainer.compile=true does not run with parallel.overlap_param_gather=true"),
    ],
    ids=["deepspeed", "param-gather"],
)
def test_what_compile_cannot_run_with_is_refused(overrides, message):
    from diff_transformer.config import validate

    with pytest.raises(ValueError, match=message):
        validate(compose_cfg("trainer.compile=true", *overrides), world_size=2)
    validate(compose_cfg("trainer.compile=false", *overrides), world_size=2)  # the same without compile runs


def test_train_py_refuses_compile_with_deepspeed_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "engine=deepspeed", "trainer.compile=true",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer.compile=true" in errors[0] and "engine=deepspeed" in errors[0], proc.stderr
