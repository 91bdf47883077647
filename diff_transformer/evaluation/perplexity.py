"""Perplexity: mean NLL over a token stream with a sliding window at the model's sequence length, and the loss at each
position of the window.

A stream is documents concatenated as in training (each document's tokens followed by the end-of-document token).
Windows hold L + 1 tokens (L = the model's sequence length: L inputs, L targets) and start every ``stride`` tokens;
each target is scored once, by the first window that reaches it, so with a stride S < L every target after the first
window sees at least L − S tokens of context (lm-eval-harness's rolling windows are S = L). The per-position curve
averages the NLL of the target at position p of the window (context of p tokens) over every full window: whether the
loss keeps falling with context.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from diff_transformer.distributed import all_reduce_values
from diff_transformer.evaluation.report import Progress


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the stream
    stop: int  # one past its last token (stop − start ≤ L + 1)
    first_scored: int  # first target (stream index) this window scores


def sliding_windows(num_tokens: int, seq_length: int, stride: int) -> List[Window]:
    """The windows over a stream of ``num_tokens`` tokens; every target 1 .. num_tokens − 1 is scored exactly once."""
    if not 1 <= stride <= seq_length:
        raise ValueError(f"stride={stride} must lie in [1, {seq_length}] (the model's sequence length)")
    windows, scored_until, start = [], 0, 0
    while scored_until < num_tokens - 1:
        stop = min(start + seq_length + 1, num_tokens)
        windows.append(Window(start, stop, scored_until + 1))
        scored_until = stop - 1
        start += stride
    return windows


@dataclass
class PerplexityResult:
    tokens: int  # targets scored
    nll: float  # mean NLL per target, nats
    position_nll: List[Optional[float]]  # mean NLL at window positions 1 .. L (None where no full window reached)
    windows: int
    stride: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    def summary(self) -> Dict[str, object]:
        return {"tokens": self.tokens, "nll": self.nll, "perplexity": self.perplexity, "windows": self.windows,
                "stride": self.stride, "position_nll": self.position_nll}


def stream_perplexity(model, stream: np.ndarray, stride: Optional[int] = None, batch_size: int = 8,
                      what: str = "perplexity") -> PerplexityResult:
    """Sliding-window NLL of ``stream`` (1-D token ids) under ``model`` (an InferenceModel). Under torchrun the
    windows are split over the ranks and the sums reduced, so every rank returns the same result."""
    L = model.seq_length
    stride = stride or max(L // 2, 1)
    if len(stream) < 2:
        raise ValueError(f"a stream of {len(stream)} tokens has nothing to score")
    windows = sliding_windows(len(stream), L, stride)
    mine = windows[model.rank::model.world_size]
    device = model.device
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    position_sum = torch.zeros(L, dtype=torch.float64, device=device)
    position_count = 0
    progress = Progress(f"{what}: windows of {L} tokens", len(mine), enabled=model.global_rank == 0)
    for batch in _batches_of_equal_length(mine, batch_size):
        tokens = torch.from_numpy(np.stack([stream[w.start:w.stop].astype(np.int64) for w in batch]))
        nll = model.token_nll(tokens).double()  # (b, n): target at stream index start + 1 + j
        n = nll.shape[1]
        targets = torch.tensor([w.start for w in batch], device=device)[:, None] + 1 + torch.arange(n, device=device)
        scored = targets >= torch.tensor([w.first_scored for w in batch], device=device)[:, None]
        nll_sum += (nll * scored).sum()
        count += int(sum(w.stop - w.first_scored for w in batch))
        if n == L:
            position_sum += nll.sum(0)
            position_count += len(batch)
        progress.update(len(batch))
    totals = all_reduce_values([float(nll_sum), count, position_count] + position_sum.cpu().tolist(),
                               group=model.data_group)
    nll_total, count, position_count = totals[0], int(totals[1]), int(totals[2])
    position = [s / position_count if position_count else None for s in totals[3:]]
    return PerplexityResult(count, nll_total / count, position, len(windows), stride)


def _batches_of_equal_length(windows: Sequence[Window], batch_size: int) -> Iterator[List[Window]]:
    batch: List[Window] = []
    for window in windows:
        if batch and (len(batch) == batch_size or window.stop - window.start != batch[0].stop - batch[0].start):
            yield batch
            batch = []
        batch.append(window)
    if batch:
        yield batch


# ------------------------------------------------------------------------------------------------------------------
# Streams: the run's validation split, and text files
# ------------------------------------------------------------------------------------------------------------------
def validation_stream(config: Dict, max_tokens: Optional[int],
                      tokenizer_override: Optional[str] = None) -> Tuple[np.ndarray, List[Dict]]:
    """The run's validation documents (``data.split``'s second part of every shard of its blend, as megatron's
    builder splits them), concatenated shard after shard, cut at ``max_tokens``. Returns (stream, sources).
    The bundled corpus is tokenized on first use (with ``tokenizer_override`` when given, as in training)."""
    from data.config import DataConfig
    from data.datasets import SPLIT_NAMES, prepare, split_bookends, split_document_range
    from data.indexed import verify_shard

    data_cfg = DataConfig(**{k: v for k, v in config["data"].items() if k in DataConfig.__dataclass_fields__})
    if tokenizer_override is not None:
        data_cfg.tokenizer_dir = tokenizer_override
    prepared = prepare(data_cfg)
    bookends = split_bookends(data_cfg.split)[SPLIT_NAMES.index("valid")]
    if bookends is None:
        raise ValueError(f"data.split={data_cfg.split!r} of the run has no validation part; evaluate --text FILE instead")
    pieces, sources, total = [], [], 0
    for prefix in prepared.prefixes:
        index = verify_shard(prefix)
        begin, end = split_document_range(bookends, index.num_documents)
        if end <= begin:
            continue
        first_seq, last_seq = int(index.document_indices[begin]), int(index.document_indices[end])
        itemsize = np.dtype(index.dtype).itemsize
        offset = int(index.sequence_pointers[first_seq]) // itemsize if first_seq < len(index.sequence_pointers) else 0
        length = int(index.sequence_lengths[first_seq:last_seq].sum(dtype=np.int64))
        if max_tokens is not None:
            length = min(length, max_tokens - total)
        tokens = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r")[offset:offset + length]
        pieces.append(np.asarray(tokens, dtype=np.int64))
        sources.append({"shard": os.path.basename(prefix), "documents": end - begin, "tokens": length})
        total += length
        if max_tokens is not None and total >= max_tokens:
            break
    if total < 2:
        raise ValueError("the run's validation split holds no tokens")
    return np.concatenate(pieces), sources


def read_text_documents(path: str) -> List[str]:
    """The documents of a --text file (.txt: the whole file; .jsonl/.json/.ndjson: the ``text`` field of each line;
    optionally .gz/.zst). ValueError naming the file when it is missing, empty, or not UTF-8 text."""
    from data.readers import Skipped, iter_records

    if not os.path.isfile(path):
        raise ValueError(f"--text {path} does not exist")
    if os.path.getsize(path) == 0:
        raise ValueError(f"--text {path} is empty")
    documents, skipped = [], {}
    for record in iter_records(path):
        if isinstance(record, Skipped):
            skipped[record.reason] = skipped.get(record.reason, 0) + 1
        else:
            documents.append(record)
    if skipped.get("non_utf8"):
        raise ValueError(f"--text {path} is not UTF-8 text ({skipped['non_utf8']} record(s) failed to decode)")
    bad = {k: v for k, v in skipped.items() if k != "empty"}
    if bad:
        raise ValueError(f"--text {path} has unreadable records: " + ", ".join(f"{v} {k}" for k, v in bad.items()))
    if not documents:
        raise ValueError(f"--text {path} is empty (no document with text in it)")
    return documents


def text_stream(documents: Sequence[str], tokenizer, max_tokens: Optional[int]) -> np.ndarray:
    """Documents tokenized and joined as preprocessing does (each followed by the end-of-document token)."""
    encoded = tokenizer.encode_batch(list(documents), append_eod=True)
    stream = np.fromiter((t for doc in encoded for t in doc), dtype=np.int64)
    return stream[:max_tokens] if max_tokens is not None else stream
