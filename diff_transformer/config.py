"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, with YAML files only setting values.

Groups are orthogonal (``model``, ``parallel``, ``data``, ``optim``, ``trainer``, ``logging``, ``experiment``), so a mirrored baseline is ``model.attention=vanilla`` and a sweep is one multirun line.
:func:`validate` checks every cross-field constraint before any process group starts and names the bad value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from data.config import DataConfig
from diff_transformer.attention import BACKENDS
from diff_transformer.checkpoint import CheckpointConfig, validate_checkpoint_config
from diff_transformer.failures import FailureConfig, validate_failure_config
from diff_transformer.layer_specs import ATTENTION_KINDS
from diff_transformer.model import num_kv_heads
from diff_transformer.metrics import LoggingConfig


@dataclass
class ModelConfig:
    name: str = MISSING
    attention: str = "diff"  # a key of ATTENTION_KINDS: diff | vanilla
    attention_backend: str = "sdpa"  # eager | sdpa | flash_attn | triton
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
    sublayer_norm: bool = True  # DIFF's per-head RMSNorm (ablation: false)
    make_vocab_size_divisible_by: int = 128


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    distributed_optimizer: bool = False
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo


@dataclass
class OptimConfig:
    lr: float = 1.5e-3
    min_lr: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.05
    warmup_steps: int = 375
    decay: str = "linear"  # linear | cosine | constant
    clip_grad: float = 1.0


@dataclass
class TrainerConfig:
    max_steps: int = MISSING
    micro_batch_size: int = 1
    global_batch_size: int = MISSING
    eval_interval: int = 100  # validation every N steps (0: never)
    eval_iters: int = 10
    log_interval: int = 1
    precision: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | fp32 | bf16


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    name: str = "default"  # experiment name (the W&B group)
    seed: int = 1234


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)


PRECISIONS = ("auto", "fp32", "bf16")
DECAYS = ("linear", "cosine", "constant")


def _divisors(n: int) -> str:
    return ", ".join(str(i) for i in range(1, n + 1) if n % i == 0)


def validate(cfg: Any, world_size: int) -> None:
    """Raise ValueError naming the first invalid value. Cheap: runs before any process group starts."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.trainer, cfg.optim
    if m.attention not in ATTENTION_KINDS:
        raise ValueError(f"model.attention={m.attention!r} is unknown; use one of {', '.join(ATTENTION_KINDS)}")
    if m.attention_backend not in BACKENDS:
        raise ValueError(f"model.attention_backend={m.attention_backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    for key in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "seq_length"):
        if getattr(m, key) < 1:
            raise ValueError(f"model.{key}={getattr(m, key)} must be a positive integer")
    if m.head_dim is None and m.hidden_size % (2 * m.num_heads):
        raise ValueError(
            f"model.hidden_size={m.hidden_size} is not divisible by 2*model.num_heads={2 * m.num_heads}; "
            "set model.head_dim explicitly"
        )
    kv = num_kv_heads(m)
    if kv < 1 or m.num_heads % kv:
        raise ValueError(f"model.num_kv_heads={kv} must divide model.num_heads={m.num_heads}; use {_divisors(m.num_heads)}")
    if p.tp < 1 or p.pp < 1:
        raise ValueError(f"parallel.tp={p.tp} and parallel.pp={p.pp} must be positive")
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
    if world_size % (p.tp * p.pp):
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tp*parallel.pp={p.tp * p.pp}; launch a multiple "
            f"of {p.tp * p.pp} processes or change the layout"
        )
    dp = world_size // (p.tp * p.pp)
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ValueError(
            f"trainer.micro_batch_size={t.micro_batch_size} and trainer.global_batch_size={t.global_batch_size} "
            "must be positive"
        )
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by trainer.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}"
        )
    if t.max_steps < 1:
        raise ValueError(f"trainer.max_steps={t.max_steps} must be at least 1")
    if t.precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={t.precision!r} is unknown; use one of {', '.join(PRECISIONS)}")
    if o.decay not in DECAYS:
        raise ValueError(f"optim.decay={o.decay!r} is unknown; use one of {', '.join(DECAYS)}")
    if not (o.lr > 0 and 0 <= o.min_lr <= o.lr):
        raise ValueError(f"optim.lr={o.lr} must be positive and optim.min_lr={o.min_lr} within [0, lr]")
    if o.warmup_steps < 0 or o.warmup_steps >= t.max_steps:
        raise ValueError(
            f"optim.warmup_steps={o.warmup_steps} must lie in [0, trainer.max_steps={t.max_steps}) so that the "
            "learning rate has steps left to decay"
        )
    if p.backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"parallel.backend={p.backend!r} is unknown; use auto, nccl or gloo")
    validate_checkpoint_config(cfg.checkpoint)
    validate_failure_config(cfg.failures)


def to_object(cfg: DictConfig) -> Config:
    """The typed Config object of a composed DictConfig (also reports missing ``???`` values by name)."""
    return OmegaConf.to_object(cfg)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
