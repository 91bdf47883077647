"""W&B as a source and a sink of comparisons: read one sweep's runs as RunRecords, log a comparison back to it.

A sweep is selected by its W&B group (ENTITY/PROJECT/GROUP; a sweep's group is its id, run.json "sweep.id"), or by
its tag (ENTITY/PROJECT/sweep:<id>)."""

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


def sweep_filter(group: str) -> dict:
    """The W&B API filter of one sweep: its tag for ``sweep:<id>``, else its group."""
    return {"tags": {"$in": [group]}} if group.startswith("sweep:") else {"group": group}


def load_wandb_runs(path: str, api: Any = None) -> list[RunRecord]:
    """Runs of one sweep, path ENTITY/PROJECT/GROUP or ENTITY/PROJECT/sweep:<id>; each run's config holds the
    resolved config and run.json."""
    parts = path.strip("/").split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--wandb {path!r}: expected ENTITY/PROJECT/GROUP or ENTITY/PROJECT/sweep:<id> (the group "
                         "of a sweep is its id)")
    entity, project, group = parts
    if api is None:
        try:
            import wandb
        except ImportError as error:
            raise SystemExit(f"reading runs from W&B needs the wandb package: {error}") from None
        api = wandb.Api()
    records = []
    for run in api.runs(f"{entity}/{project}", filters=sweep_filter(group)):
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
            "lr": _lookup(sources, "lr") or _lookup([config], "optim.lr"),
            **{key: _lookup([config.get("run") or {}, config], key)
               for key in ("lr_schedule", "branch", "flops_per_token", "device", "sweep")},
        }
        rows = ({"step": row.get("_step") if row.get("step") is None else row.get("step"), **row}
                for row in run.scan_history(keys=None))
        records.append(record_from_description(run.name, f"wandb:{entity}/{project}/{run.id}", description, rows))
    if not records:
        where = f"tagged {group!r}" if group.startswith("sweep:") else f"in group {group!r}"
        raise RunMismatchError(f"no W&B runs {where} of {entity}/{project}")
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
    for pair in (p for p in comparison.pairs if p.ratios_are_findings):  # only ratios the verdict supports
        for estimate in pair.parameter_ratios:
            ratio_table.add_data(pair.variant, pair.reference, "parameters", estimate.at, estimate.loss, estimate.ratio,
                                 estimate.low, estimate.high, estimate.std)
        if pair.token_ratio is not None:
            t = pair.token_ratio
            ratio_table.add_data(pair.variant, pair.reference, "tokens", t.at, t.loss, t.ratio, t.low, t.high, t.std)
    verdicts = wandb.Table(columns=["variant", "reference", "outcome", "mean_difference", "low_95", "high_95",
                                    "p_value"])
    for pair in comparison.pairs:
        v = pair.verdict
        verdicts.add_data(pair.variant, pair.reference, v.outcome, v.mean, *(v.interval or (None, None)), v.p_value)
    run.log({"comparison": wandb.Image(str(png)), "runs": runs_table, "ratios": ratio_table, "verdicts": verdicts})
    run.summary.update({"summary": comparison.summary()})
    url = run.url
    run.finish()
    return url
