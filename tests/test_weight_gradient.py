"""trainer.grad_accumulation_fusion without Apex (models/weight_gradient.py, compat.install_weight_gradient_accumulation):
each linear layer's weight gradient accumulated into its fp32 main gradient in one GEMM call, against today's path
(the GEMM, then DDP's separate add) and an fp64 reference. The TP=2 and PP=2 runs of tests/test_parallel.py train
with it on against single-process references with it off."""

import contextlib

import pytest
import torch

from diff_transformer.models.weight_gradient import APEX_COMPATIBLE, accumulate_weight_gradient

# Measured on the 2-core CPU (torch 2.13), 15 draws of (tokens, out, in) up to (1024, 64, 128): fp32 inputs, relative
# error against today's separate GEMM and add and against fp64, at most 2.5e-7; bf16 inputs into an fp32 main gradient
# against fp64 of the same bf16 values 1.1e-7, where today's bf16 GEMM then add is 1.7e-3 off (its bf16 rounding).
# Tolerances ~8x the floor; the bf16 one is 20x below today's error, so rounding to bf16 first fails it.
FP32_TOLERANCE = 2e-6
BF16_INPUT_TOLERANCE = 1e-6
SHAPES = [(64, 48, 32), (257, 96, 80), (1024, 64, 128)]


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("tokens,out,inp", SHAPES)
def test_one_call_equals_the_separate_gemm_and_add(tokens, out, inp):
    g = torch.Generator().manual_seed(tokens)
    x, dy, main_grad = (torch.randn(*shape, generator=g) for shape in ((tokens, inp), (tokens, out), (out, inp)))
    got = main_grad.clone()
    accumulate_weight_gradient(x, dy, got)
    assert rel_err(got, main_grad + dy.t() @ x) < FP32_TOLERANCE
    assert rel_err(got, main_grad.double() + dy.t().double() @ x.double()) < FP32_TOLERANCE

    xb, dyb = x.bfloat16(), dy.bfloat16()
    got = main_grad.clone()
    APEX_COMPATIBLE.wgrad_gemm_accum_fp32(xb, dyb, got)  # megatron-core's call
    assert got.dtype == torch.float32
    exact = main_grad.double() + dyb.t().double() @ xb.double()
    assert rel_err(got, exact) < BF16_INPUT_TOLERANCE
    assert rel_err(main_grad + (dyb.t() @ xb).float(), exact) > 20 * BF16_INPUT_TOLERANCE  # today's bf16 rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megatron_linear_layers_accumulate_through_it(dtype, monkeypatch, megatron_single_process):
    """ColumnParallelLinear and RowParallelLinear with gradient_accumulation_fusion (refused without Apex until the
    hook is installed) add two micro-batches' weight gradients into main_grad through the hook, and leave .grad to
    DDP's dummy; the sum equals an fp64 reference of the same inputs."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    from diff_transformer import compat

    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)  # as without Apex: undone
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                               gradient_accumulation_fusion=True, params_dtype=dtype)
    make = [lambda: ColumnParallelLinear(32, 48, config=config, init_method=torch.nn.init.normal_, bias=False,
                                         gather_output=True),
            lambda: RowParallelLinear(48, 32, config=config, init_method=torch.nn.init.normal_, bias=False,
                                      input_is_parallel=True, skip_bias_add=True)]
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        make[0]()
    assert compat.install_weight_gradient_accumulation(APEX_COMPATIBLE)
    calls = []
    monkeypatch.setattr(APEX_COMPATIBLE, "wgrad_gemm_accum_fp32",
                        lambda *args: calls.append(1) or accumulate_weight_gradient(*args))
    g = torch.Generator().manual_seed(1)
    for build, width in zip(make, (32, 48)):
        layer = build()
        weight = layer.weight
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
        weight.grad_added_to_main_grad = False
        want = torch.zeros(weight.shape, dtype=torch.float64)
        for _ in range(2):  # two micro-batches accumulate
            x = torch.randn(5, 3, width, generator=g).to(dtype)
            y, _ = layer(x)
            dy = torch.randn(y.shape, generator=g).to(dtype)
            y.backward(dy)
            want += dy.reshape(-1, dy.shape[-1]).t().double() @ x.reshape(-1, width).double()
        assert weight.grad_added_to_main_grad
        assert rel_err(weight.main_grad, want) < (FP32_TOLERANCE if dtype == torch.float32 else BF16_INPUT_TOLERANCE)
    assert len(calls) == 4


@pytest.mark.gpu
def test_bf16_on_cuda_is_one_mixed_dtype_gemm():
    """On a GPU: bf16 inputs into the fp32 main gradient in one torch.addmm(out_dtype=float32) (cuBLAS, β = 1), not
    the two-call fallback, within the CPU's tolerance of an fp64 reference."""
    from diff_transformer.models import weight_gradient

    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(*shape, generator=g, device="cuda").bfloat16() for shape in ((4096, 512), (4096, 384)))
    main_grad = torch.randn(384, 512, generator=g, device="cuda")
    exact = main_grad.double() + dy.t().double() @ x.double()
    accumulate_weight_gradient(x, dy, main_grad)
    assert weight_gradient._MIXED_ADDMM.get("cuda") is True, torch.__version__
    assert rel_err(main_grad, exact) < BF16_INPUT_TOLERANCE


def test_the_switch_is_on_with_cuda_off_on_a_cpu_and_checked():
    from diff_transformer.config import validate
    from diff_transformer.models.gpt import gradient_accumulation_fusion_enabled
    from tests.test_config import compose_cfg

    cfg = compose_cfg()
    assert cfg.trainer.grad_accumulation_fusion == "auto"
    assert gradient_accumulation_fusion_enabled(cfg, "cuda") and not gradient_accumulation_fusion_enabled(cfg, "cpu")
    assert gradient_accumulation_fusion_enabled(compose_cfg("trainer.grad_accumulation_fusion=on"), "cpu")
    assert not gradient_accumulation_fusion_enabled(compose_cfg("trainer.grad_accumulation_fusion=off"), "cuda")
    with pytest.raises(ValueError, match=r"trainer.grad_accumulation_fusion='fast' is unknown; use one of auto, on, off"):
        validate(compose_cfg("trainer.grad_accumulation_fusion=fast"), world_size=1)


def tied_training(cfg, steps=3, micro_batches=2, overlap=False):
    """A DDP-wrapped model with tied embeddings and the fusion on: ``steps`` steps of ``micro_batches`` micro-batches
    accumulated into the fp32 main gradients (``overlap``: reduced bucket by bucket in the last micro-batch's
    backward, as parallel.overlap_grad_reduce), then a plain SGD update; the losses and main gradients of every
    step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from diff_transformer.models.gpt import build_model_chunk

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    chunk = build_model_chunk(cfg, 128, grad_accumulation_fusion=True)
    model = DistributedDataParallel(config=chunk.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), module=chunk)
    tied = chunk.shared_embedding_or_output_weight()
    assert tied.zero_out_wgrad and chunk.config.gradient_accumulation_fusion  # the path the patch answers
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(32).expand(2, 32)
    losses, grads = [], []
    for _ in range(steps):
        model.zero_grad_buffer()
        for micro_batch in range(micro_batches):
            tokens = torch.randint(0, 128, (2, 32), generator=g)
            with model.no_sync() if micro_batch < micro_batches - 1 else contextlib.nullcontext():
                loss = model(tokens, positions, None, labels=tokens).mean()
                loss.backward()
            losses.append(loss.detach())
        model.finish_grad_sync()
        grads.append([p.main_grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.5 * p.main_grad)
    return model, losses, grads


def test_the_tied_embedding_gets_no_zero_filled_dummy_gradient(monkeypatch, megatron_single_process):
    """compat.skip_tied_embedding_dummy_gradient: the output layer returns no gradient for the embedding it shares
    (megatron's is a torch.zeros of vocabulary × hidden each micro-batch): losses and main gradients bitwise equal to
    megatron's path over 3 steps of 2 micro-batches, and the audit finds no zero-fill at that call site."""
    from megatron.core.tensor_parallel import layers
    from omegaconf import OmegaConf

    from diff_transformer import compat
    from diff_transformer.config import Config
    from diff_transformer.training.profiling import zero_fills

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "debug", "attention": "diff", "num_layers": 2, "hidden_size": 64, "num_heads": 2,
                  "ffn_hidden_size": 176, "seq_length": 32, "vocab_size": 128},
        "trainer": {"max_steps": 3, "global_batch_size": 4, "micro_batch_size": 2}}))
    dummy_site = "LinearWithGradAccumulationAndAsyncCommunicationBackward (backward)"

    def dummy_fills(model):
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
        with torch.profiler.profile(record_shapes=True) as profile:
            model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).mean().backward()
        return [(r["chain"], r["count"], r["elements"]) for r in zero_fills(profile.events()) if dummy_site in r["site"]]

    model, losses, grads = tied_training(cfg)  # the build installs the patch
    assert layers.LinearWithGradAccumulationAndAsyncCommunication.backward.skips_tied_dummy
    assert dummy_fills(model) == []
    with monkeypatch.context() as megatron_path:
        function = layers.LinearWithGradAccumulationAndAsyncCommunication
        megatron_path.setattr(function, "backward", staticmethod(function.backward.__wrapped__))
        megatron_path.setattr(compat, "skip_tied_embedding_dummy_gradient", lambda: False)  # the build's install
        reference, reference_losses, reference_grads = tied_training(cfg)
        assert dummy_fills(reference) == [("aten::zeros > aten::zero_", 1, 128 * 64)]  # the detector sees it
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))
    for step, (got, want) in enumerate(zip(grads, reference_grads)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    # with the reduction overlapped, DDP's hooks still see the embedding's gradient (megatron asserts one is there)
    _, overlapped_losses, overlapped_grads = tied_training(cfg, overlap=True)
    assert all(torch.equal(a, b) for a, b in zip(overlapped_losses, reference_losses))
    assert all(torch.equal(a, b) for got, want in zip(overlapped_grads, reference_grads) for a, b in zip(got, want))
    assert grads[0][0].abs().sum() > 0 and len(grads[0]) == len(list(model.parameters()))
