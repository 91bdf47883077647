"""Which trainer runs a config: the one place that chooses the engine, above both trainers (neither imports the
other's module to be chosen)."""

from __future__ import annotations

from typing import Any, Dict, List

from diff_transformer.distributed import destroy_distributed
from diff_transformer.training.trainer import Trainer


def create_trainer(cfg: Any, run_dir: str) -> Trainer:
    """The trainer of ``engine``: megatron-core's (:class:`Trainer`) or DeepSpeed's (``deepspeed_engine``)."""
    if cfg.engine.name == "deepspeed":
        from diff_transformer.training.deepspeed_engine import DeepSpeedTrainer

        return DeepSpeedTrainer(cfg, run_dir)
    return Trainer(cfg, run_dir)


def run(cfg: Any, run_dir: str) -> List[Dict[str, Any]]:
    """Set up, train, and tear down. Returns the per-step records (on every rank)."""
    trainer = create_trainer(cfg, run_dir)
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        destroy_distributed()
