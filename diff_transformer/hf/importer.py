"""Import a local Hugging Face Llama directory as a checkpoint of this framework.

The result is a complete checkpoint directory (torch_dist tensors and ``trainer_state.json``, step 0, saved at TP=1,
PP=1) that a run starts from with ``checkpoint.load_weights_only=DIR`` at any TP/PP, with
``model.attention=vanilla`` (or ``dex``) and the model settings of the imported ``config.json`` (``model.*`` values
in ``trainer_state.json``, and printed). Its tokenizer, when the directory has one (``tokenizer.model`` or
``tokenizer.json``), is written to ``DIR/tokenizer`` for ``data.tokenizer_dir``. Only ``safetensors`` is needed,
not ``transformers``; nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import time
from typing import Any, Dict, Optional

import torch
from omegaconf import OmegaConf

from data.tokenizer import import_sentencepiece, load_tokenizer
from diff_transformer import compat
from diff_transformer.config import Config, padded_vocab_size, validate
from diff_transformer.distributed import destroy_distributed, init_distributed
from diff_transformer.fileio import replace_directory, staging_directory
from diff_transformer.hf.convert import from_hf_state_dict, model_config_from_hf
from diff_transformer.models.gpt import build_model_chunk, count_parameters
from diff_transformer.training.checkpoint import FORMAT_VERSION, write_checkpoint_state

logger = logging.getLogger("diff_transformer")

TOKENIZER_SUBDIR = "tokenizer"


def read_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` (or its shards), else ``pytorch_model.bin`` (or its shards)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = os.path.join(hf_dir, index_name)
        if os.path.isfile(index):
            files = _indexed_files(index)
        elif os.path.isfile(os.path.join(hf_dir, single)):
            files = [single]
        else:
            continue
        weights: Dict[str, torch.Tensor] = {}
        for name in files:
            path = os.path.join(hf_dir, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} does not exist (named by {os.path.join(hf_dir, index_name)}): "
                                        "the download is incomplete")
            if name.endswith(".safetensors"):
                try:
                    from safetensors.torch import load_file
                except ImportError as err:
                    raise ImportError(
                        "reading .safetensors needs safetensors: pip install -c constraints.txt -e '.[hf]'"
                    ) from err
                weights.update(_read_safetensors(load_file, path))
            else:
                weights.update(_read_pickled_tensors(path))
        return weights
    raise ValueError(f"{hf_dir} holds no weights (model.safetensors, pytorch_model.bin or their sharded indexes)")


def _indexed_files(index: str) -> list:
    """The weight files a sharded checkpoint's index names."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index} is not a weights index (JSON with a weight_map of tensor names to files): "
                         "download it again") from None


def _read_safetensors(load_file, path: str) -> Dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as err:  # safetensors' own SafetensorError: a damaged header or a truncated file
        raise ValueError(f"{path} is not a readable safetensors file ({err}); download it again") from None


def _read_pickled_tensors(path: str) -> Dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``'s tensors, unpickled with ``weights_only=True``: a file that holds anything else
    (code, objects of other classes) is refused, never run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        blocked = isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err)
        why = ("holds objects besides tensors, which loading would run as code, so it is not loaded" if blocked
               else f"cannot be read ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
        raise ValueError(f"{path} {why}: give the model as model.safetensors (safetensors holds tensors only), "
                         "e.g. saved by save_pretrained(..., safe_serialization=True) where you trust the file") \
            from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} holds no state dict (a mapping of names to tensors): give the model's weights, "
                         "preferably as model.safetensors")
    return state


def import_hf(hf_dir: str, out: str, seq_length: Optional[int] = None, name: Optional[str] = None, *,
              writer: str) -> Dict[str, Any]:
    """Write the Llama model in ``hf_dir`` as a checkpoint ``out``, marked as ``writer``'s output (its earlier output
    replaced; anything else there moved aside: ``fileio.replace_directory``). ValueError naming the problem for
    anything that is not a Llama this framework can represent."""
    hf_dir = os.path.abspath(hf_dir)
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    with open(config_path) as f:
        try:
            hf = json.load(f)
        except ValueError as err:
            raise ValueError(f"{config_path} is not JSON ({err}): download it again") from None
    model = model_config_from_hf(hf, name or os.path.basename(hf_dir.rstrip("/")), seq_length)
    cfg: Config = OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(Config),
        {"name": "import", "model": model, "trainer": {"max_steps": 1, "global_batch_size": 1},
         "optim": {"warmup_steps": 0}},
    ))
    validate(cfg, world_size=1)
    hf_weights = {k: v.float() for k, v in read_hf_weights(hf_dir).items()}
    padded = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    sd = from_hf_state_dict(cfg.model, hf_weights, padded)

    out = os.path.abspath(out)
    staging = staging_directory(out)
    try:
        tokenizer_dir = _import_tokenizer(hf_dir, os.path.join(staging, TOKENIZER_SUBDIR), cfg.model.vocab_size)
        num_parameters = _save_checkpoint(cfg, sd, padded, staging)
        state = {
            "format_version": FORMAT_VERSION,
            "step": 0,
            "consumed_samples": 0,
            "skipped_steps": 0,
            "bad_steps_in_a_row": 0,
            "recent_losses": [],
            "wandb_run_id": None,
            "layout": {"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "distributed_optimizer": False},
            "num_parameters": num_parameters,
            "params_dtype": "float32",
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "save_seconds": None,
            "imported_from": hf_dir,
            "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        }
        write_checkpoint_state(staging, state)  # last: it marks the checkpoint complete, then its manifest
        moved_aside = replace_directory(staging, out, writer)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    tokenizer_path = os.path.join(out, TOKENIZER_SUBDIR) if tokenizer_dir else None
    logger.info("imported %s (%s parameters) to %s", hf_dir, f"{num_parameters:,}", out)
    return {"path": out, "model": model, "num_parameters": num_parameters, "tokenizer_dir": tokenizer_path,
            "moved_aside": moved_aside}


def _import_tokenizer(hf_dir: str, out_dir: str, model_vocab: int) -> Optional[str]:
    """The directory's tokenizer as a framework tokenizer directory, or None when it has none."""
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        tokenizer = import_sentencepiece(os.path.join(hf_dir, "tokenizer.model"), out_dir)
    elif os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        os.makedirs(out_dir)
        shutil.copyfile(os.path.join(hf_dir, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
        tokenizer = load_tokenizer(out_dir)
    else:
        return None
    if tokenizer.vocab_size > model_vocab:
        raise ValueError(
            f"the tokenizer of {hf_dir} has {tokenizer.vocab_size} tokens, the model's vocab_size is {model_vocab} "
            "(vocabulary mismatch)"
        )
    return out_dir


def _save_checkpoint(cfg: Config, sd: Dict[str, torch.Tensor], padded_vocab: int, out_dir: str) -> int:
    """Build the model at TP=1, PP=1 in a world of one, load ``sd`` into it and save it with dist_checkpointing."""
    init_distributed("gloo", tp=1, pp=1, seed=0)
    try:
        from megatron.core import dist_checkpointing

        chunk = build_model_chunk(cfg, padded_vocab, torch.float32, perform_init=False)
        extra = {k: v for k, v in chunk.state_dict().items() if k.endswith("_extra_state")}
        chunk.load_state_dict({**sd, **extra}, strict=True)
        compat.fork_checkpoint_results_queue()
        dist_checkpointing.save({"model": chunk.sharded_state_dict()}, out_dir)
        return count_parameters([chunk])
    finally:
        destroy_distributed()
