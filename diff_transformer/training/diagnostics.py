"""Cheap attention diagnostics while training: on every evaluation step, a fixed probe batch (the first sequences of
the validation set) runs forward once with the maps captured, and per layer three numbers are logged:

- ``attn/entropy``: mean entropy (nats) of the rows of each kind's combined map, normalised (|W| / Σ|W|, A for
  softmax kinds), over heads, rows and probe sequences;
- ``attn/sink_rate``: share of heads whose mean first-token mass of that map exceeds 0.3;
- ``attn/max_logit``: the largest attention logit q·kᵀ·scale of the layer (every softmax map of the kind).

The maps are recomputed from q and k in blocks of query rows (memory O(block · N) per head, whatever the backend),
and the statistics stay on the device until one transfer per evaluation. Under TP the heads' sums are reduced over
the TP group, under PP each stage's layers are gathered, so every rank logs the whole model's values.

``trainer.attention_diagnostics=auto`` turns them on when their estimated cost is at most 1% of the training
compute between two evaluations (:func:`estimated_cost_fraction`); ``on`` and ``off`` force it.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Dict

import torch

from diff_transformer import attention_metrics as am
from diff_transformer import distributed
from diff_transformer.config import ATTENTION_DIAGNOSTICS_MODES
from diff_transformer.models.attention_maps import capture_attention
from diff_transformer.models.layer_specs import attention_heads
from diff_transformer.training.steps import DOCUMENT_KEY, model_inputs

PROBE_SEQUENCES = 2
ROW_BLOCK = 256
MAX_COST_FRACTION = 0.01
# The probe's small, unfused operations (eager maps in row blocks, metric passes, a forward of two sequences) cost
# more than their FLOP share: on the 2-core CPU the measured cost was 1.1-9x the FLOP ratio
# (benchmarks/results/attention_diagnostics_cpu-2core_2026-11-26.md); the estimate charges 10x.
COST_CALIBRATION = 10.0


def estimated_cost_fraction(cfg: Any, flops_per_token: float) -> float:
    """Probe cost / training cost between two evaluations: the FLOPs of the probe's forward (a third of a training
    token's) and of its eager maps (q·kᵀ for every softmax head and ~4 passes over each map, per layer), over the
    FLOPs of eval_interval steps of global_batch_size sequences, times COST_CALIBRATION."""
    m, t = cfg.model, cfg.trainer
    query_heads, _, head_dim = attention_heads(m)
    n = m.seq_length
    probe = PROBE_SEQUENCES * n * flops_per_token / 3
    maps = PROBE_SEQUENCES * m.num_layers * query_heads * (2 * n * n * head_dim + 4 * n * n)
    training = max(t.eval_interval, 1) * t.global_batch_size * n * flops_per_token
    return COST_CALIBRATION * (probe + maps) / training


def diagnostics_enabled(cfg: Any, flops_per_token: float) -> bool:
    mode = cfg.trainer.attention_diagnostics
    if mode not in ATTENTION_DIAGNOSTICS_MODES:
        raise ValueError(f"trainer.attention_diagnostics={mode!r} is unknown; use one of "
                         f"{', '.join(ATTENTION_DIAGNOSTICS_MODES)}")
    if mode != "auto":
        return mode == "on"
    if cfg.parallel.cp != 1:  # the probe reads whole attention maps, which context parallelism splits over ranks
        return False
    return cfg.trainer.eval_interval > 0 and estimated_cost_fraction(cfg, flops_per_token) <= MAX_COST_FRACTION


class _LayerSums:
    """Device-side sums of one layer on this rank: entropy over rows, rows, sink heads, heads, max logit."""

    def __init__(self, device):
        self.values = torch.zeros(5, dtype=torch.float32, device=device)
        self.values[4] = float("-inf")


def _measure_layer(sums: Dict[int, _LayerSums], layer: int, maps_for) -> None:
    """Accumulate one layer's statistics, ROW_BLOCK query rows at a time."""
    n, first = maps_for.num_keys, None
    for start in range(n - maps_for.num_queries, n, ROW_BLOCK):
        maps = maps_for(torch.arange(start, min(start + ROW_BLOCK, n)))
        acc = sums.setdefault(layer, _LayerSums(maps.combined.device))
        weights = am.normalized_magnitude(maps.combined)  # (b, H, rows, N)
        entropy = am.entropy(weights)
        first_mass = am.first_token_mass(weights).sum(-1)  # (b, H): summed over this block's rows
        first = first_mass if first is None else first + first_mass
        logit = torch.stack([x.max() for x in maps.logits.values()]).max()
        acc.values[0] += entropy.sum()
        acc.values[1] += entropy.numel()
        acc.values[4] = torch.maximum(acc.values[4], logit)
    mean_first = first / maps_for.num_queries  # (b, H): mean over every row of the sequence
    acc.values[2] += (mean_first > am.SINK_THRESHOLD).sum()
    acc.values[3] += mean_first.numel()


class AttentionDiagnostics:
    """The trainer's probe; ``measure()`` is collective over the whole world (every rank calls it)."""

    def __init__(self, trainer):
        self.trainer = trainer
        dataset = trainer.valid_ds
        samples = [dataset[i] for i in range(min(PROBE_SEQUENCES, len(dataset)))]
        self.batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in
                      ("tokens", "labels", "loss_mask", "position_ids", DOCUMENT_KEY) if k in samples[0]}

    def measure(self) -> Dict[str, Any]:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.perf_counter()
        sums: Dict[int, _LayerSums] = {}
        model = self.trainer.model
        for chunk in model:
            chunk.eval()
        try:
            with torch.no_grad(), capture_attention(model, partial(_measure_layer, sums)):
                forward = partial(self._forward_step, reset_position_ids=self.trainer.cfg.data.reset_position_ids)
                get_forward_backward_func()(
                    forward_step_func=forward, data_iterator=iter([self.batch]), model=model,
                    num_microbatches=1, seq_length=self.trainer.cfg.model.seq_length,
                    micro_batch_size=self.batch["tokens"].shape[0], forward_only=True,
                )
        finally:
            for chunk in model:
                chunk.train()
        layers = sorted(sums)
        local = torch.stack([sums[layer].values for layer in layers]) if layers else torch.zeros(0, 5)
        values = local.cpu().tolist()  # the one device-to-host transfer
        tp = parallel_state.get_tensor_model_parallel_group()
        added = distributed.all_reduce_values([x for row in values for x in row[:4]], group=tp)
        largest = distributed.all_reduce_values([row[4] for row in values], group=tp, op="max")
        mine = {layer: (added[4 * i:4 * i + 4], largest[i]) for i, layer in enumerate(layers)}
        stages = distributed.all_gather_objects(mine, group=parallel_state.get_pipeline_model_parallel_group())
        merged = {layer: v for stage in stages for layer, v in stage.items()}
        ordered = [merged[layer] for layer in sorted(merged)]
        return {
            "attn/entropy": [s[0] / s[1] for s, _ in ordered],
            "attn/sink_rate": [s[2] / s[3] for s, _ in ordered],
            "attn/max_logit": [m for _, m in ordered],
            "attn/seconds": time.perf_counter() - start,
        }

    @staticmethod
    def _forward_step(data_iterator, model, reset_position_ids=False):
        batch = next(data_iterator)
        tokens, position_ids, documents = model_inputs(batch, next(model.parameters()).device, reset_position_ids)
        output = model(tokens, position_ids, None, packed_seq_params=documents)

        def loss_func(output_tensor):
            zero = output_tensor.float().sum() * 0.0
            return zero, {}

        return output, loss_func
