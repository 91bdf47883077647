"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, with YAML files only setting values.

Groups are orthogonal (``model``, ``parallel``, ``data``, ``optim``, ``trainer``, ``engine``, ``logging``, ``experiment``), so a mirrored baseline is ``model.attention=vanilla`` and a sweep is one multirun line.
:func:`validate` checks every cross-field constraint before any process group starts and names the bad value.
Every group's schema lives here, so the training code, the launchers and the tools read one definition.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from data.config import DataConfig


DEX_SELECTIONS = ("calibrate", "all", "none", "list")


@dataclass
class DexConfig:
    """``model.dex``: DEX (model.attention=dex), differential attention added to a pretrained softmax model."""

    select: str = "calibrate"  # calibrate | all | none | list: how the heads that get W_D are chosen
    # per layer, the global indices (0 .. 2H-1) of the softmax heads that get W_D; select=list reads it, the other
    # modes fill it in before the model is built (recorded in config.yaml and checkpoints; a resumed run reuses it)
    heads: Optional[List[List[int]]] = None
    head_fraction: float = 0.5  # calibrate: the share of each layer's heads selected (rounded up)
    calibration_samples: int = 64  # calibrate: sequences of the training data the criterion is measured on
    lambda_anneal_steps: Optional[int] = None  # steps over which λ moves from λ_init to its learned value (None: all)
    lambda_anneal: str = "linear"  # linear | cosine
    train_base: bool = False  # false: only W_D and λ train; true: the whole model


@dataclass
class ModelConfig:
    name: str = MISSING
    # a key of ATTENTION_KINDS: diff | vanilla | diff_v2 | vanilla_subln | vanilla_wide | topk | signed_mask
    attention: str = "diff"
    # auto (timed once per GPU and shape; by rule on a CPU) | eager | sdpa | flash_attn | flash_attn4 | triton |
    # combined (each kind's: docs/speed.md)
    attention_backend: str = "auto"
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING  # differential heads H; the mirrored baseline has 2H heads of size head_dim
    num_kv_heads: Optional[int] = None  # differential KV groups Hkv (GQA); None means Hkv = H
    head_dim: Optional[int] = None  # d; None means hidden_size / (2H)
    ffn_hidden_size: int = MISSING
    vocab_size: Optional[int] = None  # None: the tokenizer's vocabulary, padded for TP
    seq_length: int = 2048
    share_embeddings: bool = True
    init_std: float = 0.02
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    lambda_init: Optional[float] = None  # None: the per-layer schedule 0.8 - 0.6 exp(-0.3 (l-1)); a number fixes it
    lambda_learnable: bool = True  # DIFF: false freezes λ at λ_init (ablation; with lambda_init=1.0: pure cancellation)
    sublayer_norm: bool = True  # DIFF's per-head RMSNorm (ablation: false)
    topk: Optional[int] = None  # topk: scores each query keeps (None: 32)
    make_vocab_size_divisible_by: int = 128
    dex: DexConfig = field(default_factory=DexConfig)  # read by model.attention=dex only


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    # context parallelism: each sequence split over cp ranks (ring attention); null: the smallest the memory plan fits
    cp: Optional[int] = 1
    distributed_optimizer: bool = False
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    sequence_parallel: bool = False  # shard norms, residuals and their activations over the sequence (needs tp >= 2)
    overlap_grad_reduce: bool = False  # reduce gradients bucket by bucket during the backward pass
    overlap_param_gather: bool = False  # gather updated parameters during the next forward (distributed optimizer)
    ddp_bucket_size: Optional[int] = None  # parameters per communication bucket; None: megatron's max(4e7, 1e6 dp)


@dataclass
class OptimConfig:
    lr: float = 1.5e-3
    min_lr: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.05
    warmup_steps: int = 375
    decay: str = "linear"  # linear | cosine | constant | wsd (warm-up, stable, then a (1 - sqrt) cooldown)
    clip_grad: float = 1.0
    # wsd: the cooldown's length, a fraction of trainer.max_steps, or cooldown_steps when set
    cooldown_fraction: float = 0.2
    cooldown_steps: Optional[int] = None


@dataclass
class TrainerConfig:
    max_steps: int = MISSING
    micro_batch_size: int = 1
    global_batch_size: int = MISSING
    eval_interval: int = 100  # validation every N steps (0: never)
    eval_iters: int = 10
    log_interval: int = 1
    precision: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | fp32 | bf16
    recompute: str = "none"  # activation recomputation: none | selective (core attention) | full (whole layers)
    recompute_method: str = "uniform"  # full: uniform (every layer, in groups) | block (the first N of each stage)
    recompute_layers: Optional[int] = None  # full: layers per group (uniform, default 1) or N (block, default all)
    gpu_memory_gib: Optional[float] = None  # memory plan budget per device; None: the GPU's memory (no check on CPU)
    # attention entropy, sink rate and largest logit per layer on eval steps: auto (on when it costs <= 1%) | on | off
    attention_diagnostics: str = "auto"
    # fused RoPE, SwiGLU, cross-entropy and DIFF epilogue: auto (on with CUDA, off on a CPU) | on | off
    fusions: str = "auto"
    diff_epilogue: str = "triton"  # the DIFF epilogue when fusions are on: triton (one kernel each way) | compile
    # each linear layer's weight gradient accumulated into the fp32 main gradient in its GEMM (megatron-core's
    # gradient_accumulation_fusion, without Apex: models/weight_gradient.py): auto (on with CUDA, off on a CPU) | on | off
    grad_accumulation_fusion: str = "auto"
    # each transformer layer under torch.compile (inductor fuses norms, RoPE, SwiGLU, residuals), with its core
    # attention on sdpa and combined (outside CP, selective recomputation, document masking), eager on the others;
    # the first step pays the compilation; evaluation runs eagerly
    compile: bool = False
    # the compiled layers replayed as CUDA graphs (inductor's graph trees: torch.compile's reduce-overhead), one launch
    # per layer each way: off | layers (needs trainer.compile; tp=pp=cp=1, no recomputation, no document masking)
    cuda_graphs: str = "off"
    profile_step: Optional[int] = None  # write profile_step_<N>.json: step N's time by kind of work (torch.profiler)
    # draw the initial weights on the GPU (seconds instead of minutes for billions of parameters); they then depend
    # on the TP layout, unlike the default CPU initialisation (and a resume or weights-only start loads them anyway)
    init_on_gpu: bool = False


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None: <run dir>/checkpoints
    interval: int = 1000  # save every N steps (0: only at the end and on a signal)
    save_at_end: bool = True
    keep_last: int = 3  # keep the newest K checkpoints ...
    keep_every: int = 0  # ... and every checkpoint whose step is a multiple of M (0: none)
    resume: str = "auto"  # auto: latest under dir, if any | none | a checkpoint path (step_* or a checkpoints dir)
    load_weights_only: Optional[str] = None  # a checkpoint whose weights start a new run (step 0, fresh optimizer)
    async_save: bool = False  # write from a forked process; the loop blocks only while the state is staged
    check_free_space: bool = True  # at start-up and before each save: is there room for one more checkpoint?
    on_disk_full: str = "skip"  # no room before an interval save: skip it with a warning | stop the run
    verify: bool = True  # record each file's crc32 when saving and check it before loading (false: sizes only)
    # a cooldown branch: start from another run's checkpoint (model, optimizer, data position), read only, and train
    # to this run's trainer.max_steps; branch_step null: where this run's cooldown begins
    branch_from: Optional[str] = None  # the source run directory (or one of its checkpoints)
    branch_step: Optional[int] = None


RESUME_MODES = ("auto", "none")
DISK_FULL_ACTIONS = ("skip", "stop")


def validate_checkpoint_config(c: CheckpointConfig) -> None:
    """Raise ValueError naming the first invalid ``checkpoint.*`` value."""
    if c.interval < 0:
        raise ValueError(f"checkpoint.interval={c.interval} must be >= 0 (0 saves only at the end and on signals)")
    if c.keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={c.keep_last} must be >= 1 (the newest checkpoint is always kept)")
    if c.keep_every < 0:
        raise ValueError(f"checkpoint.keep_every={c.keep_every} must be >= 0 (0 keeps no extra checkpoints)")
    if c.resume not in RESUME_MODES and not os.path.exists(c.resume):
        raise ValueError(f"checkpoint.resume={c.resume!r} is neither auto, none, nor an existing checkpoint path")
    if c.load_weights_only is not None and not os.path.exists(c.load_weights_only):
        raise ValueError(f"checkpoint.load_weights_only={c.load_weights_only!r} does not exist")
    if c.on_disk_full not in DISK_FULL_ACTIONS:
        raise ValueError(
            f"checkpoint.on_disk_full={c.on_disk_full!r} is unknown; use skip (an interval save with no room is "
            "skipped with a warning) or stop (the run stops with an error)"
        )


SIGNAL_NAMES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")


@dataclass
class FailureConfig:
    signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGUSR2"])  # save, then exit
    # seconds from the signal to a forced exit, when the save has not finished (the scheduler kills soon after);
    # None: SHUTDOWN_GRACE_S from the launcher, else 120
    grace_period_s: Optional[float] = None
    max_consecutive_bad_steps: int = 5  # stop with a checkpoint after this many skipped steps in a row
    loss_spike_factor: float = 0.0  # skip a step whose loss exceeds this times the recent mean (0: off)
    loss_spike_window: int = 20  # good steps in that mean; no spike test before the window is full
    inject_nan_at_steps: List[int] = field(default_factory=list)  # testing: these steps' loss and grads become NaN


def validate_failure_config(f: FailureConfig) -> None:
    for name in f.signals:
        if name not in SIGNAL_NAMES:
            raise ValueError(f"failures.signals has {name!r}; use names from {', '.join(SIGNAL_NAMES)}")
    if f.grace_period_s is not None and f.grace_period_s <= 0:
        raise ValueError(f"failures.grace_period_s={f.grace_period_s} must be positive (or null for the default)")
    if f.max_consecutive_bad_steps < 1:
        raise ValueError(f"failures.max_consecutive_bad_steps={f.max_consecutive_bad_steps} must be >= 1")
    if f.loss_spike_factor != 0 and f.loss_spike_factor <= 1:
        raise ValueError(f"failures.loss_spike_factor={f.loss_spike_factor} must be > 1 (or 0 to turn it off)")
    if f.loss_spike_window < 1:
        raise ValueError(f"failures.loss_spike_window={f.loss_spike_window} must be >= 1")


WANDB_MODES = ("offline", "online", "disabled")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline (default, no account) | online | disabled
    project: str = "diff-transformer"
    entity: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    level: str = "INFO"
    peak_tflops_per_device: Optional[float] = None  # for MFU; None: the datasheet bf16 peak of a known GPU, none on CPU


# ------------------------------------------------------------------------------------------------------------------
# engine: megatron-core (DDP / distributed optimizer, every parallel layout) or DeepSpeed ZeRO (TP and DP)
# ------------------------------------------------------------------------------------------------------------------
ENGINES = ("megatron", "deepspeed")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass
class EngineConfig:
    name: str = "megatron"  # megatron | deepspeed
    zero_stage: Optional[int] = None  # deepspeed: 0 (DDP), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)
    offload_optimizer: str = "none"  # deepspeed, stage >= 1: none | cpu | nvme (optimizer states and step)
    offload_param: str = "none"  # deepspeed, stage 3: none | cpu | nvme
    nvme_path: Optional[str] = None  # a local NVMe directory for offload to nvme
    extra: Dict[str, Any] = field(default_factory=dict)  # merged into the generated DeepSpeed JSON last


# (key, the value that means "not used") of the keys only engine=deepspeed reads
DEEPSPEED_KEY_DEFAULTS = {"zero_stage": None, "offload_optimizer": "none", "offload_param": "none", "nvme_path": None, "extra": {}}


def validate_engine(cfg: Any) -> None:
    """``engine.*`` and what it implies for the other groups. Pure config: whether the installed DeepSpeed can do
    it is checked by ``training.deepspeed_engine.check_deepspeed_support`` (also before any process group)."""
    e, p = cfg.engine, cfg.parallel
    if e.name not in ENGINES:
        raise ValueError(f"engine={e.name!r} is unknown; use one of {', '.join(ENGINES)}")
    if e.name == "megatron":
        for key, unused in DEEPSPEED_KEY_DEFAULTS.items():
            value = getattr(e, key)
            if value != unused:
                raise ValueError(
                    f"engine.{key}={value} applies to engine=deepspeed only (the run uses engine=megatron); add "
                    "engine=deepspeed or leave it unset"
                )
        return
    if e.zero_stage not in ZERO_STAGES:
        raise ValueError(f"engine.zero_stage={e.zero_stage} is unknown; use 0, 1, 2 or 3")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(e, key) not in OFFLOAD_DEVICES:
            raise ValueError(f"engine.{key}={getattr(e, key)!r} is unknown; use one of {', '.join(OFFLOAD_DEVICES)}")
    if e.offload_optimizer != "none" and e.zero_stage == 0:
        raise ValueError(
            f"engine.offload_optimizer={e.offload_optimizer} needs engine.zero_stage >= 1 (it offloads ZeRO's "
            "partitioned optimizer states); the run has engine.zero_stage=0"
        )
    if e.offload_param != "none" and e.zero_stage != 3:
        raise ValueError(
            f"engine.offload_param={e.offload_param} needs engine.zero_stage=3 (only stage 3 partitions the "
            f"parameters); the run has engine.zero_stage={e.zero_stage}"
        )
    nvme_keys = [k for k in ("offload_optimizer", "offload_param") if getattr(e, k) == "nvme"]
    if nvme_keys and not e.nvme_path:
        raise ValueError(
            f"engine.{nvme_keys[0]}=nvme needs engine.nvme_path (a directory on a local NVMe drive, e.g. "
            "engine.nvme_path=/local_nvme/offload)"
        )
    if e.offload_optimizer == "nvme" and e.zero_stage != 3:
        raise ValueError(
            f"engine.offload_optimizer=nvme needs engine.zero_stage=3 (DeepSpeed swaps optimizer states to NVMe at "
            f"stage 3 only; at stage {e.zero_stage} it keeps them in host memory); the run has "
            f"engine.zero_stage={e.zero_stage}: use engine.offload_optimizer=cpu, or engine.zero_stage=3"
        )
    if e.nvme_path and not nvme_keys:
        raise ValueError(
            f"engine.nvme_path={e.nvme_path} is read only with engine.offload_optimizer=nvme or "
            "engine.offload_param=nvme; set one of them or leave it unset"
        )
    if p.cp is None or p.cp > 1:
        raise ValueError(
            f"engine=deepspeed does not run context parallelism (parallel.cp={_shown(p.cp)}); use engine=megatron for "
            "CP, or parallel.cp=1"
        )
    if p.pp > 1:
        raise ValueError(
            f"engine=deepspeed does not run pipeline parallelism (parallel.pp={p.pp}); use engine=megatron for PP, "
            "or parallel.pp=1"
        )
    for key, instead in (
        ("distributed_optimizer", "engine.zero_stage >= 1 partitions the optimizer states"),
        ("overlap_grad_reduce", "DeepSpeed overlaps its own reductions (engine.extra.zero_optimization.overlap_comm)"),
        ("overlap_param_gather", "engine.zero_stage=3 gathers parameters layer by layer during the forward"),
    ):
        if getattr(p, key):
            raise ValueError(f"parallel.{key}=true is megatron-core's (engine=megatron); with engine=deepspeed, {instead}")
    if p.ddp_bucket_size is not None:
        raise ValueError(
            f"parallel.ddp_bucket_size={p.ddp_bucket_size} sizes megatron-core DDP's buckets (engine=megatron); with "
            "engine=deepspeed set engine.extra.zero_optimization.reduce_bucket_size"
        )
    if cfg.checkpoint.async_save:
        raise ValueError(
            "checkpoint.async_save=true uses megatron-core's torch_dist writer (engine=megatron); engine=deepspeed "
            "saves synchronously: set checkpoint.async_save=false"
        )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    name: str = "default"  # experiment name (the W&B group)
    seed: int = 1234
    # a fresh start in a run directory that holds a run moves the old run aside (<dir>.old-<time>) instead of refusing
    overwrite_run: bool = False


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)


PRECISIONS = ("auto", "fp32", "bf16")
DECAYS = ("linear", "cosine", "constant", "wsd")
RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_DIAGNOSTICS_MODES = ("auto", "on", "off")
FUSION_MODES = ("auto", "on", "off")
CUDA_GRAPH_MODES = ("off", "layers")


def _divisors(n: int) -> str:
    return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)


def validate_settings(cfg: Any) -> None:
    """The values whose check needs neither the attention kinds (megatron-core) nor the world size: checked first,
    also by train.py before it imports torch."""
    p, t, o = cfg.parallel, cfg.trainer, cfg.optim
    validate_checkpoint_config(cfg.checkpoint)
    validate_failure_config(cfg.failures)
    if t.max_steps < 1:
        raise ValueError(f"trainer.max_steps={t.max_steps} must be at least 1")
    if t.eval_interval < 0:
        raise ValueError(f"trainer.eval_interval={t.eval_interval} must be >= 0 (0: no validation)")
    if t.eval_interval > 0 and t.eval_iters < 1:
        raise ValueError(f"trainer.eval_iters={t.eval_iters} must be at least 1 when validating every "
                         f"trainer.eval_interval={t.eval_interval} steps (or set trainer.eval_interval=0: no validation)")
    if t.log_interval < 1:
        raise ValueError(f"trainer.log_interval={t.log_interval} must be at least 1 (the progress line every N steps)")
    if t.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={t.precision!r} is unknown; use one of {', '.join(PRECISIONS)}")
    if t.attention_diagnostics not in ATTENTION_DIAGNOSTICS_MODES:
        raise ValueError(f"trainer.attention_diagnostics={t.attention_diagnostics!r} is unknown; use one of "
                         f"{', '.join(ATTENTION_DIAGNOSTICS_MODES)}")
    if t.gpu_memory_gib is not None and t.gpu_memory_gib <= 0:
        raise ValueError(f"trainer.gpu_memory_gib={t.gpu_memory_gib} must be positive (or null: the GPU's memory)")
    if t.fusions not in FUSION_MODES:
        raise ValueError(f"trainer.fusions={t.fusions!r} is unknown; use one of {', '.join(FUSION_MODES)}")
    if t.grad_accumulation_fusion not in FUSION_MODES:
        raise ValueError(f"trainer.grad_accumulation_fusion={t.grad_accumulation_fusion!r} is unknown; use one of "
                         f"{', '.join(FUSION_MODES)}")
    if t.cuda_graphs not in CUDA_GRAPH_MODES:
        raise ValueError(f"trainer.cuda_graphs={t.cuda_graphs!r} is unknown; use one of {', '.join(CUDA_GRAPH_MODES)}")
    if t.profile_step is not None and not 1 <= t.profile_step <= t.max_steps:
        raise ValueError(f"trainer.profile_step={t.profile_step} must be a step of the run, 1..{t.max_steps} (or null)")
    if o.decay not in DECAYS:
        raise ValueError(f"optim.decay={o.decay!r} is unknown; use one of {', '.join(DECAYS)}")
    if not (o.lr > 0 and 0 <= o.min_lr <= o.lr):
        raise ValueError(f"optim.lr={o.lr} must be positive and optim.min_lr={o.min_lr} within [0, lr]")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ValueError(f"optim.{key}={getattr(o, key)} must lie in [0, 1)")
    if not o.eps > 0:
        raise ValueError(f"optim.eps={o.eps} must be positive")
    if not o.weight_decay >= 0:
        raise ValueError(f"optim.weight_decay={o.weight_decay} must be >= 0")
    if not o.clip_grad >= 0:
        raise ValueError(f"optim.clip_grad={o.clip_grad} must be >= 0 (0: no clipping)")
    if o.warmup_steps < 0 or o.warmup_steps >= t.max_steps:
        raise ValueError(
            f"optim.warmup_steps={o.warmup_steps} must lie in [0, trainer.max_steps={t.max_steps}) so that the "
            "learning rate has steps left to decay"
        )
    if o.decay == "wsd":
        validate_cooldown(o, t.max_steps)
    validate_branch_keys(cfg)
    if p.backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"parallel.backend={p.backend!r} is unknown; use auto, nccl or gloo")
    if cfg.logging.level not in LOG_LEVELS:
        raise ValueError(f"logging.level={cfg.logging.level!r} is unknown; use one of {', '.join(LOG_LEVELS)}")
    if cfg.logging.wandb.mode not in WANDB_MODES:
        raise ValueError(
            f"logging.wandb.mode={cfg.logging.wandb.mode!r} is unknown; use one of {', '.join(WANDB_MODES)}"
        )


def cooldown_steps(o: Any, max_steps: int) -> int:
    """The length of ``optim.decay=wsd``'s final cooldown: ``optim.cooldown_steps``, else ``cooldown_fraction`` of
    ``max_steps`` (at least one step)."""
    if o.cooldown_steps is not None:
        return o.cooldown_steps
    return max(1, round(o.cooldown_fraction * max_steps))


def validate_cooldown(o: Any, max_steps: int) -> None:
    if not 0 < o.cooldown_fraction < 1:
        raise ValueError(f"optim.cooldown_fraction={o.cooldown_fraction} must lie in (0, 1): the share of "
                         "trainer.max_steps spent cooling down (0.2 is usual)")
    room = max_steps - o.warmup_steps
    if o.cooldown_steps is not None and not 1 <= o.cooldown_steps <= room:
        raise ValueError(f"optim.cooldown_steps={o.cooldown_steps} must lie in [1, {room}] (trainer.max_steps="
                         f"{max_steps} minus optim.warmup_steps={o.warmup_steps}), or null: optim.cooldown_fraction")
    if cooldown_steps(o, max_steps) > room:
        raise ValueError(f"optim.cooldown_fraction={o.cooldown_fraction} gives a cooldown of "
                         f"{cooldown_steps(o, max_steps)} steps, more than the {room} after the warm-up "
                         f"(optim.warmup_steps={o.warmup_steps}): lower one of them")


def validate_branch_keys(cfg: Any) -> None:
    """The cheap checks of ``checkpoint.branch_from``/``branch_step``; the source itself is checked by
    ``training.branching.resolve_branch``."""
    c, o = cfg.checkpoint, cfg.optim
    if c.branch_from is None:
        if c.branch_step is not None:
            raise ValueError(f"checkpoint.branch_step={c.branch_step} needs checkpoint.branch_from=<the source run "
                             "directory>")
        return
    if o.decay != "wsd":
        raise ValueError(f"checkpoint.branch_from is a cooldown branch and needs optim.decay=wsd, not "
                         f"optim.decay={o.decay}")
    if c.load_weights_only is not None or c.resume not in RESUME_MODES:
        raise ValueError("checkpoint.branch_from starts the run from the source's checkpoint: leave "
                         "checkpoint.load_weights_only unset and checkpoint.resume=auto")
    start = cfg.trainer.max_steps - cooldown_steps(o, cfg.trainer.max_steps)
    if c.branch_step is not None and not 0 < c.branch_step <= start:
        raise ValueError(f"checkpoint.branch_step={c.branch_step} must lie in [1, {start}]: before this run's "
                         f"cooldown, which starts at step {start} (trainer.max_steps={cfg.trainer.max_steps}), or "
                         "null: that step")


def validate(cfg: Any, world_size: int) -> None:
    """Raise ValueError naming the first invalid value. Cheap: runs before any process group starts; the shapes and
    the layout are checked before megatron-core is imported (seconds), the attention kinds' own rules after."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    validate_settings(cfg)
    for key in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "seq_length"):
        if getattr(m, key) < 1:
            raise ValueError(f"model.{key}={getattr(m, key)} must be a positive integer")
    if m.head_dim is None and m.hidden_size % (2 * m.num_heads):
        raise ValueError(
            f"model.hidden_size={m.hidden_size} is not divisible by 2*model.num_heads={2 * m.num_heads}; "
            "set model.head_dim explicitly"
        )
    kv = m.num_kv_heads if m.num_kv_heads is not None else m.num_heads  # layer_specs.num_kv_heads, without megatron
    if kv < 1 or m.num_heads % kv:
        why = (
            " (DIFF V2 subtracts query heads 2h and 2h+1, which must share one KV head)"
            if m.attention == "diff_v2" else ""
        )
        raise ValueError(
            f"model.num_kv_heads={kv} must divide model.num_heads={m.num_heads}{why}; use {_divisors(m.num_heads)}"
        )
    validate_engine(cfg)  # before the layout: engine=deepspeed refuses PP whatever the world size
    if p.tp < 1 or p.pp < 1 or (p.cp is not None and p.cp < 1):
        raise ValueError(
            f"parallel.tp={p.tp}, parallel.pp={p.pp} and parallel.cp={_shown(p.cp)} must be positive (parallel.cp may "
            "be null: chosen by the memory plan)"
        )
    if m.num_heads % p.tp:
        raise ValueError(
            f"parallel.tp={p.tp} does not divide model.num_heads={m.num_heads} (a differential head's pair of "
            f"softmax heads stays on one rank); use {_divisors(m.num_heads)}"
        )
    if kv % p.tp:
        raise ValueError(f"parallel.tp={p.tp} does not divide model.num_kv_heads={kv}; use {_divisors(kv)}")
    if m.num_layers % p.pp:
        raise ValueError(
            f"parallel.pp={p.pp} does not divide model.num_layers={m.num_layers}; use {_divisors(m.num_layers)}"
        )
    model_parallel = p.tp * p.pp * (p.cp or 1)
    if world_size % model_parallel:
        names = "parallel.tp*parallel.pp" + ("*parallel.cp" if p.cp not in (None, 1) else "")
        raise ValueError(
            f"world size {world_size} is not divisible by {names}={model_parallel}; launch a multiple "
            f"of {model_parallel} processes or change the layout"
        )
    dp = world_size // model_parallel
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ValueError(
            f"trainer.micro_batch_size={t.micro_batch_size} and trainer.global_batch_size={t.global_batch_size} "
            "must be positive"
        )
    if p.cp is not None and t.global_batch_size % (t.micro_batch_size * dp):  # null: checked once chosen
        raise ValueError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}"
        )
    validate_recompute(t, m.num_layers // p.pp)
    validate_parallel_switches(p, m.seq_length, dp)
    validate_compile(cfg)
    # the attention kinds are megatron-core ModuleSpecs: imported here, after the checks that need none of them
    from diff_transformer.models.attention import BACKENDS, EPILOGUE_IMPLS
    from diff_transformer.models.layer_specs import ATTENTION_KINDS

    backend_choices = ("auto",) + BACKENDS
    if m.attention not in ATTENTION_KINDS:
        raise ValueError(f"model.attention={m.attention!r} is unknown; use one of {', '.join(ATTENTION_KINDS)}")
    if m.attention_backend not in backend_choices:
        raise ValueError(
            f"model.attention_backend={m.attention_backend!r} is unknown; use one of {', '.join(backend_choices)}"
        )
    validate_attention_kind(m)
    validate_cuda_graphs(cfg)
    fused_epilogues = tuple(e for e in EPILOGUE_IMPLS if e != "unfused")
    if t.diff_epilogue not in fused_epilogues:
        raise ValueError(f"trainer.diff_epilogue={t.diff_epilogue!r} is unknown; use one of {', '.join(fused_epilogues)}")
    validate_context_parallel(cfg)
    validate_flash_library(m.attention_backend)  # a machine's lack, after what the config itself gets wrong


def validate_flash_library(backend: str) -> None:
    """A FlashAttention backend named explicitly needs its library here (``auto`` only times what is installed)."""
    from diff_transformer.models.attention.base import FLASH_LIBRARIES, flash_library_installed

    if backend in FLASH_LIBRARIES and not flash_library_installed(backend):
        raise ValueError(f"model.attention_backend={backend} needs {FLASH_LIBRARIES[backend][1]}, which is not "
                         "installed here; use model.attention_backend=auto or sdpa")


def validate_attention_kind(m: ModelConfig) -> None:
    """The backend and the ablation keys must fit ``model.attention``: a key a kind does not read is refused."""
    from diff_transformer.models.layer_specs import ABLATION_KEY_DEFAULTS, ATTENTION_KINDS

    kind = ATTENTION_KINDS[m.attention]
    if m.attention_backend != "auto" and m.attention_backend not in kind.backends:
        raise ValueError(
            f"model.attention={m.attention} does not run on model.attention_backend={m.attention_backend}; "
            f"use {', '.join(kind.backends)}"
        )
    for key, default in ABLATION_KEY_DEFAULTS.items():
        value = getattr(m, key)
        if key not in kind.keys and value != default:
            readers = [name for name, k in ATTENTION_KINDS.items() if key in k.keys]
            shown = str(value).lower() if isinstance(value, bool) else value  # as written in an override
            raise ValueError(
                f"model.{key}={shown} does not apply to model.attention={m.attention} (only to "
                f"{', '.join(readers)}); leave it unset"
            )
    if m.topk is not None and m.topk < 1:
        raise ValueError(f"model.topk={m.topk} must be >= 1 (scores kept per query; >= model.seq_length keeps all)")
    validate_dex(m)
    validate_rope_head_size(m, kind.heads(m)[2])
    if m.lambda_init is not None and m.lambda_init >= 1 and (m.attention != "diff" or m.lambda_learnable):
        raise ValueError(
            f"model.lambda_init={m.lambda_init} makes the output multiplier (1 - lambda_init) of "
            f"model.attention={m.attention} zero or negative; to fix DIFF's λ at 1 use model.lambda_learnable=false"
        )


def validate_rope_head_size(m: Any, head_size: int) -> None:
    """RoPE rotates pairs of features (the rotate-half layout): the heads it sees need an even size."""
    if head_size % 2 == 0:
        return
    if m.head_dim is not None:
        given = f"model.head_dim={m.head_dim}"
        fix = f"set model.head_dim={m.head_dim - 1} or {m.head_dim + 1}"
    else:
        given = (f"model.hidden_size={m.hidden_size} / (2 x model.num_heads={m.num_heads}) gives a head dim of "
                 f"{m.hidden_size // (2 * m.num_heads)}, which")
        fix = (f"use a model.hidden_size divisible by 4*model.num_heads={4 * m.num_heads}, or set model.head_dim to "
               "an even number")
    raise ValueError(f"{given} is odd: RoPE rotates pairs of features, so model.attention={m.attention}'s heads of "
                     f"size {head_size} must be even; {fix}")


def validate_dex(m: Any) -> None:
    """``model.dex.*``: read by model.attention=dex only; a selection that names existing heads of every layer."""
    from diff_transformer.models.attention import DEX_ANNEAL_SCHEDULES

    dex, defaults = m.dex, DexConfig()
    if m.attention != "dex":
        for key in DexConfig.__dataclass_fields__:
            if getattr(dex, key) != getattr(defaults, key):
                raise ValueError(f"model.dex.{key} applies to model.attention=dex only (it is {m.attention}); leave it unset")
        return
    if dex.select not in DEX_SELECTIONS:
        raise ValueError(f"model.dex.select={dex.select!r} is unknown; use one of {', '.join(DEX_SELECTIONS)}")
    if not 0 < dex.head_fraction <= 1:
        raise ValueError(f"model.dex.head_fraction={dex.head_fraction} must lie in (0, 1]")
    if dex.calibration_samples < 1:
        raise ValueError(f"model.dex.calibration_samples={dex.calibration_samples} must be >= 1")
    if dex.lambda_anneal not in DEX_ANNEAL_SCHEDULES:
        raise ValueError(
            f"model.dex.lambda_anneal={dex.lambda_anneal!r} is unknown; use one of {', '.join(DEX_ANNEAL_SCHEDULES)}"
        )
    if dex.lambda_anneal_steps is not None and dex.lambda_anneal_steps < 0:
        raise ValueError(f"model.dex.lambda_anneal_steps={dex.lambda_anneal_steps} must be >= 0 (or null: the whole run)")
    if dex.heads is None:
        if dex.select == "list":
            raise ValueError("model.dex.select=list needs model.dex.heads, one list of head indices per layer")
        return
    heads = 2 * m.num_heads
    if len(dex.heads) != m.num_layers:
        raise ValueError(
            f"model.dex.heads has {len(dex.heads)} lists for model.num_layers={m.num_layers}; give one per layer"
        )
    for layer, selected in enumerate(dex.heads, start=1):
        bad = [h for h in selected if not 0 <= h < heads]
        if bad or len(set(selected)) != len(selected):
            raise ValueError(
                f"model.dex.heads for layer {layer} is {list(selected)}: give distinct head indices in 0..{heads - 1} "
                f"(the {heads} softmax heads of model.num_heads={m.num_heads})"
            )


def validate_recompute(t: Any, layers_per_stage: int) -> None:
    """``trainer.recompute*``: a known mode and method, and a layer count that fits one pipeline stage."""
    if t.recompute not in RECOMPUTE_MODES:
        raise ValueError(f"trainer.recompute={t.recompute!r} is unknown; use one of {', '.join(RECOMPUTE_MODES)}")
    if t.recompute_method not in RECOMPUTE_METHODS:
        raise ValueError(
            f"trainer.recompute_method={t.recompute_method!r} is unknown; use one of {', '.join(RECOMPUTE_METHODS)}"
        )
    n = t.recompute_layers
    if n is None:
        return
    if t.recompute != "full":
        raise ValueError(
            f"trainer.recompute_layers={n} applies to trainer.recompute=full only (it is {t.recompute!r}); "
            "leave it null"
        )
    if t.recompute_method == "uniform" and (n < 1 or layers_per_stage % n):
        raise ValueError(
            f"trainer.recompute_layers={n} must divide the {layers_per_stage} layers of a pipeline stage "
            f"(trainer.recompute_method=uniform recomputes them in groups of N); use {_divisors(layers_per_stage)}"
        )
    if t.recompute_method == "block" and not 0 <= n <= layers_per_stage:
        raise ValueError(
            f"trainer.recompute_layers={n} must lie in [0, {layers_per_stage}] (the layers of a pipeline stage) "
            "with trainer.recompute_method=block"
        )


def validate_parallel_switches(p: Any, seq_length: int, dp: int) -> None:
    """Sequence parallelism and overlapped data-parallel communication."""
    if p.sequence_parallel and p.tp < 2:
        raise ValueError(
            f"parallel.sequence_parallel=true needs tensor parallelism (parallel.tp={p.tp}); set parallel.tp >= 2 "
            "or turn it off"
        )
    if p.sequence_parallel and seq_length % p.tp:
        raise ValueError(
            f"parallel.sequence_parallel=true splits the sequence over tensor-parallel ranks: model.seq_length="
            f"{seq_length} is not divisible by parallel.tp={p.tp}"
        )
    if p.overlap_param_gather and not p.distributed_optimizer:
        raise ValueError(
            "parallel.overlap_param_gather=true overlaps the distributed optimizer's parameter all-gather; set "
            "parallel.distributed_optimizer=true or turn it off"
        )
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        raise ValueError(
            "parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true (megatron-core overlaps the "
            "parameter all-gather only together with the gradient reduce-scatter)"
        )
    if p.ddp_bucket_size is not None and p.ddp_bucket_size < 1:
        raise ValueError(f"parallel.ddp_bucket_size={p.ddp_bucket_size} must be a positive number of parameters")


def validate_compile(cfg: Any) -> None:
    """``trainer.compile=true`` (models.gpt.compile_layers) with what it cannot run with."""
    if not cfg.trainer.compile:
        return
    if cfg.engine.name != "megatron":
        raise ValueError(
            f"trainer.compile=true compiles the layers of engine=megatron only; engine={cfg.engine.name} (ZeRO "
            "partitions and gathers the parameters in hooks on every module) runs eagerly: set trainer.compile=false "
            "or use engine=megatron"
        )
    if cfg.parallel.overlap_param_gather:
        raise ValueError(
            "trainer.compile=true does not run with parallel.overlap_param_gather=true: the parameter all-gather waits "
            "in forward pre-hooks on every module, which torch.compile traces once and does not follow when "
            "megatron-core turns them off and on; set one of them false"
        )


def validate_cuda_graphs(cfg: Any) -> None:
    """``trainer.cuda_graphs=layers`` (training.cuda_graphs): each compiled layer one graph each way, of static shapes,
    with nothing that leaves it (the trainer checks the core attention again once ``auto`` has chosen its backend)."""
    from diff_transformer.models.attention.base import TRACEABLE_BACKENDS
    from diff_transformer.models.layer_specs import core_attention_class

    t, p, m = cfg.trainer, cfg.parallel, cfg.model
    if t.cuda_graphs == "off":
        return
    setting = f"trainer.cuda_graphs={t.cuda_graphs}"
    if not t.compile:
        raise ValueError(f"{setting} records the compiled layers as CUDA graphs: it needs trainer.compile=true "
                         "(or set trainer.cuda_graphs=off)")
    if p.tp != 1 or p.pp != 1 or (p.cp or 1) != 1:
        raise ValueError(
            f"{setting} runs with parallel.tp=1, pp=1 and cp=1 (got tp={p.tp}, pp={p.pp}, cp={_shown(p.cp)}): the "
            "pipeline runs several forwards before their backwards, tensor and context parallelism call collectives "
            "inside the layers; set trainer.cuda_graphs=off for this layout"
        )
    if t.recompute != "none":
        raise ValueError(
            f"{setting} does not run with trainer.recompute={t.recompute}: recomputation reruns parts of the layers "
            "outside their graphs; set trainer.recompute=none (or trainer.cuda_graphs=off)"
        )
    if cfg.data.document_mask:
        raise ValueError(
            f"{setting} does not run with data.document_mask=true: the variable-length kernel takes the longest "
            "document as a host integer, a shape that changes every batch; set one of them off"
        )
    if not getattr(core_attention_class(m, m.attention), "traceable", False):
        raise ValueError(f"{setting} does not run with model.attention={m.attention}: its core attention runs "
                         "eagerly, outside the compiled layer's graph; set trainer.cuda_graphs=off")
    if m.attention_backend != "auto" and m.attention_backend not in TRACEABLE_BACKENDS:
        raise ValueError(
            f"{setting} does not run with model.attention_backend={m.attention_backend}: its core attention runs "
            f"eagerly, outside the compiled layer's graph; use one of "
            f"{', '.join(b for b in TRACEABLE_BACKENDS if b != 'eager')} or auto"
        )


def _shown(value: Any) -> str:
    return "null" if value is None else str(value)


def validate_ring_attention(m: Any, shown: str, backend_key: str = "model.attention_backend") -> None:
    """The attention kind and backend of ``m`` have a ring-attention path (``shown``: the CP setting, for the message;
    ``backend_key``: how the user sets the backend)."""
    from diff_transformer.models.layer_specs import context_parallel_kinds, core_attention_class

    kinds = context_parallel_kinds(m)
    if m.attention not in kinds:
        why = " (its head calibration reads whole attention maps)" if m.attention == "dex" else ""
        raise ValueError(
            f"model.attention={m.attention} has no ring-attention path for context parallelism ({shown}){why}; "
            f"use one of {', '.join(kinds)}, or no context parallelism"
        )
    backends = core_attention_class(m, m.attention).ring_backends
    if m.attention_backend not in backends + ("auto",):  # auto chooses among the ring's
        raise ValueError(
            f"model.attention_backend={m.attention_backend} has no ring-attention path for context parallelism "
            f"({shown}): the ring merges each softmax map by its log-sum-exp, which this backend does not expose; "
            f"use {backend_key}=sdpa (or {', '.join(b for b in backends if b != 'sdpa')})"
        )


def validate_context_parallel(cfg: Any) -> None:
    """``parallel.cp`` > 1 (or null, which may choose it): a sequence that splits into 2·cp equal chunks, and an
    attention kind and backend with a ring-attention path (models/ring_attention.py)."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    if p.cp == 1:
        return
    shown = f"parallel.cp={_shown(p.cp)}"
    validate_ring_attention(m, shown)
    if t.attention_diagnostics == "on":
        raise ValueError(
            f"trainer.attention_diagnostics=on reads whole attention maps, which context parallelism ({shown}) "
            "splits over ranks; use trainer.attention_diagnostics=auto (off under CP) or parallel.cp=1"
        )
    if p.cp is None:
        return
    if m.seq_length % (2 * p.cp):
        raise ValueError(
            f"model.seq_length={m.seq_length} is not divisible by 2*parallel.cp={2 * p.cp} (each context-parallel rank "
            f"holds two equal chunks, one from each end of the sequence, so that causal work is even)"
        )
    if p.sequence_parallel and (m.seq_length // p.cp) % p.tp:
        raise ValueError(
            f"parallel.sequence_parallel=true splits each context-parallel rank's {m.seq_length // p.cp} tokens "
            f"(model.seq_length={m.seq_length} / parallel.cp={p.cp}) over parallel.tp={p.tp}, which does not divide them"
        )


# Config keys that name files or directories; relative values are taken from the directory the user launched from.
PATH_KEYS = (
    "data.blend", "data.tokenizer_dir", "data.cache_dir", "data.index_cache_dir",
    "checkpoint.dir", "checkpoint.resume", "checkpoint.load_weights_only", "engine.nvme_path",
)


def _absolute(value: str, base_dir: str) -> str:
    expanded = os.path.expanduser(value)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base_dir, expanded))


def _hydra_string(value: str) -> str:
    """A Hydra override value for a path: as it is when plain, quoted when it holds Hydra's special characters."""
    if re.fullmatch(r"[A-Za-z0-9_./@+-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def resolve_launch_paths(cfg: Any, base_dir: str) -> List[str]:
    """Make every relative path in ``cfg`` (the PATH_KEYS) absolute against ``base_dir``, in place, so that the
    resolved config records where the data and checkpoints are, whatever directory the job later runs in.
    ``checkpoint.resume``'s keywords (auto, none) stay. Returns ``key=value`` overrides for the changed keys."""
    changed = []
    for dotted in PATH_KEYS:
        group, key = dotted.split(".")
        section = getattr(cfg, group) if not isinstance(cfg, dict) else cfg[group]
        value = section[key] if isinstance(section, dict) else getattr(section, key)
        if value is None or (dotted == "checkpoint.resume" and value in RESUME_MODES):
            continue
        if value == "" or (not isinstance(value, str) and any(str(v) == "" for v in value)):
            raise ValueError(f"{dotted} is empty: give a path (absolute, or relative to where you launch), or null")
        if isinstance(value, str):
            new = _absolute(value, base_dir)
        else:  # data.blend: a list of prefixes
            new = [_absolute(str(v), base_dir) for v in value]
        if new != value:
            if isinstance(section, dict):
                section[key] = new
            else:
                setattr(section, key, new)
            rendered = _hydra_string(new) if isinstance(new, str) else "[" + ",".join(map(_hydra_string, new)) + "]"
            changed.append(f"{dotted}={rendered}")
    return changed


def launch_record(dict_cfg: DictConfig) -> Dict[str, str]:
    """Hydra's record of this launch (``.hydra/``: the composed config, Hydra's own, the overrides), written by the
    run with config.yaml once its start is committed (``hydra.output_subdir`` is null), so that a refused start
    leaves the run directory as it was."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    return {
        "config.yaml": OmegaConf.to_yaml(dict_cfg),
        "hydra.yaml": OmegaConf.to_yaml({"hydra": hydra_cfg}),
        "overrides.yaml": OmegaConf.to_yaml(list(hydra_cfg.overrides.task)),
    }


def to_object(cfg: DictConfig) -> Config:
    """The typed Config object of a composed DictConfig. A key the schema does not know (added with ``+``, which
    Hydra accepts and the conversion would drop) and a missing ``???`` value raise ValueError naming the key."""
    check_known_keys(cfg)
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ValueError(config_error_message(err)) from None


# ------------------------------------------------------------------------------------------------------------------
# Keys the schema knows, and Hydra's composition errors as one line
# ------------------------------------------------------------------------------------------------------------------
def _schema_fields(schema: type) -> Dict[str, Any]:
    """{field: its type} of a dataclass schema, the string annotations resolved."""
    import typing

    return typing.get_type_hints(schema)


def _schema_at(dotted: str) -> Optional[type]:
    """The dataclass schema of the config node at ``dotted`` ("" is the root), or None when it is no schema node."""
    schema: Any = Config
    for part in [p for p in dotted.split(".") if p]:
        if not dataclasses.is_dataclass(schema):
            return None
        schema = _schema_fields(schema).get(part)
    return schema if dataclasses.is_dataclass(schema) else None


def unknown_key_message(full_key: str) -> str:
    """``full_key`` is not in the schema: say so, with the nearest key of its node (or the node's keys)."""
    parent, _, key = full_key.rpartition(".")
    schema = _schema_at(parent)
    if schema is None:
        return f"{full_key} is not a config key"
    fields = sorted(_schema_fields(schema))
    prefix = f"{parent}." if parent else ""
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    if close:
        return f"{full_key} is not a config key; did you mean {prefix}{close[0]}?"
    return f"{full_key} is not a config key; {parent or 'the top level'} has: {', '.join(fields)}"


def check_known_keys(cfg: DictConfig, node_key: str = "") -> None:
    """Raise ValueError for the first key of ``cfg`` that its schema does not have (a typo added with ``+``)."""
    schema = _schema_at(node_key)
    if schema is None:
        return  # a free-form dict (engine.extra) takes any key
    fields = _schema_fields(schema)
    for key in cfg.keys():
        full_key = f"{node_key}.{key}" if node_key else str(key)
        if key not in fields:
            raise ValueError(unknown_key_message(full_key))
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            check_known_keys(child, full_key)


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def config_error_message(err: BaseException) -> str:
    """Hydra's or OmegaConf's error about the command line or the config, as one line that names the key and what
    would be right (without Hydra's advice to add a ``+``, which would add the misspelled key)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    text = str(err)
    if isinstance(err, MissingConfigException):
        found = re.search(r"Could not find '([^']+)'", text)
        missing = found.group(1) if found else str(err.missing_cfg_file)
        group, _, option = missing.rpartition("/")
        if group and err.options:
            return f"{group}={option} is not a config of the {group} group; use one of {', '.join(err.options)}"
        return f"no config {missing!r} ({_first_line(text)})"
    if isinstance(err, OverrideParseException):
        return f"cannot parse the command line: {_first_line(text)}"
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:  # a comma makes Hydra read several values (a sweep) unless the value is quoted or a list
        key, value = ambiguous.groups()
        return (f"{key}={value}: Hydra reads a comma as several values to sweep over; quote the value to give one "
                f"string: '{key}=\"{value}\"' (the outer quotes keep the inner ones from the shell)")
    existing = re.search(r"An item is already at '([^']+)'", text)
    if existing:
        key = existing.group(1)
        return f"+{key} adds a key that exists already: set it without the +, {key}=VALUE"
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)) or isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        full_key = (cause or err).full_key
        return unknown_key_message(full_key)
    if isinstance(err, MissingMandatoryValue) or isinstance(cause, MissingMandatoryValue):
        full_key = (cause or err).full_key
        return f"{full_key} has no value (??? in the config): set it, e.g. {full_key}=VALUE"
    if cause is not None or isinstance(err, OmegaConfBaseException):
        detail = cause or err
        override = re.search(r"Error merging override (\S+)", text)
        where = override.group(1) if override else (getattr(detail, "full_key", None) or "the config")
        return f"{where}: {_first_line(getattr(detail, 'msg', None) or str(detail))}"
    return _first_line(text)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
