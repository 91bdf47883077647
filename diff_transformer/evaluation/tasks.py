"""The evaluation tasks run on an InferenceModel: ``ppl`` and ``niah``; each returns the JSON-ready section of
eval.json."""

from __future__ import annotations

import contextlib
import os
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from diff_transformer import attention_metrics as am
from diff_transformer.distributed import all_gather_objects, all_reduce_values
from diff_transformer.evaluation import niah
from diff_transformer.evaluation.report import Progress
from diff_transformer.evaluation.perplexity import read_text_documents, stream_perplexity, text_stream, validation_stream
from diff_transformer.models.attention_maps import capture_attention


def run_ppl(model, tokenizer, texts: Sequence[str], max_tokens: Optional[int], stride: Optional[int],
            batch_size: int, tokenizer_override: Optional[str] = None) -> Dict[str, Dict]:
    """Perplexity on the run's validation split and on each --text file."""
    out: Dict[str, Dict] = {}
    stream, sources = validation_stream(model.run.config, max_tokens, tokenizer_override)
    result = stream_perplexity(model, stream, stride, batch_size, f"{model.run.label}: validation perplexity").summary()
    result["sources"] = sources
    out["validation"] = result
    for path in texts:
        stream = text_stream(read_text_documents(path), tokenizer, max_tokens)
        result = stream_perplexity(model, stream, stride, batch_size,
                                   f"{model.run.label}: {os.path.basename(path)} perplexity").summary()
        result["file"] = os.path.abspath(path)
        out[f"text:{os.path.basename(path)}"] = result
    return out


def run_niah(model, tokenizer, config: niah.NiahConfig, haystack: np.ndarray, batch_size: int) -> Dict:
    """Accuracy by length × depth, and per layer the share of attention mass the answer rows put on the answer
    needle, the other needles, the haystack and the queries (normalised |weights| of each kind's combined map,
    averaged over heads, answer rows and samples; not measured under context parallelism, where no rank holds a
    whole map: empty)."""
    samples = niah.generate(config, tokenizer, haystack)
    if len(samples) < model.world_size:
        raise ValueError(f"niah has {len(samples)} samples for {model.world_size} processes; raise --samples or use "
                         "fewer processes")
    mine = list(range(model.rank, len(samples), model.world_size))
    results: Dict[int, List[bool]] = {}
    region_sums: Dict[int, torch.Tensor] = {}  # layer -> (regions,) summed over rows (mean over heads)
    uniform_sums = torch.zeros(len(niah.REGIONS), dtype=torch.float64)  # what uniform causal attention would give
    rows_seen = 0
    progress = Progress(f"{model.run.label}: NIAH samples", len(mine), enabled=model.global_rank == 0)
    for start in range(0, len(mine), batch_size):
        batch = mine[start:start + batch_size]
        progress.update(len(batch))
        for length in sorted({samples[i].length for i in batch}):
            indices = [i for i in batch if samples[i].length == length]
            group = [samples[i] for i in indices]
            rows_per_sample = [torch.cat([niah.answer_rows(q) for q in s.queries]) for s in group]
            union = torch.unique(torch.cat(rows_per_sample))
            masks = torch.stack([  # (b, rows, regions, L): the region of each key, for each sample's answer rows
                torch.stack([torch.stack([m for m in _query_masks(s, r)]) for r in union.tolist()])
                for s in group
            ]).to(model.device)
            wanted = torch.stack([torch.isin(union, r) for r in rows_per_sample]).to(model.device)  # (b, rows)
            # a row at position p attending uniformly puts 1/(p+1) on each key up to p: a region's share is its count
            causal = (torch.arange(length)[None, :] <= union[:, None]).to(model.device, torch.float32)  # (rows, L)
            uniform = torch.einsum("bril,rl->bri", masks.float(), causal) / causal.sum(1)[None, :, None]
            uniform_sums += (uniform * wanted[..., None]).sum((0, 1)).double().cpu()

            def on_maps(layer, maps_for, masks=masks, wanted=wanted, union=union):
                weights = am.normalized_magnitude(maps_for(union.to(model.device)).combined)  # (b, H, rows, L)
                mass = torch.einsum("bhrl,bril->bhri", weights, masks.float()).mean(1)  # (b, rows, regions)
                total = (mass * wanted[..., None]).sum((0, 1)).double()
                region_sums[layer] = region_sums.get(layer, 0) + total

            tokens = torch.tensor([s.tokens for s in group])
            with capture_attention([model.model], on_maps) if model.cp == 1 else contextlib.nullcontext():
                predictions = model.greedy_next(tokens).cpu()
            rows_seen += int(wanted.sum())
            for i, p in zip(indices, predictions):
                results[i] = niah.retrieved(samples[i], p.tolist())
    gathered = {}
    for part in all_gather_objects(results, group=model.data_group):
        gathered.update(part)
    ordered = [gathered[i] for i in range(len(samples))]
    layers = sorted(region_sums)
    sums = all_reduce_values([float(x) for layer in layers for x in region_sums[layer]]
                             + [float(x) for x in uniform_sums] + [rows_seen], group=model.data_group)
    rows_total = sums[-1]
    uniform_shares = sums[len(layers) * len(niah.REGIONS):-1]
    allocation = {
        str(layer): {region: sums[i * len(niah.REGIONS) + j] / rows_total for j, region in enumerate(niah.REGIONS)}
        for i, layer in enumerate(layers)
    }
    grid = niah.accuracy_grid(config, samples, ordered)
    return {
        "config": {"needles": config.needles, "asked": config.asked, "lengths": list(config.lengths),
                   "depths": list(config.depths), "samples_per_cell": config.samples, "seed": config.seed,
                   "value_digits": config.value_digits},
        "accuracy": float(np.mean([np.mean(r) for r in ordered])),
        "accuracy_by_length_depth": grid,
        "attention_allocation": allocation,
        "uniform_allocation": {region: uniform_shares[j] / rows_total for j, region in enumerate(niah.REGIONS)},
        "example": tokenizer.decode(samples[0].tokens),
    }


def _query_masks(sample: niah.Sample, row: int) -> List[torch.Tensor]:
    """Region masks for the query whose answer rows hold ``row`` (zeros when none does)."""
    for q in sample.queries:
        if q.answer[0] - 1 <= row < q.answer[1] - 1:
            masks = niah.region_masks(sample, q)
            return [masks[r] for r in niah.REGIONS]
    return [torch.zeros(sample.length, dtype=torch.bool)] * len(niah.REGIONS)


def haystack_stream(model, max_tokens: int, tokenizer_override: Optional[str] = None) -> np.ndarray:
    """The run's validation split: the default haystack corpus (under document masking without its EOD tokens, so
    that a prompt is one document)."""
    stream, _ = validation_stream(model.run.config, max_tokens, tokenizer_override)
    return stream[stream != model.eod] if model.document_mask else stream
