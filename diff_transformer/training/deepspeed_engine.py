"""DeepSpeed ZeRO as the training engine (``engine=deepspeed``): the same megatron-core GPTModel, data, metrics,
failure handling and checkpoint protocol as :class:`trainer.Trainer`; DeepSpeed owns the data-parallel reduction,
the ZeRO partitioning and offload, clipping and the optimizer step.

- **Model**: ``models.gpt.build_model_chunk`` exactly as for engine=megatron (any attention kind), wrapped by
  ``deepspeed.initialize`` with megatron-core's parallel state as ``mpu``: ZeRO partitions over the data-parallel
  group, and each TP rank keeps its shards. Under ZeRO-3 the model is built inside ``deepspeed.zero.Init``
  (:func:`build_partitioned_chunk`): each module's parameters are drawn whole, exactly as without it, and
  partitioned as soon as the module is built, so no rank ever holds the whole model.
- **TP-replicated parameters** (DIFF's λ and sub-layer norm, ``vanilla_subln``'s norm, ``signed_mask``'s logits; under
  sequence parallelism also the norms): a hook on each sums its gradient over the TP group as autograd produces it,
  before DeepSpeed accumulates, reduces or partitions it. DeepSpeed's gradient norm counts a parameter that is not
  ``tensor_model_parallel`` on TP rank 0 only, as megatron-core's does, so none is counted twice.
- **Optimizer and schedule**: AdamW over megatron-core's parameter groups (no weight decay on biases and 1-D
  weights), torch's when the states stay on the device and DeepSpeed's CPU Adam when they are offloaded, stepped by
  megatron-core's ``OptimizerParamScheduler`` on the optimizer's groups: both engines follow the same learning rate
  and weight decay, step for step.
- **Bad steps** (NaN/Inf or spiking loss, ``training.failures``): decided on the loss before the last micro-batch's
  backward; DeepSpeed's own optimizers (ZeRO 1–3, bf16) then get non-finite gradients, which they drop as they drop
  an overflowed fp16 step (weights, optimizer state and DeepSpeed's step unchanged); the bare torch optimizer of
  ZeRO-0 in fp32 has no such path and is not stepped.
- **Checkpoints**: DeepSpeed's own files in ``checkpoints/step_*/`` under the same atomic protocol (temporary
  directory, ``trainer_state.json`` last, rename, ``latest``), plus the LR schedule and every rank's RNG states.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any, Dict, Iterator, List, Optional

import torch

from diff_transformer import compat, distributed
from diff_transformer.fileio import atomic_write_json
from diff_transformer.models.attention import TP_REPLICATED_ATTR
from diff_transformer.models.gpt import build_model_chunk, parameter_numel
from diff_transformer.training.checkpoint import (
    CheckpointManager,
    check_resumable,
    checkpoint_bytes,
    load_deepspeed_file,
    load_model_weights,
    load_weights_only,
    read_trainer_state,
    reading_checkpoint,
    rng_state,
    saved_engine,
    set_rng_state,
)
from diff_transformer.training.steps import loss_func, model_inputs
from diff_transformer.training.trainer import Trainer

logger = logging.getLogger("diff_transformer")

# The release this engine is written and tested against (pyproject pins it); older ones lack what it uses:
# managed gradient accumulation with bf16 overflow checks in ZeRO-1/2, zero_to_fp32's per-file parsing.
DEEPSPEED_MIN_VERSION = "0.19.8"
DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"
RNG_FILE = "rng_state_rank{rank:05d}.pt"


# ------------------------------------------------------------------------------------------------------------------
# The installed DeepSpeed: import, feature checks (before any process group), the generated config
# ------------------------------------------------------------------------------------------------------------------
def import_deepspeed():
    """``deepspeed``, with its accelerator chosen from this machine (CUDA or CPU, so that a GPU hidden by
    CUDA_VISIBLE_DEVICES is not looked for) and, without CUDA, its CPU patches (``compat``)."""
    compat.select_deepspeed_accelerator()
    try:
        import deepspeed
    except ImportError as err:
        raise ValueError(
            f"engine=deepspeed needs the deepspeed package ({err}); pip install -c constraints.txt -e . installs "
            f"deepspeed=={DEEPSPEED_MIN_VERSION}"
        ) from err
    compat.apply_deepspeed_cpu_patches()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def _version_tuple(version: str):
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def check_deepspeed_support(cfg: Any) -> None:
    """Raise ValueError naming the key when the installed DeepSpeed cannot run ``cfg.engine`` here: too old a
    release, or an op the setting needs that cannot be built on this machine (CPU Adam for optimizer offload,
    async_io for NVMe). Runs before any process group starts."""
    e = cfg.engine
    deepspeed = import_deepspeed()
    if _version_tuple(deepspeed.__version__) < _version_tuple(DEEPSPEED_MIN_VERSION):
        raise ValueError(
            f"engine=deepspeed needs deepspeed>={DEEPSPEED_MIN_VERSION}, but {deepspeed.__version__} is installed; "
            f"pip install deepspeed=={DEEPSPEED_MIN_VERSION}"
        )
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    if e.offload_optimizer != "none" and not CPUAdamBuilder().is_compatible(verbose=False):
        raise ValueError(
            f"engine.offload_optimizer={e.offload_optimizer} steps the optimizer with DeepSpeed's CPU Adam, which "
            f"deepspeed {deepspeed.__version__} cannot build on this machine (it needs a C++ compiler and ninja); "
            "use engine.offload_optimizer=none"
        )
    nvme = [k for k in ("offload_optimizer", "offload_param") if getattr(e, k) == "nvme"]
    if nvme and not AsyncIOBuilder().is_compatible(verbose=False):
        raise ValueError(
            f"engine.{nvme[0]}=nvme needs DeepSpeed's async_io op, which deepspeed {deepspeed.__version__} cannot "
            "build on this machine (it needs libaio: apt-get install libaio-dev); use cpu instead of nvme"
        )


def _offload(device: str, nvme_path: Optional[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"device": device, "pin_memory": torch.cuda.is_available()}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``extra`` merged into ``base`` recursively (dicts merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config(cfg: Any, dtype: torch.dtype, dp: int) -> Dict[str, Any]:
    """The DeepSpeed JSON of a run, from ``optim``, ``trainer`` and ``engine`` (``engine.extra`` merged last).

    The learning rate here is the peak; megatron-core's OptimizerParamScheduler sets each step's rate and weight
    decay on the optimizer's groups (warm-up from 0, linear/cosine/constant decay to ``optim.min_lr``), which
    DeepSpeed's own schedulers cannot express, so the JSON has no ``scheduler``."""
    o, t, e = cfg.optim, cfg.trainer, cfg.engine
    bf16 = dtype == torch.bfloat16
    zero: Dict[str, Any] = {"stage": e.zero_stage}
    if e.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(e.offload_optimizer, e.nvme_path)
    if e.offload_param != "none":
        zero["offload_param"] = _offload(e.offload_param, e.nvme_path)
    adamw = {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay}
    if e.offload_optimizer == "none":
        adamw["torch_adam"] = True  # torch's AdamW on the device: megatron-core's optimizer without APEX/TE
    config = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * dp),
        "gradient_clipping": o.clip_grad,
        "optimizer": {"type": "AdamW", "params": adamw},
        "zero_optimization": zero,
        # a bf16 step whose gradients are not finite is dropped: what skips a bad step (see the module docstring)
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,  # the trainer logs each step
        "wall_clock_breakdown": False,
    }
    return _merge(config, dict(e.extra))


# ------------------------------------------------------------------------------------------------------------------
# megatron-core's parallel state as DeepSpeed's mpu
# ------------------------------------------------------------------------------------------------------------------
class MegatronParallelState:
    """megatron-core's ``parallel_state`` with the names DeepSpeed's ``mpu`` argument is called by: its model-parallel
    group is the tensor-parallel group (engine=deepspeed refuses PP), its data-parallel group megatron-core's."""

    def __init__(self):
        from megatron.core import parallel_state

        self.ps = parallel_state

    def get_model_parallel_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_group(self):
        return self.ps.get_pipeline_model_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> List[int]:
        return torch.distributed.get_process_group_ranks(self.ps.get_data_parallel_group())


# ------------------------------------------------------------------------------------------------------------------
# ZeRO-3: the model built partitioned
# ------------------------------------------------------------------------------------------------------------------
def build_partitioned_chunk(cfg: Any, vocab_size: int, dtype: torch.dtype, ds_config: Dict[str, Any]):
    """This rank's model chunk built under ``deepspeed.zero.Init``: every module draws its parameters whole, as
    ``build_model_chunk`` does without it (megatron-core's CPU initialisation of each full weight, sliced for this
    TP rank; the attention kinds' own parameters; the seeded layers), and DeepSpeed partitions them over the
    data-parallel group as soon as that module's ``__init__`` returns. The largest transient is one module's
    weights, not the model.

    ``tensor_overrides=[]`` keeps DeepSpeed from creating tensors in its own dtype and on its own device during
    construction: megatron-core draws each full weight in fp32 on the CPU (``_initialize_affine_weight_cpu``) from
    the CPU generator, and drawing it in bf16 or on the GPU would give other initial weights."""
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from megatron.core import parallel_state

    # DeepSpeed's communication on the process group already started, as deepspeed.initialize would start it
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    with deepspeed.zero.Init(
        data_parallel_group=parallel_state.get_data_parallel_group(), config_dict_or_path=ds_config,
        mpu=MegatronParallelState(), tensor_overrides=[],
    ):
        chunk = build_model_chunk(cfg, vocab_size, dtype)
    if torch.cuda.is_available():  # deepspeed.initialize moves no module built under zero.Init: its buffers too
        device = torch.device("cuda", torch.cuda.current_device())
        for module in chunk.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    return chunk


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's whole shape, also when ZeRO-3 holds only a partition of it (``param.shape`` is then empty)."""
    return getattr(p, "ds_shape", p.shape)


def resident_parameter_elements(chunk: torch.nn.Module) -> int:
    """Parameter elements this process holds in memory: each ZeRO-3 parameter's partition (and anything gathered),
    every other parameter whole."""
    total = 0
    for p in chunk.parameters():
        total += p.data.numel()
        partition = getattr(p, "ds_tensor", None)
        if partition is not None:
            total += partition.data.numel()
    return total


def param_groups(chunk: torch.nn.Module, optim: Any) -> List[Dict[str, Any]]:
    """megatron-core's parameter groups (``_get_param_groups``: no weight decay on biases and 1-D weights), with
    each parameter judged on its whole shape: megatron-core's own rule reads ``param.shape``, which a parameter
    partitioned at construction (ZeRO-3) reports as empty and 1-D."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    config = OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay)
    one_dimensional = ParamPredicate(name="param_len_1", fn=lambda p: len(full_shape(p)) == 1)
    overrides = {ParamKey(name="*.bias", predicate=one_dimensional): {"wd_mult": 0.0}}
    return _get_param_groups([chunk], config, overrides)


def tp_summed_parameters(chunk: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Trainable parameters replicated on TP ranks whose gradient covers only this rank's part of the computation:
    the attention kinds' replicated parameters (their heads are split) and, under sequence parallelism, the
    parameters megatron-core marks ``sequence_parallel`` (their tokens are split). Each is summed over TP once."""
    return [
        p for p in chunk.parameters()
        if p.requires_grad and (getattr(p, TP_REPLICATED_ATTR, False) or getattr(p, "sequence_parallel", False))
    ]


def register_tp_gradient_sums(chunk: torch.nn.Module) -> List[Any]:
    """Hooks that sum the gradients of :func:`tp_summed_parameters` over the TP group as each micro-batch's backward
    produces them, before DeepSpeed sees them (its hooks run after accumulation). Returns the hook handles."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return []
    group = parallel_state.get_tensor_model_parallel_group()

    def summed(grad: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce_tensor(grad.clone(), group=group)

    return [p.register_hook(summed) for p in tp_summed_parameters(chunk)]


# ------------------------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------------------------
class DeepSpeedTrainer(Trainer):
    """:class:`Trainer` with DeepSpeed in place of megatron-core's DDP, optimizer and forward-backward schedule."""

    def _check_engine_support(self) -> None:
        check_deepspeed_support(self.cfg)

    # -- setup -------------------------------------------------------------------------------------------------------
    def _build_model(self):
        deepspeed = import_deepspeed()

        self.ds_config = deepspeed_config(self.cfg, self.dtype, self.dp_size)
        if self.rank == 0:
            atomic_write_json(os.path.join(self.run_dir, DEEPSPEED_CONFIG_FILE), self.ds_config)
        zero3 = self.cfg.engine.zero_stage == 3
        if zero3:
            chunk = build_partitioned_chunk(self.cfg, self.padded_vocab, self.dtype, self.ds_config)
        else:
            chunk = build_model_chunk(self.cfg, self.padded_vocab, self.dtype)
        self._count_parameters([chunk])
        if zero3:
            self._log_partitioned_construction(chunk)
        weights = self._decide_checkpoint()[1]
        if weights:  # a new run from a checkpoint's weights, loaded into the whole model (under ZeRO-3 gathered)
            with reading_checkpoint(weights):
                self._load_weights(chunk, weights, zero3)
        self._tp_hooks = register_tp_gradient_sums(chunk)
        groups = param_groups(chunk, self.cfg.optim)
        self.engine, optimizer, _, _ = deepspeed.initialize(
            model=chunk, model_parameters=groups, config=self.ds_config, mpu=MegatronParallelState()
        )
        self.engine.checkpoint_engine = WeightsOnlyCheckpointEngine(self.engine.checkpoint_engine)
        self._ds_optimizer = optimizer
        return chunk

    def _log_partitioned_construction(self, chunk) -> None:
        """What this rank holds after building the model partitioned (collective over all ranks)."""
        from megatron.core import parallel_state

        held = resident_parameter_elements(chunk)
        whole = sum(parameter_numel(p) for p in chunk.parameters())
        most, = distributed.all_reduce_values([held], op="max")
        if self.rank == 0:
            logger.info(
                "ZeRO-3: model built partitioned over %d data-parallel ranks; after construction a rank holds at most "
                "%s of the %s parameter elements of its model chunk",
                parallel_state.get_data_parallel_world_size(), f"{int(most):,}", f"{whole:,}",
            )

    def _load_weights(self, chunk, weights: str, zero3: bool) -> None:
        """Checkpoint ``weights`` into ``chunk`` before DeepSpeed wraps it. Under ZeRO-3 the parameters are gathered
        whole for the load (every rank reads the same checkpoint; rank 0's values are kept) and partitioned again."""
        if not zero3:
            if torch.cuda.is_available():  # loaded on the device, as engine=megatron does (NCCL moves no CPU tensor)
                chunk.cuda(torch.cuda.current_device())
            load_weights_into_chunk(chunk, weights)
            return
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters(list(chunk.parameters()), modifier_rank=0):
            load_weights_into_chunk(chunk, weights)

    def _build_optimizer(self):
        return self._ds_optimizer, self._lr_scheduler(self._ds_optimizer)

    def _checkpoint_manager(self, root: str) -> CheckpointManager:
        return DeepSpeedCheckpointManager(self, root)

    def _memory_switches_line(self) -> str:
        e, t = self.cfg.engine, self.cfg.trainer
        line = f"DeepSpeed ZeRO-{e.zero_stage}, optimizer offload {e.offload_optimizer}"
        if e.zero_stage == 3:
            line += f", parameter offload {e.offload_param}"
        return line + f", recompute {t.recompute}, sequence parallel {'on' if self.cfg.parallel.sequence_parallel else 'off'}"

    # -- steps -------------------------------------------------------------------------------------------------------
    def _micro_batch_loss(self, data_iter: Iterator):
        """(loss to backpropagate, its detached value) of the next micro-batch."""
        batch = next(data_iter)
        device = self.engine.device
        tokens, position_ids, documents = model_inputs(batch, device, self.cfg.data.reset_position_ids)
        output = self.engine(tokens, position_ids, None, labels=batch["labels"].to(device, non_blocking=True),
                             packed_seq_params=documents)
        loss, info = loss_func(batch["loss_mask"].to(device, non_blocking=True), output)
        return loss, info["lm loss"]

    def _mean_over_data_parallel(self, losses: List[torch.Tensor]) -> float:
        from megatron.core import parallel_state

        local = torch.stack([x.double() for x in losses]).mean()
        (total,) = distributed.all_reduce_values([float(local)], group=parallel_state.get_data_parallel_group())
        return total / self.dp_size

    def _forward_backward(self, data_iter: Iterator, forward_only: bool) -> Optional[float]:
        """Validation: the mean loss of one global batch (training steps go through :meth:`train_step`)."""
        if not forward_only:
            raise NotImplementedError("engine=deepspeed trains through train_step")
        losses = [self._micro_batch_loss(data_iter)[1] for _ in range(self.num_microbatches)]
        return self._mean_over_data_parallel(losses)

    def train_step(self, data_iter: Iterator) -> Dict[str, Any]:
        """One optimizer step of ``num_microbatches`` forward-backward passes (DeepSpeed reduces and steps at the
        last); a bad loss skips the update but consumes the batch, as with engine=megatron."""
        engine = self.engine
        losses: List[torch.Tensor] = []
        bad_reason, grad_norm = None, None
        for i in range(self.num_microbatches):
            loss, value = self._micro_batch_loss(data_iter)
            losses.append(value)
            last = i == self.num_microbatches - 1
            if last:  # the step's loss is known before its last backward: judge it there
                step_loss = self._mean_over_data_parallel(losses)
                if self.step + 1 in self.cfg.failures.inject_nan_at_steps:
                    step_loss = float("nan")
                bad_reason = self.bad_steps.check(step_loss)
                if bad_reason is not None and _drops_nonfinite_steps(engine):
                    loss = loss * float("nan")  # DeepSpeed's optimizers drop a step with non-finite gradients
            with self._update_skipped(bad_reason is not None):
                engine.backward(loss)
                if last and bad_reason is None:
                    grad_norm = self._fp32_zero0_grad_norm()
                engine.step()
        if bad_reason is None:
            self.scheduler.step(increment=1)
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
        else:
            self.skipped_steps += 1
            grad_norm = None
        self.step += 1
        self.consumed_samples += self.cfg.trainer.global_batch_size
        return {
            "loss": step_loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": bad_reason,
        }

    @contextlib.contextmanager
    def _update_skipped(self, skip: bool):
        """With ``skip``, the bare torch optimizer (ZeRO-0 in fp32, which DeepSpeed does not wrap) is not stepped; the
        engine then drops the gradients as after any step. DeepSpeed's own optimizers skip by themselves."""
        optimizer = self.engine.optimizer
        if not skip or _drops_nonfinite_steps(self.engine):
            yield
            return
        optimizer.step = lambda *args, **kwargs: None
        try:
            yield
        finally:
            del optimizer.step

    def _fp32_zero0_grad_norm(self) -> Optional[float]:
        """The gradient norm at ZeRO-0 in fp32, where DeepSpeed steps the bare torch optimizer and reports none: the
        data-parallel mean gradients (reduced by the last backward), TP-replicated parameters counted on TP rank 0
        only, as DeepSpeed's and megatron-core's norms count them. None elsewhere (DeepSpeed reports it)."""
        if _drops_nonfinite_steps(self.engine):
            return None
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        squares = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        for p in self.engine.module.parameters():
            if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0):
                squares += p.grad.detach().double().pow(2).sum()
        (total,) = distributed.all_reduce_values(
            [float(squares)], group=parallel_state.get_tensor_model_parallel_group()
        )
        return total**0.5

    def lambdas(self) -> List[float]:
        """Per-layer λ; under ZeRO-3 the λ vectors are gathered from their partitions first."""
        if self.cfg.engine.zero_stage != 3:
            return super().lambdas()
        from deepspeed.runtime.zero import GatheredParameters

        from diff_transformer.models.gpt import diff_attention_modules

        params = [p for m in diff_attention_modules(self.model) for p in m.parameters(recurse=False)]
        with GatheredParameters(params, modifier_rank=None):
            return super().lambdas()


def _drops_nonfinite_steps(engine) -> bool:
    """Whether the engine's optimizer is one of DeepSpeed's (ZeRO 1–3, bf16), which skip a step whose gradients are
    not finite and report it through ``overflow``; the engine reads the same attribute."""
    return hasattr(engine.optimizer, "overflow")


# ------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------------------------
class WeightsOnlyCheckpointEngine:
    """DeepSpeed's checkpoint engine (it reads every file of ``load_checkpoint``) with its loads made
    ``weights_only``: DeepSpeed's own TorchCheckpointEngine unpickles with ``weights_only=False``."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str):
        if name == "_inner":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return load_deepspeed_file(path, map_location)


class DeepSpeedCheckpointManager(CheckpointManager):
    """DeepSpeed's ``save_checkpoint``/``load_checkpoint`` inside :class:`CheckpointManager`'s protocol. A step
    directory holds DeepSpeed's files (``mp_rank_XX_model_states.pt``, ZeRO's ``*_optim_states.pt`` partitions,
    its ``zero_to_fp32.py``), ``rng_state_rankNNNNN.pt`` per rank and ``trainer_state.json`` (written last); the LR
    schedule travels in DeepSpeed's client state."""

    def _write(self, tmp: str):
        root, tag = os.path.split(tmp)
        engine = self.trainer.engine
        engine.save_checkpoint(
            root, tag=tag, client_state={"opt_param_scheduler": self.trainer.scheduler.state_dict()},
            save_latest=False,
        )
        torch.save(rng_state(), os.path.join(tmp, RNG_FILE.format(rank=self.rank)))
        self._record_files_by_rank(tmp)  # for the manifest: DeepSpeed's writer records nothing itself
        return None  # synchronous (config validation refuses checkpoint.async_save)

    def load(self, path: str, weights_only: bool = False) -> Dict[str, Any]:
        saved = read_trainer_state(path)
        if weights_only:  # loaded into the model before deepspeed.initialize (DeepSpeedTrainer._build_model)
            return saved
        check_resumable(path, saved, self.trainer.cfg)
        self.expected_bytes = checkpoint_bytes(path)
        root, tag = os.path.split(os.path.normpath(path))
        with reading_checkpoint(path):
            loaded, client_state = self.trainer.engine.load_checkpoint(
                root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
            if loaded is None:
                raise ValueError(f"DeepSpeed found no checkpoint to load in {path}")
            compat.restore_nvme_optimizer_memory_state(self.trainer.engine, root, tag)
            self.trainer.scheduler.load_state_dict(client_state["opt_param_scheduler"])
            set_rng_state(load_weights_only(os.path.join(path, RNG_FILE.format(rank=self.rank))))
        distributed.barrier()
        return saved


def load_weights_into_chunk(chunk: torch.nn.Module, path: str) -> None:
    """The weights of checkpoint ``path`` into this rank's model chunk (whole, before DeepSpeed wraps it): a torch_dist
    checkpoint (engine=megatron, or converted) on any TP layout; a DeepSpeed checkpoint saved at the same TP."""
    from diff_transformer.training.checkpoint_tools import (
        deepspeed_tp_state_dicts,
        load_state_dict_but_extra_state,
    )

    saved = read_trainer_state(path)
    if saved_engine(saved) != "deepspeed":  # DEX-aware: a softmax checkpoint into a DEX model leaves W_D at zero
        load_model_weights(chunk, path, saved["config"]["model"])
        return
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if saved["layout"]["tp"] != tp:
        raise ValueError(
            f"checkpoint {path} was saved by engine=deepspeed at parallel.tp={saved['layout']['tp']}, the run uses "
            f"parallel.tp={tp}: convert it first (python -m diff_transformer.checkpoint convert {path} OUT "
            "--to torch_dist), then start from checkpoint.load_weights_only=OUT"
        )
    state = deepspeed_tp_state_dicts(path, ranks=[parallel_state.get_tensor_model_parallel_rank()])[0]
    load_state_dict_but_extra_state(chunk, state, path)

