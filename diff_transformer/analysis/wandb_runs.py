"""W&B as a source and a sink of comparisons: read one group's runs as RunRecords, log a comparison back to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from diff_transformer.analysis.runs import RunMismatchError, RunRecord, record_from_description
from diff_transformer.analysis.scaling import Comparison


def _lookup(sources: Sequence[dict], dotted: str) -> Any:
    for source in sources:
        value: Any = source
        for key in dotted.split("."):
            if not isinstance(value, dict) or key not in value:
                value = None
                break
            value = value[key]
        if value is not None:
            return value
    return None


def load_wandb_runs(path: str, api: Any = None) -> list[RunRecord]:
    """Runs of one W&B group, path ENTITY/PROJECT/GROUP; each run's config holds the resolved config and run.json."""
    parts = path.strip("/").split("/")
    if len(parts) != 3:
        raise ValueError(f"--wandb {path!r}: expected ENTITY/PROJECT/GROUP")
    entity, project, group = parts
    if api is None:
        try:
            import wandb
        except ImportError as error:
            raise SystemExit(f"reading runs from W&B needs the wandb package: {error}") from None
        api = wandb.Api()
    records = []
    for run in api.runs(f"{entity}/{project}", filters={"group": group}):
        config = dict(run.config)
        summary = dict(getattr(run, "summary", {}) or {})
        # run.json's fields, either logged at the top of the config, under "run", or in the summary.
        sources = [config.get("run") or {}, config, summary]
        description = {
            "attention": _lookup(sources, "attention") or _lookup([config], "model.attention"),
            "variant": _lookup(sources, "variant"),
            "seed": _lookup(sources, "seed"),
            "model": _lookup(sources, "model") if isinstance(_lookup(sources, "model"), str) else _lookup([config], "model.name"),
            "num_parameters": _lookup(sources, "num_parameters"),
            "num_non_embedding_parameters": _lookup(sources, "num_non_embedding_parameters"),
            "tokens_per_step": _lookup(sources, "tokens_per_step"),
            "seq_length": _lookup(sources, "seq_length") or _lookup([config], "model.seq_length"),
            "max_steps": _lookup(sources, "max_steps") or _lookup([config], "trainer.max_steps"),
            "data": _lookup([config.get("run") or {}], "data") or _lookup([config], "data"),
            "data_source": _lookup([config.get("run") or {}, summary], "data_source"),
        }
        rows = ({"step": row.get("_step") if row.get("step") is None else row.get("step"), **row}
                for row in run.scan_history(keys=None))
        records.append(record_from_description(run.name, f"wandb:{entity}/{project}/{run.id}", description, rows))
    if not records:
        raise RunMismatchError(f"no W&B runs in group {group!r} of {entity}/{project}")
    return records


def log_to_wandb(comparison: Comparison, png: Path, path: str) -> str:
    """Log the figure and the tables as a `compare` run in the same W&B group; returns its URL."""
    import wandb

    entity, project, group = path.strip("/").split("/")
    run = wandb.init(entity=entity, project=project, group=group, job_type="compare", name=f"compare-{group}")
    count = comparison.parameter_count
    runs_table = wandb.Table(columns=["run", "model", "attention", f"parameters_{count}", "tokens", "final_val_loss"])
    for r in comparison.runs:
        runs_table.add_data(r.name, r.model, r.variant, r.parameters(count), r.token_budget, r.final_val_loss)
    ratio_table = wandb.Table(columns=["variant", "reference", "kind", "variant_at", "loss", "ratio", "low_68",
                                       "high_68", "std"])
    for pair in comparison.pairs:
        for estimate in pair.parameter_ratios:
            ratio_table.add_data(pair.variant, pair.reference, "parameters", estimate.at, estimate.loss, estimate.ratio,
                                 estimate.low, estimate.high, estimate.std)
        if pair.token_ratio is not None:
            t = pair.token_ratio
            ratio_table.add_data(pair.variant, pair.reference, "tokens", t.at, t.loss, t.ratio, t.low, t.high, t.std)
    run.log({"comparison": wandb.Image(str(png)), "runs": runs_table, "ratios": ratio_table})
    run.summary.update({"summary": comparison.summary()})
    url = run.url
    run.finish()
    return url
