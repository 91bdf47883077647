"""Pretrain a Differential Transformer or its mirrored baseline.

    python train.py experiment=smoke
    python train.py model=1.4b model.attention=vanilla hydra.run.dir=runs/1.4b-vanilla
    torchrun --nproc_per_node=8 train.py model=3b parallel.tp=2 parallel.pp=2
    torchrun --nproc_per_node=8 train.py model=3b engine=deepspeed engine.zero_stage=3 engine.offload_optimizer=cpu
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from diff_transformer.config import register_configs, resolve_launch_paths, to_object, validate
from diff_transformer.distributed import destroy_distributed, set_torch_env_from_slurm, world_size_from_env
from diff_transformer.training.engines import create_trainer

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    trainer = None
    try:
        set_torch_env_from_slurm()  # processes srun starts directly (one per GPU, e.g. Hydra's submitit launcher)
        cfg = to_object(dict_cfg)
        resolve_launch_paths(cfg, os.getcwd())  # relative data/checkpoint paths: from where the user launched
        validate(cfg, world_size_from_env())  # before any process group starts or data is touched
        trainer = create_trainer(cfg, HydraConfig.get().runtime.output_dir)
        trainer.setup()
    except ValueError as err:  # bad configuration or data: one clear line
        print(f"error: {err}", file=sys.stderr)
        destroy_distributed()
        sys.exit(2)
    try:
        trainer.fit()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
