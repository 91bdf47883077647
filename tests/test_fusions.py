"""The baseline at its best, piece by piece, against the unfused path (in process; the loss curves with every fusion
on against off, at TP=1, TP=2 and PP=2, are in tests/test_parallel.py): fused RoPE (compiled too), the cross-entropy
that keeps the logits' dtype, the gradient norm that stays on the device, fused AdamW, the step profile's kinds of
work, and model.attention_backend=auto's decision (timings injected: no GPU needed)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diff_transformer import compat
from diff_transformer.training import backend_choice
from diff_transformer.training.profiling import categorize


@pytest.fixture
def no_dynamo():
    """megatron-core's fused functions are torch.compile'd; run their Python (the formulas under test) eagerly, as the
    CPU test runs of train.py do with TORCHDYNAMO_DISABLE=1 (inductor's code generation is tested on the GPU)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def compose_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from diff_transformer.config import register_configs, to_object

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "configs"), version_base="1.3"):
        return to_object(compose("config", overrides=list(overrides)))


# ------------------------------------------------------------------------------------------------------------------
# Fused pieces against megatron-core's unfused ones
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rotary_dims", [8, 4], ids=["all-dims", "half-dims-passed-through"])
def test_fused_rope_equals_megatrons_unfused_rope(no_dynamo, rotary_dims):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from diff_transformer.models.rope import fused_apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    t = torch.randn(12, 2, 3, 8, generator=g, dtype=torch.float64)
    freqs = torch.randn(12, 1, 1, rotary_dims, generator=g, dtype=torch.float64)
    grad = torch.randn(12, 2, 3, 8, generator=g, dtype=torch.float64)
    outs = []
    for fn in (fused_apply_rotary_pos_emb, _apply_rotary_pos_emb_bshd):
        x = t.clone().requires_grad_(True)
        y = fn(x, freqs)
        y.backward(grad)
        outs.append((y.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], rtol=0, atol=1e-15)


def _rel(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def test_compiled_rope_computes_cos_and_sin_once_a_layer_not_per_element():
    """Under torch.compile (trainer.compile's layers), cos and sin come from one call of the opaque rope_cos_sin a
    layer, shared by the query and the key and saved for the backward; inductor's kernels, forward and backward, only
    read them. Inlined, inductor computes both for every element of the query and key (b·heads times per angle). The
    compiled result equals the eager one."""
    import re

    from torch._inductor.utils import run_and_get_code

    from diff_transformer.models.rope import fused_apply_rotary_pos_emb

    s, b, heads, d = 16, 2, 3, 8
    g = torch.Generator().manual_seed(2)
    mixed = torch.randn(s, b, 2 * heads * d, generator=g, dtype=torch.bfloat16)
    freqs = torch.randn(s, 1, 1, d, generator=g)

    def layer(x):  # the query and key as views of one projection, as megatron-core's SelfAttention splits them
        q, k = x[..., : heads * d].view(s, b, heads, d), x[..., heads * d:].view(s, b, heads, d)
        return fused_apply_rotary_pos_emb(q, freqs) * fused_apply_rotary_pos_emb(k, freqs)

    def forward_backward(fn):
        x = mixed.clone().requires_grad_(True)
        y = fn(x)
        y.float().square().sum().backward()
        return y.detach(), x.grad

    torch.library.opcheck(torch.ops.diff_transformer.rope_cos_sin.default, (freqs, torch.bfloat16))
    torch._dynamo.reset()
    (y, dx), code = run_and_get_code(forward_backward, torch.compile(layer, dynamic=False))
    code = "\n".join(code)
    assert len(re.findall(r"rope_cos_sin\.default\(", code)) == 1, code
    assert not re.search(r"\b(cos|sin)\(|\.(cos|sin)\(", code), code
    want_y, want_dx = forward_backward(layer)
    # measured 3.8e-3: bf16 roundings in other places (eager rounds each operation)
    assert _rel(y, want_y) < 1e-2 and _rel(dx, want_dx) < 1e-2, (_rel(y, want_y), _rel(dx, want_dx))


def _cross_entropies(logits, target, grad_loss, *functions):
    """(loss, logits' gradient) of each function on the same logits."""
    out = []
    for fn in functions:
        x = logits.clone().requires_grad_(True)
        loss = fn(x, target)
        loss.backward(grad_loss)
        out.append((loss.detach(), x.grad))
    return out


def _ce_inputs(dtype, seq=16, batch=2, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(seq, batch, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, vocab, (seq, batch), generator=g)
    return logits, target, torch.linspace(0.5, 1.5, seq * batch, dtype=torch.float64).view(seq, batch).float()


def _reference_cross_entropy(logits, target):
    """Plain PyTorch's cross-entropy, each token's loss [s, b]."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-14), (torch.float32, 1e-6)], ids=["fp64", "fp32"])
def test_fused_cross_entropy_equals_plain_cross_entropy(no_dynamo, megatron_single_process, dtype, tolerance):
    """models/cross_entropy.py (fusions' cross-entropy, the tensor-parallel group of one) against plain PyTorch's in
    fp64: the same loss and gradient, the gradient in the logits' dtype (megatron-core's native fused one rounds it
    to bf16). Measured: fp64 2e-16, fp32 1e-7 (the gradient's)."""
    from megatron.core import parallel_state

    from diff_transformer.models.cross_entropy import vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group()
    logits, target, grad_loss = _ce_inputs(dtype)
    [(loss, grad)] = _cross_entropies(logits, target, grad_loss.to(dtype),
                                      lambda x, t: vocab_parallel_cross_entropy(x, t, group))
    [(want_loss, want_grad)] = _cross_entropies(logits.double(), target, grad_loss.double(), _reference_cross_entropy)
    assert grad.dtype == dtype and loss.shape == target.shape
    assert _rel(loss, want_loss) < tolerance and _rel(grad, want_grad) < tolerance, (_rel(loss, want_loss),
                                                                                     _rel(grad, want_grad))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_cross_entropy_in_bf16_keeps_the_logits_not_an_fp32_softmax(megatron_single_process, compiled):
    """In bf16, eagerly and compiled (each piece is a jit_fuser function: torch.compile, as on a GPU): the loss and
    the bf16 gradient against plain PyTorch's cross-entropy in fp64 on the same logits, and what the forward keeps for
    the backward: the logits themselves and a value or two per token, no fp32 copy of them (compiled, none is
    made either). Measured: the loss 3e-8 (fp32 arithmetic), the gradient 1.7e-3 (rounded once to bf16, whose half
    ulp is 2e-3 relative)."""
    from diff_transformer.models.cross_entropy import vocab_parallel_cross_entropy

    logits, target, grad_loss = _ce_inputs(torch.bfloat16)
    saved = []

    def run(x, t):
        with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
            return vocab_parallel_cross_entropy(x, t)

    if compiled:  # inductor's code allocates one tensor of the logits' size: their gradient, no fp32 copy of them
        from torch._inductor.utils import run_and_get_code

        torch._dynamo.reset()
        [(loss, grad)], code = run_and_get_code(_cross_entropies, logits, target, grad_loss, run)
        assert "\n".join(code).count(f"empty_strided_cpu({tuple(logits.shape)}") == 1, code
    else:
        with torch._dynamo.config.patch(disable=True):
            [(loss, grad)] = _cross_entropies(logits, target, grad_loss, run)
    [(want_loss, want_grad)] = _cross_entropies(logits.double(), target, grad_loss.double(), _reference_cross_entropy)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert _rel(loss, want_loss) < 1e-6 and _rel(grad, want_grad) < 4e-3, (_rel(loss, want_loss), _rel(grad, want_grad))
    large = [s for s in saved if s.numel() > target.numel()]
    assert len(large) == 1 and large[0].dtype == torch.bfloat16 and large[0].shape == logits.shape, saved


def test_gradient_norm_never_reads_the_device():
    """The patched norm works on meta tensors, which have no values to read: it makes no host sync (megatron-core's
    local_multi_tensor_l2_norm, which reads every tensor's norm, cannot); on real tensors it equals it."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    compat.apply_grad_norm_patches()
    assert clip_grads.l2_norm_impl is compat._multi_tensor_l2_norm
    flag = torch.zeros(1, dtype=torch.int)
    meta = [torch.empty(5, 3, device="meta"), torch.empty(7, device="meta")]
    norm, _ = clip_grads.l2_norm_impl(2048, flag.to("meta"), [meta], False)
    assert norm.device.type == "meta" and norm.shape == (1,)
    with pytest.raises(Exception):
        local_multi_tensor_l2_norm(2048, flag, [meta], False)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    ours, theirs = clip_grads.l2_norm_impl(2048, flag, [grads], False)[0], local_multi_tensor_l2_norm(2048, flag, [grads], False)[0]
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    scaled = [g.clone() for g in grads]
    clip_grads.multi_tensor_scale_impl(2048, flag, [scaled, scaled], 0.5)
    assert all(torch.equal(s, g * 0.5) for s, g in zip(scaled, grads))


def test_fused_adamw_switch_takes_effect_and_matches_foreach():
    """compat.fuse_torch_adamw turns megatron-core's torch AdamW groups fused (on a GPU; here on the CPU, where torch
    has a fused AdamW too): the flag is read at each step, and the updates match the foreach implementation."""
    def train(fuse):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if fuse:
            assert compat.fuse_torch_adamw(optimizer, device_type="cpu") == 1
            assert optimizer.param_groups[0]["fused"] and not optimizer.param_groups[0]["foreach"]
        for step in range(4):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            with torch.profiler.profile() as profile:
                optimizer.step()
            ran_fused = any("_fused_adamw" in e.name for e in profile.events())
            assert ran_fused == fuse, [e.name for e in profile.events()]
        return [p.detach() for p in params]

    for fused, foreach in zip(train(True), train(False)):
        assert torch.allclose(fused, foreach, rtol=1e-6, atol=1e-7)


def test_fusions_switch_megatrons_fused_paths_on():
    from diff_transformer.models.gpt import epilogue_impl, fusions_enabled, transformer_config

    on, off = compose_cfg("model=debug", "trainer.fusions=on"), compose_cfg("model=debug", "trainer.fusions=off")
    config = transformer_config(on)
    assert config.bias_activation_fusion and config.apply_rope_fusion and config.cross_entropy_loss_fusion
    assert config.cross_entropy_fusion_impl == "native"
    assert epilogue_impl(on) == "triton" and epilogue_impl(off) == "unfused"
    assert not transformer_config(off).apply_rope_fusion
    auto = compose_cfg("model=debug")
    assert fusions_enabled(auto, "cuda") and not fusions_enabled(auto, "cpu")


@pytest.mark.parametrize("overrides, says", [
    (["trainer.fusions=off"], "off"),
    (["model.attention_backend=sdpa"], "on (triton DIFF epilogue)"),
    (["model.attention_backend=sdpa", "trainer.diff_epilogue=compile"], "on (compile DIFF epilogue)"),
    (["model.attention=diff_v2", "model.attention_backend=sdpa"], "on (triton DIFF epilogue)"),
    (["model.attention_backend=triton"], "on (the DIFF epilogue inside the triton backend)"),
    (["model.attention_backend=combined"], "on (the DIFF epilogue inside the combined backend)"),
    (["model.attention_backend=triton", "parallel.cp=2"], "on (triton DIFF epilogue)"),  # the ring's epilogue
    (["model.attention_backend=eager"], "on (eager's unfused DIFF epilogue)"),
    (["model.attention=vanilla", "model.attention_backend=sdpa"], "on"),
])
def test_the_setup_log_names_the_diff_epilogue_the_attention_runs(overrides, says):
    from diff_transformer.models.gpt import fusions_summary

    assert fusions_summary(compose_cfg("model=debug", "trainer.fusions=on", *overrides)) == says


# ------------------------------------------------------------------------------------------------------------------
# The step profile's kinds of work
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, context, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ["aten::mm"], "GEMM"),
    ("aten::addmm", [], "GEMM"),
    ("flash_fwd_kernel", ["aten::_flash_attention_forward"], "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", [], "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], "attention"),
    ("_diff_epilogue_fwd_kernel", [], "DIFF epilogue"),
    ("aten::mul", ["aten::cat", "diff_epilogue"], "DIFF epilogue"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", [], "communication"),
    ("void at::native::(anonymous)::multi_tensor_apply_kernel", [], "optimizer"),
    ("aten::_foreach_norm", ["Optimizer.step#AdamW.step"], "optimizer"),
    ("aten::mul", ["Optimizer.step#AdamW.step"], "optimizer"),
    ("aten::_fused_rms_norm", [], "norms"),
    ("triton_poi_fused_mul_silu_0", ["SwiGLUFunction"], "other elementwise"),
])
def test_profile_kinds(name, context, kind):
    assert categorize(name, context) == kind


# ------------------------------------------------------------------------------------------------------------------
# model.attention_backend=auto
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFF_TRANSFORMER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_timer(times, calls):
    def measure(backend):
        calls.append(backend)
        if isinstance(times[backend], Exception):
            raise times[backend]
        return times[backend]
    return measure


def test_candidates_per_kind():
    assert backend_choice.candidates(compose_cfg("model.attention=diff").model)[0] == "sdpa"
    assert "triton" in backend_choice.candidates(compose_cfg("model.attention=diff_v2").model)
    assert "eager" not in backend_choice.candidates(compose_cfg("model.attention=diff").model)
    assert backend_choice.candidates(compose_cfg("model.attention=topk").model) == ["sdpa"]


def test_installed_flash_libraries_are_candidates_of_the_kinds_that_run_them():
    """With flash-attn 2 and 4 importable (their CPU stand-ins), auto times them for the softmax kinds and DIFF, not
    for the map controls, and under context parallelism only backends with a ring path."""
    from tests.flash_stand_in import installed

    with installed():
        assert backend_choice.installed("flash_attn") and backend_choice.installed("flash_attn4")
        for kind in ("diff", "diff_v2", "vanilla", "dex"):
            found = backend_choice.candidates(compose_cfg(f"model.attention={kind}").model)
            assert found[0] == "sdpa" and {"flash_attn", "flash_attn4"} <= set(found), (kind, found)
        assert backend_choice.candidates(compose_cfg("model.attention=topk").model) == ["sdpa"]
        assert "flash_attn4" not in backend_choice.candidates(compose_cfg("model.attention=diff").model, cp=2)
    assert not backend_choice.installed("flash_attn4")  # the stand-ins are gone


def test_choose_takes_the_fastest_and_skips_failures():
    calls = []
    chosen = backend_choice.choose(["sdpa", "triton", "flash_attn"], fake_timer(
        {"sdpa": 2.0, "triton": 1.5, "flash_attn": RuntimeError("no kernel for sm_90")}, calls))
    assert chosen["backend"] == "triton" and chosen["timings_ms"]["flash_attn"] is None
    assert "no kernel for sm_90" in chosen["errors"]["flash_attn"]
    assert backend_choice.choose(["sdpa", "triton"], lambda b: 1.0)["backend"] == "sdpa"  # a tie keeps sdpa
    with pytest.raises(RuntimeError, match="no candidate ran"):
        backend_choice.choose(["sdpa"], fake_timer({"sdpa": ValueError("boom")}, []))


@pytest.mark.parametrize("kind,backend", [("diff", "combined"), ("vanilla", "sdpa")])
def test_auto_without_a_gpu_follows_the_cpu_rule_and_is_recorded(kind, backend, tmp_path, cache_dir):
    """Without a GPU nothing is timed (tests/test_combined_map.py has the rule's cases)."""
    cfg = compose_cfg("model=debug", f"model.attention={kind}")
    decision = backend_choice.decide_attention_backend(cfg, str(tmp_path), torch.float32, "unfused", cuda=False,
                                                       measure=fake_timer({}, []))
    assert decision["backend"] == backend and decision["how"].startswith("no GPU")
    assert json.loads((tmp_path / backend_choice.RECORD_FILE).read_text())["backend"] == backend
    assert not cache_dir.exists()


def test_auto_times_once_per_gpu_and_shape_and_a_resume_keeps_its_choice(tmp_path, cache_dir):
    cfg = compose_cfg("model=debug")
    calls = []
    timer = fake_timer({"sdpa": 3.0, "triton": 2.0}, calls)
    first = backend_choice.decide_attention_backend(cfg, str(tmp_path / "a"), torch.bfloat16, "triton", cuda=True,
                                                    device_name="NVIDIA H100 80GB HBM3", measure=timer)
    assert first["backend"] == "triton" and first["how"] == "timed" and calls == ["sdpa", "triton"]
    assert first["timings_ms"] == {"sdpa": 3.0, "triton": 2.0}
    assert "sdpa 3.000 ms, triton 2.000 ms" in backend_choice.describe(first)
    # another run of the same shape on the same GPU reads the cache: no timing
    again = backend_choice.decide_attention_backend(cfg, str(tmp_path / "b"), torch.bfloat16, "triton", cuda=True,
                                                    device_name="NVIDIA H100 80GB HBM3", measure=timer)
    assert again["backend"] == "triton" and again["how"] == "cached timing" and calls == ["sdpa", "triton"]
    # another GPU, another shape or another epilogue is timed afresh
    for device, extra, epilogue in (("NVIDIA H200", [], "triton"), ("NVIDIA H100 80GB HBM3", ["trainer.micro_batch_size=2"], "triton"),
                                    ("NVIDIA H100 80GB HBM3", [], "compile")):
        calls.clear()
        other = compose_cfg("model=debug", *extra)
        backend_choice.decide_attention_backend(other, str(tmp_path / "c"), torch.bfloat16, epilogue, cuda=True,
                                                device_name=device, measure=timer)
        assert calls == ["sdpa", "triton"], (device, extra, epilogue)
        (tmp_path / "c" / backend_choice.RECORD_FILE).unlink()
    # a resume in run directory a keeps its recorded choice even where timing would now pick another
    calls.clear()
    slower = fake_timer({"sdpa": 1.0, "triton": 2.0}, calls)
    (cache_dir / backend_choice.CACHE_FILE).unlink()
    resumed = backend_choice.decide_attention_backend(cfg, str(tmp_path / "a"), torch.bfloat16, "triton", cuda=True,
                                                      device_name="NVIDIA H100 80GB HBM3", measure=slower)
    assert resumed["backend"] == "triton" and resumed["how"].startswith("recorded in") and calls == []
    # the checkpoint a run resumes from decides before anything else; one saved with auto does not
    from_checkpoint = backend_choice.decide_attention_backend(
        cfg, str(tmp_path / "a"), torch.bfloat16, "triton", {"model": {"attention_backend": "sdpa"}}, cuda=True,
        device_name="NVIDIA H100 80GB HBM3", measure=slower)
    assert from_checkpoint["backend"] == "sdpa" and from_checkpoint["how"] == "the resumed checkpoint's"
    assert backend_choice.saved_backend({"model": {"attention_backend": "auto"}}) is None


def test_a_resume_at_cp2_leaves_a_backend_without_a_ring_path(tmp_path, cache_dir):
    """A run trained at CP=1 on a backend without a ring (the CPU's combined, flash_attn) resumes at CP=2: decided
    afresh, and the decision says why; at CP=1 the checkpoint's backend is kept."""
    cp2 = compose_cfg("model=debug", "parallel.cp=2")
    decision = backend_choice.decide_attention_backend(cp2, str(tmp_path / "a"), torch.float32, "unfused",
                                                       {"model": {"attention_backend": "combined"}}, cuda=False)
    assert decision["backend"] == "sdpa"
    assert decision["how"] == "no GPU; not combined (the resumed checkpoint's), which this run cannot take " \
                              "(parallel.cp=2: eager or sdpa or triton)"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / backend_choice.RECORD_FILE).write_text(json.dumps({"backend": "flash_attn"}))
    recorded = backend_choice.decide_attention_backend(cp2, str(tmp_path / "b"), torch.bfloat16, "triton", cuda=True,
                                                       device_name="NVIDIA H100", measure=fake_timer(
                                                           {"sdpa": 3.0, "triton": 2.0}, []))
    assert recorded["backend"] == "triton" and "not flash_attn (recorded in" in recorded["how"]
    kept = backend_choice.decide_attention_backend(compose_cfg("model=debug"), str(tmp_path / "c"), torch.float32,
                                                   "unfused", {"model": {"attention_backend": "combined"}}, cuda=False)
    assert kept["backend"] == "combined" and kept["how"] == "the resumed checkpoint's"


def test_a_resume_leaves_a_flash_backend_whose_library_is_missing(tmp_path, cache_dir):
    """A checkpoint trained on flash_attn4 resumes where flash-attn-4 is missing: decided afresh, saying why; where
    the library is importable (its stand-in) it is kept. A cached timing holds only for the candidates it timed: with
    the libraries installed since, they are timed; removed again, the cached choice of flash_attn4 is not taken."""
    from tests.flash_stand_in import installed

    cfg = compose_cfg("model=debug")
    saved = {"model": {"attention_backend": "flash_attn4"}}
    timer = fake_timer({"sdpa": 3.0, "triton": 2.0}, [])
    if not backend_choice.installed("flash_attn4"):
        decision = backend_choice.decide_attention_backend(cfg, str(tmp_path / "a"), torch.bfloat16, "triton", saved,
                                                           cuda=True, device_name="NVIDIA H100", measure=timer)
        assert decision["backend"] == "triton" and decision["how"] == (
            "timed; not flash_attn4 (the resumed checkpoint's), which this run cannot take (its library is not "
            "installed here)")
    with installed():
        kept = backend_choice.decide_attention_backend(cfg, str(tmp_path / "b"), torch.bfloat16, "triton", saved,
                                                       cuda=True, device_name="NVIDIA H100", measure=timer)
        assert kept["backend"] == "flash_attn4" and kept["how"] == "the resumed checkpoint's"
        chosen = backend_choice.decide_attention_backend(
            cfg, str(tmp_path / "c"), torch.bfloat16, "triton", cuda=True, device_name="NVIDIA H100",
            measure=fake_timer({"sdpa": 3.0, "triton": 2.0, "flash_attn": 2.5, "flash_attn4": 1.0}, []))
        assert chosen["backend"] == "flash_attn4" and chosen["how"] == "timed"
    if not backend_choice.installed("flash_attn4"):
        again = backend_choice.decide_attention_backend(cfg, str(tmp_path / "d"), torch.bfloat16, "triton", cuda=True,
                                                        device_name="NVIDIA H100", measure=timer)
        assert again["backend"] == "triton" and again["how"] == "timed"


def test_auto_with_one_candidate_does_not_time(tmp_path, cache_dir):
    calls = []
    decision = backend_choice.decide_attention_backend(
        compose_cfg("model=debug", "model.attention=topk"), str(tmp_path), torch.bfloat16, "triton", cuda=True,
        device_name="NVIDIA H100", measure=fake_timer({}, calls))
    assert decision["backend"] == "sdpa" and decision["how"] == "the only candidate" and calls == []


def test_auto_under_context_parallelism_times_the_ring_backends(tmp_path, cache_dir):
    """Under CP the candidates are the kind's ring backends (DIFF: sdpa and the fused ring; the baseline: sdpa alone),
    timed as one CP rank's ring attention over its s/cp tokens, and cached apart from CP=1's timings."""
    calls = []
    cfg = compose_cfg("model=debug", "parallel.cp=2")
    decision = backend_choice.decide_attention_backend(cfg, str(tmp_path / "a"), torch.bfloat16, "triton", cuda=True,
                                                       device_name="NVIDIA H100", measure=fake_timer(
                                                           {"sdpa": 3.0, "triton": 2.0}, calls))
    assert decision["backend"] == "triton" and decision["how"] == "timed" and calls == ["sdpa", "triton"]
    assert json.loads(decision["key"])["cp"] == 2
    assert "cp" not in json.loads(backend_choice.problem_key(compose_cfg("model=debug"), "NVIDIA H100", torch.bfloat16,
                                                             "triton"))  # CP=1's keys as before: their cache holds
    vanilla = backend_choice.decide_attention_backend(
        compose_cfg("model=debug", "model.attention=vanilla", "parallel.cp=2"), str(tmp_path / "b"), torch.bfloat16,
        "triton", cuda=True, device_name="NVIDIA H100", measure=fake_timer({}, calls))
    assert vanilla["backend"] == "sdpa" and vanilla["how"] == "the only candidate"
    module, (q, k, v), _ = backend_choice.core_attention_problem(cfg, "sdpa", torch.float32, "unfused", device="cpu")
    assert module.ring.size == 2 and q.shape[0] == cfg.model.seq_length // 2  # one CP rank's ring over s/cp tokens
    module(q, k, v, None).sum().backward()
    assert q.grad is not None and k.grad is not None


def test_auto_under_compile_takes_the_backends_the_graph_keeps(tmp_path, cache_dir):
    """With trainer.compile keeping the core attention in the layers' graphs, auto chooses among the backends that
    stay there (sdpa; flash_attn4 where installed: its stand-in here), whatever an eager timing says, and caches that
    timing apart; where the graph breaks at the core attention (selective recomputation) it times every candidate."""
    from tests.flash_stand_in import installed

    calls = []
    timer = fake_timer({"sdpa": 3.0, "triton": 2.0, "flash_attn": 2.5, "flash_attn4": 2.8}, calls)
    compiled = compose_cfg("model=debug", "trainer.compile=true")
    decision = backend_choice.decide_attention_backend(compiled, str(tmp_path / "a"), torch.bfloat16, "triton",
                                                       cuda=True, device_name="NVIDIA H100", measure=timer)
    assert decision["backend"] == "sdpa" and calls == []
    assert decision["how"] == "the only candidate that trainer.compile keeps in the layers' graphs"
    with installed():
        decision = backend_choice.decide_attention_backend(compiled, str(tmp_path / "b"), torch.bfloat16, "triton",
                                                           cuda=True, device_name="NVIDIA H100", measure=timer)
    assert decision["backend"] == "flash_attn4" and calls == ["sdpa", "flash_attn4"]
    assert decision["how"] == "timed among the backends trainer.compile keeps in the layers' graphs"
    assert json.loads(decision["key"])["in_graph"] is True
    calls.clear()
    selective = compose_cfg("model=debug", "trainer.compile=true", "trainer.recompute=selective")
    decision = backend_choice.decide_attention_backend(selective, str(tmp_path / "c"), torch.bfloat16, "triton",
                                                       cuda=True, device_name="NVIDIA H100", measure=timer)
    assert decision["backend"] == "triton" and decision["how"] == "timed" and calls == ["sdpa", "triton"]
    assert "in_graph" not in json.loads(decision["key"])


def test_fusion_keys_are_validated():
    from diff_transformer.config import validate

    for overrides, message in (
        (["trainer.fusions=maybe"], r"trainer.fusions='maybe' is unknown; use one of auto, on, off"),
        (["trainer.diff_epilogue=unfused"], r"trainer.diff_epilogue='unfused' is unknown; use one of triton, compile"),
        (["trainer.profile_step=99"], r"trainer.profile_step=99 must be a step of the run, 1..30"),
    ):
        with pytest.raises(ValueError, match=message):
            validate(compose_cfg("experiment=smoke", *overrides), 1)
    validate(compose_cfg("experiment=smoke", "model.attention=topk"), 1)  # auto suits every kind
