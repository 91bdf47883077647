"""What evaluate and analyze share: run labels, output paths, strict JSON, the side-by-side table."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from diff_transformer.fileio import atomic_write_text, replace_directory, staging_directory

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
