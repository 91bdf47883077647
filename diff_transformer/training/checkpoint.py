"""Checkpoints on megatron-core dist_checkpointing (torch_dist): atomic, verified saves, automatic resume with
fallback, disk-full handling, resharding, tooling.

A run's checkpoints live under ``<run dir>/checkpoints/`` (the layout and the manifest: ``checkpoint_files``)::

    step_00000100/          a complete checkpoint: dist_checkpointing files, trainer_state.json, manifest.json
    step_00000200/
    latest                  the name of the newest complete checkpoint (replaced atomically)
    .step_00000300.tmp/     a save in progress (or one killed mid-way); never loaded, removed by the next save

A checkpoint holds the model, the optimizer (the distributed optimizer saved ``fully_reshardable``, so it loads on any
TP/PP/DP layout), the LR scheduler, step, consumed samples, skipped-step count, every rank's RNG states, the W&B run
id and the resolved config. Resuming on the layout that saved restores the run bit for bit.

Every save records each file's size and crc32 where the file is written (each rank, in megatron-core's writer, also
in its background process for an asynchronous save) and commits them as ``manifest.json`` before the rename that
makes the checkpoint visible. A checkpoint is verified before it is loaded; under ``checkpoint.resume=auto`` a
damaged one is skipped (logged, moved aside as ``step_*.damaged``, never deleted) for the newest one that verifies.
The tools that read checkpoints (inspect, convert) are in ``checkpoint_tools``; the command line is
``python -m diff_transformer.checkpoint``.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import random
import re
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from diff_transformer import compat
from diff_transformer.config import CheckpointConfig
from diff_transformer.distributed import barrier, broadcast_object
from diff_transformer.fileio import atomic_write_text, fsync_dir
from diff_transformer.training.checkpoint_files import (  # noqa: F401  (the layout, importable from here too)
    CHECKPOINTS_DIRNAME,
    DAMAGED_SUFFIX,
    DCP_METADATA,
    CheckpointRefused,
    FORMAT_WITH_MANIFEST,
    LATEST_FILE,
    MANIFEST_FILE,
    RANK_RECORD_PREFIX,
    STATE_FILE,
    Verification,
    apply_retention,
    checkpoint_bytes,
    checkpoint_name,
    checkpoints_dir,
    checkpoints_to_delete,
    directory_bytes,
    ensure_free_space,
    format_bytes,
    free_bytes,
    incomplete_checkpoints,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    move_aside,
    partial_saves,
    pointer_target,
    read_dcp_metadata,
    read_manifest,
    read_trainer_state,
    rerun_advice,
    resolve_checkpoint_path,
    room_choices,
    saved_engine,
    verify,
    write_checkpoint_state,
    write_rank_record,
)
from diff_transformer.models.layer_specs import DIFFERENTIAL_KINDS

logger = logging.getLogger("diff_transformer")

FORMAT_VERSION = FORMAT_WITH_MANIFEST  # trainer_state.json's format: 2 is committed with a manifest
# The distributed optimizer's only format that reshards across TP/PP/DP (and the one that works on the torch-Adam path).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Model settings that may differ between the run that saved and the run that loads: same parameters, same math.
MODEL_KEYS_FREE_TO_CHANGE = ("attention_backend",)
# ... and those a run that starts from a checkpoint's weights may change too: same tensors, another context or label
# (rope_base: the long-context extension raises RoPE's θ with the sequence length).
WEIGHTS_KEYS_FREE_TO_CHANGE = MODEL_KEYS_FREE_TO_CHANGE + ("name", "seq_length", "init_std", "rope_base")
# Errors a damaged checkpoint raises from inside megatron-core's or DeepSpeed's readers.
_READ_ERRORS = (
    OSError, EOFError, RuntimeError, KeyError, ValueError, AttributeError, pickle.UnpicklingError, CheckpointException,
)


# What a failed write raises: any Exception, and torch's CheckpointException, a BaseException, for a write that failed
# on some rank (megatron-core's finalisation raises it on every rank).
_WRITE_FAILURES = (Exception, CheckpointException)


class CheckpointDamaged(ValueError):
    """A checkpoint that fails verification or cannot be read; the message names the checkpoint and the file."""


class CheckpointSaveFailed(RuntimeError):
    """A save that could not finish (``disk_full``: no space left, before or during it). Its partial files are
    removed and ``latest`` still names the last good checkpoint; the message (complete on rank 0) says what to do."""

    def __init__(self, message: str, disk_full: bool = False):
        super().__init__(message)
        self.disk_full = disk_full


# ------------------------------------------------------------------------------------------------------------------
# Reading torch_dist's .metadata: only the format's own classes (torch's reader unpickles whatever the file names)
# ------------------------------------------------------------------------------------------------------------------
class RestrictedMetadataReader(FileSystemReader):
    """torch's FileSystemReader whose ``.metadata`` is read by ``checkpoint_files.read_dcp_metadata``: a file naming
    anything but the format's classes raises CheckpointRefused before any of it is built."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = str(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_dcp_metadata(path)
        if not isinstance(metadata, Metadata):
            raise CheckpointRefused(f"{path} holds no torch_dist Metadata but a {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_weights_only(path: str, safe_globals: Tuple[type, ...] = (), map_location: Any = "cpu",
                      mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, plain containers, the classes torch and megatron-core admit
    and ``safe_globals``. A file naming anything else raises CheckpointRefused naming the file and the global."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        refused = re.search(r"GLOBAL ([\w.]+)", str(err))
        if refused is None:
            raise
        raise CheckpointRefused(
            f"{path} names {refused.group(1)}, which this checkpoint format never holds: loading it could run code "
            "planted in the file, so it is refused; load only checkpoints from a source you trust"
        ) from None


def deepspeed_safe_globals() -> tuple:
    """The classes DeepSpeed's checkpoint files hold besides tensors and containers (its ZeRO optimizers' state:
    the loss scaler, the stage, the bf16/ZeRO parameter-slice addresses)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


def load_deepspeed_file(path: str, map_location=None, mmap: bool = False):
    """One file of a DeepSpeed checkpoint, ``weights_only`` with DeepSpeed's own classes admitted."""
    return load_weights_only(path, deepspeed_safe_globals(), map_location, mmap)


def _cached_reader_class() -> type:
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    class CachedRestrictedMetadataReader(CachedMetadataFileSystemReader, RestrictedMetadataReader):
        """megatron-core's caching reader (the one its loader uses) reading through RestrictedMetadataReader."""

    return CachedRestrictedMetadataReader


compat.read_checkpoint_metadata_with(RestrictedMetadataReader, _cached_reader_class())


# ------------------------------------------------------------------------------------------------------------------
# Directory layout: the `latest` pointer, resume candidates, partial saves
# ------------------------------------------------------------------------------------------------------------------
def resume_candidates(root: str) -> List[str]:
    """What ``checkpoint.resume=auto`` tries, in order: the checkpoint ``latest`` names, then every older complete
    one, newest first. A complete checkpoint newer than ``latest`` (a save killed before the pointer moved) is not
    one: the run retraces its step and replaces it."""
    latest = latest_checkpoint(root)
    if latest is None:
        return []
    newest = os.path.basename(latest)
    older = [path for _, path in reversed(list_checkpoints(root)) if os.path.basename(path) < newest]
    return [latest] + older


def _discard_checkpoint(path: str) -> None:
    """Remove a checkpoint so that a crash part-way leaves an incomplete one (never loaded), not a damaged one."""
    state = os.path.join(path, STATE_FILE)
    if os.path.exists(state):
        os.remove(state)
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def remove_partial_saves(root: str) -> None:
    """Temporary directories of saves that never completed (a process killed mid-save)."""
    for path in partial_saves(root):
        logger.warning("removing the partial checkpoint %s left by an interrupted save", os.path.basename(path))
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------------------------------
def verify_checkpoint(path: str, checksums: bool = True) -> Verification:
    """``checkpoint_files.verify`` (sizes and crc32 against the manifest); a checkpoint saved before manifests gets
    the checks its own files allow (the files torch_dist's ``.metadata`` names exist and are long enough)."""
    result = verify(path, checksums)
    if result.ok and not result.has_manifest:
        result.problems.extend(_unmanifested_problems(path))
    return result


def _unmanifested_problems(path: str) -> List[str]:
    try:
        state = read_trainer_state(path)
        engine = saved_engine(state)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{STATE_FILE} is unreadable ({err})"]
    if engine == "deepspeed":
        present = os.listdir(path)
        return [] if any(name.endswith("_model_states.pt") for name in present) else ["DeepSpeed's *_model_states.pt files are missing"]
    problems = [f"{name}: missing" for name in ("common.pt", "metadata.json", ".metadata")
                if not os.path.isfile(os.path.join(path, name))]
    if problems:
        return problems
    try:
        storage = read_dcp_metadata(os.path.join(path, DCP_METADATA)).storage_data
    except CheckpointRefused:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged .metadata raises anything pickle can
        return [f".metadata: unreadable ({type(err).__name__}: {err})"]
    needed: Dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            problems.append(f"{name}: missing")
        elif os.path.getsize(file_path) < size:
            problems.append(f"{name}: {os.path.getsize(file_path):,} bytes, .metadata needs {size:,} (truncated)")
    return problems


def require_verified(path: str, checksums: bool = True) -> Verification:
    """Raise CheckpointDamaged naming every file that fails; log how it went (an unmanifested checkpoint loads with a
    warning that its contents are unverified)."""
    result = verify_checkpoint(path, checksums)
    if not result.ok:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {result.summary()}")
    _log_verification(result)
    return result


def _log_verification(result: Verification) -> None:
    if not result.has_manifest:
        logger.warning(
            "checkpoint %s has no %s (saved before checkpoints recorded checksums): its files are present and long "
            "enough, their contents are unverified", result.path, MANIFEST_FILE,
        )
    else:
        logger.info(
            "verified checkpoint %s: %d files, %s, %s in %.2f s", result.path, result.files,
            format_bytes(result.bytes), "sizes and crc32" if result.checksums else "sizes only", result.seconds,
        )


def select_resume_checkpoint(root: str, checksums: bool = True) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """``checkpoint.resume=auto``: (the newest checkpoint under ``root`` that verifies, [(damaged checkpoint, what is
    wrong)] skipped on the way). None when ``root`` holds no checkpoint; CheckpointDamaged when none verifies."""
    skipped: List[Tuple[str, str]] = []
    for path in incomplete_checkpoints(root):  # unloadable, and in the way of a later save of their step
        why = f"{STATE_FILE} is missing (an incomplete checkpoint)"
        logger.warning("checkpoint %s is damaged (%s): it is kept, moved aside as %s%s", path, why,
                       os.path.basename(path), DAMAGED_SUFFIX)
        skipped.append((path, why))
    for path in resume_candidates(root):
        result = verify_checkpoint(path, checksums)
        if result.ok:
            _log_verification(result)
            return path, skipped
        logger.warning(
            "checkpoint %s is damaged (%s): skipping it for the previous one; it is kept, moved aside as %s%s",
            path, result.summary(), os.path.basename(path), DAMAGED_SUFFIX,
        )
        skipped.append((path, result.summary()))
    if any(is_complete(p) for p, _ in skipped):
        listing = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
        raise CheckpointDamaged(
            f"no checkpoint under {root} verifies ({listing}); restore the damaged files, resume from a copy with "
            "checkpoint.resume=PATH, or start the run over in a new directory (hydra.run.dir=NEW) or here "
            "(checkpoint.resume=none overwrite_run=true)"
        )
    return None, skipped


# ------------------------------------------------------------------------------------------------------------------
# Free space
# ------------------------------------------------------------------------------------------------------------------
def estimate_checkpoint_bytes(num_parameters: int, params_dtype: torch.dtype) -> int:
    """Weights in their dtype, an fp32 master copy when they are not fp32, and Adam's two fp32 moments."""
    weight = torch.empty((), dtype=params_dtype).element_size()
    master = 0 if params_dtype == torch.float32 else 4
    return num_parameters * (weight + master + 8)


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err``, or anything it wraps (causes, torch's per-rank checkpoint failures), is an ENOSPC."""
    seen, stack = set(), [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "[Errno 28]" in str(e):
            return True
        stack.extend([e.__cause__, e.__context__])
        for failure in getattr(e, "failures", {}).values() if isinstance(getattr(e, "failures", None), dict) else ():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


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


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def config_changes(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """``key: checkpoint X -> now Y`` for every setting a resumed run changes against its checkpoint's config."""
    old, new = _flatten(saved), _flatten(current)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]


def check_tokenizer_unchanged(path: str, saved: Dict[str, Any], tokenizer_sha256: str, tokenizer_dir: str) -> None:
    """A resumed run reads its data with the tokenizer that trained it: another one (even of the same size) would
    give the same ids other meanings. Checkpoints from before the hash was recorded are not checked."""
    recorded = saved.get("tokenizer_sha256")
    if recorded is not None and recorded != tokenizer_sha256:
        raise ValueError(
            f"checkpoint {path} was trained with the tokenizer of sha256 {recorded[:12]}… (data.tokenizer_dir="
            f"{saved.get('config', {}).get('data', {}).get('tokenizer_dir')}), the run has {tokenizer_dir} of sha256 "
            f"{tokenizer_sha256[:12]}…: a run cannot change its tokenizer; resume with the checkpoint's, or start a "
            "new run from its weights (checkpoint.load_weights_only) in a new directory"
        )


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
        # the tokenizer the run reads its data with: a resume with another one is refused
        "tokenizer_sha256": getattr(getattr(trainer, "tokenizer", None), "model_sha256", None),
        "layout": _layout(trainer),
        "num_parameters": getattr(trainer, "num_parameters", None),
        "params_dtype": str(trainer.dtype).replace("torch.", ""),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "save_seconds": save_seconds,
        "config": OmegaConf.to_container(OmegaConf.structured(trainer.cfg)),
    }


_FILE_RECORDS: Dict[str, bool] = {"installed": False, "checksums": True}


def record_written_files(checksums: bool = True) -> None:
    """Make megatron-core's torch_dist writer record the size (and crc32) of each file a rank writes, in the
    writer itself: for an asynchronous save that is the forked background process, so the loop never waits for the
    hashing. Installed once; ``checksums`` applies to the saves that follow."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    _FILE_RECORDS["checksums"] = checksums
    if _FILE_RECORDS["installed"]:
        return
    original = FileSystemWriterAsync.get_save_function_and_args

    def get_save_function_and_args(self):
        write, stage, args = original(self)
        if write is None:  # nothing to write on this rank
            return write, stage, args
        directory, with_checksums = str(self.checkpoint_dir), _FILE_RECORDS["checksums"]

        def write_and_record(rank, write_buckets, results_queue):
            files = [bucket[0] for bucket in write_buckets]
            write(rank, write_buckets, _RecordingQueue(results_queue, directory, rank, files, with_checksums))

        return write_and_record, stage, args

    FileSystemWriterAsync.get_save_function_and_args = get_save_function_and_args
    _FILE_RECORDS["installed"] = True


class _RecordingQueue:
    """Stands in for the writer's results queue: when the writer reports its files written, record them first, then
    pass the report on (or the recording's own failure, an ENOSPC say, as the write's failure)."""

    def __init__(self, queue, directory: str, rank: int, files: List[str], checksums: bool):
        self.queue, self.directory, self.rank, self.files, self.checksums = queue, directory, rank, files, checksums

    def put(self, result) -> None:
        if not isinstance(result, BaseException):
            try:
                write_rank_record(self.directory, self.rank, self.files, self.checksums)
            except OSError as err:
                result = err
        self.queue.put(result)


class _Reading:
    """Turns what a damaged checkpoint raises inside a reader into CheckpointDamaged naming the checkpoint."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        passed_on = (CheckpointDamaged, CheckpointRefused)  # said in full already
        if err is not None and isinstance(err, _READ_ERRORS) and not isinstance(err, passed_on):
            raise CheckpointDamaged(f"checkpoint {self.path} cannot be read: {type(err).__name__}: {err}") from err
        return False


def reading_checkpoint(path: str) -> _Reading:
    return _Reading(path)


class CheckpointManager:
    """Saves and loads one run's checkpoints; every rank calls every method (they are collective)."""

    def __init__(self, trainer, root: str):
        self.trainer = trainer
        self.root = root
        self.config: CheckpointConfig = trainer.cfg.checkpoint
        self.rank = torch.distributed.get_rank()
        self.last_save_seconds: Optional[float] = None
        self.expected_bytes: Optional[int] = None  # a checkpoint's size on disk: the last one saved or loaded
        self._pending = None  # the queue of a background save
        self._pending_save: Optional[Tuple[int, str]] = None  # (step, temporary directory) of that save

    # -- save ----------------------------------------------------------------------------------------------------
    def save(self, reason: str = "interval") -> Optional[str]:
        """Write a checkpoint of the current step; returns its path (None if it exists already, or if the disk has
        no room and ``checkpoint.on_disk_full=skip`` lets an interval save be skipped). Raises
        CheckpointSaveFailed when the disk is full (before or during the save) and the run must stop."""
        self.wait()  # one save at a time: the previous background save must be renamed first
        step = self.trainer.step
        final = os.path.join(self.root, checkpoint_name(step))
        # one rank decides, so that every rank takes the same branch
        action, message = broadcast_object(self._plan_save(final) if self.rank == 0 else None, src=0)
        if action == "skip":
            return None  # this step is saved already (e.g. on the interval, then again on a signal)
        if action == "no_room":
            if reason == "interval" and self.config.on_disk_full == "skip":
                if self.rank == 0:
                    logger.warning(
                        "skipping the checkpoint of step %d: %s; training goes on and the next save tries again "
                        "(checkpoint.on_disk_full=skip)", step, message,
                    )
                return None
            raise CheckpointSaveFailed(
                f"{message}; the run stops at step {step} ({reason}; checkpoint.on_disk_full="
                f"{self.config.on_disk_full}) and `latest` still names {pointer_target(self.root) or 'no checkpoint'}: "
                f"{room_choices(self.root, self.config.keep_last)}", disk_full=True,
            )
        start = time.perf_counter()
        tmp = os.path.join(self.root, f".{checkpoint_name(step)}.tmp")
        if self.rank == 0:
            os.makedirs(tmp)
        barrier()
        try:
            request = self._write(tmp)
        except _WRITE_FAILURES as err:  # clean up, then report (a full disk) or re-raise
            self._abandon(err, step, tmp)
        meta = trainer_state(self.trainer)

        def finalize() -> None:
            barrier()
            seconds = time.perf_counter() - start
            failure = None
            if self.rank == 0:
                try:
                    meta["save_seconds"] = round(seconds, 3)
                    # trainer_state.json (completeness) and the manifest go last, then the rename makes it visible
                    manifest = write_checkpoint_state(tmp, meta, checksums=self.config.verify)
                    os.rename(tmp, final)
                    fsync_dir(self.root)
                    atomic_write_text(os.path.join(self.root, LATEST_FILE), os.path.basename(final) + "\n")
                    self.expected_bytes = int(manifest["bytes"])
                    removed = apply_retention(self.root, self.config.keep_last, self.config.keep_every)
                    logger.info(
                        "saved checkpoint %s (%s, %s, %.1f s)%s", final, reason, format_bytes(manifest["bytes"]),
                        seconds, f"; removed {len(removed)} old" if removed else "",
                    )
                except OSError as err:
                    failure = self._failure(err, step, tmp)
            failure = broadcast_object(failure, src=0)  # every rank stops together, or goes on together
            if failure is not None:
                raise CheckpointSaveFailed(*failure)
            self.last_save_seconds = seconds

        if request is None:
            finalize()
        else:
            self._pending = self._schedule_async(request, finalize)
            self._pending_save = (step, tmp)
        return final

    def _plan_save(self, final: str) -> Tuple[str, Optional[str]]:
        """("skip" | "save" | "no_room", why): rank 0's decision, taken before anything is written."""
        if is_complete(final):
            if pointer_target(self.root) == os.path.basename(final):
                return "skip", None
            # complete but never named by `latest`: a save killed between its rename and the pointer update; this
            # run resumed from an earlier checkpoint and retraced the step, so its own state replaces the orphan
            logger.warning("replacing %s, which the latest pointer never named (an interrupted save)", final)
            _discard_checkpoint(final)
        elif os.path.exists(final):  # a damaged checkpoint of this step: evidence, kept aside, never written over
            logger.warning("moved the damaged checkpoint %s aside to %s (kept for inspection)", final,
                           move_aside(final, DAMAGED_SUFFIX))
        os.makedirs(self.root, exist_ok=True)
        remove_partial_saves(self.root)
        if self.config.check_free_space:
            needed, free = self._needed_bytes(), free_bytes(self.root)
            if free < needed:
                kept = len(list_checkpoints(self.root))
                return "no_room", (
                    f"the checkpoint disk at {self.root} has {format_bytes(free)} free, less than the "
                    f"{format_bytes(needed)} a checkpoint needs" + (
                        f" (the {kept} checkpoint{'s' if kept > 1 else ''} retention keeps stay until it is committed)"
                        if kept else ""
                    )
                )
        return "save", None

    def _needed_bytes(self) -> int:
        """The size of the next checkpoint: the last one saved or loaded, else the estimate from the parameter count;
        5% more for what varies between saves."""
        size = self.expected_bytes
        if size is None:
            size = estimate_checkpoint_bytes(getattr(self.trainer, "num_parameters", 0) or 0, self.trainer.dtype)
        return int(size * 1.05)

    def _failure(self, err: BaseException, step: int, tmp: str) -> Optional[Tuple[str, bool]]:
        """(message, disk full) of a failed write after removing its temporary directory (rank 0's message names
        the sizes and the choices); None when ``err`` is no write failure (a bug: re-raise it)."""
        disk_full = is_disk_full(err)
        if not (disk_full or isinstance(err, (OSError, CheckpointException)) or "CheckpointingException" in type(err).__name__):
            return None
        if self.rank != 0:
            return f"saving the checkpoint of step {step} failed (rank 0 reports why)", disk_full
        shutil.rmtree(tmp, ignore_errors=True)
        latest = pointer_target(self.root) or "no checkpoint"
        if not disk_full:
            return (
                f"saving the checkpoint of step {step} to {self.root} failed ({' '.join(str(err).split())[:300]}); its "
                f"partial files are removed and `latest` still names {latest}", False,
            )
        return (
            f"the checkpoint disk at {self.root} filled up while saving the checkpoint of step {step}: its partial "
            f"files are removed and `latest` still names {latest}; a checkpoint needs about "
            f"{format_bytes(self._needed_bytes())}, {format_bytes(free_bytes(self.root))} are free there now: "
            f"{room_choices(self.root, self.config.keep_last)}", True,
        )

    def _abandon(self, err: BaseException, step: int, tmp: str) -> None:
        """A write raised ``err``: remove the partial save and raise CheckpointSaveFailed (or ``err`` itself)."""
        failure = self._failure(err, step, tmp)
        if failure is None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise err
        raise CheckpointSaveFailed(*failure) from err

    def _write(self, tmp: str):
        """Write every rank's state into the (existing) directory ``tmp``; returns the request of a background
        write, or None when the files are written."""
        from megatron.core import dist_checkpointing

        compat.fork_checkpoint_results_queue()
        record_written_files(checksums=self.config.verify)
        self.trainer.finish_param_sync()  # parameters updated by the last step, on every rank
        state = _sharded_state_dict(self.trainer, is_loading=False, optimizer=True, rng=True)
        # the background writer is forked after the state is staged in host memory, so later steps cannot change it
        return dist_checkpointing.save(state, tmp, async_sharded_save=self.config.async_save)

    def _record_files_by_rank(self, tmp: str) -> None:
        """For a writer that records nothing itself (DeepSpeed's): once every rank's files are written, each rank
        records a share of them, so that the hashing is spread over the ranks."""
        barrier()
        world = torch.distributed.get_world_size()
        names = sorted(
            os.path.join(d, f) for d, _, files in os.walk(tmp) for f in files if not f.startswith(RANK_RECORD_PREFIX)
        )
        write_rank_record(tmp, self.rank, names[self.rank::world], self.config.verify)

    def _schedule_async(self, request, finalize):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if not hasattr(self, "_queue"):
            self._queue = AsyncCallsQueue()
        request.add_finalize_fn(finalize)
        self._queue.schedule_async_request(request)
        return self._queue

    def _finish_pending(self, blocking: bool) -> None:
        if self._pending is None:
            return
        try:
            self._pending.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointSaveFailed:
            self._pending = None
            raise
        except _WRITE_FAILURES as err:  # the background write failed: clean up, then report or re-raise
            self._pending = None
            self._abandon(err, *self._pending_save)
        if blocking or self._pending.get_num_unfinalized_calls() == 0:
            self._pending = None

    def poll(self) -> None:
        """Finish a background save whose writes are done (collective; call at a step boundary)."""
        self._finish_pending(blocking=False)

    def wait(self) -> None:
        self._finish_pending(blocking=True)

    # -- load ----------------------------------------------------------------------------------------------------
    def load(self, path: str, weights_only: bool = False) -> Dict[str, Any]:
        """Load ``path`` (verified beforehand) into the trainer's model (and, unless ``weights_only``, optimizer,
        scheduler, step, data position and RNG); returns the checkpoint's trainer state. A file that cannot be read
        raises CheckpointDamaged naming the checkpoint."""
        from megatron.core import dist_checkpointing

        saved = read_trainer_state(path)
        if weights_only:
            with reading_checkpoint(path):
                load_model_weights(_model_chunks(self.trainer)[0], path, saved["config"]["model"])
            barrier()
            return saved
        check_resumable(path, saved, self.trainer.cfg)
        self.expected_bytes = checkpoint_bytes(path)
        current_layout = _layout(self.trainer)
        same_layout = all(saved["layout"][k] == current_layout[k] for k in ("tp", "pp", "dp"))
        with_rng = same_layout
        state = _sharded_state_dict(self.trainer, is_loading=True, optimizer=True, rng=with_rng)
        with reading_checkpoint(path):
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
