"""Reading checkpoints outside training: describe one (``inspect``), convert one to a single PyTorch file, and
convert a DeepSpeed checkpoint (any ZeRO stage) to the torch_dist format engine=megatron loads.

A DeepSpeed checkpoint's weights, per TP rank (``mp_rank_XX``): whole in ``mp_rank_XX_model_states.pt`` at ZeRO
0–2 (the model's dtype: in a bf16 run the rounded weights engine=megatron would also hold), and at ZeRO-3 only as
the fp32 partitions of every data-parallel rank, put back together with DeepSpeed's ``zero_to_fp32`` readers.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from diff_transformer import compat
from diff_transformer.config import Config, padded_vocab_size
from diff_transformer.fileio import atomic_write_binary, replace_directory, staging_directory
from diff_transformer.models.gpt import build_model_chunk, resolve_precision, set_dex_anneal
from diff_transformer.training.checkpoint import (
    FORMAT_VERSION,
    load_deepspeed_file,
    read_trainer_state,
    reading_checkpoint,
    require_verified,
    resolve_checkpoint_path,
    saved_engine,
    write_checkpoint_state,
)
from diff_transformer.training.checkpoint_files import describe  # noqa: F401  (inspect's description, torch-free)
from diff_transformer.distributed import destroy_distributed, free_port, init_distributed

logger = logging.getLogger("diff_transformer")


def _saved_config(state: Dict[str, Any]) -> Config:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), state["config"]))


def saved_config(path: str) -> Tuple[Config, Dict[str, Any]]:
    """(typed config, trainer state) of checkpoint ``path`` (already resolved)."""
    state = read_trainer_state(path)
    return _saved_config(state), state


def load_single_rank_model(path: str, dtype: Optional[torch.dtype] = None):
    """(GPTModel, config, trainer state) of checkpoint ``path`` (any saved TP/PP) rebuilt at TP=1, PP=1, in the
    world of one the caller has started (``init_distributed("gloo", tp=1, pp=1)``). ``dtype`` None: the run's
    precision on a GPU, fp32 on a CPU."""
    from megatron.core import dist_checkpointing

    cfg, state = saved_config(path)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp = 1, 1, 1  # a CP run's checkpoint holds whole tensors too
    if dtype is None:
        dtype = resolve_precision(cfg.trainer.precision) if torch.cuda.is_available() else torch.float32
    vocab = cfg.model.vocab_size
    if vocab is None:  # the padded size was derived from the tokenizer at save time: read it from the tensor
        meta = dist_checkpointing.load_tensors_metadata(path)
        vocab = meta["embedding.word_embeddings.weight"].local_shape[0]
    chunk = build_model_chunk(cfg, padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, 1), dtype)
    load_single_rank_weights(chunk, path, cfg, state)
    chunk.eval()
    return chunk, cfg, state


def load_single_rank_weights(chunk: torch.nn.Module, path: str, cfg: Config, state: Dict[str, Any]) -> None:
    """The weights of torch_dist checkpoint ``path`` (any saved TP/PP; trainer state ``state``) into ``chunk``, a
    TP=1/PP=1 model built from its config ``cfg``, as the run computed at that step: DEX's λ annealing is set to the
    checkpoint's step. The checkpoint is verified first; a DeepSpeed checkpoint is refused, naming the conversion."""
    if saved_engine(state) == "deepspeed":
        raise ValueError(
            f"checkpoint {path} was saved by engine=deepspeed; convert it to torch_dist first "
            f"(python -m diff_transformer.checkpoint convert {path} OUT --to torch_dist) and give OUT"
        )
    require_verified(path)
    with reading_checkpoint(path):
        load_torch_dist_weights(chunk, path)
    if cfg.model.attention == "dex":
        set_dex_anneal([chunk], cfg.model.dex, state["step"], cfg.trainer.max_steps)


# ------------------------------------------------------------------------------------------------------------------
# Weights of a checkpoint in either format
# ------------------------------------------------------------------------------------------------------------------
def load_torch_dist_weights(chunk: torch.nn.Module, path: str) -> None:
    """The model of torch_dist checkpoint ``path`` into ``chunk`` (this rank's part of the model; any TP layout)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": chunk.sharded_state_dict()}, path)
    chunk.load_state_dict(loaded["model"], strict=True)


def load_state_dict_but_extra_state(chunk: torch.nn.Module, state: Dict[str, torch.Tensor], path: str) -> None:
    """``state`` into ``chunk``: every parameter and buffer must be there; megatron's ``_extra_state`` entries (no
    data on the local spec) may be missing."""
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")


def deepspeed_tp_state_dicts(path: str, ranks: Optional[List[int]] = None) -> List[Dict[str, torch.Tensor]]:
    """The model state dict of each TP rank in ``ranks`` (default: all) of DeepSpeed checkpoint ``path``, as that
    rank's GPTModel chunk names it (what its ``load_state_dict`` takes)."""
    state = read_trainer_state(path)
    layout = state["layout"]
    stage = layout["zero_stage"]
    out = []
    for mp in range(layout["tp"]) if ranks is None else ranks:
        if stage < 3:
            model_file = os.path.join(path, f"mp_rank_{mp:02d}_model_states.pt")
            weights = load_deepspeed_file(model_file, "cpu")["module"]
        else:
            weights = _zero3_weights(path, mp)
        out.append(weights)
    return out


def _zero3_weights(path: str, mp: int) -> Dict[str, torch.Tensor]:
    """TP rank ``mp``'s fp32 weights of a ZeRO-3 checkpoint, from every data-parallel rank's partitions: DeepSpeed's
    zero_to_fp32 readers, given the files of this TP rank only (its own driver reads ``mp_rank_00`` alone)."""
    from deepspeed.utils import zero_to_fp32

    def files(pattern: str) -> List[str]:
        found = sorted(glob.glob(os.path.join(path, pattern)), key=zero_to_fp32.natural_keys)
        if not found:
            raise ValueError(f"{path} is missing DeepSpeed's {pattern} files: not a complete ZeRO-3 checkpoint")
        return found

    with compat.zero_to_fp32_loads_with(load_deepspeed_file):  # its own loads are not weights_only
        model_states = zero_to_fp32.parse_model_states(files(f"zero_pp_rank_*_mp_rank_{mp:02d}_model_states.pt"))
        stage, world_size, flat_groups, _ = zero_to_fp32.parse_optim_states(
            files(f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt"), path
        )
    if stage != 3:
        raise ValueError(f"{path}: DeepSpeed's files are of ZeRO stage {stage}, its trainer_state.json says 3")
    weights = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world_size, flat_groups, model_states, False)
    return zero_to_fp32.to_torch_tensor(weights)


# ------------------------------------------------------------------------------------------------------------------
# DeepSpeed -> torch_dist
# ------------------------------------------------------------------------------------------------------------------
def convert_to_torch_dist(path: str, output: str, *, writer: str) -> Dict[str, Any]:
    """Write the weights of DeepSpeed checkpoint ``path`` (any ZeRO stage) as a torch_dist checkpoint at ``output``,
    at the TP of the run that saved it: engine=megatron starts from it with ``checkpoint.load_weights_only`` on any
    TP/PP layout (the optimizer state stays behind). One process per TP rank, over gloo on this machine. ``output``
    is marked as ``writer``'s (``fileio.replace_directory``: its earlier output replaced, anything else moved aside)."""
    path = resolve_checkpoint_path(path)
    require_verified(path)
    state = read_trainer_state(path)
    if saved_engine(state) != "deepspeed":
        raise ValueError(f"{path} was saved by engine={saved_engine(state)} and is torch_dist already")
    tmp = staging_directory(output)
    try:
        _write_torch_dist(path, state, tmp)
        replace_directory(tmp, output, writer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s (ZeRO-%d, tp=%d) to torch_dist %s", path, state["layout"]["zero_stage"],
                state["layout"]["tp"], output)
    return {"path": output, "tp": state["layout"]["tp"], "zero_stage": state["layout"]["zero_stage"]}


def _write_torch_dist(path: str, state: Dict[str, Any], tmp: str) -> None:
    """The torch_dist checkpoint of DeepSpeed checkpoint ``path`` (trainer state ``state``) into directory ``tmp``."""
    tp = state["layout"]["tp"]
    if tp == 1:
        _write_torch_dist_rank(0, 1, path, tmp, None)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_write_torch_dist_rank, args=(tp, path, tmp, free_port()), nprocs=tp, join=True)
    meta = dict(state)
    meta["layout"] = dict(
        tp=tp, pp=1, dp=1, world_size=tp, distributed_optimizer=False, engine="megatron"
    )
    meta.update(weights_only=True, converted_from=f"converted from engine=deepspeed checkpoint {path}")
    meta["format_version"] = FORMAT_VERSION
    write_checkpoint_state(tmp, meta)  # last: marks the checkpoint complete, then its manifest


def _write_torch_dist_rank(rank: int, tp: int, path: str, output: str, port: Optional[int]) -> None:
    """TP rank ``rank`` of the conversion: build the model at TP=``tp``, load this rank's weights, save collectively."""
    if port is not None:  # a spawned world of tp processes
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    state = read_trainer_state(path)
    cfg = _saved_config(state)
    init_distributed("gloo", tp=tp, pp=1, seed=0)
    try:
        from megatron.core import dist_checkpointing

        from diff_transformer.compat import fork_checkpoint_results_queue

        weights = deepspeed_tp_state_dicts(path, ranks=[rank])[0]
        vocab = weights["embedding.word_embeddings.weight"].shape[0] * tp
        dtype = weights["embedding.word_embeddings.weight"].dtype
        chunk = build_model_chunk(cfg, vocab, dtype, perform_init=False)
        load_state_dict_but_extra_state(chunk, weights, path)
        fork_checkpoint_results_queue()
        dist_checkpointing.save({"model": chunk.sharded_state_dict()}, output)
    finally:
        destroy_distributed()


def convert_to_torch(path: str, output: str) -> Dict[str, Any]:
    """Write the model of checkpoint ``path`` as one PyTorch file at TP=1, PP=1: ``{"model": state_dict,
    "config": resolved config, "step": int}``; the state dict is GPTModel's own (what ``load_state_dict`` takes).
    The file is written beside ``output`` and renamed over it once complete."""
    path = resolve_checkpoint_path(path)
    state = read_trainer_state(path)
    if saved_engine(state) == "deepspeed":  # through torch_dist, which reshards to one rank
        with tempfile.TemporaryDirectory(prefix=f".{os.path.basename(output)}.", dir=os.path.dirname(os.path.abspath(output))) as scratch:
            staging = os.path.join(scratch, "torch_dist")
            convert_to_torch_dist(path, staging, writer=__name__)
            return convert_to_torch(staging, output)
    init_distributed("gloo", tp=1, pp=1, seed=0)  # a world of one: the conversion reshards to one rank
    try:
        chunk, _, state = load_single_rank_model(path)
        weights = {k: v.detach().cpu().clone() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
        # a new temporary file renamed over output: a link planted at either name is never written through
        atomic_write_binary(output, lambda f: torch.save({"model": weights, "config": state["config"],
                                                         "step": state["step"]}, f))
        logger.info("converted %s (saved at tp=%d) to %s", path, state["layout"]["tp"], output)
        return {"path": output, "tensors": len(weights), "parameters": sum(v.numel() for v in weights.values())}
    finally:
        destroy_distributed()
