"""trainer.cuda_graphs=layers (training/cuda_graphs.py): the compiled layers under inductor's CUDA graph trees.

On a CPU inductor compiles the same kernels and records no CUDA graph (it says so: "no CUDA graph on a CPU"), so the
CPU tests prove the path around the capture: train.py with the switch on gives the losses and gradient norms of the
switch off bit for bit (each micro-batch a new graph generation, megatron-core DDP's hooks outside the layers), the
linear layers stay in the layer's one graph once their fused weight-gradient accumulation is off, the run log reports
what happened, and what the graphs cannot run with is refused. The GPU test checks on CUDA that the graphs are
recorded and the losses match the switch off."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.test_compile import VOCAB, BATCH, SEQ, debug_cfg
from tests.test_config import compose_cfg
from tests.train_runs import DISTRIBUTED_ENV, REPO, read_metrics, run_train, train_command, train_env

# the same steps of the compiled layers with and without the switch, fusion off in both (its fp32 accumulation into
# main_grad rounds differently from DDP's add): on a CPU nothing is recorded, so the arithmetic is the same, bit for bit
RUN = ["experiment=smoke", "trainer.max_steps=2", "optim.warmup_steps=1", "trainer.eval_interval=0",
       "trainer.compile=true", "trainer.grad_accumulation_fusion=off", "checkpoint.save_at_end=false"]
# On a GPU (bf16) a replayed graph runs the kernels the compiled layer launches one by one; cuBLAS may choose another
# algorithm under capture, which moves a bf16 loss by ~1e-4 relative over a few steps. Tolerance: 2e-3 relative.
GPU_LOSS_TOLERANCE = 2e-3
REPORT = re.compile(r"trainer\.cuda_graphs=layers: (\d+) CUDA graphs recorded by step \d+ \(expected (\d+)")


@pytest.fixture(scope="module")
def runs_off_and_on(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_graphs")
    for mode in ("off", "layers"):
        run_train(root / mode, [*RUN, f"trainer.cuda_graphs={mode}"])
    return root / "off", root / "layers"


def test_the_switch_on_gives_the_losses_and_gradients_of_the_switch_off(runs_off_and_on):
    """Step 2's loss depends on step 1's gradients, and each step's gradient norm on all of them: equal bit for bit."""
    off, on = (read_metrics(run) for run in runs_off_and_on)
    assert [(r["loss"], r["grad_norm"]) for r in on] == [(r["loss"], r["grad_norm"]) for r in off]
    assert len(on) == 2


def test_the_run_log_says_what_was_recorded(runs_off_and_on):
    off, on = ((run / "train.log").read_text() for run in runs_off_and_on)
    assert "trainer.cuda_graphs" not in off
    assert "trainer.cuda_graphs=layers: the compiled layers as CUDA graphs (torch.compile mode reduce-overhead)" in on
    # one report, after step 1 (two micro-batches: the second records), with inductor's count of skipped graphs
    reports = [line for line in on.splitlines() if "trainer.cuda_graphs=layers: no CUDA graph on a CPU" in line]
    assert len(reports) == 1 and re.search(r"\((\d+) compiled graphs? skipped\)", reports[0]), reports
    assert int(re.search(r"\((\d+) compiled graph", reports[0]).group(1)) >= 1


def test_the_linear_layers_stay_in_the_graph_once_their_fused_accumulation_is_off(monkeypatch, megatron_single_process):
    """megatron-core's fused accumulation writes main_grad in its autograd function's backward, a side effect that
    breaks the compiled layer at every linear layer; unfuse_weight_gradients leaves each layer one graph (dynamo's
    guards alone, backend="eager": no inductor)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from diff_transformer.models.gpt import build_model_chunk, compile_layers
    from diff_transformer.models.weight_gradient import unfuse_weight_gradients

    monkeypatch.setattr(TransformerLayer, "compile",
                        lambda self, **kwargs: torch.nn.Module.compile(self, backend="eager", dynamic=False))
    results = {}
    for unfused in (False, True):
        chunk = build_model_chunk(debug_cfg("diff"), VOCAB, grad_accumulation_fusion=True)
        model = DistributedDataParallel(config=chunk.config, module=chunk,
                                        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        changed = unfuse_weight_gradients(chunk) if unfused else 0
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        assert compile_layers(chunk) == 2
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens).mean().backward()
        counters = torch._dynamo.utils.counters
        results[unfused] = (changed, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        assert all(p.main_grad.abs().sum() > 0 for p in chunk.decoder.parameters())  # every gradient reached DDP
    torch._dynamo.reset()
    assert results[False][2] > 0, results  # today's compiled layer with the fusion: broken at its linear layers
    assert results[True] == (8, 1, 0), results  # 4 linear layers a layer, 2 layers: one graph, no break


def test_inductors_skip_warnings_are_collected_and_reported():
    """The reasons come from torch's own warning (its logger in the installed torch), the stack trace left out of the
    line; a GPU run's report says how many graphs were recorded against the expected two a layer, and why any was
    skipped."""
    from torch._inductor import cudagraph_utils

    from diff_transformer.training.cuda_graphs import SkipReasons, report, skipped_graphs

    skips, before = SkipReasons().attach(), skipped_graphs()
    try:
        cudagraph_utils.log_cudagraph_skip_and_bump_counter(
            "skipping cudagraphs due to mutated inputs (1 instances). Found from : \n  File x.py, line 3")
    finally:
        skips.detach()
    cudagraph_utils.log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device (arg0)")  # detached
    assert skips.reasons == ["skipping cudagraphs due to mutated inputs (1 instances)"]
    assert len(skips.messages) == 1 and "x.py" in skips.messages[0] and skipped_graphs() == before + 2

    line = report(24, 1, skips.reasons * 3, 3, 45, on_cuda=True)
    assert line == ("45 CUDA graphs recorded by step 1 (expected 48: each of the 24 compiled layers' forward and "
                    "backward); 3 compiled graphs skipped: skipping cudagraphs due to mutated inputs (1 instances)")
    assert REPORT.search(f"trainer.cuda_graphs=layers: {report(2, 1, [], 0, 4, on_cuda=True)}").groups() == ("4", "4")
    assert report(2, 1, [], 5, None, on_cuda=False).startswith("no CUDA graph on a CPU")
    assert report(0, 1, [], 0, None, on_cuda=True).startswith("no CUDA graph: TorchDynamo is off")


@pytest.mark.parametrize("overrides,message", [
    (["trainer.compile=false"], r"it needs trainer.compile=true"),
    (["parallel.tp=2"], r"runs with parallel.tp=1, pp=1 and cp=1 \(got tp=2, pp=1, cp=1\)"),
    (["trainer.recompute=selective"], r"does not run with trainer.recompute=selective"),
    (["data.document_mask=true"], r"does not run with data.document_mask=true"),
    (["model.attention=dex"], r"does not run with model.attention=dex: its core attention runs eagerly"),
    (["model.attention_backend=triton"], r"model.attention_backend=triton: .* use one of sdpa, combined, "
                                         r"flash_attn4 or auto"),
    (["trainer.cuda_graphs=whole"], r"trainer.cuda_graphs='whole' is unknown; use one of off, layers"),
], ids=["no-compile", "tp", "recompute", "document-mask", "dex", "eager-backend", "unknown"])
def test_what_the_graphs_cannot_run_with_is_refused(overrides, message):
    from diff_transformer.config import validate

    with pytest.raises(ValueError, match=message):
        validate(compose_cfg("trainer.compile=true", "trainer.cuda_graphs=layers", *overrides), world_size=2)
    validate(compose_cfg("trainer.compile=true", "trainer.cuda_graphs=layers"), world_size=2)


def test_train_py_refuses_the_graphs_without_compile_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", "trainer.cuda_graphs=layers",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer.cuda_graphs=layers" in errors[0] and "trainer.compile=true" in errors[0], \
        proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.gpu
def test_the_graphs_are_recorded_on_a_gpu_and_give_the_losses_of_the_switch_off(tmp_path):
    """bf16 on one CUDA device, sdpa (the 830m benchmark's backend), 4 steps of 2 micro-batches: step 1 records each
    layer's forward and backward (2 x 2 graphs, none skipped), and every step's loss is the switch off's within
    GPU_LOSS_TOLERANCE."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    losses, logs = {}, {}
    for mode in ("off", "layers"):
        run_dir = tmp_path / mode
        overrides = [*RUN, "trainer.max_steps=4", "model.attention_backend=sdpa", f"trainer.cuda_graphs={mode}"]
        proc = subprocess.run(train_command(run_dir, overrides),
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, f"train.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        losses[mode] = [r["loss"] for r in read_metrics(run_dir)]
        logs[mode] = (run_dir / "train.log").read_text()
    assert "dtype bfloat16" in logs["layers"]
    report = REPORT.search(logs["layers"])
    assert report and int(report.group(1)) == int(report.group(2)) == 4, logs["layers"][-3000:]
    assert "skipped" not in logs["layers"].split("CUDA graphs recorded", 1)[1].splitlines()[0]
    errors = [abs(a - b) / abs(b) for a, b in zip(losses["layers"], losses["off"])]
    print(f"CUDA graphs against none: loss relative error at most {max(errors):.2e} over {len(errors)} steps")
    assert len(errors) == 4 and max(errors) <= GPU_LOSS_TOLERANCE, (losses, errors)
