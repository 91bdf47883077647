"""Checkpoints on megatron-core dist_checkpointing (torch_dist): atomic saves, automatic resume, resharding, tooling.

A run's checkpoints live under ``<run dir>/checkpoints/``::

    step_00000100/          a complete checkpoint: dist_checkpointing files + trainer_state.json (written last)
    step_00000200/
    latest                  the name of the newest complete checkpoint (replaced atomically)
    .step_00000300.tmp/     a save in progress (or one killed mid-way); never loaded, removed by the next save

A checkpoint holds the model, the optimizer (the distributed optimizer saved ``fully_reshardable``, so it loads on any
TP/PP/DP layout), the LR scheduler, step, consumed samples, skipped-step count, every rank's RNG states, the W&B run
id and the resolved config. Resuming on the layout that saved restores the run bit for bit. The tools that read
checkpoints (inspect, convert) are in ``checkpoint_tools``; the command line is ``python -m diff_transformer.checkpoint``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from diff_transformer import compat
from diff_transformer.config import CheckpointConfig
from diff_transformer.fileio import atomic_write_json, atomic_write_text, fsync_dir
from diff_transformer.distributed import barrier, broadcast_object
from diff_transformer.models.layer_specs import DIFFERENTIAL_KINDS

logger = logging.getLogger("diff_transformer")

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# The distributed optimizer's only format that reshards across TP/PP/DP (and the one that works on the torch-Adam path).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Model settings that may differ between the run that saved and the run that loads: same parameters, same math.
MODEL_KEYS_FREE_TO_CHANGE = ("attention_backend",)
# ... and those a run that starts from a checkpoint's weights may change too: same tensors, another context or label
# (rope_base: the long-context extension raises RoPE's θ with the sequence length).
WEIGHTS_KEYS_FREE_TO_CHANGE = MODEL_KEYS_FREE_TO_CHANGE + ("name", "seq_length", "init_std", "rope_base")


# ------------------------------------------------------------------------------------------------------------------
# Directory layout: names, the `latest` pointer, retention, free space
# ------------------------------------------------------------------------------------------------------------------
def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(cfg: Any, run_dir: str) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir, CHECKPOINTS_DIRNAME)


def is_complete(path: str) -> bool:
    """A checkpoint is complete once its trainer_state.json exists: it is written after every tensor file."""
    return os.path.isfile(os.path.join(path, STATE_FILE))


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint that ``latest`` names; the newest complete one when the pointer is absent or stale."""
    name = _pointer_target(root)
    if name is not None:
        path = os.path.join(root, name)
        if is_complete(path):
            return path
        logger.warning(
            "%s names %s, which is not a complete checkpoint; using the newest complete one",
            os.path.join(root, LATEST_FILE), path,
        )
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def _pointer_target(root: str) -> Optional[str]:
    """The name ``latest`` holds, or None when there is no pointer."""
    pointer = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        return f.read().strip()


def _discard_checkpoint(path: str) -> None:
    """Remove a checkpoint so that a crash part-way leaves an incomplete one (never loaded), not a damaged one."""
    state = os.path.join(path, STATE_FILE)
    if os.path.exists(state):
        os.remove(state)
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint_path(path: str) -> str:
    """The checkpoint meant by ``path``: a step_* checkpoint; a checkpoints directory or a run directory (its
    ``checkpoints/``), then its latest complete checkpoint; or a ``latest`` pointer file, then the checkpoint it names.
    """
    if os.path.isfile(path) and os.path.basename(path) == LATEST_FILE:
        path = os.path.dirname(path) or "."
    if is_complete(path):
        return path
    for root in (path, os.path.join(path, CHECKPOINTS_DIRNAME)):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise ValueError(
        f"{path} is not a checkpoint: give a step_* checkpoint directory (holding {STATE_FILE}), a checkpoints "
        f"directory or run directory holding one, or a {LATEST_FILE} file"
    )


def checkpoints_to_delete(steps: List[int], keep_last: int, keep_every: int) -> List[int]:
    """Steps that fall outside the newest ``keep_last`` and the multiples of ``keep_every``."""
    newest = set(sorted(steps)[-keep_last:])
    return [s for s in sorted(steps) if s not in newest and not (keep_every and s % keep_every == 0)]


def apply_retention(root: str, keep_last: int, keep_every: int) -> List[str]:
    removed = []
    by_step = dict(list_checkpoints(root))
    for step in checkpoints_to_delete(list(by_step), keep_last, keep_every):
        shutil.rmtree(by_step[step], ignore_errors=True)
        removed.append(by_step[step])
    return removed


def remove_partial_saves(root: str) -> None:
    """Temporary directories of saves that never completed (a process killed mid-save)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith(".step_") and name.endswith(".tmp"):
            logger.warning("removing the partial checkpoint %s left by an interrupted save", name)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def estimate_checkpoint_bytes(num_parameters: int, params_dtype: torch.dtype) -> int:
    """Weights in their dtype, an fp32 master copy when they are not fp32, and Adam's two fp32 moments."""
    weight = torch.empty((), dtype=params_dtype).element_size()
    master = 0 if params_dtype == torch.float32 else 4
    return num_parameters * (weight + master + 8)


def ensure_free_space(root: str, needed_bytes: int) -> None:
    free = free_bytes(root)
    if free < needed_bytes:
        raise ValueError(
            f"the checkpoint disk at {root} has {free / 2**30:.2f} GiB free, less than one checkpoint "
            f"({needed_bytes / 2**30:.2f} GiB); free space, point checkpoint.dir elsewhere, or set "
            "checkpoint.check_free_space=false"
        )


# ------------------------------------------------------------------------------------------------------------------
# Config compatibility
# ------------------------------------------------------------------------------------------------------------------
def model_config_differences(
    saved: Dict[str, Any], current: Dict[str, Any], free: Tuple[str, ...] = MODEL_KEYS_FREE_TO_CHANGE
) -> List[str]:
    """``model.<key>: checkpoint X, config Y`` for every model setting that changes the parameters or the math."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        if key in free:
            continue
        if key == "dex" and "dex" not in (saved.get("attention"), current.get("attention")):
            continue  # read by model.attention=dex only (and absent from checkpoints older than it)
        if saved.get(key) != current.get(key):
            diffs.append(f"model.{key}: checkpoint {saved.get(key)!r}, config {current.get(key)!r}")
    return diffs


def check_model_compatible(
    path: str, saved_model: Dict[str, Any], current_model: Dict[str, Any],
    free: Tuple[str, ...] = MODEL_KEYS_FREE_TO_CHANGE,
) -> None:
    diffs = model_config_differences(saved_model, current_model, free)
    if diffs:
        raise ValueError(
            f"checkpoint {path} was saved with a different model config; differing keys: " + "; ".join(diffs)
        )


def check_weights_compatible(path: str, saved_model: Dict[str, Any], current_model: Dict[str, Any]) -> None:
    """``checkpoint.load_weights_only``: the same model, or (DEX) the softmax-attention model DEX adapts."""
    if current_model.get("attention") != "dex" or saved_model.get("attention") == "dex":
        check_model_compatible(path, saved_model, current_model, WEIGHTS_KEYS_FREE_TO_CHANGE)
        return
    saved_kind = saved_model.get("attention")
    if saved_kind in DIFFERENTIAL_KINDS:
        raise ValueError(
            f"checkpoint {path} is already differential (model.attention={saved_kind}); DEX adds differential "
            "attention to a softmax-attention model: start from a model.attention=vanilla checkpoint"
        )
    if saved_kind != "vanilla":
        raise ValueError(
            f"checkpoint {path} has model.attention={saved_kind}; DEX adapts model.attention=vanilla checkpoints "
            "(trained here or imported with python -m diff_transformer.import_hf)"
        )
    base = {k: v for k, v in current_model.items() if k not in ("attention", "dex", "lambda_init")}
    saved = {k: v for k, v in saved_model.items() if k not in ("attention", "dex", "lambda_init")}
    check_model_compatible(path, saved, base, WEIGHTS_KEYS_FREE_TO_CHANGE)


def load_model_weights(chunk: torch.nn.Module, path: str, saved_model: Dict[str, Any]) -> None:
    """Load the model weights of checkpoint ``path`` into ``chunk`` (this rank's stage, any TP/PP layout). Loading
    a softmax-attention checkpoint into a DEX model leaves the parameters DEX adds at their initial values (W_D
    zero); any other missing or unexpected tensor is an error."""
    from megatron.core import dist_checkpointing

    from diff_transformer.models.gpt import dex_parameter_keys

    new = set(dex_parameter_keys(chunk)) if saved_model.get("attention") != "dex" else set()
    sharded = {k: v for k, v in chunk.sharded_state_dict().items() if k not in new}
    loaded = dist_checkpointing.load({"model": sharded}, path)
    missing, unexpected = chunk.load_state_dict(loaded["model"], strict=False)
    if set(missing) != new or unexpected:
        raise RuntimeError(
            f"checkpoint {path}: tensors missing {sorted(set(missing) - new)}, unexpected {sorted(unexpected)}"
        )


def convert_command(path: str) -> str:
    return f"python -m diff_transformer.checkpoint convert {path} OUT --to torch_dist"


def saved_engine(saved: Dict[str, Any]) -> str:
    """The engine that wrote a checkpoint (checkpoints from before engines were recorded are megatron-core's)."""
    return saved["layout"].get("engine", "megatron")


def check_weights_loadable(path: str, saved: Dict[str, Any], cfg: Any) -> None:
    """``checkpoint.load_weights_only``: engine=megatron reads torch_dist checkpoints (its own, or converted from
    DeepSpeed); engine=deepspeed reads both formats (a DeepSpeed one at the TP that saved it)."""
    if cfg.engine.name == "megatron" and saved_engine(saved) == "deepspeed":
        raise ValueError(
            f"checkpoint {path} was saved by engine=deepspeed (ZeRO-{saved['layout']['zero_stage']}); engine=megatron "
            f"loads torch_dist checkpoints: convert it ({convert_command(path)}), then use "
            "checkpoint.load_weights_only=OUT"
        )


def check_resumable(path: str, saved: Dict[str, Any], cfg: Any) -> None:
    """Refuse optimizer-state resharding that the engine cannot do; the weights alone always reshard (for DeepSpeed
    checkpoints through ``checkpoint convert``)."""
    layout, p = saved["layout"], cfg.parallel
    if saved.get("weights_only"):
        raise ValueError(
            f"checkpoint {path} holds weights only ({saved.get('converted_from', 'converted')}); start a run from it "
            f"with checkpoint.load_weights_only={path}"
        )
    engine = saved_engine(saved)
    if engine != cfg.engine.name:
        how = (
            f"convert it ({convert_command(path)}) and start from checkpoint.load_weights_only=OUT"
            if engine == "deepspeed" else f"start from its weights with checkpoint.load_weights_only={path}"
        )
        raise ValueError(
            f"checkpoint {path} was saved by engine={engine}, the run uses engine={cfg.engine.name}; the optimizer "
            f"state does not move between engines: resume with engine={engine}, or {how}"
        )
    if engine == "deepspeed":
        check_deepspeed_resumable(path, layout, cfg)
        return
    if layout["distributed_optimizer"] != p.distributed_optimizer:
        raise ValueError(
            f"checkpoint {path} was saved with parallel.distributed_optimizer={layout['distributed_optimizer']}, "
            f"the run uses {p.distributed_optimizer}; use the same setting, or start from its weights with "
            "checkpoint.load_weights_only"
        )
    if p.distributed_optimizer and cfg.model.share_embeddings and layout["pp"] != p.pp:
        # measured: PP=2 -> PP=1 restores every tensor but the tied embedding, whose fp32 copy comes back wrong
        raise ValueError(
            f"checkpoint {path} was saved at parallel.pp={layout['pp']} with the distributed optimizer and tied "
            f"embeddings; megatron-core 0.16.1 restores the tied embedding's optimizer state wrongly when PP changes "
            f"(here to parallel.pp={p.pp}): resume at parallel.pp={layout['pp']}, or start from its weights with "
            "checkpoint.load_weights_only"
        )


def check_deepspeed_resumable(path: str, layout: Dict[str, Any], cfg: Any) -> None:
    """DeepSpeed restores ZeRO's partitions only on the stage and layout that wrote them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    differences = [
        (layout["zero_stage"], cfg.engine.zero_stage, f"with engine.zero_stage={layout['zero_stage']}",
         f"engine.zero_stage={cfg.engine.zero_stage}", f"engine.zero_stage={layout['zero_stage']}"),
        (layout["tp"], cfg.parallel.tp, f"with parallel.tp={layout['tp']}", f"parallel.tp={cfg.parallel.tp}",
         f"parallel.tp={layout['tp']}"),
        (layout["world_size"], world, f"by a world of {layout['world_size']} processes", f"{world}",
         f"{layout['world_size']} processes"),
    ]
    for saved, current, saved_words, current_words, resume_words in differences:
        if saved != current:
            raise ValueError(
                f"checkpoint {path} was saved {saved_words}, the run has {current_words}; DeepSpeed restores ZeRO's "
                f"partitioned optimizer state only on the stage and layout that saved it: resume with "
                f"{resume_words}, or convert it ({convert_command(path)}) and start from "
                "checkpoint.load_weights_only=OUT (weights only, fresh optimizer state)"
            )


def read_trainer_state(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------------------------
# RNG states
# ------------------------------------------------------------------------------------------------------------------
def rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# ------------------------------------------------------------------------------------------------------------------
# Save and load
# ------------------------------------------------------------------------------------------------------------------
def _layout(trainer) -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    layout = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world_size": torch.distributed.get_world_size(),
        "distributed_optimizer": bool(trainer.cfg.parallel.distributed_optimizer),
        "engine": trainer.cfg.engine.name,
    }
    if trainer.cfg.engine.name == "deepspeed":
        e = trainer.cfg.engine
        layout.update(zero_stage=e.zero_stage, offload_optimizer=e.offload_optimizer, offload_param=e.offload_param)
    return layout


def _rng_sharded_object(layout: Dict[str, int], state: Optional[Dict[str, Any]]):
    """One object per rank, addressed by its (pp, tp, dp) coordinates: only the layout that saved can load it. The
    ranks of a context-parallel group hold the same states (seeded alike, no dropout): the first saves them, and
    every one loads them, whatever the context parallelism of the run that loads."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state",
        state,
        (layout["pp"], layout["tp"], layout["dp"]),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()),
        replica_id=ps.get_context_parallel_rank(),
    )


def _model_chunks(trainer) -> List[torch.nn.Module]:
    return [getattr(chunk, "module", chunk) for chunk in trainer.model]


def _model_sharded_state_dict(trainer) -> Dict[str, Any]:
    chunks = _model_chunks(trainer)
    if len(chunks) != 1:
        raise NotImplementedError("checkpoints of virtual pipeline stages (several model chunks) are not supported")
    return chunks[0].sharded_state_dict()


def _sharded_state_dict(trainer, *, is_loading: bool, optimizer: bool, rng: bool) -> Dict[str, Any]:
    model_sd = _model_sharded_state_dict(trainer)
    state = {"model": model_sd}
    if optimizer:
        if is_loading:
            compat.initialise_adam_state(trainer.optimizer)
        state["optimizer"] = trainer.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
        state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    if rng:
        state["rng_state"] = _rng_sharded_object(_layout(trainer), None if is_loading else rng_state())
    return state


def trainer_state(trainer, save_seconds: Optional[float] = None) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    return {
        "format_version": FORMAT_VERSION,
        "step": trainer.step,
        "consumed_samples": trainer.consumed_samples,
        "skipped_steps": getattr(trainer, "skipped_steps", 0),
        # the bad-step guard's memory, so that a resumed run judges spikes and streaks as the original would
        "bad_steps_in_a_row": trainer.bad_steps.consecutive if hasattr(trainer, "bad_steps") else 0,
        "recent_losses": list(trainer.bad_steps.recent) if hasattr(trainer, "bad_steps") else [],
        "wandb_run_id": getattr(trainer, "wandb_run_id", None),
        "layout": _layout(trainer),
        "num_parameters": getattr(trainer, "num_parameters", None),
        "params_dtype": str(trainer.dtype).replace("torch.", ""),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "save_seconds": save_seconds,
        "config": OmegaConf.to_container(OmegaConf.structured(trainer.cfg)),
    }


class CheckpointManager:
    """Saves and loads one run's checkpoints; every rank calls every method (they are collective)."""

    def __init__(self, trainer, root: str):
        self.trainer = trainer
        self.root = root
        self.config: CheckpointConfig = trainer.cfg.checkpoint
        self.rank = torch.distributed.get_rank()
        self.last_save_seconds: Optional[float] = None
        self._pending = None  # (async request, finalize) of a background save

    # -- save ----------------------------------------------------------------------------------------------------
    def save(self, reason: str = "interval") -> Optional[str]:
        """Write a checkpoint of the current step; returns its path (None if it already exists)."""
        self.wait()  # one save at a time: the previous background save must be renamed first
        step = self.trainer.step
        final = os.path.join(self.root, checkpoint_name(step))
        action = None
        if self.rank == 0:  # one rank decides, so that every rank takes the same branch
            action = "save"
            if is_complete(final):
                action = "skip" if _pointer_target(self.root) == os.path.basename(final) else "replace"
        action = broadcast_object(action, src=0)
        if action == "skip":
            return None  # this step is saved already (e.g. on the interval, then again on a signal)
        if action == "replace" and self.rank == 0:
            # complete but never named by `latest`: a save killed between its rename and the pointer update; this
            # run resumed from an earlier checkpoint and retraced the step, so its own state replaces the orphan
            logger.warning("replacing %s, which the latest pointer never named (an interrupted save)", final)
            _discard_checkpoint(final)
        start = time.perf_counter()
        tmp = os.path.join(self.root, f".{checkpoint_name(step)}.tmp")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            remove_partial_saves(self.root)
            os.makedirs(tmp)
        barrier()
        request = self._write(tmp)
        meta = trainer_state(self.trainer)

        def finalize() -> None:
            barrier()
            seconds = time.perf_counter() - start
            if self.rank == 0:
                meta["save_seconds"] = round(seconds, 3)
                # the state file marks completeness, so it goes last, then the directory becomes visible by rename
                atomic_write_json(os.path.join(tmp, STATE_FILE), meta)
                os.rename(tmp, final)
                fsync_dir(self.root)
                atomic_write_text(os.path.join(self.root, LATEST_FILE), os.path.basename(final) + "\n")
                removed = apply_retention(self.root, self.config.keep_last, self.config.keep_every)
                logger.info(
                    "saved checkpoint %s (%s, %.2f GiB, %.1f s)%s", final, reason, directory_bytes(final) / 2**30,
                    seconds, f"; removed {len(removed)} old" if removed else "",
                )
            self.last_save_seconds = seconds
            barrier()

        if request is None:
            finalize()
        else:
            self._pending = self._schedule_async(request, finalize)
        return final

    def _write(self, tmp: str):
        """Write every rank's state into the (existing) directory ``tmp``; returns the request of a background
        write, or None when the files are written."""
        from megatron.core import dist_checkpointing

        compat.fork_checkpoint_results_queue()
        self.trainer.finish_param_sync()  # parameters updated by the last step, on every rank
        state = _sharded_state_dict(self.trainer, is_loading=False, optimizer=True, rng=True)
        # the background writer is forked after the state is staged in host memory, so later steps cannot change it
        return dist_checkpointing.save(state, tmp, async_sharded_save=self.config.async_save)

    def _schedule_async(self, request, finalize):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if not hasattr(self, "_queue"):
            self._queue = AsyncCallsQueue()
        request.add_finalize_fn(finalize)
        self._queue.schedule_async_request(request)
        return self._queue

    def poll(self) -> None:
        """Finish a background save whose writes are done (collective; call at a step boundary)."""
        if self._pending is not None:
            self._pending.maybe_finalize_async_calls(blocking=False)
            if self._pending.get_num_unfinalized_calls() == 0:
                self._pending = None

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.maybe_finalize_async_calls(blocking=True)
            self._pending = None

    # -- load ----------------------------------------------------------------------------------------------------
    def load(self, path: str, weights_only: bool = False) -> Dict[str, Any]:
        """Load ``path`` into the trainer's model (and, unless ``weights_only``, optimizer, scheduler, step, data
        position and RNG); returns the checkpoint's trainer state."""
        from megatron.core import dist_checkpointing

        saved = read_trainer_state(path)
        if weights_only:
            load_model_weights(_model_chunks(self.trainer)[0], path, saved["config"]["model"])
            barrier()
            return saved
        check_resumable(path, saved, self.trainer.cfg)
        current_layout = _layout(self.trainer)
        same_layout = all(saved["layout"][k] == current_layout[k] for k in ("tp", "pp", "dp"))
        with_rng = same_layout
        state = _sharded_state_dict(self.trainer, is_loading=True, optimizer=True, rng=with_rng)
        loaded = dist_checkpointing.load(state, path)
        _model_chunks(self.trainer)[0].load_state_dict(loaded["model"], strict=True)
        with compat.adam_step_left_out_of_param_copies(self.trainer.optimizer):
            self.trainer.optimizer.load_state_dict(loaded["optimizer"])
        compat.unshare_adam_step_tensors(self.trainer.optimizer)
        self.trainer.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        if with_rng:
            set_rng_state(loaded["rng_state"])
        else:
            logger.warning(
                "layout changed (saved tp=%d pp=%d dp=%d, now tp=%d pp=%d dp=%d): RNG states restart from the seed",
                *(saved["layout"][k] for k in ("tp", "pp", "dp")), *(current_layout[k] for k in ("tp", "pp", "dp")),
            )
        barrier()
        return saved
