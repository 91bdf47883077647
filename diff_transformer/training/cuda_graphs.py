"""``trainer.cuda_graphs=layers``: the compiled layers (``trainer.compile``) under inductor's CUDA graph trees
(``torch.compile(mode="reduce-overhead")``), and a report of what torch recorded or skipped and why.

Each layer's forward and backward is one inductor graph (its core attention in it), so each is one CUDA graph: the
host launches a layer each way with one call instead of its kernels one by one. Parameters keep their addresses
(static inputs, not copied); the first layer's input and the RoPE table are copied into the graphs' buffers, each
later layer reads its predecessor's output in place. Outside the graphs: the embedding, the output layer and loss,
megatron-core DDP's gradient hooks (they add each weight gradient, a graph output, into the fp32 ``main_grad`` after
the layer's backward graph) and the optimizer.

The graph trees warm each layer up once (the first micro-batch), record it at the second and replay it from then on:
with two micro-batches or more, step 1 pays the compile and the capture. Every micro-batch starts a new generation
(``torch.compiler.cudagraph_mark_step_begin``): its graphs may reuse the previous one's memory, whose outputs nobody
reads once its backward is done. On a CPU inductor compiles the same kernels and records nothing.
"""

from __future__ import annotations

import logging
import re
from typing import List, Optional

import torch

CUDA_GRAPH_MODE = "reduce-overhead"  # torch.compile's mode: inductor's CUDA graph trees
MOST_REASONS = 3  # distinct skip reasons the report names


def cuda_graphs_on(cfg) -> bool:
    return getattr(cfg.trainer, "cuda_graphs", "off") != "off"


def new_micro_batch() -> None:
    """A new generation of the CUDA graph trees: this micro-batch's graphs may overwrite the previous one's outputs."""
    torch.compiler.cudagraph_mark_step_begin()


class SkipReasons(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." warnings (``torch._inductor.cudagraph_utils``' logger,
    which torch's own handler prints to stderr, not to the run's log) while attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: List[str] = []  # each warning's reason, without the stack trace torch appends
        self.messages: List[str] = []  # each distinct warning whole
        self._loggers: List[logging.Logger] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip()
        if message.startswith("skipping cudagraph"):
            self.reasons.append(re.split(r"\.?\s*Found from\s*:", message.splitlines()[0])[0].strip())
            if message not in self.messages:
                self.messages.append(message)

    def attach(self) -> "SkipReasons":
        from torch._inductor import cudagraph_utils

        # the logger torch 2.11 to 2.13 writes the skips to (older releases: perf_hint_log)
        for name in ("cudagraphs_log", "perf_hint_log"):
            log = getattr(cudagraph_utils, name, None)
            if isinstance(log, logging.Logger) and log not in self._loggers:
                log.addHandler(self)
                self._loggers.append(log)
        return self

    def detach(self) -> None:
        for log in self._loggers:
            log.removeHandler(self)
        self._loggers = []


def skipped_graphs() -> int:
    """Graphs inductor compiled without a CUDA graph so far in this process (its counter; on a CPU, every graph)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def recorded_graphs() -> Optional[int]:
    """CUDA graphs the graph trees of this device have recorded (every node of its trees), 0 before any; None where
    there is no CUDA or torch's trees are not laid out as in torch 2.11 to 2.13."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None:
            return 0
        nodes = [node for roots in manager.roots.values() for node in roots]
        count = 0
        while nodes:
            node = nodes.pop()
            count += 1
            nodes.extend(child for children in node.children.values() for child in children)
        return count
    except Exception:  # a torch whose trees are laid out otherwise: the count is unknown, the run goes on
        return None


def report(compiled_layers: int, steps: int, reasons: List[str], skipped: int, recorded: Optional[int],
           on_cuda: bool) -> str:
    """One line of what happened by the end of step ``steps``: how many CUDA graphs were recorded against the
    expected two a compiled layer (forward and backward), and why inductor skipped any."""
    if not compiled_layers:
        return ("no CUDA graph: TorchDynamo is off in this process, the layers run eagerly (each micro-batch still "
                "starts a new graph generation)")
    distinct = list(dict.fromkeys(reasons))
    why = "; ".join(distinct[:MOST_REASONS]) + (f"; and {len(distinct) - MOST_REASONS} more" if len(distinct) >
                                                MOST_REASONS else "")
    if not on_cuda:
        return (f"no CUDA graph on a CPU: inductor records them on CUDA only ({skipped} compiled graph"
                f"{'s' if skipped != 1 else ''} skipped); the layers run compiled")
    expected = 2 * compiled_layers
    recorded_text = "an unknown number of" if recorded is None else str(recorded)
    line = (f"{recorded_text} CUDA graphs recorded by step {steps} (expected {expected}: each of the {compiled_layers} "
            f"compiled layers' forward and backward)")
    if skipped:
        line += f"; {skipped} compiled graph{'s' if skipped != 1 else ''} skipped: {why or 'no reason logged'}"
    elif recorded == 0:
        line += "; none skipped by inductor, none recorded yet (one micro-batch a step records in step 2)"
    return line
