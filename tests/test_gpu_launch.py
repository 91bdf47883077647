"""The launchers' GPU branch, run in Triton's interpreter (kernels/gpu_target.py): what a GPU launch decides.

On a CPU the launchers normally take the interpreter's own branch (small fixed block configs, no allocator), which
no GPU runs. Here they plan as on an H100 (sm_90: its shared memory, multiprocessors and the table's Hopper configs,
tensor descriptors on and off) and an A100 (sm_80), and the interpreter runs the kernels: every table entry, V1 and
V2 at each head dim the tables serve (64, 96, 128), forward and backward, the context-parallel pieces, the fused
epilogue. Each backward runs on a thread of its own, as autograd runs a CUDA backward on its device thread, so a
launcher that sets Triton's per-thread allocator only once fails here as it would on a GPU.
"""

import threading

import pytest
import torch

from kernels import gpu_target
from kernels.diff_attn import function, launch, tuning
from tests.test_diff_attn_kernel import (
    FP32_TOLERANCE,
    FUSED,
    REFERENCE,
    Case,
    assert_errors_below,
    dlam_scale,
    make_inputs,
    reference_epilogue,
    rel_rms,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a GPU in the interpreter (CPU only)")


def on_another_thread(fn):
    """``fn()`` on a fresh thread (a fresh context: no Triton allocator), its result or its exception."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001  (re-raised on the caller's thread)
            result["error"] = err

    thread = threading.Thread(target=run, name="autograd-device-thread")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def launched_configs(monkeypatch):
    """Record the (kernel name, config) of every launch."""
    launched = []
    original = launch._block_config

    def recording(name, *args, **kwargs):
        config = original(name, *args, **kwargs)
        launched.append((name, config))
        return config

    monkeypatch.setattr(launch, "_block_config", recording)
    return launched


# (arch, version, head dim, GQA, DIFF_ATTN_DESIGN): every table entry of both architectures, each head dim it serves.
SIMULATED_CASES = [
    ("sm_90", 1, 128, False, ""), ("sm_90", 1, 96, True, ""), ("sm_90", 1, 64, False, ""),
    ("sm_90", 2, 128, False, ""), ("sm_90", 2, 96, False, ""), ("sm_90", 2, 64, True, ""),
    ("sm_90", 1, 128, False, "descriptors=1"), ("sm_90", 2, 64, False, "descriptors=1,forward=twopass"),
    ("sm_80", 1, 128, False, ""), ("sm_80", 1, 64, True, ""), ("sm_80", 2, 96, False, ""), ("sm_80", 2, 64, False, ""),
]


@pytest.mark.parametrize("arch,version,head_dim,gqa,design_env", SIMULATED_CASES,
                         ids=[f"{a}-v{v}-d{d}{'-gqa' if g else ''}{'-' + e if e else ''}"
                              for a, v, d, g, e in SIMULATED_CASES])
def test_table_entries_through_the_gpu_branch(arch, version, head_dim, gqa, design_env, monkeypatch):
    """Forward and backward (on another thread) with the table's design and configs for that GPU, against the fp32
    reference; every kernel launched with the table's config for its problem (fitted to the device)."""
    monkeypatch.setenv(tuning.DESIGN_ENV, design_env)
    torch.manual_seed(head_dim + 7 * version)
    case = Case(1, 72, 2, 1 if gqa else 2, head_dim, lam="per_head" if version == 1 else "sigmoid",
                epilogue=version == 1)
    inputs = make_inputs(case, version, torch.float32, "cpu")
    fused_epilogue, reference_args = reference_epilogue(case, inputs)
    launched = launched_configs(monkeypatch)
    with gpu_target.simulate(arch):
        gpu = gpu_target.simulated()
        design = launch._design(inputs[0], inputs[2].shape[3], None)
        out, lse = FUSED[version](*inputs[:4], return_lse=True, **fused_epilogue)
        upstream = torch.randn_like(out)
        grads = on_another_thread(lambda: torch.autograd.grad(out, inputs, upstream))
    assert design == tuning.default_design(gpu.capability[0], head_dim, inputs[2].shape[3])
    assert design.descriptors == ("descriptors=1" in design_env)
    device = tuning.DeviceInfo(gpu.name, gpu.capability, gpu.shared_memory)
    expected_kernels = set(tuning.FORWARD_DESIGNS[design.forward])
    assert expected_kernels <= {name for name, _ in launched}, launched
    for name, config in launched:
        problem = tuning.KernelProblem.of(name, "fp32", head_dim, inputs[2].shape[3], version == 2, True, 72, 72,
                                          design.split_dims, design.descriptors, gqa)
        assert config == tuning.default_config(problem, device), (name, config)

    reference_inputs = [x.detach().float().requires_grad_() for x in inputs]
    if case.epilogue:
        reference_args["norm_weight"] = reference_inputs[4]
    ref_out, ref_lse = REFERENCE[version](*reference_inputs[:4], return_lse=True, **reference_args)
    ref_grads = torch.autograd.grad(ref_out, reference_inputs, upstream)
    errors = {"out": rel_rms(out, ref_out), "lse": rel_rms(lse, ref_lse)}
    scales = {"dlam": dlam_scale(version, case, inputs, upstream)}
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "dlam", "dw"), grads, ref_grads):
        errors[name] = rel_rms(grad, ref_grad, scales.get(name, 0.0))
    assert_errors_below(errors, FP32_TOLERANCE)


def test_descriptor_backward_on_autograd_thread_has_the_allocator(monkeypatch):
    """Triton keeps its allocator per thread: the backward's thread launches tensor-descriptor kernels and must find
    one set there (a launcher that set it once, on the forward's thread, fails here as on a GPU)."""
    from triton.runtime import _allocation

    monkeypatch.setenv(tuning.DESIGN_ENV, "descriptors=1")
    case = Case(1, 24, 1, 1, 64)
    inputs = make_inputs(case, 1, torch.float32, "cpu")
    seen = {}

    def backward():
        grads = torch.autograd.grad(out, inputs[:3], torch.ones_like(out))
        seen["allocator"] = _allocation._allocator.get()
        return grads

    with gpu_target.simulate("sm_90"):
        out = FUSED[1](*inputs[:4])
        grads = on_another_thread(backward)
        assert not isinstance(seen["allocator"], _allocation.NullAllocator)
        # A thread without an allocator is refused in the simulation, as the GPU refuses it.
        with pytest.raises(RuntimeError, match="no allocator was set"):
            on_another_thread(lambda: gpu_target.require_allocator())
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("head_dim", [128, 96])
def test_context_parallel_pieces_through_the_gpu_branch(head_dim):
    """The ring's pieces (LSE pass, chunk output, r2, chunk gradients) with the sm_90 table (the two-pass LSE kernel
    has no VALUE_D of its own: its problem is looked up with the V1 value dim), assembled over two key chunks and
    compared with the whole fused attention."""
    from kernels.diff_attn import (diff_attn_chunk_backward, diff_attn_chunk_forward, diff_attn_chunk_lse,
                                   diff_attn_chunk_r2, diff_attn_delta)

    torch.manual_seed(head_dim)
    n, split, h = 48, 20, 1
    q, k = (torch.randn(1, n, 2 * h, head_dim) for _ in range(2))
    v = torch.randn(1, n, h, 2 * head_dim)
    lam = torch.tensor(0.3)
    dy = torch.randn(1, n, h, 2 * head_dim)
    with gpu_target.simulate("sm_90"):
        chunks = [(k[:, :split], v[:, :split], 0), (k[:, split:], v[:, split:], split)]
        lses = [diff_attn_chunk_lse(q, kc, causal_offset=-start) for kc, _, start in chunks]
        lse = torch.logaddexp(*lses)
        y = sum(diff_attn_chunk_forward(q, kc, vc, lam, lse, causal_offset=-start) for kc, vc, start in chunks)
        r2 = sum(diff_attn_chunk_r2(dy, q, kc, vc, lse, causal_offset=-start) for kc, vc, start in chunks)
        delta = diff_attn_delta(dy, y, lam, r2)
        pieces = [diff_attn_chunk_backward(dy, q, kc, vc, lam, lse, delta, causal_offset=-start)
                  for kc, vc, start in chunks]
    qr, kr, vr, lr = (x.clone().requires_grad_() for x in (q, k, v, lam))
    want, want_lse = REFERENCE[1](qr, kr, vr, lr, return_lse=True)
    dq, dk, dv = torch.autograd.grad(want, (qr, kr, vr), dy)
    assert rel_rms(lse, want_lse) < FP32_TOLERANCE and rel_rms(y, want) < FP32_TOLERANCE
    assert rel_rms(sum(p[0] for p in pieces), dq) < FP32_TOLERANCE
    assert rel_rms(torch.cat([p[1] for p in pieces], 1), dk) < FP32_TOLERANCE
    assert rel_rms(torch.cat([p[2] for p in pieces], 1), dv) < FP32_TOLERANCE


def test_fused_epilogue_through_the_gpu_branch():
    """The DIFF epilogue with the GPU's tiles (512 elements) and one program per block group sized by the H100's
    multiprocessors, backward on another thread, against its plain-PyTorch reference."""
    from kernels.diff_epilogue import diff_epilogue, diff_epilogue_naive, fused as epilogue_fused

    torch.manual_seed(3)
    b, n, h, d = 2, 40, 3, 64
    oa, ob = (torch.randn(b, n, 2, h, d, requires_grad=True) for _ in range(2))
    lam = torch.tensor(0.4, requires_grad=True)
    weight = (1 + 0.2 * torch.randn(2 * d)).requires_grad_()
    with gpu_target.simulate("sm_90"):
        assert epilogue_fused._tile(d) == (512 // d, d)
        assert epilogue_fused._programs_per_head(80, h, torch.device("cpu")) == min(80, -(-4 * 132 // h))
        out = diff_epilogue((oa, ob), lam, weight, 1e-5, 0.7)
        grad_out = torch.randn_like(out)
        grads = on_another_thread(lambda: torch.autograd.grad(out, (oa, ob, lam, weight), grad_out))
    leaves = [x.detach().clone().requires_grad_() for x in (oa, ob, lam, weight)]
    want = diff_epilogue_naive((leaves[0], leaves[1]), leaves[2], leaves[3], 1e-5, 0.7)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    assert rel_rms(out, want) < 1e-5
    for got, expected in zip(grads, want_grads):
        assert rel_rms(got, expected) < 1e-5


def test_simulation_needs_the_interpreter_and_a_known_gpu():
    with pytest.raises(ValueError, match=r"DIFF_ATTN_SIMULATE_GPU='sm_70'; expected one of sm_90, sm_80"):
        with gpu_target.simulate("sm_70"):
            pass
    assert gpu_target.simulated() is None and not gpu_target.gpu_branch()


def test_norm_weight_partial_sums_are_the_launched_configs_rows_unfilled(monkeypatch):
    """The backward's preprocess writes one row of the norm weight's partial sums per query-block program: with the
    H100's configs (blocks larger than the smallest, 16 rows) the rows of the config launched come back, each written
    (NaN-poisoned before: no fill), and none of the smallest block's count (a zero fill once kept those)."""
    torch.manual_seed(5)
    case = Case(2, 72, 2, 2, 64, lam="per_head", epilogue=True)
    inputs = make_inputs(case, 1, torch.float32, "cpu")
    fused_epilogue, _ = reference_epilogue(case, inputs)
    launched = launched_configs(monkeypatch)
    partials = []
    original = launch._diff_attn_preprocess

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        partials.append(result[3])
        return result

    monkeypatch.setattr(function, "_diff_attn_preprocess", recording)
    with gpu_target.simulate("sm_90"):
        out = FUSED[1](*inputs[:4], **fused_epilogue)
        on_another_thread(lambda: torch.autograd.grad(out, inputs, torch.randn_like(out)))
    block_m = dict(launched)["preprocess"].block_m
    assert block_m > launch._MIN_BLOCK_M
    assert len(partials) == 1 and partials[0].shape == (2 * 2 * -(-72 // block_m), 2 * 64)
    assert not partials[0].isnan().any() and launch._POISON
