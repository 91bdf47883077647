"""DEX head selection: which heads of a pretrained softmax-attention model get W_D (``model.dex.select``).

``calibrate`` (the default) measures the pretrained model on ``model.dex.calibration_samples`` sequences of the
training data and scores every head of a layer by the criterion of the DEX design notes (high attention entropy,
low importance):

    score_h = Ĥ_h − I_h / max_layer(I)

- Ĥ_h: the head's attention entropy averaged over calibration tokens, each query's entropy divided by the log of the
  keys it sees (1: attention spread uniformly over the causal prefix, i.e. the noise DEX cancels; 0: one key);
- I_h: the head's importance, Michel et al. (2019): the mean over sequences of |Σ_t O_h,t·∂L/∂O_h,t|, the derivative
  of the loss by a gate on the head's output, normalised by the layer's most important head.

Each layer keeps its ceil(``model.dex.head_fraction`` × heads) highest-scoring heads (ties: the lower index).
``all``/``none`` select every head or none (ablations), ``list`` takes ``model.dex.heads`` as given. The resolved
lists are written into ``model.dex.heads`` before the model is built, so ``config.yaml`` and every checkpoint record
them, and a resumed run reuses its checkpoint's selection instead of measuring again.
"""

from __future__ import annotations

import copy
import logging
import math
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from diff_transformer import distributed
from diff_transformer.models.gpt import build_model_chunk, dex_attention_modules
from diff_transformer.training.checkpoint import check_weights_compatible, load_model_weights, read_trainer_state

logger = logging.getLogger("diff_transformer")

# (entropy sum, entropy count, importance sum, importance count) of one head: summed over data-parallel ranks
HeadSums = Tuple[float, int, float, int]


def head_scores(stats: Dict[int, Tuple[float, float]]) -> Dict[int, float]:
    """score_h = Ĥ_h − I_h / max(I) over one layer's heads, from {head: (mean normalised entropy, importance)}."""
    top = max(importance for _, importance in stats.values())
    return {h: entropy - (importance / top if top > 0 else 0.0) for h, (entropy, importance) in stats.items()}


def select_heads(layer_stats: Dict[int, Dict[int, Tuple[float, float]]], fraction: float) -> List[List[int]]:
    """Per layer (1-based numbers, all present), the ceil(fraction × heads) heads of highest score, sorted."""
    selection = []
    for layer in sorted(layer_stats):
        scores = head_scores(layer_stats[layer])
        keep = math.ceil(fraction * len(scores))
        ranked = sorted(scores, key=lambda h: (-scores[h], h))
        selection.append(sorted(ranked[:keep]))
    return selection


def resolve_dex_heads(trainer, resume: Optional[str]) -> str:
    """Fill ``model.dex.heads`` in ``trainer.cfg`` (the same on every rank); returns how it was chosen."""
    m = trainer.cfg.model
    dex = m.dex
    if dex.heads is not None:
        return "model.dex.heads"
    heads, layers = 2 * m.num_heads, m.num_layers
    if resume is not None:
        saved = read_trainer_state(resume)["config"]["model"]
        if saved.get("attention") == "dex" and saved.get("dex", {}).get("heads") is not None:
            dex.heads = [list(h) for h in saved["dex"]["heads"]]
            return f"the checkpoint it resumes ({resume})"
    if dex.select == "all":
        dex.heads = [list(range(heads)) for _ in range(layers)]
        return "model.dex.select=all"
    if dex.select == "none":
        dex.heads = [[] for _ in range(layers)]
        return "model.dex.select=none"
    weights = trainer.cfg.checkpoint.load_weights_only
    if weights is None:
        raise ValueError(
            "model.dex.select=calibrate measures the pretrained model: set checkpoint.load_weights_only=CHECKPOINT "
            "(or choose the heads with model.dex.select=all|none|list)"
        )
    from diff_transformer.training.checkpoint import resolve_checkpoint_path

    weights = resolve_checkpoint_path(weights)
    dex.heads = calibrate(trainer, weights)
    return f"calibration on {dex.calibration_samples} training sequences with {weights}"


def calibrate(trainer, weights: str) -> List[List[int]]:
    """Run the pretrained model (DEX with no W_D: exactly the pretrained function) over the calibration data with
    every DEX layer recording its heads' entropy and importance, then select. Collective over all ranks."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from diff_transformer.training.steps import forward_step

    cfg = copy.deepcopy(trainer.cfg)
    m = cfg.model
    saved_model = read_trainer_state(weights)["config"]["model"]
    check_weights_compatible(weights, saved_model, OmegaConf.to_container(OmegaConf.structured(m)))
    m.dex.heads = [[] for _ in range(m.num_layers)]
    chunk = build_model_chunk(cfg, trainer.padded_vocab, trainer.dtype)
    if torch.cuda.is_available():
        chunk.cuda(torch.cuda.current_device())
    chunk.config.finalize_model_grads_func = None  # no DDP wrapper here: the gradients are thrown away
    load_model_weights(chunk, weights, saved_model)
    modules = dex_attention_modules([chunk])
    for module in modules:
        module.calibrating = True

    mbs, dp = cfg.trainer.micro_batch_size, parallel_state.get_data_parallel_world_size()
    micro_batches = math.ceil(m.dex.calibration_samples / (mbs * dp))
    if micro_batches * mbs * dp > len(trainer.train_ds):
        raise ValueError(
            f"model.dex.calibration_samples={m.dex.calibration_samples} needs {micro_batches * mbs * dp} training "
            f"sequences; the run's training data holds {len(trainer.train_ds)}: ask for fewer"
        )
    get_forward_backward_func()(
        forward_step_func=partial(forward_step, reset_position_ids=cfg.data.reset_position_ids),
        data_iterator=trainer._loader(trainer.train_ds, consumed_samples=0),
        model=[chunk],
        num_microbatches=micro_batches,
        seq_length=m.seq_length,
        micro_batch_size=mbs,
        forward_only=False,  # the importance is a gradient
    )
    local: Dict[int, Dict[int, HeadSums]] = {}
    for module in modules:
        first = module.tp_rank * module.num_local_heads
        local[module.layer_number] = {
            first + i: (float(module.entropy_sum[i]), module.entropy_count, float(module.importance_sum[i]),
                        module.importance_count)
            for i in range(module.num_local_heads)
        }
    merged: Dict[int, Dict[int, List[float]]] = {}
    for part in distributed.all_gather_objects(local):  # TP ranks: other heads; PP: other layers; DP: other data
        for layer, heads in part.items():
            for h, sums in heads.items():
                total = merged.setdefault(layer, {}).setdefault(h, [0.0, 0, 0.0, 0])
                for i, value in enumerate(sums):
                    total[i] += value
    stats = {
        layer: {h: (s[0] / s[1], s[2] / s[3]) for h, s in heads.items()} for layer, heads in merged.items()
    }
    selection = select_heads(stats, m.dex.head_fraction)
    if torch.distributed.get_rank() == 0:
        for layer, chosen in zip(sorted(stats), selection):
            scores = head_scores(stats[layer])
            logger.info(
                "DEX calibration, layer %d: heads %s (score = entropy - importance/max: %s)", layer, chosen,
                ", ".join(f"{h}: {scores[h]:+.3f}" for h in sorted(scores)),
            )
    return selection
