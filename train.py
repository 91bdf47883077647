"""Pretrain a Differential Transformer or its mirrored baseline.

    python train.py experiment=smoke
    python train.py model=1.4b model.attention=vanilla hydra.run.dir=runs/1.4b-vanilla
    torchrun --nproc_per_node=8 train.py model=3b parallel.tp=2 parallel.pp=2
    torchrun --nproc_per_node=8 train.py model=3b engine=deepspeed engine.zero_stage=3 engine.offload_optimizer=cpu

Exit status (diff_transformer.cli): 0 trained to the end; 75 stopped by a signal after saving (rerun to resume; 0
when the job requeued itself under SLURM); 2 input refused before any expensive work; 1 failure; 130 interrupted
before training started, or by a second Ctrl-C during a save.
"""

import os
import sys

from diff_transformer.cli import EXIT_INTERRUPTED, exit_on_sigint, print_error

INTERRUPTED_AT_START = "interrupted (SIGINT) before training started: nothing was saved; rerun the same command"


def first_process() -> bool:
    """Every process refuses alike; one of them says so."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


if __name__ == "__main__":  # until the trainer takes SIGINT over; set before the slow imports, which it covers too
    exit_on_sigint(INTERRUPTED_AT_START, first_process(), cleanup=lambda: release_run_directory())

import hydra  # noqa: E402  (after the handler: Ctrl-C during these imports exits cleanly too)
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from diff_transformer.cli import (  # noqa: E402
    EXIT_FAILURE, EXIT_REFUSED, EXIT_STOPPED_RESUMABLE, USER_ERRORS, error_text,
)
from diff_transformer.config import (  # noqa: E402
    config_error_message, launch_record, register_configs, resolve_launch_paths, to_object, validate, validate_settings,
)
from diff_transformer.training.branching import resolve_branch  # noqa: E402
from diff_transformer.training.checkpoint_files import checkpoints_dir  # noqa: E402
from diff_transformer.training.metrics import wandb_credentials_problem  # noqa: E402
from diff_transformer.training.sweep import SweepRefusal, finished_run, sweep_of_run  # noqa: E402
from diff_transformer.training.run_directory import (  # noqa: E402
    check_disks, check_start, lock_run_directory, release_run_directory,
)

register_configs()
_started = []  # main was entered: Hydra made the run directory


def refuse(err: BaseException) -> None:
    if first_process():
        print_error(err)
    sys.exit(EXIT_REFUSED)


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    _started.append(True)
    try:
        run(dict_cfg)
    finally:
        release_run_directory()


def run(dict_cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        cfg = to_object(dict_cfg)  # unknown keys, also those added with +, fail here
        resolve_launch_paths(cfg, os.getcwd())  # relative data/checkpoint paths: from where the user launched
        run_dir = hydra_cfg.runtime.output_dir
        validate_settings(cfg)  # what needs neither torch nor the world size
        credentials = wandb_credentials_problem(cfg)
        if credentials:
            raise ValueError(credentials)
        if first_process():
            check_disks(cfg, run_dir)
            # held until the run ends: a second start here, or into the same checkpoint directory, is refused
            lock_run_directory(run_dir, checkpoints_dir(cfg, run_dir))
        if in_sweep:  # a rerun of the sweep: its finished runs are skipped (another run's directory is refused)
            finished = finished_run(cfg, run_dir)
            if finished:
                if first_process():
                    print(finished, flush=True)
                return
        check_start(cfg, run_dir)  # a fresh start where a run is: refused before torch is even imported
        resolve_branch(cfg, run_dir)  # a branch's source checkpoint, read only: refused before torch is imported
    except ValueError as err:
        refuse(err)
    from diff_transformer.distributed import destroy_distributed, set_torch_env_from_slurm, world_size_from_env

    trainer = None
    try:
        set_torch_env_from_slurm()  # processes srun starts directly (one per GPU, e.g. Hydra's submitit launcher)
        validate(cfg, world_size_from_env())  # before any process group starts or data is touched
        from diff_transformer.training.engines import create_trainer

        trainer = create_trainer(cfg, run_dir)
        trainer.launch_record = launch_record(dict_cfg)
        if in_sweep:
            trainer.sweep = sweep_of_run(hydra_cfg.sweep.dir, cfg.name)
        trainer.setup()
    except USER_ERRORS as err:  # bad configuration, data or checkpoint: one clear line
        destroy_distributed()
        refuse(err)
    from diff_transformer.training.checkpoint import CheckpointSaveFailed
    from diff_transformer.training.failures import TrainingDiverged
    from diff_transformer.training.metrics import RunLogFailed

    try:
        trainer.fit()
    except (TrainingDiverged, CheckpointSaveFailed, RunLogFailed) as err:  # said in full by rank 0
        if trainer.rank == 0:
            print_error(err)
        sys.exit(EXIT_FAILURE)
    finally:
        destroy_distributed()
    if trainer.stopped_by_signal:
        sys.exit(0 if trainer.requeued else EXIT_STOPPED_RESUMABLE)


if __name__ == "__main__":
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's composition errors reach us, to be told in one line
    try:
        main()
    except SweepRefusal as refusal:  # the sweep's callback, before any run starts
        refuse(refusal.args[0])
    except (HydraException, OmegaConfBaseException) as error:
        refuse(ValueError(config_error_message(error)))
    except OSError as error:
        if _started:
            raise
        # Hydra could not make the run directory (read-only, under a file, a full disk)
        refuse(ValueError(f"cannot create the run directory (hydra.run.dir): {error_text(error)}"))
    except KeyboardInterrupt:
        if first_process():
            print_error(INTERRUPTED_AT_START)
        sys.exit(EXIT_INTERRUPTED)
