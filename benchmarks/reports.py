"""Where benchmark results go: ``<out>/<what>_<machine>_<date>.md``, named by the machine that measured them."""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import diff_transformer.cli  # noqa: F401  (every benchmark, as every command, hides the libraries' notices)


def machine_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"


def table_cell(text: str, limit: int = 200) -> str:
    """``text`` as one Markdown table cell: terminal colour codes dropped, lines and runs of spaces joined into one
    line, pipes escaped, at most ``limit`` characters (a library's multi-line, coloured error message included)."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())
    return text[:limit].replace("|", "\\|")


def positive_int(text: str) -> int:
    """argparse ``type``: a whole number of at least 1, or the error argparse reports as one line."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value


def time_ms(fn: Callable[[], object], device: str, repeats: int, return_mode: str = "mean") -> float:
    """One ``fn()``'s time in ms: on a GPU ``triton.testing.do_bench``'s (warm-up, L2 flushed between calls;
    ``return_mode`` "mean" or "median"), elsewhere the median wall time of ``repeats`` calls after one warm-up call
    (which compiles what ``fn`` compiles)."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode=return_mode)
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
