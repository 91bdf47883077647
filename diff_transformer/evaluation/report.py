"""What evaluate and analyze share: run labels, output paths, strict JSON, the side-by-side table."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from diff_transformer.fileio import atomic_write_text, replace_directory, staging_directory


class Progress:
    """A progress line for evaluate's and analyze's long loops, at most every ``every`` seconds and at the end:
    what, done of total, elapsed and ETA (from the rate so far). Silent where ``enabled`` is false (ranks but the
    first)."""

    def __init__(self, what: str, total: int, enabled: bool = True, every: float = 5.0, stream=None,
                 clock=time.monotonic):
        self.what, self.total, self.enabled, self.every = what, max(int(total), 1), enabled, every
        self.stream = stream
        self.clock = clock
        self.start = self.last = clock()
        self.done = 0

    def update(self, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        now = self.clock()
        if self.enabled and (now - self.last >= self.every or self.done == self.total):
            self.last = now
            print(self.line(now), file=self.stream or sys.stderr, flush=True)

    def line(self, now: float) -> str:
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        return (f"{self.what}: {self.done}/{self.total} ({100 * self.done / self.total:.0f}%), "
                f"{format_seconds(elapsed)} elapsed, ETA {format_seconds(eta)}")


def data_label(config: Dict[str, Any]) -> str:
    """What a run trained on, from its saved config, as figure titles name it (data.config.DataConfig.describe)."""
    from data.config import DataConfig

    data = config.get("data") or {}
    return DataConfig(**{k: v for k, v in data.items() if k in DataConfig.__dataclass_fields__}).describe()


def training_of(config: Dict[str, Any], step: int) -> Dict[str, Any]:
    """What a run's figures say about its training at ``step``: its data, the tokens it had seen, its seed."""
    trainer, model = config.get("trainer") or {}, config.get("model") or {}
    batch, length = trainer.get("global_batch_size"), model.get("seq_length")
    return {"data": data_label(config), "tokens": step * batch * length if batch and length else None,
            "seed": config.get("seed")}


def lambda_over_training(run_dir: Optional[str], up_to_step: int) -> List[Dict[str, Any]]:
    """DIFF's per-layer λ at every step metrics.jsonl logged it (logging steps), up to the analysed step; a step
    replayed after a resume keeps its last record, a line cut short by a crash is skipped. Empty without a run
    directory or a λ record."""
    path = Path(run_dir) / "metrics.jsonl" if run_dir else None
    if path is None or not path.is_file():
        return []
    by_step: Dict[int, List[float]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("lambda") and record.get("step") is not None \
                and record["step"] <= up_to_step:
            by_step[int(record["step"])] = record["lambda"]
    return [{"step": step, "lambda": by_step[step]} for step in sorted(by_step)]


def format_seconds(seconds: float) -> str:
    if seconds != seconds:  # nan: no rate yet
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

REPO = Path(__file__).resolve().parent.parent.parent


def output_dir(out: Optional[str], tool: str) -> Path:
    """``--out``, or outputs/<tool>/<time> under the repository."""
    return Path(out).resolve() if out else REPO / "outputs" / tool / time.strftime("%Y-%m-%d_%H-%M-%S")


@contextlib.contextmanager
def writing_output(final: Path, command: str) -> Iterator[Path]:
    """A staging directory beside ``final`` to write the results in; on success it replaces ``final`` (an earlier
    output of ``command`` replaced, anything else moved aside), on failure it is removed."""
    staging = Path(staging_directory(str(final)))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    moved = replace_directory(staging, final, command)
    if moved:
        print(f"what {final} held before is kept in {moved}")


def unique_labels(labels: Sequence[str]) -> List[str]:
    seen: Dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if labels.count(label) == 1 else f"{label} #{seen[label]}")
    return out


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")


def write_json(path: Path, payload: Any) -> Path:
    """Strict JSON (a NaN or infinity is an error, not a silent non-standard token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(path), json.dumps(payload, indent=2, allow_nan=False) + "\n")
    return path


def write_run_results(out: Path, results: Dict[str, Any], name: str) -> None:
    """Each run's results as ``name`` in ``out``: directly for one run, else in a folder per run (its label's slug)."""
    if len(results) == 1:
        write_json(out / name, next(iter(results.values())))
        return
    for label, result in results.items():
        write_json(out / slug(label) / name, result)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
