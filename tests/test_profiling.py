"""trainer.profile_step's analysis of where a step's time goes: the GPU's idle gaps put on the operator that launched
the kernel after each (with its module and backward node), the host syncs by operator, module ranges that name the
place without changing the kinds of work. The GPU analysis runs here on profiler events built as torch builds them
from a CUDA trace; a GPU test profiles a real step with a sync in it."""

import contextlib
import inspect
import json
import warnings

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from diff_transformer.training.host_reads import HostReads
from diff_transformer.training.profiling import (OUTSIDE_OPERATORS, Launchers, StepProfiler, breakdown, device_fills,
                                                 host_syncs, idle_gaps, launch_site, zero_fills)


def cpu_op(id, name, start, end, parent=None, linked=0):
    event = FunctionEvent(id=id, name=name, thread=1, start_us=start, end_us=end, linked_correlation_id=linked)
    if parent is not None:
        event.set_cpu_parent(parent)
    return event


def kernel(name, start, end, launcher, annotation=False, correlation=None, metadata=None):
    return FunctionEvent(id=correlation or 1000 + start, name=name, thread=7, start_us=start, end_us=end,
                         device_type=DeviceType.CUDA, linked_correlation_id=launcher, is_user_annotation=annotation,
                         metadata_json=metadata)


def trace():
    """A forward in a module range (a full launched by a module's Python, then a GEMM), a backward node's kernel,
    an .item() that syncs, the profiler's own synchronisation, and the profiler's range projected on the GPU."""
    step = cpu_op(1, "ProfilerStep#3", 0, 500)
    module = cpu_op(2, "module: DiffCoreAttention", 10, 200, step)
    full = cpu_op(3, "aten::full", 20, 30, module)
    mm = cpu_op(4, "aten::mm", 40, 60, module)
    node = cpu_op(5, "autograd::engine::evaluate_function: DiffAttnFunctionBackward", 210, 300, step)
    bwd = cpu_op(6, "DiffAttnFunctionBackward", 215, 290, node)
    item = cpu_op(7, "aten::_local_scalar_dense", 310, 400, cpu_op(8, "aten::item", 305, 405, step))
    events = [step, module, full, mm, node, bwd, item, item.cpu_parent]
    events += [cpu_op(20, "cudaLaunchKernel", 21, 22, full, linked=3),
               cpu_op(21, "cudaLaunchKernel", 41, 42, mm, linked=4),
               cpu_op(22, "cudaStreamSynchronize", 320, 390, item, linked=0),
               cpu_op(23, "cudaDeviceSynchronize", 450, 480)]
    events += [
        kernel("vectorized_elementwise_kernel", 100, 110, 3),   # starts the busy time
        kernel("nvjet_sm90_gemm", 130, 180, 4),                 # after a 20 us gap: aten::mm in the module
        kernel("memcpy DtoD", 150, 170, 4),                     # inside the GEMM: no gap, no extra busy time
        kernel("_diff_attn_bwd_kv_kernel", 250, 290, 6),        # after 70 us: the backward node's launch
        kernel("Memcpy DtoH", 300, 305, 7),                     # after 10 us: the .item()
        kernel("_diff_attn_bwd_dq_kernel", 340, 350, 6),        # after 35 us: launched late (host waited on the sync)
        kernel("ProfilerStep#3", 0, 500, 0, annotation=True),   # the profiler's range on the GPU: not work
    ]
    return events


def test_idle_gaps_are_put_on_the_operator_that_launched_the_next_kernel():
    busy, gaps = idle_gaps(trace())
    assert busy == pytest.approx((10 + 50 + 40 + 5 + 10) * 1e-6)
    by_site = {g["site"]: g for g in gaps}
    assert set(by_site) == {"aten::mm in DiffCoreAttention",
                            "DiffAttnFunctionBackward in DiffAttnFunctionBackward (backward)",
                            "aten::_local_scalar_dense"}
    backward = by_site["DiffAttnFunctionBackward in DiffAttnFunctionBackward (backward)"]
    assert backward["count"] == 2 and backward["seconds"] == pytest.approx(105e-6) and backward["largest_ms"] == 0.07
    assert by_site["aten::mm in DiffCoreAttention"]["seconds"] == pytest.approx(20e-6)
    assert [g["site"] for g in gaps][0] == backward["site"]  # largest total first


def test_host_syncs_name_the_operator_and_keep_the_profilers_own_apart():
    assert host_syncs(trace()) == [{"site": "aten::_local_scalar_dense", "count": 1},
                                   {"site": OUTSIDE_OPERATORS, "count": 1}]


def test_the_throughput_report_says_where_the_gpu_waited():
    """benchmarks/train_throughput.py's lines for a GPU profile: the median step's idle estimated from the busy time
    (and called an estimate), the largest gaps and the syncs with their sites."""
    from benchmarks.train_throughput import idle_lines

    busy, gaps = idle_gaps(trace())
    profile = {"device": "cuda", "step_time_s": 600e-6, "busy_s": busy, "idle_gaps": gaps, "host_syncs": host_syncs(trace()),
               "sync_sites": [{"site": "diff_transformer/training/trainer.py:631", "count": 1}]}
    text = "\n".join(idle_lines([{"label": "diff (triton)", "step_time_s": 500e-6, "profile": profile}]))
    assert "estimate" in text
    assert "busy 0.1 ms of the profiled step's 0.6; idle in a median step ≈ 0.4 ms of 0.5 (77.0%)" in text
    assert "DiffAttnFunctionBackward in DiffAttnFunctionBackward (backward) 0.1 ms (2 gaps, largest 0.07 ms)" in text
    assert "aten::_local_scalar_dense ×1" in text and "trainer.py:631 ×1" in text
    assert idle_lines([{"label": "cpu", "step_time_s": 1.0, "profile": {**profile, "device": "cpu"}}]) == []


def fill_trace():
    """A backward step's memsets and fill kernels, each launcher found in another way: a memset the profiler linked to
    aten::zero_ (inside aten::zeros in the embedding's backward node); one linked to nothing whose cudaMemsetAsync (of
    the same CUPTI correlation id, which repeats an operator's id) lies under cuDNN's attention backward; one whose
    runtime call has no parent (another thread's id) but lies in the time span of aten::full; a FillFunctor<int>
    and an inductor kernel that only fills, linked to aten::fill_; a memset with no runtime call recorded."""
    node = cpu_op(1, "autograd::engine::evaluate_function: EmbeddingBackward0", 0, 100)
    zeros = cpu_op(2, "aten::zeros", 10, 40, cpu_op(9, "aten::embedding_dense_backward", 5, 90, node))
    zero_ = cpu_op(3, "aten::zero_", 20, 30, zeros)
    cudnn = cpu_op(4, "aten::_cudnn_attention_backward", 110, 200,
                   cpu_op(10, "autograd::engine::evaluate_function: CudnnAttentionBackward0", 105, 205))
    full = cpu_op(5, "aten::full", 210, 260)
    fill = cpu_op(6, "aten::fill_", 220, 250, full)
    events = [node, zeros, zeros.cpu_parent, zero_, cudnn, cudnn.cpu_parent, full, fill,
              cpu_op(4001, "cudaMemsetAsync", 21, 22, zero_, linked=3),
              cpu_op(4, "cudaMemsetAsync", 120, 121, cudnn),      # CUPTI's id 4 is also the cuDNN op's id
              cpu_op(4003, "cudaMemsetAsync", 230, 231),           # no parent: found by its time span
              cpu_op(4004, "cudaLaunchKernel", 232, 233, fill, linked=6)]
    events += [
        kernel("Memset (Device)", 300, 310, 3, correlation=4001, metadata='"bytes": 4096, "stream": 7'),
        kernel("Memset (Device)", 320, 322, 0, correlation=4, metadata='"bytes": 512'),
        kernel("Memset (Device)", 330, 331, 0, correlation=4003),
        kernel("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, ...>", 340, 344, 6,
               correlation=4004),
        kernel("Memset (Device)", 350, 351, 0, correlation=4005),  # launched where the profiler saw nothing
        kernel("nvjet_sm90_gemm", 360, 400, 0, correlation=4006),  # ... before a GEMM on its stream
        kernel("triton_poi_fused_zeros_0", 410, 412, 6, correlation=4007),  # inductor's kernel that only fills
        kernel("triton_poi_fused_add_zeros_1", 420, 430, 6, correlation=4008),  # a fill fused into other work
    ]
    return events


def test_memsets_and_fills_are_counted_on_the_operator_that_launched_them():
    launchers = Launchers(fill_trace())
    rows = {(r["kind"], r["site"], r["chain"]): r for r in device_fills(fill_trace(), launchers)}
    embedding = rows[("memset", "aten::embedding_dense_backward in EmbeddingBackward0 (backward)",
                      "aten::embedding_dense_backward > aten::zeros > aten::zero_")]
    assert (embedding["count"], embedding["bytes"], embedding["ms"]) == (1, 4096, pytest.approx(0.010))
    cudnn = rows[("memset", "aten::_cudnn_attention_backward in CudnnAttentionBackward0 (backward)",
                  "aten::_cudnn_attention_backward")]
    assert (cudnn["count"], cudnn["bytes"]) == (1, 512)
    assert rows[("memset", "aten::full", "aten::full > aten::fill_")]["count"] == 1  # the span's innermost operator
    assert rows[("fill", "aten::full", "aten::full > aten::fill_")]["ms"] == pytest.approx(0.004 + 0.002)
    assert rows[("memset", "Memset (Device) (launcher not recorded)", "")]["next"] == {"name": "nvjet_sm90_gemm",
                                                                                    "count": 1}
    assert embedding["next"] == {"name": "Memset (Device)", "count": 1}
    assert len(rows) == 5  # the GEMM is neither
    assert launchers.how == {"linked": 3, "runtime call": 1, "time span": 1, "not recorded": 1}
    assert launchers.misses == [{"name": "Memset (Device)", "id": 4005, "linked_correlation_id": 0,
                                 "runtime_call": None}]
    # the gaps find the same launchers: before the cuDNN memset (10 us), after the last memset (9 us, none recorded)
    _, gaps = idle_gaps(fill_trace())
    by_site = {g["site"]: g["seconds"] for g in gaps}
    assert by_site["aten::_cudnn_attention_backward in CudnnAttentionBackward0 (backward)"] == pytest.approx(10e-6)
    assert by_site["nvjet_sm90_gemm (launcher not recorded)"] == pytest.approx(9e-6)


def test_the_throughput_report_counts_the_memsets_by_launcher():
    from benchmarks.train_throughput import fill_lines

    fills = device_fills(fill_trace())
    profile = {"device": "cuda", "fills": fills, "fill_totals": {"memset": {"count": 4, "ms": 0.014},
                                                                 "fill": {"count": 1, "ms": 0.004}},
               "fill_launchers": {"how": {"linked": 2, "runtime call": 1, "time span": 1, "not recorded": 1}}}
    text = "\n".join(fill_lines([{"label": "vanilla (sdpa)", "profile": profile}], micro_batches=2))
    assert "vanilla (sdpa): 4 memsets (0.01 ms) and 1 fill kernels (0.00 ms) in the profiled step" in text
    assert ("| vanilla (sdpa) | memset | aten::embedding_dense_backward in EmbeddingBackward0 (backward) | "
            "aten::embedding_dense_backward > aten::zeros > aten::zero_ | 1 | 0.5 | 0.004 | 0.010 | Memset (Device) ×1 |"
            ) in text
    assert "launchers: 2 linked by the profiler, 1 by the runtime call, 1 by time span, 1 not recorded" in text
    assert ("| vanilla (sdpa) | memset | Memset (Device) (launcher not recorded) |  | 1 | 0.5 | – | 0.001 "
            "| nvjet_sm90_gemm ×1 |") in text
    assert fill_lines([{"label": "cpu", "profile": {**profile, "device": "cpu"}}], micro_batches=2) == []


def embedding_then_zeros(embedding, tokens):
    out = embedding(tokens)
    return out + torch.zeros(out.shape)


def test_zero_fills_of_a_cpu_profile_name_the_python_call_and_the_backward_node():
    """A real CPU profile with stacks: torch.zeros called here, and the dense gradient the embedding's backward
    zero-fills, named by its node and by the Python line of its forward; fills inside another fill count once."""
    embedding, tokens = torch.nn.Embedding(50, 8), torch.randint(0, 50, (4, 6))
    with torch.profiler.profile(with_stack=True, record_shapes=True) as profile:
        embedding_then_zeros(embedding, tokens).sum().backward()
    rows = {(r["site"], r["chain"]): r for r in zero_fills(profile.events())}
    here = f"tests/test_profiling.py({inspect.getsourcelines(embedding_then_zeros)[1]}): embedding_then_zeros"
    assert rows[(f"aten::zeros ({here})", "aten::zeros > aten::zero_")] == {
        "site": f"aten::zeros ({here})", "chain": "aten::zeros > aten::zero_", "count": 1, "elements": 4 * 6 * 8}
    backward = [r for (site, chain), r in rows.items() if "EmbeddingBackward0 (backward)" in site
                and chain.endswith("aten::embedding_dense_backward > aten::zeros > aten::zero_")]
    assert len(backward) == 1 and backward[0]["count"] == 1 and backward[0]["elements"] == 50 * 8, rows
    assert f"(forward at {here})" in backward[0]["site"]
    assert all(not r["chain"].endswith("aten::zero_ > aten::fill_") for r in rows.values())


class FooAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.sigmoid(self.proj(x)) * 2.0


def test_module_ranges_name_the_place_but_not_the_kind_of_work(tmp_path):
    """On a CPU: each module call is a range around its operators, launch_site names the innermost, and neither the
    ranges' own time nor their names change the kinds of work (a multiply in FooAttention is not attention)."""
    model, x = torch.nn.Sequential(FooAttention(), torch.nn.ReLU()), torch.randn(8, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="an unrelated warning"):  # shown once the step ends
        with StepProfiler() as profiler:
            model(x).sum().backward()
            warnings.warn("Warning: called a synchronizing CUDA operation")  # torch's text, as on a GPU
            sync_line = inspect.currentframe().f_lineno - 1
            warnings.warn("an unrelated warning")
    events = profiler._profile.events()
    names = {e.name for e in events}
    assert {"module: Sequential", "module: FooAttention", "module: Linear", "module: ReLU"} <= names
    sites = {launch_site(e) for e in events if e.name in ("aten::addmm", "aten::sigmoid", "aten::relu")}
    assert sites == {"aten::addmm in Linear", "aten::sigmoid in FooAttention", "aten::relu in ReLU"}
    seconds, top = breakdown(events, 1.0, "cpu")
    assert seconds["attention"] == 0.0 and seconds["GEMM"] > 0 and seconds["other elementwise"] > 0
    assert not any(name.startswith("module: ") for name, _, _ in top)
    # the hooks are gone after the step: a later forward records no ranges
    with torch.profiler.profile() as later:
        model(x)
    assert not any(e.name.startswith("module: ") for e in later.events())
    # real events carry what the GPU analysis reads (on a CPU no device work: nothing busy, no gaps)
    assert idle_gaps(events) == (0.0, []) and host_syncs(events) == []
    record = json.loads(open(profiler.write(str(tmp_path), 3, 1.0)).read())
    assert record["device"] == "cpu" and record["busy_s"] == 0.0 and record["idle_gaps"] == []
    assert record["fills"] == [] and record["fill_totals"]["memset"] == {"count": 0, "ms": 0.0}
    assert all(row["count"] > 0 for row in record["host_fills"])  # the CPU kernels' own fills, by call site
    assert record["sync_sites"] == [{"site": f"tests/test_profiling.py:{sync_line}", "count": 1}]


@pytest.mark.parametrize("kind, backend", [("diff", "sdpa"), ("diff", "triton"), ("diff", "combined"),
                                           ("diff_v2", "sdpa"), ("vanilla", "sdpa")])
def test_a_layers_forward_and_backward_read_nothing_on_the_host(kind, backend, megatron_single_process):
    """The model's forward and backward (every fusion on; DIFF's fused kernel through its GPU launch branch, as on an
    H100) call no operator that reads values on the host, so on a GPU they never wait for it: a step's syncs are the
    trainer's own (the loss, the gradient norm)."""
    from omegaconf import OmegaConf

    from diff_transformer.config import Config
    from diff_transformer.models.gpt import build_model_chunk
    from kernels import gpu_target

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "debug", "attention": kind, "attention_backend": backend, "num_layers": 2,
                  "hidden_size": 128, "num_heads": 2, "ffn_hidden_size": 352, "seq_length": 64},
        "trainer": {"max_steps": 2, "global_batch_size": 2, "fusions": "on"}}))
    model = build_model_chunk(cfg, 128)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(2, 64)
    with gpu_target.simulate("sm_90") if backend == "triton" else contextlib.nullcontext(), HostReads() as reads:
        model(tokens, positions, None, labels=tokens).mean().backward()
    assert not reads.reads, str(reads)
    assert all(p.grad is not None or not p.requires_grad for p in model.parameters())
    # the detector sees a host read
    with HostReads() as reads:
        torch.ones(2).sum().item()
    assert len(reads.reads) == 1


@pytest.mark.gpu
def test_a_profiled_gpu_step_finds_its_sync_and_idle(tmp_path):
    """On a GPU: an .item() between matrix products is a host sync, found at its Python line and on its operator,
    and the device waits after it (a gap, put on a launch site); a torch.zeros's fill is put on it."""
    model = torch.nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(4096, 1024, device="cuda")
    with StepProfiler() as profiler:
        y = model(model(x))
        scale = float(y.abs().max())  # the sync
        model(y / scale + torch.zeros(4096, 1024, device="cuda")).sum().backward()  # a zero-fill
        profiler.synchronize()
    path = profiler.write(str(tmp_path), 1, 0.1)
    record = json.loads(open(path).read())
    syncs = {s["site"]: s["count"] for s in record["host_syncs"]}
    assert any("_local_scalar_dense" in site for site in syncs), record["host_syncs"]
    assert any(s["site"].startswith("tests/test_profiling.py:") for s in record["sync_sites"]), record["sync_sites"]
    assert 0 < record["busy_s"] < record["step_time_s"] and record["idle_gaps"], record
    assert sum(g["seconds"] for g in record["idle_gaps"]) < record["step_time_s"], record["idle_gaps"]
    # the zero-fill (a memset or a fill kernel, by torch version) is found on the torch.zeros that launched it
    zeros = [f for f in record["fills"] if f["site"].startswith("aten::zeros (tests/") or f["site"] == "aten::zeros"]
    assert zeros and zeros[0]["chain"] == "aten::zeros > aten::zero_", (record["fills"], record["fill_launchers"])
