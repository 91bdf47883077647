"""megatron-core 0.16.1 on machines without CUDA: the patches that let it run on CPU over gloo.

megatron-core assumes a CUDA device in a few dozen places. On a CPU-only machine (laptops, CI) we patch exactly
those places so that the same model, schedules, optimizer and checkpoint code run there, which is what lets tensor
and pipeline parallelism, checkpoints and the optimizer be tested without a GPU. Each patch names the megatron-core
lines (paths relative to ``megatron/core``) it answers. Nothing here is applied when CUDA is available.

Call :func:`apply_cpu_patches` once, before building models; it is idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging

import torch

logger = logging.getLogger(__name__)

_APPLIED = False

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
    return factory(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Literal device="cuda": pipeline_parallel/schedules.py:596,983,2138 (token counters),
# optimizer/optimizer.py:473,481,485,907 (loss-scale tensors), optimizer/clip_grads.py:90,103,115,174,207,
# dist_checkpointing/strategies/state_dict_saver.py:204, dist_checkpointing/exchange_utils.py:104,110,326,
# utils.py:1207 (local_multi_tensor_l2_norm, the grad-norm fallback without apex/TE).
# Tensor.cuda(): models/common/language_module/language_module.py:244 (tied embeddings across PP stages),
# dist_checkpointing/exchange_utils.py:336,499 (resharding exchange); ShardedTensor.init_data("cuda"):
# exchange_utils.py:98,106.
# ---------------------------------------------------------------------------------------------------------------
_MODULES_WITH_LITERAL_CUDA = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
)


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
