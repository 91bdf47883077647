"""Training runs as data: a run directory's ``run.json`` and ``metrics.jsonl`` read into a RunRecord, and the check
that a set of runs can be compared (same data, same token budget, finished). Runs of any attention kind load; the
scaling comparison fits every variant against a reference, the seed-spread table (``variants.py``) compares every
variant."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

DIFF = "diff"
BASELINE = "vanilla"
PARAMETER_COUNTS = ("total", "non_embedding")


class RunMismatchError(ValueError):
    """Runs that cannot be compared: different data, token budgets, or unfinished."""


@dataclasses.dataclass
class RunRecord:
    """One training run: its description from run.json and its logged metrics."""

    name: str
    source: str
    attention: str
    model: str
    num_parameters: int
    num_non_embedding_parameters: int
    tokens_per_step: int
    seq_length: int
    max_steps: int
    data: Any
    steps: np.ndarray
    tokens: np.ndarray
    train_loss: np.ndarray
    val_steps: np.ndarray
    val_tokens: np.ndarray
    val_loss: np.ndarray
    variant: str = ""  # the attention kind and its ablation keys (run.json "variant"); the kind for older runs
    seed: int | None = None
    baseline_variant: str | None = None  # the variant this one is compared with at equal size (DIFF V2's baseline)
    data_source: str | None = None  # run.json "data_source": what a title says it trained on
    # Keys of newer runs (null for older ones, which the analysis treats as unknown).
    lr: float | None = None  # the peak learning rate
    lr_schedule: dict | None = None  # {"decay": ..., "warmup_steps": ..., "cooldown_steps": ...}
    branch: dict | None = None  # {"source_run": ..., "source_step": ...}: a cooldown branch of another run
    flops_per_token: float | None = None  # training FLOPs per token (forward + backward)
    device: str | None = None
    sweep: dict | None = None  # {"id": ..., "dir": ...}
    tokens_per_s: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # per train record

    def __post_init__(self):
        self.variant = self.variant or self.attention

    @property
    def data_label(self) -> str:
        """What the run trained on, for titles: run.json's data_source, else its shard names."""
        if self.data_source:
            return self.data_source
        shards = self.data.get("shards") if isinstance(self.data, dict) else None
        names = [s.get("name", "?") for s in shards or [] if isinstance(s, dict)]
        return ", ".join(names) if names else "unrecorded data"

    @property
    def token_budget(self) -> int:
        return self.tokens_per_step * self.max_steps

    @property
    def decay(self) -> str | None:
        """The learning-rate schedule's decay ("linear", "cosine", "constant", "wsd"), or None where unrecorded."""
        return self.lr_schedule.get("decay") if isinstance(self.lr_schedule, dict) else None

    @property
    def training_flops(self) -> float | None:
        return None if self.flops_per_token is None else self.flops_per_token * self.token_budget

    @property
    def measured_tokens_per_s(self) -> float | None:
        """The median tokens/s over the train records after the first 10% (the warm-up and compile excluded)."""
        rates = self.tokens_per_s[len(self.tokens_per_s) // 10:]
        rates = rates[np.isfinite(rates) & (rates > 0)]
        return float(np.median(rates)) if len(rates) else None

    @property
    def last_step(self) -> int:
        return int(self.steps[-1]) if len(self.steps) else 0

    @property
    def final_val_loss(self) -> float:
        return float(self.val_loss[-1])

    def parameters(self, count: str) -> int:
        return self.num_parameters if count == "total" else self.num_non_embedding_parameters


def _metric_rows_to_arrays(rows: Iterable[dict], tokens_per_step: int) -> dict[str, np.ndarray]:
    """Train and validation series by step; a step logged twice (replayed after a resume) keeps its last record."""
    train: dict[int, tuple[float, float, float]] = {}
    val: dict[int, tuple[float, float]] = {}
    for row in rows:
        if row.get("step") is None:
            continue
        step = int(row["step"])
        tokens = float(row["tokens"]) if row.get("tokens") is not None else float(step * tokens_per_step)
        if row.get("loss") is not None:
            rate = row.get("tokens_per_s")
            train[step] = (tokens, float(row["loss"]), float(rate) if rate is not None else math.nan)
        if row.get("val_loss") is not None:
            val[step] = (tokens, float(row["val_loss"]))
    steps = sorted(train)
    val_steps = sorted(val)
    return {
        "steps": np.array(steps, dtype=np.int64),
        "tokens": np.array([train[s][0] for s in steps], dtype=np.float64),
        "train_loss": np.array([train[s][1] for s in steps], dtype=np.float64),
        "tokens_per_s": np.array([train[s][2] for s in steps], dtype=np.float64),
        "val_steps": np.array(val_steps, dtype=np.int64),
        "val_tokens": np.array([val[s][0] for s in val_steps], dtype=np.float64),
        "val_loss": np.array([val[s][1] for s in val_steps], dtype=np.float64),
    }


def record_from_description(name: str, source: str, description: dict, rows: Iterable[dict]) -> RunRecord:
    missing = [k for k in ("attention", "num_parameters", "tokens_per_step", "max_steps") if description.get(k) is None]
    if missing:
        raise ValueError(f"run {name} ({source}) lacks {', '.join(missing)} in its description; was it written by train.py?")
    tokens_per_step = int(description["tokens_per_step"])
    return RunRecord(
        name=name,
        source=source,
        attention=str(description["attention"]),
        model=str(description.get("model", name)),
        num_parameters=int(description["num_parameters"]),
        num_non_embedding_parameters=int(description.get("num_non_embedding_parameters") or description["num_parameters"]),
        tokens_per_step=tokens_per_step,
        seq_length=int(description.get("seq_length") or 0),
        max_steps=int(description["max_steps"]),
        data=description.get("data"),
        **_metric_rows_to_arrays(rows, tokens_per_step),
        variant=str(description.get("variant") or ""),
        seed=int(description["seed"]) if description.get("seed") is not None else None,
        baseline_variant=description.get("baseline_variant"),
        data_source=description.get("data_source"),
        lr=float(description["lr"]) if description.get("lr") is not None else None,
        lr_schedule=description.get("lr_schedule") if isinstance(description.get("lr_schedule"), dict) else None,
        branch=description.get("branch") if isinstance(description.get("branch"), dict) else None,
        flops_per_token=(float(description["flops_per_token"]) if description.get("flops_per_token") is not None
                         else None),
        device=str(description["device"]) if description.get("device") is not None else None,
        sweep=description.get("sweep") if isinstance(description.get("sweep"), dict) else None,
    )


def load_run(run_dir: str | Path, name: str | None = None) -> RunRecord:
    """Read one run directory written by train.py."""
    run_dir = Path(run_dir)
    description_path = run_dir / "run.json"
    metrics_path = run_dir / "metrics.jsonl"
    if not description_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no run.json; pass a run directory written by train.py or a sweep directory")
    description = json.loads(description_path.read_text())
    rows = []
    lines = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # A last line cut short by a killed job is the only expected damage: skip it, refuse anything else.
            if line_number == len(lines):
                continue
            raise ValueError(f"{metrics_path}:{line_number} is not JSON: {line[:80]!r}") from None
    return record_from_description(name or run_dir.name, str(run_dir), description, rows)


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories (those holding run.json) at or under each path, in a stable order."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if (path / "run.json").is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.rglob("run.json") if "checkpoints" not in p.parts)
        if not below:
            raise FileNotFoundError(f"no run.json under {path}; pass run directories or a sweep directory")
        found.extend(below)
    return list(dict.fromkeys(found))


def _display_names(run_dirs: Sequence[Path]) -> list[str]:
    """Shortest path suffixes that tell the runs apart."""
    for depth in range(1, 8):
        names = ["/".join(d.parts[-depth:]) for d in run_dirs]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


def load_runs(paths: Sequence[str | Path]) -> list[RunRecord]:
    run_dirs = find_run_dirs(paths)
    return [load_run(d, name) for d, name in zip(run_dirs, _display_names(run_dirs))]


def split_budgets(runs: Sequence[RunRecord]) -> tuple[list[RunRecord], list[RunRecord]]:
    """(main runs, shorter runs): in each replicate (variant, model, lr, seed) the run with the largest token budget
    (not a cooldown branch where one ties with it) is the main run; the replicate's other runs (cooldown branches,
    runs with a smaller max_steps) are further points of its loss against data. A run without a recorded seed is a
    replicate of its own. Two main candidates with the same budget are refused, naming both."""
    replicates: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        seed = run.seed if run.seed is not None else f"unrecorded:{run.source}"
        replicates.setdefault((run.variant, run.model, run.lr, seed), []).append(run)
    main, shorter = [], []
    for (variant, model, lr, seed), group in replicates.items():
        group = sorted(group, key=lambda r: (-r.token_budget, r.branch is not None))
        if len(group) > 1 and group[1].token_budget == group[0].token_budget and group[1].branch is None:
            raise ValueError(f"two runs of {variant} ({model}, lr {lr}, seed {seed}) with the same token budget: "
                             f"{group[0].source} and {group[1].source}; leave one out")
        main.append(group[0])
        shorter.extend(group[1:])
    return main, shorter


def check_comparable(runs: Sequence[RunRecord], require_finished: bool = True, same_budget: bool = True) -> None:
    """Refuse runs that saw different data or (with ``same_budget``) token budgets, or stopped early, naming them."""
    if not runs:
        raise RunMismatchError("no runs to compare")
    fields = [("data", lambda r: json.dumps(r.data, sort_keys=True, default=str))]
    if same_budget:
        fields.append(("token budget",
                       lambda r: f"{r.token_budget:,} tokens ({r.max_steps} steps x {r.tokens_per_step:,})"))
    for field, describe in fields:
        groups: dict[str, list[RunRecord]] = {}
        for run in runs:
            groups.setdefault(describe(run), []).append(run)
        if len(groups) > 1:
            # Name the odd runs out against what most runs share.
            common_value, common_runs = max(groups.items(), key=lambda item: len(item[1]))
            odd = "; ".join(
                f"{run.name} ({run.source}) has {value}"
                for value, group in groups.items() if value != common_value for run in group
            )
            raise RunMismatchError(
                f"runs differ in {field} and cannot be compared: {odd}; while {len(common_runs)} run(s) "
                f"({', '.join(r.name for r in common_runs[:4])}{', ...' if len(common_runs) > 4 else ''}) have "
                f"{common_value}. Compare runs trained on the same data with the same token budget."
            )
    if require_finished:
        unfinished = [f"{r.name} ({r.source}, step {r.last_step} of {r.max_steps})" for r in runs if r.last_step < r.max_steps]
        if unfinished:
            raise RunMismatchError(f"runs not finished: {', '.join(unfinished)}; wait for them or leave them out")
    no_val = [f"{r.name} ({r.source})" for r in runs if len(r.val_loss) == 0]
    if no_val:
        raise RunMismatchError(
            f"runs without a validation loss: {', '.join(no_val)}; train with trainer.eval_interval > 0"
        )
