"""What the attention of a checkpoint looks like on a probe batch: per layer and head, and averaged.

For every layer the maps come through the kind's ``attention_maps`` protocol (``models/attention_maps.py``), one
probe sequence at a time, and are reduced at once by ``attention_metrics``:

- ``maps``: for the weights each kind applies to V, normalised to a distribution (``combined``: |W| / Σ|W| per row;
  A itself for softmax kinds), and for every component map that differs from it (DIFF's A1 and A2, the signed mask's
  A): entropy, Gini over the visible keys, mass in the top 1% and the top k keys, first-token mass, and whether the
  head is a sink head (mean first-token mass > 0.3); each averaged over rows and probe sequences;
- ``differential`` (kinds with A1 and A2): A1 vs A2 cosine and KL(A1‖A2) per query row on relevant and on irrelevant
  keys (NIAH probes: relevant = the asked needles' tokens, rows = the answer rows; other probes: relevant = each row's
  top-k keys of the combined map); the share and mass of negative entries of A1 − λA2; the effective rank of λ·A2,
  A1 and A1 − λ·A2 (full N×N map of each head);
- ``logits`` and ``hidden``: the largest |attention logit| and |hidden state| of the layer's output (top-1, top-10,
  top-100: exact over all probes) and the median (the median of each probe's median);
- ``lambda``: DIFF's λ of the layer (DIFF V2: the mean of its per-token λ per head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from diff_transformer import attention_metrics as am
from diff_transformer.evaluation.report import Progress
from diff_transformer.models.attention_maps import capture_attention, capture_layer_outputs

MAP_METRICS = ("entropy", "gini", "top1pct_mass", "topk_mass", "first_token_mass")
DIFF_METRICS = ("cosine_relevant", "cosine_irrelevant", "kl_relevant", "kl_irrelevant", "negative_fraction",
                "negative_mass", "negative_relative_mass", "effective_rank_lambda_A2", "effective_rank_A1",
                "effective_rank_A1_minus_lambda_A2")
PROFILE_KS = (1, 10, 100)


@dataclass
class Probe:
    tokens: List[int]
    rows: Optional[torch.Tensor] = None  # query rows for the relevant/irrelevant split (None: all)
    relevant: Optional[torch.Tensor] = None  # (L,) bool: relevant keys (None: each row's top-k)


class _LayerAccumulator:
    """Per-head sums over probe sequences of one layer's metrics."""

    def __init__(self):
        self.sums: Dict[str, Dict[str, torch.Tensor]] = {}
        self.counts: Dict[str, Dict[str, torch.Tensor]] = {}
        self.logit_top: List[torch.Tensor] = []
        self.logit_medians: List[float] = []
        self.hidden_top: List[torch.Tensor] = []
        self.hidden_medians: List[float] = []
        self.lam: List[torch.Tensor] = []

    def add(self, section: str, name: str, per_row: torch.Tensor) -> None:
        """per_row (heads, rows): NaN rows are left out of the mean."""
        valid = ~torch.isnan(per_row)
        total = torch.where(valid, per_row, torch.zeros_like(per_row)).sum(-1).double().cpu()
        count = valid.sum(-1).double().cpu()
        bucket, counts = self.sums.setdefault(section, {}), self.counts.setdefault(section, {})
        bucket[name] = bucket.get(name, 0) + total
        counts[name] = counts.get(name, 0) + count

    def mean(self, section: str, name: str) -> List[Optional[float]]:
        total, count = self.sums[section][name], self.counts[section][name]
        return [float(t / c) if c > 0 else None for t, c in zip(total.tolist(), count.tolist())]


def _map_metrics(acc: _LayerAccumulator, section: str, maps: torch.Tensor, key_mask: torch.Tensor, topk: int) -> None:
    p = maps[0]  # (heads, rows, keys): one probe sequence
    acc.add(section, "entropy", am.entropy(p))
    acc.add(section, "gini", am.gini(p, key_mask))
    acc.add(section, "top1pct_mass", am.top_fraction_mass(p, 0.01, key_mask))
    acc.add(section, "topk_mass", am.top_k_mass(p, topk))
    acc.add(section, "first_token_mass", am.first_token_mass(p))


def _differential_metrics(acc: _LayerAccumulator, maps, probe: Probe, key_mask: torch.Tensor, topk: int) -> None:
    a1, a2, w = maps.components["A1"][0], maps.components["A2"][0], maps.combined[0]  # (H, N, N)
    lam = maps.lam if maps.lam.dim() == 0 else maps.lam[0]
    rows = probe.rows.to(w.device) if probe.rows is not None else torch.arange(w.shape[-2], device=w.device)
    visible = key_mask[rows]
    if probe.relevant is not None:
        relevant = probe.relevant.to(w.device)[None, None, :] & visible
    else:  # each row's top-k keys of the combined map
        magnitude = w[:, rows].abs().masked_fill(~visible, -1.0)
        top = magnitude.topk(min(topk, magnitude.shape[-1]), dim=-1).indices
        relevant = torch.zeros_like(magnitude, dtype=torch.bool).scatter_(-1, top, True) & visible
    irrelevant = visible & ~relevant
    r1, r2 = a1[:, rows], a2[:, rows]
    acc.add("differential", "cosine_relevant", am.row_cosine(r1, r2, relevant))
    acc.add("differential", "cosine_irrelevant", am.row_cosine(r1, r2, irrelevant))
    acc.add("differential", "kl_relevant", am.row_kl(r1, r2, relevant))
    acc.add("differential", "kl_irrelevant", am.row_kl(r1, r2, irrelevant))
    negative = am.negative_entries(w, key_mask)
    acc.add("differential", "negative_fraction", negative["fraction"])
    acc.add("differential", "negative_mass", negative["mass"])
    acc.add("differential", "negative_relative_mass", negative["relative_mass"])
    for name, matrix in (("lambda_A2", lam * a2), ("A1", a1), ("A1_minus_lambda_A2", w)):
        acc.add("differential", f"effective_rank_{name}", am.effective_rank(matrix)[:, None])


def analyze(model, probes: List[Probe], topk: int = 8) -> Dict[str, Any]:
    """Run each probe through ``model`` (an InferenceModel) with the maps captured; the analysis.json body."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    accumulators: Dict[int, _LayerAccumulator] = {}
    differential = {}
    progress = Progress(f"{model.run.label}: attention analysis, probe sequences", len(probes))
    for probe in probes:
        def on_maps(layer, maps_for, probe=probe):
            maps = maps_for(None)
            acc = accumulators.setdefault(layer, _LayerAccumulator())
            key_mask = maps.key_mask()
            _map_metrics(acc, "combined", am.normalized_magnitude(maps.combined), key_mask, topk)
            for name, component in maps.components.items():
                if component is not maps.combined:
                    _map_metrics(acc, name, component, key_mask, topk)
            differential[layer] = maps.differential
            if maps.differential:
                _differential_metrics(acc, maps, probe, key_mask, topk)
                lam = maps.lam.float()
                acc.lam.append(lam.reshape(1) if lam.dim() == 0 else lam[0].mean((-2, -1)))
            logits = torch.cat([x[torch.isfinite(x)].abs() for x in maps.logits.values()])
            acc.logit_top.append(logits.topk(min(max(PROFILE_KS), logits.numel())).values.cpu())
            acc.logit_medians.append(float(logits.median()))

        def on_output(layer, hidden):
            acc = accumulators.setdefault(layer, _LayerAccumulator())
            values = hidden.float().abs().flatten()
            acc.hidden_top.append(values.topk(min(max(PROFILE_KS), values.numel())).values.cpu())
            acc.hidden_medians.append(float(values.median()))

        tokens = torch.tensor([probe.tokens])
        with capture_attention([model.model], on_maps), \
                capture_layer_outputs([model.model], TransformerLayer, on_output):
            model.logits(tokens)
        progress.update()
    layers = [_layer_summary(layer, accumulators[layer], differential[layer]) for layer in sorted(accumulators)]
    return {"layers": layers, "mean": _average_over_layers(layers)}


def _profile(tops: List[torch.Tensor], medians: List[float]) -> Dict[str, float]:
    values = torch.cat(tops).sort(descending=True).values
    out = {f"top{k}": float(values[min(k, len(values)) - 1]) for k in PROFILE_KS}
    out["median"] = float(np.median(medians))
    return out


def _layer_summary(layer: int, acc: _LayerAccumulator, differential: bool) -> Dict[str, Any]:
    maps = {}
    for section in [s for s in acc.sums if s != "differential"]:
        per_head = {name: acc.mean(section, name) for name in MAP_METRICS}
        per_head["sink"] = [m is not None and m > am.SINK_THRESHOLD for m in per_head["first_token_mass"]]
        maps[section] = per_head
    out: Dict[str, Any] = {"layer": layer, "maps": maps,
                           "logits": _profile(acc.logit_top, acc.logit_medians),
                           "hidden": _profile(acc.hidden_top, acc.hidden_medians)}
    if differential:
        out["differential"] = {name: acc.mean("differential", name) for name in DIFF_METRICS}
        lam = torch.stack(acc.lam).double().mean(0).tolist()
        out["lambda"] = lam[0] if len(lam) == 1 else lam
    out["mean"] = _head_means(out)
    return out


def _nanmean(values) -> Optional[float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _head_means(layer: Dict[str, Any]) -> Dict[str, Any]:
    mean: Dict[str, Any] = {}
    for section, metrics in layer["maps"].items():
        for name in MAP_METRICS:
            mean[f"{section}/{name}"] = _nanmean(metrics[name])
        mean[f"{section}/sink_rate"] = float(np.mean(metrics["sink"]))
    for name, values in layer.get("differential", {}).items():
        mean[f"differential/{name}"] = _nanmean(values)
    for source in ("logits", "hidden"):
        for key, value in layer[source].items():
            mean[f"{source}/{key}"] = value
    return mean


def _average_over_layers(layers: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    keys = sorted({k for layer in layers for k in layer["mean"]})
    return {k: _nanmean([layer["mean"].get(k) for layer in layers]) for k in keys}


# ------------------------------------------------------------------------------------------------------------------
# λ over a run's checkpoints
# ------------------------------------------------------------------------------------------------------------------
def lambda_trajectory(model, checkpoints: List[str]) -> List[Dict[str, Any]]:
    """DIFF V1's per-layer λ at every checkpoint of the run (λ is read from each checkpoint's λ vectors only; the
    model's own weights are left as they were). Empty for kinds without learnable per-layer λ."""
    from megatron.core import dist_checkpointing

    from diff_transformer.evaluation.inference import CONVERTED_SUFFIX
    from diff_transformer.models.gpt import lambda_values

    names = [n for n, _ in model.model.named_parameters() if "core_attention.lambda_" in n]
    if not names:
        return []
    params = dict(model.model.named_parameters())
    original = {n: params[n].detach().clone() for n in names}
    trajectory = []
    try:
        for path in checkpoints:
            if path.endswith(CONVERTED_SUFFIX):
                loaded = torch.load(path, map_location="cpu", weights_only=True)["model"]
            else:
                sharded = {k: v for k, v in model.model.sharded_state_dict().items() if k in names}
                loaded = dist_checkpointing.load(sharded, path)
            with torch.no_grad():
                for n in names:
                    params[n].copy_(loaded[n])
            step = _checkpoint_step(path)
            trajectory.append({"step": step, "lambda": lambda_values([model.model])})
    finally:
        with torch.no_grad():
            for n in names:
                params[n].copy_(original[n])
    return trajectory


def _checkpoint_step(path: str) -> Optional[int]:
    from diff_transformer.training.checkpoint import read_trainer_state

    if path.endswith(".pt"):
        return int(torch.load(path, map_location="cpu", weights_only=True)["step"])
    return int(read_trainer_state(path)["step"])
