"""Where benchmark results go: ``<out>/<what>_<machine>_<date>.md``, named by the machine that measured them."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch


def machine_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"


def write_report(report: str, out_dir: str | Path, what: str, quiet: bool = False) -> Path:
    """Print the markdown report (``quiet``: not) and write it to ``out_dir``; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{what}_{machine_name()}_{datetime.date.today()}.md"
    path.write_text(report)
    if not quiet:
        print(report)
        print(f"written: {path}")
    return path
