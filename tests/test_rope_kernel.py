"""The fused RoPE kernel (kernels/rope) against megatron-core's unfused RoPE in fp64: output and gradient.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), through the launcher's
interpreter branch and through its GPU branch (an H100's tiles, ``gpu_target.simulate``); on a GPU the compiled kernel
runs, and bf16 and the model's hook are checked there."""

import contextlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from kernels import gpu_target
from kernels.rope import rotary

# Worst relative RMS error of the cases below in the interpreter, both branches: fp32 3.8e-8 (output and gradient),
# fp16 2.0e-4 (one rounding of the result); the tolerances are 5x those. A wrong sign or a swapped sine in either
# direction fails by orders of magnitude.
FP32_TOLERANCE = 2e-7
FP16_TOLERANCE = 1e-3

CASES = {  # (seq, batch, heads, head dim, rotated dims)
    "all-dims-S7-B2-H3-D16": (7, 2, 3, 16, 16),
    "partial-S5-B1-H4-D24-R16": (5, 1, 4, 24, 16),
    "830m-heads-S6-B2-H20-D96": (6, 2, 20, 96, 96),  # 20 heads: two head blocks on an H100's tiles
}


def rel_rms(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def megatron_freqs(positions, rotated, device):
    """[positions, 1, 1, rotated] fp32, as megatron-core's RotaryEmbedding lays them out (the angles twice)."""
    inverse = 1.0 / (10000 ** (torch.arange(0, rotated, 2, dtype=torch.float32) / rotated))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inverse)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)


def qkv_view(seq, batch, heads, d, generator, dtype, device):
    """The query as megatron-core's fused QKV projection gives it: a strided view of [s, b, heads, 3, d]."""
    mixed = torch.randn(seq, batch, heads, 3, d, generator=generator).to(dtype).to(device)
    return mixed[:, :, :, 0]


def run(fn, x, freqs, grad):
    x = x.detach().requires_grad_(True)
    y = fn(x, freqs)
    y.backward(grad)
    return y.detach(), x.grad


def reference(x, freqs, grad):
    """megatron-core's unfused RoPE in fp64 on the same inputs, cos and sin rounded to x's dtype as it rounds them."""
    seq = x.shape[0]
    rounded = freqs[:seq].double()
    if x.dtype == torch.float32:
        return run(_apply_rotary_pos_emb_bshd, x.double(), rounded, grad.double())
    # megatron-core rounds cos and sin to the input's dtype: the same rotation written out, with cos and sin so rounded
    cos, sin = torch.cos(rounded).to(x.dtype).double(), torch.sin(rounded).to(x.dtype).double()
    half = freqs.shape[-1] // 2

    def rotate(t, c, s, transpose):
        rot, rest = t[..., : 2 * half], t[..., 2 * half:]
        t1, t2 = rot[..., :half], rot[..., half:]
        c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
        if transpose:
            out = torch.cat((t1 * c1 + t2 * s2, t2 * c2 - t1 * s1), dim=-1)
        else:
            out = torch.cat((t1 * c1 - t2 * s1, t2 * c2 + t1 * s2), dim=-1)
        return torch.cat((out, rest), dim=-1)

    return rotate(x.double(), cos, sin, False), rotate(grad.double(), cos, sin, True)


@pytest.mark.parametrize("branch", ["interpreter", "sm_90"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_rope_matches_megatrons_unfused_rope(name, dtype, branch):
    seq, batch, heads, d, rotated = CASES[name]
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = qkv_view(seq, batch, heads, d, generator, dtype, "cpu")
    freqs = megatron_freqs(seq + 3, rotated, "cpu")  # longer than the sequence: its first rows are used
    grad = torch.randn(seq, batch, heads, d, generator=generator).to(dtype)
    with gpu_target.simulate(branch) if branch != "interpreter" else contextlib.nullcontext():
        y, dx = run(rotary, x, freqs, grad)
    want_y, want_dx = reference(x, freqs, grad)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert dx.shape == x.shape and dx.dtype == dtype
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else FP16_TOLERANCE
    assert rel_rms(y, want_y) < tolerance
    assert rel_rms(dx, want_dx) < tolerance
    assert torch.equal(y[..., rotated:], x[..., rotated:])  # passed through bit for bit


@pytest.mark.parametrize("branch", ["interpreter", "sm_90"])
def test_fused_rope_takes_each_sequences_own_positions(branch):
    """freqs [s, b, 1, d_rot]: positions restarting with every document (data.reset_position_ids, models.gpt's
    PackedGPTModel), a different position for each sequence of the micro-batch."""
    seq, batch, heads, d = 9, 3, 4, 16
    generator = torch.Generator().manual_seed(3)
    x = qkv_view(seq, batch, heads, d, generator, torch.float32, "cpu")
    positions = torch.stack([torch.arange(seq), torch.arange(seq) % 4, torch.arange(seq) % 5 + 2], dim=1)  # [s, b]
    inverse = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float()[..., None] * inverse
    freqs = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [s, b, 1, d]
    grad = torch.randn(seq, batch, heads, d, generator=generator)
    with gpu_target.simulate(branch) if branch != "interpreter" else contextlib.nullcontext():
        y, dx = run(rotary, x, freqs, grad)
    want_y, want_dx = reference(x, freqs, grad)
    assert rel_rms(y, want_y) < FP32_TOLERANCE and rel_rms(dx, want_dx) < FP32_TOLERANCE


def test_fused_rope_refuses_what_it_cannot_compute():
    x = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match=r"freqs has shape \(3, 1, 1, 8\); expected \[s >= 4, 1 or b = 1, 1, d_rot\]"):
        rotary(x, torch.zeros(3, 1, 1, 8))
    with pytest.raises(ValueError, match=r"freqs rotates 10 features; expected an even number of at most the head dim 8"):
        rotary(x, torch.zeros(4, 1, 1, 10))
    with pytest.raises(TypeError, match=r"freqs has dtype torch.float64; expected one of float32 \(megatron-core's\)"):
        rotary(x, torch.zeros(4, 1, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x has shape \(4, 2, 8\); expected \[s, b, heads, d\]"):
        rotary(torch.randn(4, 2, 8), torch.zeros(4, 1, 1, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_fused_rope_in_bf16_on_the_gpu(name):
    """The compiled kernel in bf16, and the model's hook (models/rope.py) taking it for CUDA tensors: against megatron's
    unfused RoPE in fp64 with cos and sin rounded to bf16 as megatron-core rounds them (bf16's half ulp is 2e-3)."""
    from diff_transformer.models.rope import fused_apply_rotary_pos_emb

    seq, batch, heads, d, rotated = CASES[name]
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = qkv_view(seq, batch, heads, d, generator, torch.bfloat16, "cuda")
    freqs = megatron_freqs(seq, rotated, "cuda")
    grad = torch.randn(seq, batch, heads, d, generator=generator).to(torch.bfloat16).cuda()
    want_y, want_dx = reference(x, freqs, grad)
    for fn in (rotary, fused_apply_rotary_pos_emb):
        y, dx = run(fn, x, freqs, grad)
        assert rel_rms(y, want_y) < 4e-3 and rel_rms(dx, want_dx) < 4e-3


def test_sm90_compile_check(tmp_path):
    """kernels/rope/check_compile.py under this Triton's real compiler: both directions, bf16 and fp32, the model's
    head dims and a partial rotation, each with the launcher's GPU tile, compile for sm_90 without a spill."""
    # the real compiler: neither the interpreter nor a simulated GPU (kernels/gpu_target.py)
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "DIFF_ATTN_SIMULATE_GPU")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run([sys.executable, "kernels/rope/check_compile.py"], cwd=Path(__file__).resolve().parent.parent,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.count(": ok,") == 16
