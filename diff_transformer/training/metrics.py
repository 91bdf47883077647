"""Run-directory logging: ``metrics.jsonl`` (the source of truth), a human-readable progress log, and W&B."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import logging.handlers
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

from diff_transformer.config import WANDB_MODES
from diff_transformer.figure_style import human_number
from diff_transformer.fileio import atomic_write_lines

logger = logging.getLogger("diff_transformer")

LOG_FILE = "train.log"
_FORMAT = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")


class RunLogFailed(RuntimeError):
    """metrics.jsonl could not be written (a full disk, say): the run stops; the file ends with the last complete
    record, and the message says where the run can resume from."""


class RunLogHandler(logging.FileHandler):
    """train.log: a line that cannot be written (a full disk) is dropped quietly rather than printing a traceback;
    the failure that matters (metrics.jsonl, a checkpoint) stops the run with its own error line."""

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True


def setup_console_logging(run_dir: str, rank: int, level: str = "INFO", hold_file: bool = False) -> None:
    """Rank 0 logs to stdout and ``train.log``; other ranks log warnings only. ``hold_file``: ``train.log``'s lines
    are held in memory until :func:`start_run_log` (a start refused leaves the run directory untouched)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = _FORMAT
    if rank == 0:
        if hold_file:
            held = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
            handlers = (logging.StreamHandler(sys.stdout), held)
        else:
            os.makedirs(run_dir, exist_ok=True)
            handlers = (logging.StreamHandler(sys.stdout), RunLogHandler(os.path.join(run_dir, LOG_FILE)))
        for handler in handlers:
            handler.setFormatter(fmt)
            root.addHandler(handler)
        root.setLevel(level)
        # megatron-core logs every bucket and parameter name at INFO; keep its warnings only
        logging.getLogger("megatron").setLevel(logging.WARNING)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)


def start_run_log(run_dir: str) -> None:
    """``train.log`` receives the lines held back by ``setup_console_logging(hold_file=True)``, then every line."""
    root = logging.getLogger()
    for held in [h for h in root.handlers if isinstance(h, logging.handlers.MemoryHandler) and h.target is None]:
        log_file = RunLogHandler(os.path.join(run_dir, LOG_FILE))
        log_file.setFormatter(_FORMAT)
        held.setTarget(log_file)
        held.close()  # flushes what it held
        root.removeHandler(held)
        root.addHandler(log_file)


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


METRICS_FILE = "metrics.jsonl"


def last_logged_step(path: str) -> Optional[int]:
    """The step of the last complete record of a metrics.jsonl (read from its end), or None when it has none."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end, block = f.tell(), 1 << 16
        while True:
            start = max(0, end - block)
            f.seek(start)
            lines = f.read(end - start).splitlines()
            for line in reversed(lines[1:] if start else lines):  # the first may be cut by the block start
                try:
                    return int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash mid-write
            if start == 0:
                return None
            block *= 4


def truncate_metrics(path: str, last_step: int) -> int:
    """Drop the records after ``last_step`` (logged after the checkpoint a run resumes from, so they will be logged
    again); rewrites the file atomically. Returns how many records were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError):  # a line cut short by a crash mid-write
            continue
        if step <= last_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    dropped = len(lines) - len(kept)
    if dropped:
        atomic_write_lines(path, kept)
        logger.info("metrics.jsonl: dropped %d records after step %d, the step this run resumes from", dropped, last_step)
    return dropped


# The progress line's tok/s and ETA are measured over at least this many steps (and over the log and evaluation
# intervals): one step's rate swings by 30x on a shared machine, and only a window holding an evaluation sees its cost.
PROGRESS_WINDOW_STEPS = 20

# What a W&B run's summary holds (its console footer and overview list the summary's keys sorted, first ten): the losses.
WANDB_SUMMARY_KEYS = ("loss", "val_loss")


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` on the logging rank, and mirrors it to W&B (whose summary
    keeps the losses only: every other series is history)."""

    def __init__(self, run_dir: str, max_steps: int, enabled: bool, wandb_run=None, resume_step: Optional[int] = None,
                 window_steps: int = PROGRESS_WINDOW_STEPS):
        self.run_dir = run_dir
        self.started = time.time()  # the progress line's elapsed time: since this process began training
        # (wall time, step, tokens, seconds training) of the last steps: the progress line's rate and ETA
        self._window: collections.deque = collections.deque(maxlen=window_steps + 1)
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.max_steps = max_steps
        self.enabled = enabled
        self.wandb_run = wandb_run
        self._wandb_keys: set = set()
        if enabled and resume_step is not None:
            truncate_metrics(self.path, resume_step)

    def log(self, record: Dict[str, Any], wall_time: Optional[float] = None) -> None:
        """Append ``record``; ``wall_time``: when its step ended (the progress line's rate), if not now."""
        if not self.enabled:
            return
        step_time = record.get("step_time") or 0.0
        ended = time.time() if wall_time is None else wall_time
        self._window.append((ended, record["step"], record.get("tokens_per_s", 0.0) * step_time, step_time))
        line = memoryview((json.dumps(record) + "\n").encode("utf-8"))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                while line:
                    line = line[os.write(fd, line):]
            except OSError as err:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)  # no torn record: the file ends with the last complete one
                raise RunLogFailed(
                    f"cannot write {self.path} at step {record.get('step')} ({err.strerror or err}); it ends with the "
                    f"record of the step before"
                ) from None
        finally:
            os.close(fd)
        if self.wandb_run is not None:
            flat = {}
            for key, value in record.items():
                if key == "step":
                    continue
                if isinstance(value, list):  # per-layer values (λ, attention diagnostics): one W&B series a layer
                    flat.update({f"{key}/layer_{i + 1:02d}": v for i, v in enumerate(value)})
                else:
                    flat[key] = value
            for key in flat.keys() - self._wandb_keys:
                if key not in WANDB_SUMMARY_KEYS:
                    self.wandb_run.define_metric(key, summary="none")
                self._wandb_keys.add(key)
            self.wandb_run.log(flat, step=record["step"])

    def progress_line(self, record: Dict[str, Any]) -> str:
        """step, loss, lr, grad norm, tokens seen, tok/s, elapsed time and ETA; tok/s and ETA over the window of the
        last steps logged (tok/s: training time only; ETA: wall-clock, evaluations and saves included)."""
        step = record["step"]
        now = time.time()
        window = list(self._window) or [(now, step, 0.0, 0.0)]
        steps = window[1:] or window  # the steps between the window's first wall-clock mark and its last
        tokens = sum(w[2] for w in steps)
        training = sum(w[3] for w in steps)
        tokens_per_s = tokens / training if training > 0 else record.get("tokens_per_s", 0.0)
        (first_time, first_step, *_), (last_time, last_step, *_) = window[0], window[-1]
        if last_step > first_step:
            per_step = (last_time - first_time) / (last_step - first_step)
        else:  # one step in the window: its own time
            per_step = window[-1][3] or record.get("step_time", math.nan)
        eta = per_step * (self.max_steps - step)
        parts = [
            f"step {step}/{self.max_steps}",
            f"loss {record['loss']:.4f}",
            f"lr {record['lr']:.3e}",
            f"grad_norm {record['grad_norm']:.3f}" if record.get("grad_norm") is not None else None,
            f"val_loss {record['val_loss']:.4f}" if "val_loss" in record else None,
            f"{human_number(record['tokens'])} tokens" if record.get("tokens") is not None else None,
            f"{tokens_per_s:,.0f} tok/s (last {len(steps)} step{'s' if len(steps) != 1 else ''})",
            f"elapsed {format_duration(now - self.started)}",
            f"ETA {format_duration(eta)}",
        ]
        return " | ".join(p for p in parts if p)

    def close(self) -> None:
        if self.wandb_run is not None:
            offline = getattr(getattr(self.wandb_run, "settings", None), "mode", None) == "offline"
            run_id = self.wandb_run.id
            self.wandb_run.finish()
            if offline:
                logger.info("%s", wandb_sync_line(self.run_dir, run_id))


def wandb_segments(run_dir: str, run_id: str) -> list:
    """The offline folders of one W&B run under a run directory: one per process start (a resume adds one)."""
    import glob

    return sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}")))


def wandb_sync_line(run_dir: str, run_id: str) -> str:
    """The command that uploads every segment of the run, not only the last one wandb names."""
    segments = wandb_segments(run_dir, run_id)
    pattern = os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}")
    return (f"W&B run {run_id}: {len(segments)} offline segment{'s' if len(segments) != 1 else ''} (one per start); "
            f"upload all with: wandb sync {pattern}")


def wandb_run_name(cfg: Any, run_dir: Optional[str] = None, sweep: Optional[Dict[str, str]] = None) -> str:
    """Model size, attention variant and seed (after the sweep's or experiment's name): what tells runs apart in
    W&B's run list, where the run directory's timestamp would not. In a sweep: the sweep's id and the run's
    subdirectory, unique within it, so that names differ across sweeps too."""
    from diff_transformer.models.layer_specs import variant_label

    if sweep is not None and run_dir is not None:
        return f"{sweep['id']}/{os.path.relpath(os.path.abspath(run_dir), sweep['dir'])}"
    parts = [] if cfg.name == "default" else [cfg.name]
    parts += [cfg.model.name, variant_label(cfg.model).replace(" ", "_"), f"seed{cfg.seed}"]
    return "-".join(parts)


def wandb_tags(cfg: Any, sweep: Optional[Dict[str, str]] = None) -> List[str]:
    """The configured tags, the size and kind, what the run trained on, and (in a sweep) ``sweep:<id>``, seed and lr:
    W&B filters on tags, so a sweep or a data set can be picked out. W&B allows 64 characters a tag."""
    tags = list(cfg.logging.wandb.tags) + [cfg.model.name, cfg.model.attention, f"data:{cfg.data.describe()}"[:64]]
    if sweep is not None:
        tags += [f"sweep:{sweep['id']}"[:64], f"seed:{cfg.seed}", f"lr:{cfg.optim.lr:g}"]
    return tags


def wandb_credentials_problem(cfg: Any) -> Optional[str]:
    """Why ``logging.wandb.mode=online`` cannot log in here (no API key in WANDB_API_KEY or the netrc file W&B reads),
    or None. Checked at start-up, before the model is built."""
    if cfg.logging.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (
        f"logging.wandb.mode=online needs a W&B API key for {host}, and there is none (no WANDB_API_KEY, no entry in "
        f"{path}): run `wandb login` or set WANDB_API_KEY; or log offline (logging.wandb.mode=offline, then "
        "`wandb sync` the run directory's wandb/ folder)"
    )


def init_wandb(cfg: Any, run_dir: str, resolved_config: Dict[str, Any], run_id: Optional[str] = None,
               sweep: Optional[Dict[str, str]] = None):
    """Start (or, with ``run_id``, continue) the W&B run; offline by default and never needing an account. Its group
    is the sweep's id in a sweep (one group per sweep invocation), else the experiment's name."""
    wcfg = cfg.logging.wandb
    if wcfg.mode not in WANDB_MODES:
        raise ValueError(f"logging.wandb.mode={wcfg.mode!r} is unknown; use one of {', '.join(WANDB_MODES)}")
    if wcfg.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as err:
        raise ImportError("logging.wandb.mode needs the wandb package; pip install wandb, or set it to disabled") from err
    return wandb.init(
        mode=wcfg.mode,
        project=wcfg.project,
        entity=wcfg.entity,
        group=sweep["id"] if sweep else cfg.name,
        name=wandb_run_name(cfg, run_dir, sweep),
        tags=wandb_tags(cfg, sweep),
        config=resolved_config,
        dir=run_dir,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=True),  # its banner and history table: the run's own lines say where it is
    )
