"""The fused DIFF epilogue (kernels/diff_epilogue) against its plain PyTorch definition: outputs and every gradient.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), with tiles of 256
elements here so that these shapes cross tile edges and the backward's loop over token blocks; on a GPU the compiled
kernels run, and bf16 is checked there (the interpreter's bf16 is unreliable: platform facts)."""

import math
import zlib

import pytest
import torch

from kernels.diff_epilogue import diff_epilogue, diff_epilogue_naive

# Worst relative RMS error of fp32 cases below in the interpreter: 2.3e-7 (the weight's gradient, a sum over every
# token); 2e-6 is 9x that, and a slip in the norm's backward (a missing rstd² or 1/n) fails by orders of magnitude.
FP32_TOLERANCE = 2e-6


def rel_rms(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def library_view(batch, seq, heads, d, generator, dtype):
    """(B, N, 2, H, d) as the view of an SDPA output (B, 2H, N, d) that the model hands the epilogue."""
    out = torch.randn(batch, 2 * heads, seq, d, generator=generator).to(dtype)
    return out.transpose(1, 2).unflatten(2, (heads, 2)).transpose(2, 3)


def run(fn, halves, lam, weight, scale, grad_seed):
    halves = [h.detach().requires_grad_(True) for h in halves]
    lam = lam.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True) if weight is not None else None
    out = fn(halves, lam, weight, 1e-5, scale)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype).to(out.device)
    out.backward(grad)
    return [out.detach()] + [h.grad for h in halves] + [lam.grad] + ([weight.grad] if weight is not None else [])


CASES = {  # (batch, seq, heads, d, halves, λ per token, norm)
    "V1-B2-N40-H3-D16": (2, 40, 3, 16, 2, False, True),
    "V1-no-norm-B1-N33-H2-D12": (1, 33, 2, 12, 2, False, False),
    "V2-B3-N20-H4-D16": (3, 20, 4, 16, 1, True, False),
    "V1-d96-B1-N9-H2-D96": (1, 9, 2, 96, 2, False, True),
}


def inputs(case, device, dtype, seed):
    batch, seq, heads, d, n, per_token, norm = case
    g = torch.Generator().manual_seed(seed)
    halves = [library_view(batch, seq, heads, d, g, dtype).to(device) for _ in range(n)]
    lam = torch.rand(batch, seq, heads, generator=g) if per_token else torch.tensor(0.37)
    weight = (torch.rand(n * d, generator=g) + 0.5).to(dtype).to(device) if norm else None
    return halves, lam.to(device), weight


@pytest.fixture
def small_interpreter_tiles(monkeypatch):
    from kernels.diff_epilogue import fused

    monkeypatch.setattr(fused, "_INTERPRET_TILE_ELEMENTS", 256)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_epilogue_matches_the_definition_in_fp32(name, small_interpreter_tiles):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = zlib.crc32(name.encode())
    halves, lam, weight = inputs(CASES[name], device, torch.float32, seed)
    fused = run(diff_epilogue, halves, lam, weight, 0.7, seed)
    reference = run(diff_epilogue_naive, halves, lam, weight, 0.7, seed)
    assert fused[0].shape == (CASES[name][1], CASES[name][0], CASES[name][2] * CASES[name][4] * CASES[name][3])
    assert fused[0].is_contiguous()  # megatron's [s, b, hidden], written in place: no layout copy after it
    for h, grad in zip(halves, fused[1:1 + len(halves)]):
        assert grad.stride() == h.stride()  # the attention kernel's own layout: no copy before its backward
    for got, want in zip(fused, reference):
        assert got.shape == want.shape
        assert rel_rms(got, want) < FP32_TOLERANCE


@pytest.mark.parametrize("layout", ["combined", "halves-of-wide-V"])
def test_fused_epilogue_takes_the_context_parallel_layouts(layout, small_interpreter_tiles):
    """The fused ring's y, its maps already combined: one part as wide as a head, (B, N, 1, H, 2d), no λ; and the
    sdpa ring's two maps over a 2d-wide V split into halves, views that skip every other d columns, whose gradients
    the kernel writes at their own (compact) strides."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = zlib.crc32(layout.encode())
    g = torch.Generator().manual_seed(seed)
    batch, seq, heads, d = 2, 17, 3, 8
    if layout == "combined":
        halves = [torch.randn(batch, seq, heads, 2 * d, generator=g).to(device).unsqueeze(2)]
    else:
        maps = torch.randn(batch, heads, 2, seq, 2 * d, generator=g).to(device).transpose(1, 3)  # (B, N, 2, H, 2d)
        halves = [maps[..., :d], maps[..., d:]]
    lam, weight = torch.tensor(0.37, device=device), (torch.rand(2 * d, generator=g) + 0.5).to(device)
    fused = run(diff_epilogue, halves, lam, weight, 0.7, seed)
    reference = run(diff_epilogue_naive, halves, lam, weight, 0.7, seed)
    for got, want in zip(fused, reference):
        if want is None:  # λ's gradient, of maps already combined
            assert got is None
        else:
            assert rel_rms(got, want) < FP32_TOLERANCE


def test_fused_epilogue_refuses_what_it_cannot_compute():
    halves = [torch.randn(1, 4, 2, 2, 8)]
    with pytest.raises(ValueError, match=r"lam has shape \(3,\); expected \(\) or \(B, N, H\)"):
        diff_epilogue(halves, torch.ones(3))
    with pytest.raises(ValueError, match=r"weight has shape \(16,\); expected \(8,\)"):
        diff_epilogue(halves, torch.tensor(0.5), torch.ones(16))
    with pytest.raises(ValueError, match=r"expected \(B, N, 2, H, d\)"):
        diff_epilogue([torch.randn(1, 4, 3, 2, 8)], torch.tensor(0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["V1-B2-N40-H3-D16", "V2-B3-N20-H4-D16", "V1-d96-B1-N9-H2-D96"])
def test_fused_epilogue_in_bf16_matches_the_fp32_definition(name):
    """bf16 inputs, one rounding at the end: the fused kernel against the definition on the same bf16 inputs in fp32."""
    seed = zlib.crc32(name.encode())
    halves, lam, weight = inputs(CASES[name], "cuda", torch.bfloat16, seed)
    fused = run(diff_epilogue, halves, lam, weight, 0.7, seed)
    reference = run(diff_epilogue_naive, [h.float() for h in halves], lam,
                    weight.float() if weight is not None else None, 0.7, seed)
    for got, want in zip(fused, reference):
        assert rel_rms(got, want) < 1e-2  # bf16's half ulp is 2e-3 relative


@pytest.mark.gpu
def test_compiled_epilogue_matches_the_definition():
    """The torch.compile candidate (inductor on the GPU) against the definition, fp32."""
    from diff_transformer.models.attention.epilogue import diff_epilogue as dispatch

    seed = zlib.crc32(b"compile")
    halves, lam, weight = inputs(CASES["V1-B2-N40-H3-D16"], "cuda", torch.float32, seed)
    compiled = run(lambda *a: dispatch(*a, impl="compile"), halves, lam, weight, 0.7, seed)
    reference = run(diff_epilogue_naive, halves, lam, weight, 0.7, seed)
    for got, want in zip(compiled, reference):
        assert rel_rms(got, want) < 1e-5


def test_compiled_epilogue_compiles_once_for_every_layer(monkeypatch):
    """Each layer calls the compiled epilogue with its own output factor (1 - λ_init): one graph serves them all
    (a float argument would be a guard: a recompilation per layer, eager after dynamo's cache limit of 8)."""
    from diff_transformer.models.attention import epilogue

    compiled = torch.compile(diff_epilogue_naive, backend="eager", dynamic=False)
    monkeypatch.setattr(epilogue, "_compiled_epilogue", lambda: compiled)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    halves, lam, weight = inputs(CASES["V1-B2-N40-H3-D16"], "cpu", torch.float32, 5)
    for layer in range(12):
        scale = 1 - (0.8 - 0.6 * math.exp(-0.3 * layer))
        out = epilogue.diff_epilogue(halves, lam, weight, 1e-5, scale, impl="compile")
        torch.testing.assert_close(out, diff_epilogue_naive(halves, lam, weight, 1e-5, scale), rtol=1e-6, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
