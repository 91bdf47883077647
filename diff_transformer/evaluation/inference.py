"""A checkpoint's model for inference: load it whatever layout saved it, run it, score tokens.

    from diff_transformer.evaluation.inference import load_for_inference, resolve_run

    run = resolve_run("runs/x")                      # cheap: config, step, tokenizer; no model, no process group
    model = load_for_inference(run)                  # TP=1/PP=1 on this process's device, eval mode
    nll = model.token_nll(tokens)                    # (b, s) fp32 from (b, s + 1) ids: −log p(x[t+1] | x[:t+1])
    ...
    destroy_distributed()                            # diff_transformer.distributed, when done

A run may be a run directory, a checkpoints directory, a ``step_*`` checkpoint or its ``latest`` file (any TP/PP
layout: dist_checkpointing reshards the weights onto one rank), or a ``.pt`` file written by
``python -m diff_transformer.checkpoint convert``. The model runs on the GPU of ``LOCAL_RANK`` when there is one (in the
precision the run trained in, ``trainer.precision``), else on the CPU in fp32; logits are scored in fp32. Under
torchrun every process holds the whole model (data parallelism over the world), so evaluation loops split their work
with :attr:`InferenceModel.rank` and :attr:`InferenceModel.world_size` and reduce over
:attr:`InferenceModel.data_group`.

Long contexts: ``seq_length`` evaluates at another context length than the run trained at (RoPE positions beyond
the training length), and ``cp`` splits each sequence over that many ranks (context parallelism, ring attention:
``models/ring_attention.py``): the ranks of a context-parallel group score the same sequences, each its two
load-balanced chunks, and gather the per-token results, so the world is ``cp`` × data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from diff_transformer.config import Config, ModelConfig, padded_vocab_size
from diff_transformer.distributed import all_gather_tensor, init_distributed, world_size_from_env
from diff_transformer.models.documents import packed_documents
from diff_transformer.models.gpt import build_model_chunk, lambda_values, resolve_precision, set_dex_anneal
from diff_transformer.models.layer_specs import variant_label
from diff_transformer.models.ring_attention import context_parallel_chunks, load_balanced_indices
from diff_transformer.training.checkpoint import (
    CHECKPOINTS_DIRNAME,
    list_checkpoints,
    read_trainer_state,
    resolve_checkpoint_path,
)

CONVERTED_SUFFIX = ".pt"


@dataclasses.dataclass
class RunInfo:
    """What a checkpoint says about itself, read without building the model."""

    checkpoint: str  # a step_* directory, or a converted .pt file
    config: Dict[str, Any]  # the resolved config it was trained with
    step: int
    run_dir: Optional[str]  # the run directory holding it (None for a file or a checkpoint outside a run)
    tokenizer_dir: str
    label: str  # the attention kind and its ablation keys (``variant_label``), and the step

    @property
    def seq_length(self) -> int:
        return int(self.config["model"]["seq_length"])

    @property
    def attention(self) -> str:
        return self.config["model"]["attention"]

    def typed_config(self) -> Config:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), self.config))

    def checkpoints(self) -> List[str]:
        """Every complete checkpoint of the run, oldest first (this one alone when it is not in a run)."""
        if self.run_dir is None:
            return [self.checkpoint]
        root = self.config.get("checkpoint", {}).get("dir") or os.path.join(self.run_dir, CHECKPOINTS_DIRNAME)
        return [path for _, path in list_checkpoints(root)] or [self.checkpoint]


def bundled_tokenizer_dir(data_cfg: Dict[str, Any]) -> str:
    """Where ``data.source=bundled`` keeps the tokenizer it trained (``data.datasets.prepare``)."""
    from data.config import BUNDLED_CORPUS, resolve_path
    from data.tokenizer import file_sha256

    corpus_hash = file_sha256(BUNDLED_CORPUS)[:12]
    return os.path.join(resolve_path(data_cfg.get("cache_dir", "data/cache")),
                        f"bundled-{corpus_hash}-bpe{data_cfg.get('bundled_vocab_size', 4096)}", "tokenizer")


def run_tokenizer_dir(config: Dict[str, Any], override: Optional[str] = None) -> str:
    """The tokenizer a run trained with: ``override``, else the config's ``data.tokenizer_dir``, else the bundled
    corpus's; ValueError naming the path when it is missing."""
    from data.config import resolve_path
    from data.tokenizer import CONFIG_FILE, MODEL_FILE

    data_cfg = config.get("data", {})
    if override is not None:
        path, source = resolve_path(override), "--tokenizer"
    elif data_cfg.get("tokenizer_dir"):
        path, source = resolve_path(data_cfg["tokenizer_dir"]), "data.tokenizer_dir of the checkpoint's config"
    else:
        path, source = bundled_tokenizer_dir(data_cfg), "the bundled corpus's tokenizer"
    present = os.path.isfile(path) or any(os.path.isfile(os.path.join(path, f))
                                          for f in (MODEL_FILE, CONFIG_FILE, "tokenizer.json"))
    if not present:
        hint = ("run `python train.py experiment=smoke trainer.max_steps=1` once to prepare it, or give --tokenizer DIR"
                if override is None and not data_cfg.get("tokenizer_dir") else "give the tokenizer with --tokenizer DIR")
        raise ValueError(f"the run's tokenizer is missing: {path} ({source}) does not exist; {hint}")
    return path


def resolve_run(path: str, tokenizer: Optional[str] = None) -> RunInfo:
    """The checkpoint ``path`` means (see the module docstring) and what it says about itself; cheap."""
    if os.path.isfile(path) and path.endswith(CONVERTED_SUFFIX):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or not {"model", "config", "step"} <= set(saved):
            raise ValueError(f"{path} is not a file written by `python -m diff_transformer.checkpoint convert`")
        checkpoint, config, step, run_dir = path, saved["config"], int(saved["step"]), None
    else:
        if not os.path.exists(path):
            raise ValueError(f"{path} does not exist")
        checkpoint = resolve_checkpoint_path(path)
        state = read_trainer_state(checkpoint)
        config, step = state["config"], int(state["step"])
        parent = os.path.dirname(os.path.abspath(checkpoint))
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == CHECKPOINTS_DIRNAME else None
    typed_model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), config["model"]))
    return RunInfo(
        checkpoint=checkpoint, config=config, step=step, run_dir=run_dir,
        tokenizer_dir=run_tokenizer_dir(config, tokenizer), label=f"{variant_label(typed_model)} @ step {step}",
    )


def load_run_tokenizer(run: RunInfo):
    from data.tokenizer import load_tokenizer

    return load_tokenizer(run.tokenizer_dir)


def inference_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class InferenceModel:
    """A checkpoint's GPTModel at TP=1/PP=1, in eval mode on :attr:`device`."""

    def __init__(self, run: RunInfo, model: torch.nn.Module, cfg: Config, padded_vocab: int):
        from megatron.core import parallel_state

        self.run = run
        self.model = model
        self.cfg = cfg
        self.padded_vocab = padded_vocab
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.global_rank = torch.distributed.get_rank()
        # the work is split over data-parallel ranks; a context-parallel group shares its sequences
        self.rank = parallel_state.get_data_parallel_rank()
        self.world_size = parallel_state.get_data_parallel_world_size()
        self.data_group = parallel_state.get_data_parallel_group()
        self.cp = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group()
        # document masking (the run's data.document_mask, or evaluate's --document-mask) needs the EOD token's id
        self.document_mask = bool(cfg.data.document_mask)
        self.reset_position_ids = bool(cfg.data.reset_position_ids)
        self.eod: Optional[int] = None
        if self.document_mask or self.reset_position_ids:
            self.eod = load_run_tokenizer(run).eod

    @property
    def seq_length(self) -> int:
        return self.cfg.model.seq_length

    def check_length(self, length: int, what: str = "the input") -> None:
        if length > self.seq_length:
            raise ValueError(
                f"{what} has {length} tokens, above the model's maximum sequence length {self.seq_length} "
                "(model.seq_length)"
            )

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, padded vocab) logits in the model's dtype."""
        return self._per_position(tokens, lambda logits, _: logits)

    @torch.no_grad()
    def token_nll(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s + 1) token ids -> (b, s) fp32 NLL of tokens[:, 1:] given the tokens before each (the inputs are
        tokens[:, :-1], at most the model's sequence length, as a training sample); over the padded vocabulary, as
        the training loss."""

        def nll(logits, positions):
            targets = tokens[:, 1:].to(self.device).index_select(1, positions)
            logits = logits.float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(
                targets.shape
            )

        return self._per_position(tokens[:, :-1], nll)

    @torch.no_grad()
    def greedy_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s) -> (b, s) the most likely next token after each position (argmax over the real vocabulary)."""
        return self._per_position(tokens, lambda logits, _: logits.argmax(-1))

    def _per_position(self, tokens: torch.Tensor, score) -> torch.Tensor:
        """``score(logits, positions)`` of the (b, s) inputs ``tokens``, (b, s, ...) in position order. Under context
        parallelism each rank scores its chunks of the sequence (padded at the end to 2·cp equal chunks: causal, so
        the padding changes no earlier position) and the ranks gather the scores, not the logits."""
        self.check_length(tokens.shape[-1])
        tokens = tokens.to(self.device)
        s = tokens.shape[-1]
        if self.cp == 1:
            positions = torch.arange(s, device=self.device)
            documents = self._documents(tokens)
            return score(self.model(tokens, positions.expand_as(tokens), None, packed_seq_params=documents),
                         positions)
        padded = -(-s // (2 * self.cp)) * 2 * self.cp
        tokens = F.pad(tokens, (0, padded - s))
        positions = load_balanced_indices(padded, self.cp, self.cp_rank).to(self.device)
        local = context_parallel_chunks(tokens, self.cp, self.cp_rank, dim=1)
        documents = self._documents(tokens, local=lambda t: context_parallel_chunks(t, self.cp, self.cp_rank, dim=1))
        scores = score(self.model(local, positions.expand_as(local), None, packed_seq_params=documents),
                       positions.clamp(max=s - 1))
        gathered = all_gather_tensor(scores, self.cp_group)
        order = torch.cat([load_balanced_indices(padded, self.cp, r) for r in range(self.cp)]).to(self.device)
        out = torch.empty_like(torch.cat(gathered, dim=1))
        out[:, order] = torch.cat(gathered, dim=1)
        return out[:, :s]

    def _documents(self, tokens: torch.Tensor, local=None):
        """The packed documents of (b, s) inputs under document masking or per-document positions (None without):
        ids from the EOD tokens, as training draws them; ``local`` takes a context-parallel rank's chunks."""
        if self.eod is None:
            return None
        from data.datasets import document_ids, document_positions

        ids = document_ids(tokens, self.eod)
        positions = document_positions(ids) if self.reset_position_ids else None
        local = local or (lambda t: t)
        return packed_documents(local(ids) if self.document_mask else None,
                                local(positions) if positions is not None else None, tokens.shape[-1])

    def lambdas(self) -> List[float]:
        """DIFF V1's per-layer λ (empty for other kinds)."""
        return lambda_values([self.model])


def _saved_padded_vocab(run: RunInfo, cfg: Config) -> int:
    if cfg.model.vocab_size is not None:
        return padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    if run.checkpoint.endswith(CONVERTED_SUFFIX):
        weights = torch.load(run.checkpoint, map_location="cpu", weights_only=True)["model"]
        rows = weights["embedding.word_embeddings.weight"].shape[0]
    else:  # derived from the tokenizer and TP at save time: the tensor's global shape says it
        from megatron.core import dist_checkpointing

        rows = dist_checkpointing.load_tensors_metadata(run.checkpoint)["embedding.word_embeddings.weight"].local_shape[0]
    return padded_vocab_size(rows, cfg.model.make_vocab_size_divisible_by, 1)


def inference_config(run: RunInfo, attention_backend: Optional[str] = None, seq_length: Optional[int] = None,
                     cp: int = 1, document_mask: Optional[bool] = None) -> Config:
    """The run's config laid out for inference: TP=PP=1, no sequence parallelism or recomputation, the sequence split
    over ``cp`` ranks (context parallelism), the context ``seq_length`` (default: the run's), document masking as
    the run trained (``document_mask``: on or off instead)."""
    from diff_transformer.config import validate_attention_kind, validate_ring_attention

    cfg = run.typed_config()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.sequence_parallel = 1, 1, cp, False
    cfg.trainer.recompute, cfg.trainer.recompute_layers = "none", None
    if document_mask is not None:
        cfg.data.document_mask = document_mask
    if attention_backend is not None:
        cfg.model.attention_backend = attention_backend
        validate_attention_kind(cfg.model)
    if seq_length is not None and seq_length != cfg.model.seq_length:
        if cfg.model.attention == "signed_mask":
            raise ValueError(
                "model.attention=signed_mask lays its distance buckets out up to the training length "
                f"(model.seq_length={cfg.model.seq_length}); evaluate it at that length (leave --seq-length unset)"
            )
        cfg.model.seq_length = seq_length
    if cp < 1:
        raise ValueError(f"--cp {cp} must be at least 1")
    if cp > 1:
        validate_ring_attention(cfg.model, f"--cp {cp}", backend_key="--backend")
    return cfg


def load_weights(model: torch.nn.Module, run: RunInfo, cfg: Config) -> None:
    """Load ``run.checkpoint`` (a step_* directory of any layout, or a converted .pt file) into a TP=1/PP=1 model
    built from ``cfg``, as the run computed at that step."""
    checkpoint = run.checkpoint
    if checkpoint.endswith(CONVERTED_SUFFIX):
        weights = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"{checkpoint} does not fit the model of its config: missing {missing}, unexpected "
                             f"{unexpected}")
        if cfg.model.attention == "dex":
            set_dex_anneal([model], cfg.model.dex, run.step, cfg.trainer.max_steps)
        return
    from diff_transformer.training.checkpoint_tools import load_single_rank_weights

    load_single_rank_weights(model, checkpoint, cfg, read_trainer_state(checkpoint))


def load_for_inference(run: RunInfo, attention_backend: Optional[str] = None, seq_length: Optional[int] = None,
                       cp: int = 1, document_mask: Optional[bool] = None) -> InferenceModel:
    """Build the run's model at TP=1/PP=1 on this process's device and load its weights.

    Starts the process group if none is (a world of one, or torchrun's world: every rank then holds the whole model);
    an existing one must have TP=PP=1. ``attention_backend`` overrides the trained one (``eager`` materialises maps);
    ``seq_length`` the context length; ``cp`` splits each sequence over that many ranks (the world must be a multiple);
    ``document_mask`` (None: as the run trained) keeps attention within the documents the EOD tokens delimit.
    """
    cfg = inference_config(run, attention_backend, seq_length, cp, document_mask)
    if world_size_from_env() % cp:
        raise ValueError(f"--cp {cp} does not divide the world of {world_size_from_env()} processes; launch a "
                         f"multiple of {cp} processes (torchrun --nproc_per_node)")
    init_distributed(cfg.parallel.backend, tp=1, pp=1, seed=cfg.seed, cp=cp)
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() != 1 or \
            parallel_state.get_pipeline_model_parallel_world_size() != 1 or \
            parallel_state.get_context_parallel_world_size() != cp:
        raise ValueError(f"load_for_inference needs tensor and pipeline parallel sizes of 1 (the model is whole on "
                         f"every rank) and a context-parallel size of {cp}")
    device = inference_device()
    dtype = resolve_precision(cfg.trainer.precision) if device.type == "cuda" else torch.float32
    padded = _saved_padded_vocab(run, cfg)
    model = build_model_chunk(cfg, padded, dtype, perform_init=False).to(device)  # on its device first, as training
    load_weights(model, run, cfg)
    model.eval()
    return InferenceModel(run, model, cfg, padded)
