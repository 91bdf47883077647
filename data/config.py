"""The `data` config group: what to train on, as a typed schema for Hydra's ConfigStore.

train.py makes relative paths absolute against the directory it is launched from before this schema sees them; a
relative path that reaches ``resolve_path`` (a DataConfig built in code) is taken from the repository root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_CORPUS = REPO_ROOT / "data" / "corpus" / "shakespeare_kjv.jsonl.gz"
SOURCES = ("bundled", "shards")
SPLIT_PATTERN = re.compile(r"^\s*\d+(\.\d+)?\s*(,\s*\d+(\.\d+)?\s*){0,2}$")
# A blend entry naming every shard of `python -m data.preprocess --partition I/N`: PREFIX-*-of-N.
PARTITIONS_ENTRY = re.compile(r"^(?P<prefix>.+)-\*-of-(?P<count>[1-9][0-9]*)$")


@dataclass
class DataConfig:
    """Schema of the `data` config group.

    source: "bundled" trains a tokenizer on the corpus shipped in data/corpus/ and tokenizes it into `cache_dir` the
        first time (seconds), so training needs no data step; "shards" trains on `blend`, prepared beforehand with
        `python -m data.tokenizer train` and `python -m data.preprocess`.
    tokenizer_dir: the tokenizer the shards were made with (required for "shards"; for "bundled", None trains one of
        `bundled_vocab_size` pieces, a path re-tokenizes the bundled corpus with that tokenizer).
    blend: shard prefixes (PREFIX.bin/PREFIX.idx) for "shards"; blend_weights: one non-negative weight each, or None
        to weight by size.
    split: train,valid,test proportions of each shard's documents, e.g. "969,30,1".
    index_cache_dir: where megatron-core caches its document/sample/shuffle indices (None: rebuilt in memory by every
        process each run, cheap for small corpora).
    document_mask: attention stays within each document of a packed sample (a token attends to no token of the
        documents before it). Off by default: the DIFF paper's runs and megatron's GPTDataset attend across documents,
        so a run stays comparable with them and with earlier runs; the long-context preset turns it on.
    reset_position_ids: RoPE positions restart at 0 with every document (off: positions count from the sample's
        start). With document_mask on it changes only rounding (RoPE depends on the distance within a document).
    """

    source: str = "bundled"
    tokenizer_dir: Optional[str] = None
    blend: List[str] = field(default_factory=list)
    blend_weights: Optional[List[float]] = None
    split: str = "969,30,1"
    cache_dir: str = "data/cache"
    index_cache_dir: Optional[str] = None
    bundled_vocab_size: int = 4096
    preprocess_workers: int = 1
    num_workers: Optional[int] = None  # DataLoader worker processes; None: 2 on a GPU, 0 on a CPU
    eod_mask_loss: bool = False
    document_mask: bool = False
    reset_position_ids: bool = False

    def validate(self) -> None:
        validate(self)

    def describe(self) -> str:
        """What the data is, as run.json's data_source and every figure's title name it."""
        if self.source == "bundled":
            return "the bundled corpus (Shakespeare, King James Bible)"
        return ", ".join("/".join(str(p).rstrip("/").split("/")[-2:]) for p in self.blend)  # "shards/mytext"


def resolve_path(path: str) -> str:
    """An absolute path; a relative one is taken from the repository root."""
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else str(REPO_ROOT / expanded)


def parse_split(split: str) -> List[float]:
    """The three split proportions of a "train,valid,test" string (missing parts are 0), validated."""
    if not isinstance(split, str) or not SPLIT_PATTERN.match(split):
        raise ValueError(f"data.split={split!r} is malformed: give up to three non-negative numbers separated by "
                         f"commas, train,valid,test, e.g. '969,30,1'")
    parts = [float(p) for p in split.split(",")]
    parts += [0.0] * (3 - len(parts))
    if sum(parts) <= 0:
        raise ValueError(f"data.split={split!r} sums to 0: at least the train part must be positive, e.g. '969,30,1'")
    if parts[0] <= 0:
        raise ValueError(f"data.split={split!r} leaves no training documents: make its first part positive")
    return parts


def partition_prefix(prefix: str, index: int, count: int) -> str:
    """The shard prefix `data.preprocess --partition index/count --out prefix` writes."""
    return f"{prefix}-{index}-of-{count}"


def blend_shards(entry: str) -> List[str]:
    """The shard prefixes a blend entry names: itself, or the N partitions of PREFIX-*-of-N in order."""
    match = PARTITIONS_ENTRY.match(entry)
    if not match:
        return [entry]
    count = int(match.group("count"))
    return [partition_prefix(match.group("prefix"), i, count) for i in range(1, count + 1)]


def validate(cfg: DataConfig) -> None:
    """Refuse a bad data config with a message naming the value; cheap, no process group or megatron import needed."""
    if cfg.source not in SOURCES:
        raise ValueError(f"data.source={cfg.source!r} is not one of {SOURCES}")
    parse_split(cfg.split)
    if cfg.bundled_vocab_size < 512 or cfg.bundled_vocab_size > 65536:
        raise ValueError(f"data.bundled_vocab_size={cfg.bundled_vocab_size} is outside 512..65536 (the bundled corpus "
                         f"is 9 M characters; 2048-8192 suits it)")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise ValueError(f"data.num_workers={cfg.num_workers} must be 0 (load in the training process) or more")
    if cfg.preprocess_workers < 1:
        raise ValueError(f"data.preprocess_workers={cfg.preprocess_workers} must be at least 1")
    if cfg.source == "bundled":
        if cfg.blend:
            raise ValueError(f"data.blend={list(cfg.blend)} is set but data.source='bundled' ignores it; "
                             f"set data.source=shards to train on your shards")
        if not BUNDLED_CORPUS.is_file():
            raise ValueError(f"the bundled corpus {BUNDLED_CORPUS} is missing; rebuild it with data/corpus/build.py")
    else:
        if not cfg.blend:
            raise ValueError("data.source='shards' needs data.blend, a list of shard prefixes (PREFIX.bin/PREFIX.idx) "
                             "written by `python -m data.preprocess`")
        if cfg.tokenizer_dir is None:
            raise ValueError("data.source='shards' needs data.tokenizer_dir, the tokenizer the shards were made with")
        for prefix in cfg.blend:
            shards = blend_shards(resolve_path(prefix))
            for number, shard in enumerate(shards, start=1):
                for suffix in (".bin", ".idx"):
                    path = shard + suffix
                    if os.path.isfile(path):
                        continue
                    if len(shards) == 1:
                        raise ValueError(f"data.blend entry {prefix!r}: shard file {path} does not exist")
                    raise ValueError(
                        f"data.blend entry {prefix!r} names {len(shards)} partitions, but partition {number} "
                        f"({path}) does not exist: run `python -m data.preprocess ... --partition "
                        f"{number}/{len(shards)}` (or resubmit the SLURM array) until all {len(shards)} are written"
                    )
    if cfg.blend_weights is not None:
        if cfg.source == "bundled":
            raise ValueError("data.blend_weights is set but data.source='bundled' has a single dataset")
        if len(cfg.blend_weights) != len(cfg.blend):
            raise ValueError(f"data.blend_weights has {len(cfg.blend_weights)} weights for {len(cfg.blend)} prefixes "
                             f"in data.blend; give one weight per prefix, or none to weight by size")
        for prefix, weight in zip(cfg.blend, cfg.blend_weights):
            if not weight >= 0:  # also catches NaN
                raise ValueError(f"data.blend_weights: weight {weight} for {prefix!r} is negative; weights must be >= 0")
        if sum(cfg.blend_weights) <= 0:
            raise ValueError(f"data.blend_weights={list(cfg.blend_weights)} sum to 0; at least one must be positive")
    if cfg.tokenizer_dir is not None and not os.path.exists(resolve_path(cfg.tokenizer_dir)):
        raise ValueError(f"data.tokenizer_dir={cfg.tokenizer_dir!r}: {resolve_path(cfg.tokenizer_dir)} does not exist")
