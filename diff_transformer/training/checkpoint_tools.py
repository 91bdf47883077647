"""Reading checkpoints outside training: describe one (``inspect``) and convert one to a single PyTorch file."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import OmegaConf

from diff_transformer.config import Config, padded_vocab_size
from diff_transformer.models.gpt import build_model_chunk, resolve_precision, set_dex_anneal
from diff_transformer.training.checkpoint import directory_bytes, read_trainer_state, resolve_checkpoint_path
from diff_transformer.distributed import destroy_distributed, init_distributed

logger = logging.getLogger("diff_transformer")


def describe(path: str) -> Dict[str, Any]:
    path = resolve_checkpoint_path(path)
    state = read_trainer_state(path)
    model = state["config"]["model"]
    return {
        "path": path,
        "step": state["step"],
        "consumed_samples": state["consumed_samples"],
        "skipped_steps": state.get("skipped_steps", 0),
        "layout": state["layout"],
        "model": model,
        "num_parameters": state.get("num_parameters"),
        "size_bytes": directory_bytes(path),
        "wandb_run_id": state.get("wandb_run_id"),
        "saved_at": state.get("saved_at"),
        "save_seconds": state.get("save_seconds"),
    }


def saved_config(path: str) -> Tuple[Config, Dict[str, Any]]:
    """(typed config, trainer state) of checkpoint ``path`` (already resolved)."""
    state = read_trainer_state(path)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), state["config"])), state


def load_single_rank_model(path: str, dtype: Optional[torch.dtype] = None):
    """(GPTModel, config, trainer state) of checkpoint ``path`` (any saved TP/PP) rebuilt at TP=1, PP=1, in the
    world of one the caller has started (``init_distributed("gloo", tp=1, pp=1)``). DEX's λ annealing is set to the
    checkpoint's step. ``dtype`` None: the run's precision on a GPU, fp32 on a CPU."""
    from megatron.core import dist_checkpointing

    cfg, state = saved_config(path)
    cfg.parallel.tp, cfg.parallel.pp = 1, 1
    if dtype is None:
        dtype = resolve_precision(cfg.trainer.precision) if torch.cuda.is_available() else torch.float32
    vocab = cfg.model.vocab_size
    if vocab is None:  # the padded size was derived from the tokenizer at save time: read it from the tensor
        meta = dist_checkpointing.load_tensors_metadata(path)
        vocab = meta["embedding.word_embeddings.weight"].local_shape[0]
    chunk = build_model_chunk(cfg, padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, 1), dtype)
    loaded = dist_checkpointing.load({"model": chunk.sharded_state_dict()}, path)
    chunk.load_state_dict(loaded["model"], strict=True)
    if cfg.model.attention == "dex":
        set_dex_anneal([chunk], cfg.model.dex, state["step"], cfg.trainer.max_steps)
    chunk.eval()
    return chunk, cfg, state


def convert_to_torch(path: str, output: str) -> Dict[str, Any]:
    """Write the model of checkpoint ``path`` as one PyTorch file at TP=1, PP=1: ``{"model": state_dict,
    "config": resolved config, "step": int}``; the state dict is GPTModel's own (what ``load_state_dict`` takes)."""
    path = resolve_checkpoint_path(path)
    init_distributed("gloo", tp=1, pp=1, seed=0)  # a world of one: the conversion reshards to one rank
    try:
        chunk, _, state = load_single_rank_model(path)
        weights = {k: v.detach().cpu().clone() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
        torch.save({"model": weights, "config": state["config"], "step": state["step"]}, output)
        logger.info("converted %s (saved at tp=%d) to %s", path, state["layout"]["tp"], output)
        return {"path": output, "tensors": len(weights), "parameters": sum(v.numel() for v in weights.values())}
    finally:
        destroy_distributed()
