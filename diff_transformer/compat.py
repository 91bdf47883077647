"""Every workaround the framework applies to megatron-core 0.16.1, in one module, behind one version guard.

Two kinds:

- **CPU patches** (:func:`apply_cpu_patches`). megatron-core assumes a CUDA device in a few dozen places. On a
  CPU-only machine (laptops, CI) we patch exactly those places so that the same model, schedules, optimizer and
  checkpoint code run there, which is what lets tensor and pipeline parallelism, checkpoints and the optimizer be
  tested without a GPU. Nothing of this kind is applied when CUDA is available. Call it once, before building
  models; it is idempotent.
- **DeepSpeed on a CPU** (:func:`apply_deepspeed_cpu_patches`, engine=deepspeed): DeepSpeed's CPU accelerator
  compiles a shared-memory all-reduce op when its communication backend starts; gloo reduces the same tensors. Like
  the CPU patches, applied only without CUDA.
- **Speed workarounds** (:func:`apply_grad_norm_patches`, :func:`fuse_torch_adamw`, :func:`install_fused_rope`,
  :func:`install_fused_cross_entropy`, :func:`install_weight_gradient_accumulation`,
  :func:`skip_tied_embedding_dummy_gradient`): where megatron-core without TransformerEngine or Apex falls back to
  slow paths (a host sync per parameter tensor in the gradient norm, torch's foreach AdamW, no fused RoPE, a native
  fused cross-entropy that keeps an fp32 softmax and rounds an fp32 model's gradient to bf16, a separate add of each
  weight gradient into the fp32 main gradient, a zero-filled dummy gradient of the tied embedding), on any device.
- **Compiled layers** (:func:`call_core_attention_eagerly`, :func:`resolve_default_tp_group_quietly`,
  ``trainer.compile``, any device): where megatron-core's TransformerLayer forward stops torch.compile from keeping one
  graph on each side of the core attention.
- **DeepSpeed's NVMe optimizer resume** (:func:`restore_nvme_optimizer_memory_state`, any device): its load of a
  ZeRO-3 checkpoint with the optimizer on NVMe restores only the swapped tensors.
- **Checkpoint workarounds** (:func:`fork_checkpoint_results_queue`, :func:`initialise_adam_state`,
  :func:`adam_step_left_out_of_param_copies`, :func:`unshare_adam_step_tensors`): defects of megatron-core's
  distributed-optimizer checkpointing on the torch-Adam path and of its writer start-up, needed on any device.
- **Safe checkpoint reading** (:func:`read_checkpoint_metadata_with`, :func:`zero_to_fp32_loads_with`): where
  megatron-core, torch's distributed checkpoint and DeepSpeed unpickle a checkpoint's files with no restriction
  (``pickle.load``, ``weights_only=False``), so that no file can run code when loaded.

Each names the megatron-core lines (paths relative to ``megatron/core``) it answers, and :data:`PATCH_SITES` lists
what each one assumes about the installed megatron-core; ``tests/test_compat.py`` checks every site, so an upgrade
that moves one fails loudly instead of silently running unpatched code. :func:`check_megatron_core_version` refuses
any other megatron-core version before a patch is applied.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import inspect
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

_APPLIED = False
# The release every workaround below was written against (and constraints.txt pins).
MEGATRON_CORE_VERSION = "0.16.1"


def installed_megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def check_megatron_core_version() -> None:
    """Raise RuntimeError unless the installed megatron-core is the release these workarounds were written for."""
    installed = installed_megatron_core_version()
    if installed != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megatron-core {installed} is installed, but diff_transformer.compat patches megatron-core "
            f"{MEGATRON_CORE_VERSION} (the version constraints.txt pins); install megatron-core=={MEGATRON_CORE_VERSION}, "
            "or check every site in diff_transformer.compat.PATCH_SITES against the new release and update it"
        )


@dataclass(frozen=True)
class PatchSite:
    """One thing a workaround assumes about megatron-core: ``module`` (and ``attribute``, dotted) exist, and when
    ``needle`` is given, the source of that object contains it (the line the workaround answers)."""

    workaround: str
    module: str
    attribute: Optional[str] = None
    needle: Optional[str] = None

    def problem(self) -> Optional[str]:
        """None when the site is as assumed; otherwise what differs, in words."""
        if self.module.startswith("deepspeed"):
            select_deepspeed_accelerator()
        try:
            obj = importlib.import_module(self.module)
        except ImportError as err:
            return f"{self.workaround}: cannot import {self.module}: {err}"
        for part in (self.attribute or "").split(".") if self.attribute else []:
            if not hasattr(obj, part):
                return f"{self.workaround}: {self.module} has no {self.attribute}"
            obj = getattr(obj, part)
        if self.needle is not None:
            try:
                source = inspect.getsource(obj)
            except (TypeError, OSError) as err:
                return f"{self.workaround}: no source for {self.module}.{self.attribute}: {err}"
            if self.needle not in source:
                where = f"{self.module}.{self.attribute}" if self.attribute else self.module
                return f"{self.workaround}: {where} no longer contains {self.needle!r}"
        return None


_MODULES_WITH_LITERAL_CUDA = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rope_utils",
)

PATCH_SITES = (
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add",
              "torch.cuda.get_rng_state()"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "_MODEL_PARALLEL_RNG_TRACKER_NAME"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "initialize_rng_tracker",
              "CudaRNGStatesTracker"),
    PatchSite("rng tracker", "megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed",
              "torch.cuda.manual_seed"),
    PatchSite("current_device", "megatron.core.models.common.embeddings.rotary_pos_embedding", None,
              "torch.cuda.current_device()"),
    PatchSite("current_device", "megatron.core.utils", "GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device()"),
    PatchSite("tied embedding .cuda()", "megatron.core.models.common.language_module.language_module", None,
              "weight.data.cuda()"),
    PatchSite("ShardedTensor.init_data", "megatron.core.dist_checkpointing.mapping", "ShardedTensor.init_data"),
    PatchSite("cuda type checks", "megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
              "'torch.cuda.FloatTensor'"),
    PatchSite("cuda type checks", "megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    PatchSite("cuda type checks", "megatron.core.optimizer.distrib_optimizer",
              "DistributedOptimizer._build_model_and_main_param_groups", "'torch.cuda.FloatTensor'"),
    PatchSite("checkpoint writer queue", "megatron.core.dist_checkpointing.strategies.filesystem_async",
              "_get_write_results_queue", 'get_context("spawn")'),
    PatchSite("checkpoint writer queue", "megatron.core.dist_checkpointing.strategies.filesystem_async",
              "_results_queue"),
    # not workarounds: the checkpoint reader that admits only the format's classes, and weights_only for its bytes
    PatchSite("checkpoint metadata reader", "megatron.core.dist_checkpointing.strategies.torch",
              "_get_filesystem_reader", "CachedMetadataFileSystemReader(checkpoint_dir)"),
    PatchSite("checkpoint metadata reader", "megatron.core.dist_checkpointing.strategies.torch",
              "TorchDistLoadShardedStrategy.load", "_get_filesystem_reader(checkpoint_dir, cache_metadata=True)"),
    PatchSite("checkpoint metadata reader", "megatron.core.dist_checkpointing.strategies.torch", "MCoreLoadPlanner"),
    PatchSite("checkpoint metadata reader", "torch.distributed.checkpoint.default_planner",
              "DefaultLoadPlanner.load_bytes", "torch.load(value, weights_only=False)"),
    PatchSite("checkpoint metadata reader", "torch.distributed.checkpoint.filesystem", "FileSystemReader.read_metadata",
              "pickle.load(metadata_file)"),
    PatchSite("checkpoint metadata reader", "deepspeed.utils.zero_to_fp32", "parse_model_states",
              "torch.load(file, map_location=device, weights_only=False)"),
    PatchSite("checkpoint metadata reader", "deepspeed.utils.zero_to_fp32", "parse_optim_states",
              "torch.load(f, map_location=device, mmap=True, weights_only=False)"),
    # not a workaround: training.checkpoint.record_written_files wraps the writer's save function to record each
    # rank's files (size, crc32) for the checkpoint's manifest, where they are written
    PatchSite("checkpoint file records", "megatron.core.dist_checkpointing.strategies.filesystem_async",
              "FileSystemWriterAsync.get_save_function_and_args", "self.write_preloaded_data_multiproc"),
    PatchSite("checkpoint file records", "megatron.core.dist_checkpointing.strategies.filesystem_async",
              "FileSystemWriterAsync.write_preloaded_data_multiproc", "global_results_queue.put(write_results_or_exc)"),
    PatchSite("adam step on load", "megatron.core.optimizer.distrib_optimizer",
              "DistributedOptimizer._set_main_param_and_optimizer_states", "dst_tensors[key].copy_(tensors[key])"),
    *(PatchSite("literal cuda devices", name, "torch") for name in _MODULES_WITH_LITERAL_CUDA),
    PatchSite("grad norm", "megatron.core.optimizer.clip_grads", "l2_norm_impl"),
    PatchSite("grad norm", "megatron.core.optimizer.clip_grads", "multi_tensor_scale_impl"),
    PatchSite("grad norm", "megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "l2_norm_impl,"),
    PatchSite("grad norm", "megatron.core.optimizer.optimizer", "multi_tensor_scale_impl"),
    PatchSite("grad norm", "megatron.core.utils", "local_multi_tensor_l2_norm", "torch.tensor(l2)"),
    PatchSite("fused adamw", "megatron.core.optimizer", "_get_megatron_optimizer_based_on_param_groups",
              "adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam"),
    PatchSite("fused rope", "megatron.core.models.common.embeddings.rope_utils", "fused_apply_rotary_pos_emb"),
    PatchSite("fused rope", "megatron.core.models.common.embeddings.rope_utils", "apply_rotary_pos_emb",
              "fused_apply_rotary_pos_emb(t, freqs, interleaved=config.rotary_interleaved)"),
    PatchSite("fused cross-entropy", "megatron.core.models.common.language_module.language_module",
              "fused_vocab_parallel_cross_entropy"),
    PatchSite("fused cross-entropy", "megatron.core.models.common.language_module.language_module",
              "LanguageModule.compute_language_model_loss",
              "loss = fused_vocab_parallel_cross_entropy(logits, labels, self.pg_collection.tp)"),
    PatchSite("weight gradient accumulation", "megatron.core.tensor_parallel.layers", "_grad_accum_fusion_available"),
    PatchSite("weight gradient accumulation", "megatron.core.tensor_parallel.layers",
              "LinearWithGradAccumulationAndAsyncCommunication.backward",
              "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(\n"
              "                            total_input, grad_output, weight.main_grad"),
    PatchSite("weight gradient accumulation", "megatron.core.tensor_parallel.layers", "ColumnParallelLinear.__init__",
              "if config.gradient_accumulation_fusion and not _grad_accum_fusion_available:"),
    PatchSite("tied embedding dummy gradient", "megatron.core.tensor_parallel.layers",
              "LinearWithGradAccumulationAndAsyncCommunication.backward",
              'if getattr(weight, "zero_out_wgrad", False):'),
    PatchSite("tied embedding dummy gradient", "megatron.core.tensor_parallel.layers",
              "LinearWithGradAccumulationAndAsyncCommunication.backward",
              'if hasattr(weight, "grad_added_to_main_grad"):'),
    PatchSite("tied embedding dummy gradient", "megatron.core.tensor_parallel.layers",
              "LinearWithGradAccumulationAndAsyncCommunication.backward", "grad_weight = None"),
    PatchSite("tied embedding dummy gradient", "megatron.core.distributed.distributed_data_parallel",
              "DistributedDataParallel._make_backward_post_hook",
              "not param.grad_added_to_main_grad or getattr(param, 'zero_out_wgrad', False)"),
    PatchSite("compiled layers", "megatron.core.transformer.attention", "Attention.forward",
              "if self.checkpoint_core_attention and self.training:"),
    PatchSite("compiled layers", "megatron.core.transformer.attention", "Attention.forward", "with off_interface("),
    PatchSite("compiled layers", "megatron.core.transformer.attention", "Attention._checkpointed_attention_forward",
              "tensor_parallel.checkpoint("),
    PatchSite("compiled layers", "megatron.core.tensor_parallel.layers", "RowParallelLinear.forward", "tp_group=None,"),
    PatchSite("compiled layers", "megatron.core.tensor_parallel.layers",
              "linear_with_grad_accumulation_and_async_allreduce", "get_tensor_model_parallel_group_if_none(tp_group)"),
    PatchSite("compiled layers", "megatron.core.utils", "get_tensor_model_parallel_group_if_none", "warnings.warn("),
    PatchSite("pinned memory", "megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
              "pin_memory=True"),
    PatchSite("deepspeed shm op", "deepspeed.comm.torch", "build_shm_op", "ShareMemCommBuilder"),
    PatchSite("deepspeed shm op", "deepspeed.comm.torch", "TorchBackend.__init__", "build_shm_op()"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint",
              "if load_zero_checkpoint and not self.zero_nvme_offload_optimizer():"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.engine", "DeepSpeedEngine._get_zero_ckpt_name"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.zero.stage3",
              "DeepSpeedZeroOptimizer_Stage3._set_fp32_optimizer_param_groups", "fp32_partitioned_groups_flat"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.zero.stage3",
              "DeepSpeedZeroOptimizer_Stage3._clear_fp32_optimizer_param_groups"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.zero.stage3",
              "DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.zero.stage3",
              "DeepSpeedZeroOptimizer_Stage3.checkpoint_event_prologue", "_partition_all_parameters"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.zero.stage3",
              "DeepSpeedZeroOptimizer_Stage3.checkpoint_event_epilogue", "persistent_parameters"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.swap_tensor.optimizer_utils",
              "OptimizerSwapper._get_state_tensors", "self.optimizer.state[parameter].items()"),
    PatchSite("deepspeed nvme optimizer resume", "deepspeed.runtime.zero.stage3",
              "DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters"),
    # not patched, but what engine=deepspeed builds ZeRO-3 models with: zero.Init's switch that leaves tensor creation
    # alone (megatron-core's fp32 CPU initialisation), and megatron-core's weight-decay rule it restates on whole shapes
    PatchSite("deepspeed zero3 construction", "deepspeed.runtime.zero.partition_parameters", "Init.__init__",
              "tensor_overrides"),
    PatchSite("deepspeed engine", "megatron.core.optimizer", "get_standard_config_overrides",
              "len(param.shape) == 1"),
    # not patched, but private functions engine=deepspeed calls: megatron-core's parameter groups (no weight decay on
    # biases and 1-D weights) and DeepSpeed's ZeRO-3 readers, given one TP rank's files (checkpoint_tools)
    PatchSite("deepspeed engine", "megatron.core.optimizer", "_get_param_groups", "wd_mult"),
    PatchSite("deepspeed checkpoints", "deepspeed.utils.zero_to_fp32", "parse_model_states"),
    PatchSite("deepspeed checkpoints", "deepspeed.utils.zero_to_fp32", "parse_optim_states", "FP32_FLAT_GROUPS"),
    PatchSite("deepspeed checkpoints", "deepspeed.utils.zero_to_fp32", "_get_fp32_state_dict_from_zero3_checkpoint"),
    PatchSite("deepspeed checkpoints", "deepspeed.utils.zero_to_fp32", "to_torch_tensor"),
)


def patch_site_problems() -> List[str]:
    """What differs from every PatchSite in the installed megatron-core (empty when all are as assumed)."""
    return [p for p in (site.problem() for site in PATCH_SITES) if p is not None]

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def cpu_patches_needed() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU execution when CUDA is absent. Returns whether patches are active."""
    global _APPLIED
    if _APPLIED:
        return True
    if not cpu_patches_needed():
        return False
    check_megatron_core_version()
    _patch_rng_tracker()
    _patch_torch_cuda_device_calls()
    _patch_literal_cuda_devices()
    _patch_cuda_type_checks()
    _APPLIED = True
    logger.debug("megatron-core CPU patches applied")
    return True


# ---------------------------------------------------------------------------------------------------------------
# RNG: tensor_parallel/random.py:235-240 (CudaRNGStatesTracker.add reads torch.cuda.get_rng_state) and
# random.py:244-277 (fork swaps CUDA generator states). On CPU the tracker keeps CPU generator states instead.
# ---------------------------------------------------------------------------------------------------------------
def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """The model-parallel RNG tracker, holding CPU generator states."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig_state = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig_state)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig_state)

    # initialize_rng_tracker (random.py:336) instantiates the class by its module-level name.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    # model_parallel_cuda_manual_seed (random.py:422) seeds the CUDA generator directly; seed the CPU one.
    torch.cuda.manual_seed = lambda seed: None
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# ---------------------------------------------------------------------------------------------------------------
# torch.cuda.current_device() as a tensor device: models/common/embeddings/rotary_pos_embedding.py:162,
# utils.py:631 (GlobalMemoryBuffer), tensor_parallel/layers.py:552 and mappings.py:91,141 (TP all-gather buffers),
# pipeline_parallel/p2p_communication.py:190-202,313,321 (shape and activation buffers),
# dist_checkpointing/strategies/state_dict_saver.py:252, optimizer/distrib_optimizer.py:791,
# models/gpt/gpt_model.py:415. torch.cuda.synchronize(): p2p_communication.py:242,398,
# dist_checkpointing/strategies/filesystem_async.py:230, async_utils.py:212, fully_parallel.py:272,281.
# ---------------------------------------------------------------------------------------------------------------
def _patch_torch_cuda_device_calls() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None


class _CpuDeviceTorch:
    """Stands in for ``torch`` inside one megatron-core module: factories asked for "cuda" build on the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "empty_like", "zeros_like", "arange")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return functools.partial(_on_cpu, attr)
        return attr


def _on_cpu(factory, *args, **kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs["device"] = "cpu"
    kwargs.pop("pin_memory", None)  # a CPU-only torch has no pinned-memory allocator and refuses the request
    return factory(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Literal device="cuda": pipeline_parallel/schedules.py:596,983,2138 (token counters),
# optimizer/optimizer.py:473,481,485,907 (loss-scale tensors), optimizer/clip_grads.py:90,103,115,174,207,
# dist_checkpointing/strategies/state_dict_saver.py:204, dist_checkpointing/exchange_utils.py:104,110,326,
# utils.py:1207 (local_multi_tensor_l2_norm, the grad-norm fallback without apex/TE). Pinned staging buffers
# (refused without CUDA): models/common/embeddings/rope_utils.py:62-64 (get_pos_emb_on_this_cp_rank, the rotary
# positions of a context-parallel rank's chunks).
# Tensor.cuda(): models/common/language_module/language_module.py:244 (tied embeddings across PP stages),
# dist_checkpointing/exchange_utils.py:336,499 (resharding exchange); ShardedTensor.init_data("cuda"):
# exchange_utils.py:98,106.
# ---------------------------------------------------------------------------------------------------------------
def _patch_literal_cuda_devices() -> None:
    proxy = _CpuDeviceTorch()
    for name in _MODULES_WITH_LITERAL_CUDA:
        importlib.import_module(name).torch = proxy
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    original_init_data = ShardedTensor.init_data

    def init_data(self, device, init_fn=torch.empty):
        if torch.device(device).type == "cuda":
            device = "cpu"
        return original_init_data(self, device, init_fn)

    ShardedTensor.init_data = init_data


# ---------------------------------------------------------------------------------------------------------------
# Type-string checks that only accept CUDA tensors: optimizer/distrib_optimizer.py:420-437 (building the main
# parameter shards) and optimizer/clip_grads.py:167 (gradient clipping). Inside those calls only, a CPU tensor's
# type() reports the CUDA name of the same dtype.
# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    original_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original_type(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original_type


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _cpu_tensors_report_cuda_types():
            return fn(*args, **kwargs)

    return wrapped


def _patch_cuda_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name at optimizer.py:50

    cls = distrib_optimizer.DistributedOptimizer
    build = cls._build_model_and_main_param_groups
    cls._build_model_and_main_param_groups = staticmethod(_with_cuda_type_names(build))


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed's communication backend, deepspeed/comm/torch.py: TorchBackend.__init__ calls build_shm_op(), which on
# the CPU accelerator JIT-compiles a shared-memory all-reduce (30-60 s per process, a C++ toolchain needed) for
# single-node CPU runs. gloo does the same reductions; on a GPU the op is not built at all.
# ---------------------------------------------------------------------------------------------------------------
def select_deepspeed_accelerator() -> None:
    """DeepSpeed's accelerator from this machine, before deepspeed is imported: CUDA, or its CPU accelerator (rather
    than its probing, which warns, and would look for a GPU that CUDA_VISIBLE_DEVICES hides)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def apply_deepspeed_cpu_patches() -> bool:
    """Start DeepSpeed's communication backend on gloo alone when CUDA is absent. Returns whether it patched."""
    if not cpu_patches_needed():
        return False
    import sys

    import deepspeed.comm.torch  # noqa: F401  (registers the module; its name is shadowed by torch in deepspeed.comm)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return True


def restore_nvme_optimizer_memory_state(engine, root: str, tag: str) -> bool:
    """Complete DeepSpeed's resume of a ZeRO-3 run whose optimizer is offloaded to NVMe. Its ``load_checkpoint``
    (runtime/engine.py: ``if load_zero_checkpoint and not self.zero_nvme_offload_optimizer()``) skips the rank's
    ``*_optim_states.pt`` and copies the checkpoint's ``offloaded_tensors/`` into the swap folder, but:

    - the optimizer's state is empty in a new process (Adam creates it at its first step), so its swapper, which
      learns a parameter's state tensors from that state, reads back only the fp32 master weights: Adam's moments
      restart from zero and its step count from 0;
    - a sub-group too small to swap (under 1 MiB, ``swap_tensor/utils.py`` MIN_AIO_BYTES: the 1-D weights' group of a
      small model) keeps its initial master weights and moments: they are in the skipped file.

    Recreates each swapped sub-group's state (the saved step count, and tensors of the right size under the names
    the swap files carry, which the swapper then fills from them), loads the small sub-groups from the file, copies
    their master weights into the model's partitions and gathers ZeRO-3's persistent parameters (those small enough
    to stay whole, which the end of ``load_checkpoint`` gathered before this) from them again. Returns whether the engine
    swaps its optimizer."""
    if not engine.zero_nvme_offload_optimizer():
        return False
    optimizer = engine.optimizer
    saved = engine.checkpoint_engine.load(engine._get_zero_ckpt_name(root, tag), map_location="cpu")  # weights_only
    saved = saved["optimizer_state_dict"]
    optimizer._set_fp32_optimizer_param_groups()  # how it numbered the states it saved (state_dict does the same)
    try:
        index = {id(p): i for i, p in enumerate(p for g in optimizer.optimizer.param_groups for p in g["params"])}
    finally:
        optimizer._clear_fp32_optimizer_param_groups()
    optimizer.checkpoint_event_prologue()  # every parameter back to its partition, the persistent ones too
    for sub_group, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
        state = optimizer.optimizer.state[flat]
        swapped = optimizer._swappable_optimizer_subgroup(sub_group)
        numel = int(optimizer.fp16_partitioned_groups_flat_numel[sub_group])
        for key, value in saved["optimizer_state_dict"]["state"][index[id(flat)]].items():
            if swapped and torch.is_tensor(value) and value.numel() == 0:  # its values are in the swap files
                state[key] = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
            else:
                state[key] = value.clone().to(flat.device) if torch.is_tensor(value) else value
        if not swapped:
            flat.data.copy_(saved["fp32_flat_groups"][sub_group])
            optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
    optimizer.checkpoint_event_epilogue()  # and ZeRO-3's persistent ones (small, kept whole) gathered again
    return True


# ---------------------------------------------------------------------------------------------------------------
# Speed workarounds (any device)
# ---------------------------------------------------------------------------------------------------------------
def _multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract ((1,) fp32 norm of every tensor, None) without leaving the device."""
    tensors = list(tensor_lists[0])
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = [n.float() for n in torch._foreach_norm(tensors)]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract (dst = src · scale), one foreach call instead of one kernel per tensor."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def apply_grad_norm_patches() -> bool:
    """Without TransformerEngine or Apex, megatron-core's gradient norm is ``local_multi_tensor_l2_norm``
    (utils.py:1205-1207): ``torch.tensor(l2)`` of a list of device scalars reads every parameter tensor's norm to the
    host, one sync each, then ``float()`` of the total; and gradients are scaled one tensor at a time
    (``local_multi_tensor_scale``, utils.py:1212-1215). clip_grads.py:42-43 and optimizer.py:37 pick these at import
    as ``l2_norm_impl`` and ``multi_tensor_scale_impl``; put one norm of the stacked per-tensor norms (on the device;
    ``get_grad_norm_fp32``'s ``.item()`` at clip_grads.py:133 stays the step's one sync) and foreach scaling in
    their place. Same contracts, same math. Any device; idempotent; returns whether it patched."""
    check_megatron_core_version()
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    patched = False
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _multi_tensor_l2_norm
        patched = True
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _multi_tensor_scale
            patched = True
    return patched


def fuse_torch_adamw(optimizer, device_type: str = "cuda") -> int:
    """megatron-core without TransformerEngine or Apex builds ``torch.optim.AdamW`` with torch's default (foreach)
    implementation (optimizer/__init__.py:360, no ``fused`` flag). Switch every param group whose parameters all live
    on ``device_type`` to torch's fused kernel (one kernel per group and dtype; state made later lives on the device,
    as fused AdamW needs). Call on CUDA only (the caller decides); returns the number of groups switched."""
    switched = 0
    inners = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else _inner_optimizers(optimizer)
    for inner in inners:
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            params = group["params"]
            if params and all(p.device.type == device_type and p.is_floating_point() for p in params):
                group["fused"], group["foreach"] = True, False
                for p in params:  # state made before the switch: fused AdamW keeps its step on the device
                    step = inner.state.get(p, {}).get("step")
                    if torch.is_tensor(step):
                        inner.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
                switched += 1
    return switched


def install_fused_rope(apply_fn) -> bool:
    """megatron-core's ``apply_rope_fusion`` calls TransformerEngine's fused RoPE through a module global,
    ``fused_apply_rotary_pos_emb`` (models/common/embeddings/rope_utils.py:286-287, TE's signature
    ``(t, freqs, interleaved=False)``), which is None without TE, and TransformerConfig refuses the switch when it is
    (transformer/transformer_config.py:1544-1552). Put ``apply_fn`` there unless TE's own is installed; returns
    whether the hook now holds ``apply_fn``."""
    check_megatron_core_version()
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_fn
    return rope_utils.fused_apply_rotary_pos_emb is apply_fn


def install_weight_gradient_accumulation(apex_compatible) -> bool:
    """megatron-core's ``gradient_accumulation_fusion`` accumulates each linear layer's weight gradient into its fp32
    ``main_grad`` through Apex's ``fused_weight_gradient_mlp_cuda``, a module global of tensor_parallel/layers.py
    (imported at lines 45-48, called at 569-575 as ``wgrad_gemm_accum_fp32(total_input, grad_output,
    weight.main_grad)``), and ColumnParallelLinear refuses the switch without it (``_grad_accum_fusion_available``,
    layers.py:924). Put ``apex_compatible`` (an object with both
    functions, ``models.weight_gradient``) there unless Apex's own is installed; returns whether the hook now holds
    it. Idempotent."""
    check_megatron_core_version()
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:  # without Apex the module global is not even defined
        layers.fused_weight_gradient_mlp_cuda = apex_compatible
        layers._grad_accum_fusion_available = True
    return getattr(layers, "fused_weight_gradient_mlp_cuda", None) is apex_compatible


def skip_tied_embedding_dummy_gradient() -> bool:
    """With ``gradient_accumulation_fusion`` a linear layer's backward adds its weight gradient to ``main_grad`` and
    returns a dummy in its place (tensor_parallel/layers.py:581-610). For the embedding the output layer shares on one
    pipeline stage (``zero_out_wgrad``, models/common/language_module/language_module.py:201) the dummy is
    ``torch.zeros`` of the whole vocabulary × hidden table (layers.py:586-599, without TransformerEngine): a memset,
    then autograd's add of it to the embedding's own gradient, every micro-batch, before DDP's hook adds that sum to
    ``main_grad`` (distributed/distributed_data_parallel.py:437-440). Take layers.py's ``grad_weight = None`` branch
    (line 612) for that weight instead: ``grad_added_to_main_grad`` hidden for the call, set again after, as megatron
    sets it; the embedding's gradient reaches the hook alone (the same sum: x + 0 = x). Any device; idempotent;
    returns whether it patched now."""
    check_megatron_core_version()
    from megatron.core.tensor_parallel import layers

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    if getattr(function.backward, "skips_tied_dummy", False):
        return False
    megatron_backward = function.backward

    @functools.wraps(megatron_backward)
    def backward(ctx, grad_output):
        weight = ctx.saved_tensors[1]
        if not (ctx.gradient_accumulation_fusion and getattr(weight, "zero_out_wgrad", False)
                and hasattr(weight, "grad_added_to_main_grad")):
            return megatron_backward(ctx, grad_output)
        del weight.grad_added_to_main_grad
        try:
            return megatron_backward(ctx, grad_output)
        finally:
            weight.grad_added_to_main_grad = True

    backward.skips_tied_dummy = True
    function.backward = staticmethod(backward)
    return True


def install_fused_cross_entropy(cross_entropy_fn) -> None:
    """megatron-core's ``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl="native"`` calls its own fused
    cross-entropy through a module global of ``LanguageModule.compute_language_model_loss``,
    ``fused_vocab_parallel_cross_entropy(logits, labels, self.pg_collection.tp)``
    (models/common/language_module/language_module.py:16 and 165). That one saves an fp32 softmax of the logits for
    the backward and rounds the gradient to bf16 whatever the logits' dtype (fusions/fused_cross_entropy.py:82); put
    ``cross_entropy_fn``, of the same signature, there instead (``models.cross_entropy``). Idempotent."""
    check_megatron_core_version()
    from megatron.core.models.common.language_module import language_module

    language_module.fused_vocab_parallel_cross_entropy = cross_entropy_fn


# ---------------------------------------------------------------------------------------------------------------
# Compiled layers: trainer.compile (any device)
# ---------------------------------------------------------------------------------------------------------------
def call_core_attention_eagerly(attention: torch.nn.Module) -> None:
    """Make megatron-core's ``attention`` (a layer's SelfAttention) run its core attention eagerly, out of the graph
    of a compiled layer, in a training forward: the Triton kernel's launchers choose configs in Python, flash-attn
    and the context-parallel ring call libraries and collectives that dynamo cannot trace.

    A ``torch.compiler.disable``d call breaks the graph; dynamo resumes after it, but not inside a context manager of
    a user class: ``Attention.forward`` calls the core attention inside ``with off_interface(...)``
    (transformer/attention.py:1147; fine-grained activation offloading, off here), and a graph break there makes dynamo
    give up the whole layer's frame (each submodule then compiles alone, nothing fused across them). Its
    selective-recomputation branch (attention.py:1134, ``if self.checkpoint_core_attention and self.training``) calls
    ``_checkpointed_attention_forward`` outside any context manager: every training forward takes that branch here,
    into a disabled function that calls the core attention, through megatron's checkpoint (attention.py:415) when
    ``trainer.recompute=selective`` asked for it. Forwards outside training do not take the branch: the trainer runs
    them eagerly (``models.gpt.compile_layers``). Idempotent."""
    check_megatron_core_version()
    if getattr(attention, "_core_attention_eager", False):
        return
    recompute = attention.checkpoint_core_attention
    checkpointed = attention._checkpointed_attention_forward  # megatron's own, bound before it is replaced

    @torch.compiler.disable
    def core_attention(query, key, value, attention_mask, rotary_pos_emb=None, attn_mask_type=None,
                       attention_bias=None, packed_seq_params=None):
        if recompute:
            return checkpointed(query, key, value, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                packed_seq_params=packed_seq_params)
        return attention.core_attention(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                        attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    attention._checkpointed_attention_forward = core_attention
    attention.checkpoint_core_attention = True
    attention._core_attention_eager = True


def _default_tp_group(tp_group, is_expert=False, check_initialized=True):
    """megatron-core's ``get_tensor_model_parallel_group_if_none`` (utils.py:489), the same group without its
    deprecation warning."""
    from megatron.core import parallel_state

    if tp_group is not None or not torch.distributed.is_initialized() or not parallel_state.is_initialized():
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def resolve_default_tp_group_quietly() -> None:
    """``RowParallelLinear.forward`` passes ``tp_group=None`` (tensor_parallel/layers.py:1281) to
    ``linear_with_grad_accumulation_and_async_allreduce``, whose ``get_tensor_model_parallel_group_if_none``
    (layers.py:713) then warns on rank 0 at every call (utils.py:499-506): a ``warnings.warn`` that dynamo cannot
    trace, a graph break in the middle of every compiled attention output projection and MLP (on rank 0 only). The
    same group, without the warning, in that module. Idempotent."""
    check_megatron_core_version()
    from megatron.core.tensor_parallel import layers

    layers.get_tensor_model_parallel_group_if_none = _default_tp_group


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint workarounds (any device)
# ---------------------------------------------------------------------------------------------------------------
def fork_checkpoint_results_queue() -> None:
    """megatron's torch_dist writer gathers its workers' results through a Manager queue that it starts with the
    spawn method (dist_checkpointing/strategies/filesystem_async.py:51-56); a spawned child re-imports the training
    script, seconds per process. A forked Manager serves the same queue at once (the writers themselves fork too); it
    dies with the trainer (:func:`_die_with_parent`), so that a trainer killed outright leaves no process behind."""
    check_megatron_core_version()
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()


def read_checkpoint_metadata_with(reader: type, cached_reader: type) -> None:
    """Make megatron-core's torch_dist loader read ``.metadata`` through the project's readers (subclasses of torch's
    FileSystemReader that admit only the format's classes): megatron-core builds its reader itself
    (dist_checkpointing/strategies/torch.py ``_get_filesystem_reader``), with no argument to pass one. And the
    objects a checkpoint stores as bytes (the RNG states) load with ``weights_only``: torch's planner unpickles them
    with ``weights_only=False`` (distributed/checkpoint/default_planner.py ``load_bytes``)."""
    check_megatron_core_version()
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    def _get_filesystem_reader(checkpoint_dir, cache_metadata: bool = False):
        return (cached_reader if cache_metadata else reader)(checkpoint_dir)

    torch_strategy._get_filesystem_reader = _get_filesystem_reader
    torch_strategy.MCoreLoadPlanner.load_bytes = _load_bytes_weights_only


def _load_bytes_weights_only(self, read_item, value) -> None:
    """DefaultLoadPlanner.load_bytes with ``weights_only=True``."""
    from torch.distributed.checkpoint._traverse import set_element

    loaded = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def zero_to_fp32_loads_with(load):
    """DeepSpeed's ZeRO-3 readers (deepspeed/utils/zero_to_fp32.py ``parse_model_states``, ``parse_optim_states``)
    unpickle each file with ``torch.load(..., weights_only=False)``: inside the block they call
    ``load(path, map_location, mmap)`` instead (the caller's weights-only load)."""
    from deepspeed.utils import zero_to_fp32

    original = zero_to_fp32.torch

    class TorchWithLoad:
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def load(f, map_location=None, mmap=False, **_):
            return load(f, map_location, mmap)

    zero_to_fp32.torch = TorchWithLoad()
    try:
        yield
    finally:
        zero_to_fp32.torch = original


# The trainer's handlers (training.failures) a forked helper must not run: it would only record a stop nobody reads.
_TRAINER_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


def _die_with_parent(parent: int) -> None:
    """In a forked helper process: the kernel kills it when ``parent`` dies (Linux's PR_SET_PDEATHSIG), and the
    signals the trainer handles get their default action back (SIGINT stays ignored, as multiprocessing sets it
    for a Manager: a Ctrl-C reaches the whole process group, and the trainer's save after it needs the queue)."""
    for name in _TRAINER_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


def _inner_optimizers(optimizer) -> "List[torch.optim.Optimizer]":
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt.optimizer for opt in chained if getattr(opt, "optimizer", None) is not None]


def initialise_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its state tensors (zeros, step 0) so that a load has somewhere to write; megatron's
    distributed optimizer reads the step of existing state when it builds the state dict to load into."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        # fused AdamW (fuse_torch_adamw) keeps its step on the parameter's device
                        "step": torch.zeros((), dtype=torch.float32, device=param.device if group.get("fused") else None),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


@contextlib.contextmanager
def adam_step_left_out_of_param_copies(optimizer):
    """The distributed optimizer's fully_reshardable load copies every key of a parameter's torch-Adam state from
    the checkpoint's per-parameter tensors, which carry no ``step`` (it travels in the param groups):
    megatron/core/optimizer/distrib_optimizer.py:938-940 raises KeyError('step'). Copy the keys that exist only."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None or getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            continue

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step") if "step" in state and "step" not in tensors else None
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def unshare_adam_step_tensors(optimizer) -> None:
    """megatron's load gives every parameter the same ``step`` tensor; torch Adam increments it in place once per
    parameter, so each parameter needs its own copy."""
    for inner in _inner_optimizers(optimizer):
        for param_state in inner.state.values():
            step = param_state.get("step")
            if torch.is_tensor(step):
                param_state["step"] = step.clone()
