"""The launchers of the fused differential attention: the design and block configs of a call (tuning.py), its
buffers, grids and kernel constants, and the kernels of each pass in order.

Block sizes come from tuning.py; fp32 inputs run their products in TF32 on a GPU (fp32 accumulation and softmax
statistics), in full fp32 in the interpreter.
"""

import os

import torch
import triton

from kernels import gpu_target
from kernels.diff_attn import tuning
from kernels.diff_attn.backward import (
    _diff_attn_bwd_dq_kernel,
    _diff_attn_bwd_kv_kernel,
    _diff_attn_bwd_preprocess_kernel,
)
from kernels.diff_attn.forward import _diff_attn_fwd_kernel, _diff_attn_fwd_lse_kernel, _diff_attn_fwd_out_kernel
from kernels.diff_attn.tuning import BlockConfig

_INTERPRET = gpu_target.INTERPRET
_LOG2E = 1.4426950408889634

# Block sizes in the interpreter (no tuning there); small, so that the tests cross block edges.
_INTERPRET_CONFIGS = {
    "forward": BlockConfig(32, 16, 4, 1),
    "forward_lse": BlockConfig(32, 16, 4, 1),
    "forward_out": BlockConfig(16, 32, 4, 1),
    "preprocess": BlockConfig(16, 32, 4, 1),
    "dkdv": BlockConfig(16, 32, 4, 1),
    "dk": BlockConfig(16, 32, 4, 1),
    "dv": BlockConfig(32, 16, 4, 1),
    "dkdq": BlockConfig(16, 32, 4, 1),
    "dq": BlockConfig(16, 32, 4, 1),
}


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# dK/dV-kernel flags (COMPUTE_DK, COMPUTE_DV, ATOMIC_DQ) by kernel name.
_KEY_BLOCK_FLAGS = {"dkdv": (True, True, False), "dk": (True, False, False), "dv": (False, True, False),
                    "dkdq": (True, False, True)}
# The smallest BLOCK_M of any config: the norm weight's partial sums have a row for each query block of at most this.
_MIN_BLOCK_M = 16
# Chosen designs and configs by (device index, problem): selection runs once per shape class, a dict lookup after
# (configs also by the call's own values, looked up first).
_CHOSEN_DESIGNS = {}
_CHOSEN_CONFIGS = {}
_CONFIG_CACHE = {}


def _capability_major(device):
    """The GPU's compute capability major (the simulated GPU's); the interpreter's own branch plans as on Hopper (the
    table's main entries)."""
    if not gpu_target.gpu_branch():
        return 9
    return gpu_target.device_properties(device).capability[0]


def _design(q, value_dim, plan):
    """The explicit plan's design, else the table's for this GPU and these head dims (with DIFF_ATTN_DESIGN)."""
    if plan is not None:
        return plan.design
    key = (gpu_target.key(), q.device.index, q.shape[3], value_dim, os.environ.get(tuning.DESIGN_ENV, ""))
    design = _CHOSEN_DESIGNS.get(key)
    if design is None:
        design = tuning.default_design(_capability_major(q.device), q.shape[3], value_dim)
        _CHOSEN_DESIGNS[key] = design
    return design


def _descriptors_usable(*tensors):
    """TMA needs 16-byte aligned bases and row strides (each head's base is then aligned too) and unit last strides."""
    return all(
        x.data_ptr() % 16 == 0 and x.stride(-1) == 1 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
        for x in tensors
    )


def _use_descriptors(design, *tensors):
    if not design.descriptors or not _descriptors_usable(*tensors):
        return False
    # Tensor descriptors built inside a kernel live in a global scratch buffer that Triton asks the host for, through
    # an allocator kept per thread: the backward may run on autograd's device thread, so every launch checks.
    gpu_target.ensure_allocator()
    return True


def _dims(head_dim, value_dim, split_dims):
    block_d, block_d2 = tuning.dim_blocks(head_dim, split_dims)
    block_dv, block_dv2 = tuning.dim_blocks(value_dim, split_dims)
    return dict(HEAD_D=head_dim, VALUE_D=value_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, BLOCK_DV=block_dv,
                BLOCK_DV2=block_dv2)


def _kernel_constants(q, value_dim, causal, shared_k, design, use_desc):
    return dict(
        **_dims(q.shape[3], value_dim, design.split_dims),
        CAUSAL=causal,
        SHARED_K=shared_k,
        USE_DESC=use_desc,
        # The interpreter computes bf16 arithmetic wrongly, so bf16 tiles are widened to fp32 after loading there.
        UPCAST=_INTERPRET and q.dtype == torch.bfloat16,
        # fp32 inputs: TF32 products with fp32 accumulation on a GPU (IEEE fp32 dots are an order of magnitude slower
        # on tensor cores); the interpreter multiplies in full fp32, which the reference tests rely on. 16-bit inputs
        # ignore it.
        DOT_PRECISION="ieee" if _INTERPRET else "tf32",
    )


def _block_config(name, kernel, grid, args, constants, q, n_q, n_k, plan, design, value_dim):
    """The block config `kernel` launches with at this problem (kernels/diff_attn/tuning.py explains the choice)."""
    if plan is not None:
        return plan.configs[name]
    if not gpu_target.gpu_branch():
        return _INTERPRET_CONFIGS[name]
    # first by the call's own values, a lookup without building the problem (a launch's host time counts: six a call)
    call_key = ("call", gpu_target.key(), q.device.index, name, q.dtype, constants["HEAD_D"], value_dim,
                constants["SHARED_K"], constants["CAUSAL"], n_q, n_k, design.split_dims, constants["USE_DESC"],
                constants.get("HEAD_LOOP", False), os.environ.get(tuning.AUTOTUNE_ENV))
    config = _CHOSEN_CONFIGS.get(call_key)
    if config is not None:
        return config
    autotuning = tuning.autotune_enabled() and not _INTERPRET  # nothing to time in the interpreter
    problem = tuning.KernelProblem.of(name, _DTYPE_NAMES[q.dtype], constants["HEAD_D"], value_dim,
                                      constants["SHARED_K"], constants["CAUSAL"], n_q, n_k, design.split_dims,
                                      constants["USE_DESC"], constants.get("HEAD_LOOP", False))
    memo_key = (gpu_target.key(), q.device.index, problem, autotuning)
    config = _CHOSEN_CONFIGS.get(memo_key)
    if config is None:
        device = tuning.device_info(q.device)
        cache = None
        if autotuning:
            path = tuning.default_cache_path()
            cache = _CONFIG_CACHE.setdefault(path, tuning.ConfigCache(path))

        def bench(candidate):
            launch = lambda: kernel[grid(candidate)](*args, **constants, **candidate.launch_options())  # noqa: E731
            return triton.testing.do_bench(launch, warmup=5, rep=25, return_mode="median")

        config = tuning.select_config(problem, device, autotuning, cache, bench, triton.__version__)
        _CHOSEN_CONFIGS[memo_key] = config
    _CHOSEN_CONFIGS[call_key] = config
    return config


def _launch(name, kernel, grid, args, constants, q, n_q, n_k, plan, design, value_dim=None):
    """Launch `kernel` over `grid(config)` with the block config chosen for it (the problem's value dim: the
    kernel's VALUE_D unless the kernel has none); returns that config."""
    config = _block_config(name, kernel, grid, args, constants, q, n_q, n_k, plan, design,
                           constants["VALUE_D"] if value_dim is None else value_dim)
    if constants["USE_DESC"]:
        gpu_target.require_allocator()
    kernel[grid(config)](*args, **constants, **config.launch_options())
    return config


# Buffers the kernels write in full are poisoned with NaN under test, so that any element a kernel fails to write shows
# up: DIFF_ATTN_POISON=1, the default in the interpreter (tests/conftest.py sets it, so the GPU tests poison too).
# Elsewhere they are left uninitialised: a fill is a launch and a full write of the tensor, ten a layer's call.
POISON_ENV = "DIFF_ATTN_POISON"


def poison_setting() -> bool:
    """``DIFF_ATTN_POISON`` (0 or 1; unset: 1 in the interpreter, 0 on a GPU)."""
    value = os.environ.get(POISON_ENV, "1" if _INTERPRET else "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{POISON_ENV}={value!r}; expected 0 (buffers left uninitialised) or 1 (NaN-poisoned)")
    return value == "1"


_POISON = poison_setting()


def _written(shape, dtype, device) -> torch.Tensor:
    """A buffer the kernels write every element of: NaN-poisoned under test (``_POISON``), uninitialised otherwise."""
    if _POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


_PLACEHOLDERS = {}


def _placeholder(device) -> torch.Tensor:
    """An int32 argument the kernels never read (no document ids): one per device, not an allocation per launch."""
    device = torch.device(device)
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _PLACEHOLDERS[device]


def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _query_grid(n_q, batch, n_heads):
    return lambda config: (triton.cdiv(n_q, config.block_m), batch * n_heads)


def _document_args(documents, q):
    """The kernels' (DOC_Q, DOC_K, stride_docq, stride_dock) and DOCUMENTS: the queries' and keys' document ids
    ((B, Nq), (B, Nk) int32, rows contiguous), or an unread placeholder without documents."""
    if documents is None:
        placeholder = _placeholder(q.device)
        return (placeholder, placeholder, 0, 0), dict(DOCUMENTS=False)
    q_ids, k_ids = documents
    return (q_ids, k_ids, q_ids.stride(0), k_ids.stride(0)), dict(DOCUMENTS=True)


def _diff_attn_lse(q, k, value_dim, causal, causal_offset, softmax_scale, shared_k, design, plan, documents=None):
    """The two-pass forward's first pass: lse (B, 2H, Nq) fp32, natural log. The kernel reads no V; `value_dim`
    picks the table entry of the problem it belongs to. `documents`: (query ids, key ids) or None."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k = two_h // 2, k.shape[1]
    group = n_heads // (k.shape[2] if shared_k else k.shape[2] // 2)
    lse = _written((batch, two_h, n_q), torch.float32, q.device)
    constants = _kernel_constants(q, q.shape[3], causal, shared_k, design, _use_descriptors(design, q, k))
    for name in ("VALUE_D", "BLOCK_DV", "BLOCK_DV2"):
        del constants[name]
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    args = (q, k, lse, *_strides3(q), *_strides3(k), n_heads, group, n_q, n_k, causal_offset,
            softmax_scale * _LOG2E, *document_args)
    _launch("forward_lse", _diff_attn_fwd_lse_kernel, _query_grid(n_q, batch, n_heads), args, constants, q, n_q,
            n_k, plan, design, value_dim)
    return lse


def _diff_attn_forward(q, k, v, lam_rows, norm_weight, causal, causal_offset, softmax_scale, shared_k, norm_eps,
                       output_scale, design, plan, lse=None, out_dtype=None, documents=None):
    """Launch the forward kernels of `design`; returns out (B, Nq, H, Dv), the pre-norm y (out itself without an
    epilogue), lse (B, 2H, Nq) fp32 natural log and rstd (B, H, Nq) fp32 (None without a norm weight).

    With `lse` given the two-pass forward's output pass alone runs with it (context-parallel pieces)."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    norm = norm_weight is not None
    epilogue = norm or output_scale != 1.0
    out = _written((batch, n_q, n_heads, value_dim), out_dtype or q.dtype, q.device)
    y = _written(out.shape, out.dtype, q.device) if epilogue else out
    rstd = _written((batch, n_heads, n_q), torch.float32, q.device) if norm else None
    constants = _kernel_constants(q, value_dim, causal, shared_k, design, _use_descriptors(design, q, k, v))
    constants.update(EPILOGUE=epilogue, NORM=norm)
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    grid = _query_grid(n_q, batch, n_heads)
    tail = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(out),
            n_heads, n_heads // n_kv_groups, n_q, n_k, causal_offset, softmax_scale * _LOG2E, output_scale, norm_eps,
            *document_args)
    if design.forward == "twopass" or lse is not None:
        if lse is None:
            lse = _diff_attn_lse(q, k, value_dim, causal, causal_offset, softmax_scale, shared_k, design, plan,
                                 documents)
        args = (q, k, v, lam_rows, lse, out, y, rstd if norm else lse, norm_weight if norm else lse, *tail)
        _launch("forward_out", _diff_attn_fwd_out_kernel, grid, args, constants, q, n_q, n_k, plan, design)
    else:
        lse = _written((batch, two_h, n_q), torch.float32, q.device)
        args = (q, k, v, lam_rows, out, y, lse, rstd if norm else lse, norm_weight if norm else lse, *tail)
        _launch("forward", _diff_attn_fwd_kernel, grid, args, constants, q, n_q, n_k, plan, design)
    return out, y, lse, rstd


def _diff_attn_preprocess(dout, q, k, v, lam_rows, y, lse, rstd, norm_weight, causal, causal_offset, softmax_scale,
                          shared_k, output_scale, design, plan, documents=None):
    """The epilogue's backward and δ: returns dy (dout itself without an epilogue), delta (B, 2H, Nq), r2 (B, H, Nq)
    and the norm weight's partial sums (rows, Dv) fp32 (None without a norm weight)."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    norm = norm_weight is not None
    epilogue = norm or output_scale != 1.0
    dy = _written(y.shape, y.dtype, y.device) if epilogue else dout
    delta = _written((batch, two_h, n_q), torch.float32, q.device)
    r2 = _written((batch, n_heads, n_q), torch.float32, q.device)
    # one row for each query-block program, sized for the smallest block: the rows of the config launched are
    # returned, each written in full (no fill); without a norm weight the kernel writes none (the LSE stands in)
    dw_partial = _written((batch * n_heads * triton.cdiv(n_q, _MIN_BLOCK_M), value_dim), torch.float32,
                          q.device) if norm else lse
    constants = _kernel_constants(q, value_dim, causal, shared_k, design, _use_descriptors(design, q, k, v))
    constants.update(EPILOGUE=epilogue, NORM=norm)
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    args = (
        q, k, v, lam_rows, y, dout, dy, lse, rstd if norm else lse, norm_weight if norm else lse, delta, r2,
        dw_partial, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(y),
        *_strides3(dout), n_heads, n_heads // n_kv_groups, n_q, n_k, causal_offset, softmax_scale * _LOG2E,
        output_scale, *document_args,
    )
    config = _launch("preprocess", _diff_attn_bwd_preprocess_kernel, _query_grid(n_q, batch, n_heads), args,
                     constants, q, n_q, n_k, plan, design)
    if not norm:
        return dy, delta, r2, None
    return dy, delta, r2, dw_partial[:batch * n_heads * triton.cdiv(n_q, config.block_m)]


def _diff_attn_grads(dy, q, k, v, lam_rows, lse, delta, causal, causal_offset, softmax_scale, shared_k, design,
                     plan, grad_dtype=None, documents=None):
    """dq, dk, dv from dy, the LSE and δ, by the design's backward kernels (in `grad_dtype`, default the inputs')."""
    batch, n_q, two_h, _ = q.shape
    n_heads, n_k, n_kv_groups, value_dim = two_h // 2, k.shape[1], v.shape[2], v.shape[3]
    group = n_heads // n_kv_groups
    grad_dtype = grad_dtype or q.dtype
    dk = _written(k.shape, grad_dtype, k.device)
    dv = _written(v.shape, grad_dtype, v.device)
    if design.backward == "atomic":
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq = _written(q.shape, grad_dtype, q.device)
    constants = _kernel_constants(q, value_dim, causal, shared_k, design, _use_descriptors(design, q, k, v, dy))
    document_args, document_flag = _document_args(documents, q)
    constants.update(document_flag)
    qk_scale = softmax_scale * _LOG2E
    common_strides = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(lam_rows), *_strides3(dy))
    key_grid = lambda config: (triton.cdiv(n_k, config.block_n), batch * n_kv_groups)  # noqa: E731
    kv_args = (
        q, k, v, lam_rows, dy, lse, delta, dk, dv, dq,
        *common_strides, *_strides3(dk), *_strides3(dv), *_strides3(dq),
        n_heads, n_kv_groups, group, n_q, n_k, causal_offset, qk_scale, softmax_scale, *document_args,
    )
    kv_kernels = [name for name in tuning.BACKWARD_DESIGNS[design.backward] if name in _KEY_BLOCK_FLAGS]
    for name in kv_kernels:
        compute_dk, compute_dv, atomic_dq = _KEY_BLOCK_FLAGS[name]
        flags = dict(COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv, ATOMIC_DQ=atomic_dq, HEAD_LOOP=group > 1)
        _launch(name, _diff_attn_bwd_kv_kernel, key_grid, kv_args, constants | flags, q, n_q, n_k, plan, design)
    if design.backward == "atomic":
        return dq.to(grad_dtype), dk, dv
    dq_args = (
        q, k, v, lam_rows, dy, lse, delta, dq, *common_strides, *_strides3(dq),
        n_heads, group, n_q, n_k, causal_offset, qk_scale, softmax_scale, *document_args,
    )
    _launch("dq", _diff_attn_bwd_dq_kernel, _query_grid(n_q, batch, n_heads), dq_args, constants, q, n_q, n_k, plan,
            design)
    return dq, dk, dv


def _lam_rows(lam, batch, n_q, n_heads):
    """λ as a (B, Nq, H) view; stride 0 along the dimensions it is shared over."""
    if lam.dim() == 3:
        return lam
    return lam.reshape(1, 1, -1).expand(batch, n_q, n_heads)
