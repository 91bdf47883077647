"""Export a checkpoint (any TP/PP it was saved with) as a Hugging Face transformers model directory.

The directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer
(``tokenizer.model`` or ``tokenizer.json``, ``tokenizer.json`` and ``tokenizer_config.json``) and
``export_info.json`` (where it came from). ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it with no custom
code: ``LlamaForCausalLM`` for vanilla, vanilla_wide and dex, ``DiffLlamaForCausalLM`` for diff (the mappings:
``convert``). The vocabulary is the model's padded one (the extra rows are the model's own, so logits and losses
equal the framework's); the tokenizer encodes text to the ids the model was trained on, adds no BOS and no EOS
(the framework trains on documents with no BOS, each followed by the end-of-document token, which is the exported
``eos_token``), and the export checks this on sample text before it writes anything. The exported ``bos_token`` (and
``bos_token_id`` of the model and generation configs) is that end-of-document token too, as for GPT-2: it is what
precedes a document in training, so a tool that starts a document from BOS (lm-eval-harness's document prefix for
perplexity and for an empty context) conditions it as training did, not on a token the model never saw.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Dict, Optional

import torch

from data.datasets import prepare
from data.tokenizer import Tokenizer, load_tokenizer
from diff_transformer.distributed import destroy_distributed, init_distributed
from diff_transformer.fileio import replace_directory, staging_directory
from diff_transformer.hf.convert import architecture, export_refusal, hf_config_kwargs, to_hf_state_dict
from diff_transformer.training.checkpoint import resolve_checkpoint_path
from diff_transformer.training.checkpoint_tools import load_single_rank_model, saved_config

logger = logging.getLogger("diff_transformer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Text the exported tokenizer must encode exactly as the framework's: spaces, newlines, tabs, digits, accents, emoji.
TOKENIZER_PROBES = (
    "Hello world",
    "  two leading spaces\nand a newline\n\n\ttab, then   three spaces",
    "KING HENRY. Thou art my liege, 1415 A.D.; café, naïve, Straße, ćžé, 日本語, 😀.",
    "\n",
    " ",
    "And God said, Let there be light: and there was light.\n",
)


def import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "exporting to Hugging Face needs transformers: pip install -c constraints.txt -e '.[hf]'"
        ) from err
    return transformers


def export_hf(checkpoint: str, out_dir: str, dtype: str = "float32", tokenizer_dir: Optional[str] = None, *,
              writer: str) -> Dict[str, Any]:
    """Write checkpoint ``checkpoint`` as a transformers directory ``out_dir``, marked as ``writer``'s output (its
    earlier output replaced atomically; anything else there moved aside: ``fileio.replace_directory``).
    ``tokenizer_dir``: None for the tokenizer the run trained with, ``"none"`` for no tokenizer files. ValueError
    for what cannot be exported (an attention kind with no transformers architecture, a tokenizer that does not fit
    the model)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    path = resolve_checkpoint_path(checkpoint)
    cfg, state = saved_config(path)
    refusal = export_refusal(state["config"]["model"])
    if refusal:
        raise ValueError(refusal)
    transformers = import_transformers()
    tokenizer = None if tokenizer_dir == "none" else load_tokenizer(tokenizer_dir or prepare(cfg.data).tokenizer_dir)

    init_distributed("gloo", tp=1, pp=1, seed=0)  # a world of one: the checkpoint reshards to TP=1, PP=1
    try:
        chunk, cfg, state = load_single_rank_model(path, torch.float32)
        sd = {k: v.detach().cpu() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    finally:
        destroy_distributed()
    vocab = sd["embedding.word_embeddings.weight"].shape[0]
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise ValueError(
            f"the tokenizer at {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the model's {vocab}: "
            "give the tokenizer the model was trained with (--tokenizer)"
        )
    hf_sd = to_hf_state_dict(cfg.model, sd, state["step"], cfg.trainer.max_steps)
    special = {"bos": None, "eos": None, "pad": None}
    if tokenizer is not None:  # BOS: the end-of-document token, which precedes every document in training
        special = {"bos": tokenizer.eod, "eos": tokenizer.eod, "pad": getattr(tokenizer, "_pad", None)}

    out_dir = os.path.abspath(out_dir)
    staging = staging_directory(out_dir)
    try:
        _save_model(transformers, cfg.model, hf_sd, vocab, special, DTYPES[dtype], staging)
        if tokenizer is not None:
            _save_tokenizer(transformers, tokenizer, cfg.model.seq_length, staging)
        info = {
            "checkpoint": path,
            "step": state["step"],
            "attention": cfg.model.attention,
            "architecture": architecture(state["config"]["model"]),
            "dtype": dtype,
            "vocab_size": vocab,
            "tokenizer": None if tokenizer is None else {
                "source": tokenizer.path, "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.eod,
                "eos_id": tokenizer.eod, "adds_bos": False, "adds_eos": False,
            },
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "transformers": transformers.__version__,
            # transformers' models attend across EOD tokens: a run trained with data.document_mask computes as it
            # trained on one document at a time (or under an attention mask that keeps each document to itself)
            "documents": "attends across documents unless given one document at a time or an attention mask that "
                         "keeps each document to itself" + (
                             "; trained with document masking (data.document_mask)"
                             if cfg.data.document_mask else ""),
        }
        with open(os.path.join(staging, "export_info.json"), "w") as f:
            json.dump(info, f, indent=2)
        os.chmod(staging, 0o755)  # mkdtemp's 0700 and temporary files' 0600: a model directory others may read
        for name in os.listdir(staging):
            os.chmod(os.path.join(staging, name), 0o644)
        moved_aside = replace_directory(staging, out_dir, writer)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s (step %d, %s) to %s as %s", path, state["step"], cfg.model.attention, out_dir,
                info["architecture"])
    return {**info, "path": out_dir, "moved_aside": moved_aside}


def _save_model(transformers, model, hf_sd, vocab, special, dtype, out_dir) -> None:
    config_cls = transformers.DiffLlamaConfig if model.attention == "diff" else transformers.LlamaConfig
    config = config_cls(**hf_config_kwargs(model, vocab, special))
    config.architectures = [architecture({"attention": model.attention})]
    config.dtype = dtype
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    weights = {k: v.to(dtype) for k, v in hf_sd.items()}
    if model.share_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    hf_model.load_state_dict(weights, strict=True, assign=True)
    if model.share_embeddings:
        hf_model.tie_weights()
    hf_model.generation_config = transformers.GenerationConfig(
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"]
    )
    hf_model.save_pretrained(out_dir, safe_serialization=True)


def _save_tokenizer(transformers, tokenizer: Tokenizer, max_length: int, out_dir: str) -> None:
    """The tokenizer files AutoTokenizer loads, checked to encode the probes to the framework's ids."""
    piece = tokenizer._backend.id_to_piece
    # bos_token is the end-of-document token: what a document follows in training (never added: add_bos_token)
    special = {"eos_token": piece(tokenizer.eod), "bos_token": piece(tokenizer.eod)}
    if getattr(tokenizer, "_pad", None) is not None:
        special["pad_token"] = piece(tokenizer._pad)
    config: Dict[str, Any] = {
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        **special,
    }
    if tokenizer.library == "sentencepiece":
        model_file = os.path.join(tokenizer.path, "tokenizer.model") if os.path.isdir(tokenizer.path) else tokenizer.path
        shutil.copyfile(model_file, os.path.join(out_dir, "tokenizer.model"))
        unk = tokenizer._backend.processor.unk_id()
        # legacy=False and add_prefix_space=False: the framework's pieces carry no dummy prefix space
        config.update(tokenizer_class="LlamaTokenizer", legacy=False, add_prefix_space=False, unk_token=piece(unk))
    elif tokenizer.library == "huggingface":
        shutil.copyfile(tokenizer.path, os.path.join(out_dir, "tokenizer.json"))
        config.update(tokenizer_class="PreTrainedTokenizerFast")
    else:
        raise ValueError(
            f"the tokenizer at {tokenizer.path} is a {tokenizer.library} tokenizer; export writes sentencepiece and "
            "Hugging Face tokenizer.json tokenizers"
        )
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    if tokenizer.library == "sentencepiece":  # the fast tokenizer too, so that loaders need no conversion
        hf_tokenizer.backend_tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    for text in TOKENIZER_PROBES:
        ours, theirs = tokenizer.encode(text), hf_tokenizer(text)["input_ids"]
        if ours != theirs:
            raise ValueError(
                f"the exported tokenizer encodes {text!r} to {theirs[:16]}, the framework's to {ours[:16]}; "
                "not exporting a tokenizer that would change the ids"
            )
    if (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) != (tokenizer.eod, tokenizer.eod):
        raise ValueError(
            f"the exported tokenizer's BOS and EOS are ids {hf_tokenizer.bos_token_id} and "
            f"{hf_tokenizer.eos_token_id}, not the end-of-document token {tokenizer.eod}; not exporting it"
        )
