"""What the trainer calls: prepare the data, load the tokenizer, build megatron-core datasets and the data loader.

    prepared = prepare(cfg.data)                     # all ranks; safe concurrently (file lock, atomic renames)
    tokenizer = load_tokenizer(prepared.tokenizer_dir)
    check_vocab(cfg.model.vocab_size, tokenizer)
    train_ds, valid_ds, test_ds = build_datasets(prepared, tokenizer, seq_length=..., seed=..., train_samples=...,
                                                 valid_samples=..., split=cfg.data.split)
    loader = build_dataloader(train_ds, consumed_samples=..., micro_batch_size=..., data_parallel_rank=...,
                              data_parallel_size=...)

Packed samples and their documents: a sample concatenates documents, each ended by the end-of-document token (EOD);
with `document_mask` every sample also carries `document_ids` (int32, [seq_length]): token i belongs to document
number (EODs among tokens 0..i-1), so an EOD closes its document and a document cut by the sample's start is the
sample's document 0 (as megatron's reset_attention_mask draws it). Per-token ids, never an N×N mask; the model's
attention kernels turn them into whatever they need. With `reset_position_ids` the `position_ids` restart at 0 with
each document.

torch and megatron-core are imported by the functions that need them, so that `prepare` stays cheap in data-only
processes (CLIs, preprocessing workers).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence

from data import indexed
from data.config import BUNDLED_CORPUS, DataConfig, parse_split, resolve_path, validate
from data.indexed import ShardError
from data.locking import file_lock
from data.tokenizer import CONFIG_FILE, MODEL_FILE, Tokenizer, file_sha256, load_tokenizer

__all__ = ["PreparedData", "prepare", "load_tokenizer", "build_datasets", "build_dataloader", "verify_shards",
           "check_vocab", "check_shard_tokenizer", "MegatronPretrainingSampler", "ShardError", "document_ids",
           "document_positions", "PackedDocumentsDataset"]


@dataclass
class PreparedData:
    """What to train on: the tokenizer directory and the weighted shard prefixes (weights None: by size)."""

    tokenizer_dir: str
    prefixes: List[str]
    weights: Optional[List[float]]


def prepare(cfg: DataConfig) -> PreparedData:
    """Resolve the data to train on; for the bundled corpus, train the tokenizer and write the shard on first use.

    `cfg` is a DataConfig or an OmegaConf node of its schema."""
    validate(cfg)
    if cfg.source == "shards":
        from data.preprocess import expand_blend

        # an entry PREFIX-*-of-N (the shards of `data.preprocess --partition I/N`) stands for its N shards
        prefixes, weights = expand_blend([resolve_path(p) for p in cfg.blend], cfg.blend_weights)
        return PreparedData(resolve_path(cfg.tokenizer_dir), prefixes, weights)
    return _prepare_bundled(cfg)


def _prepare_bundled(cfg: DataConfig) -> PreparedData:
    from data import preprocess as preprocessing
    from data.tokenizer import train_tokenizer

    cache_dir = resolve_path(cfg.cache_dir)
    corpus_hash = file_sha256(BUNDLED_CORPUS)[:12]
    if cfg.tokenizer_dir is None:
        work_dir = os.path.join(cache_dir, f"bundled-{corpus_hash}-bpe{cfg.bundled_vocab_size}")
        tokenizer_dir = os.path.join(work_dir, "tokenizer")
    else:
        tokenizer_dir = resolve_path(cfg.tokenizer_dir)
        work_dir = os.path.join(cache_dir, f"bundled-{corpus_hash}-tok{tokenizer_hash(tokenizer_dir)[:12]}")
    prefix = os.path.join(work_dir, "corpus")
    with file_lock(work_dir + ".lock"):
        if cfg.tokenizer_dir is None and not os.path.isfile(os.path.join(tokenizer_dir, CONFIG_FILE)):
            train_tokenizer([str(BUNDLED_CORPUS)], tokenizer_dir, cfg.bundled_vocab_size, model_type="bpe",
                            vocab_option="data.bundled_vocab_size")
        # A no-op (a stat and a JSON read) once the shard is up to date.
        preprocessing.preprocess([str(BUNDLED_CORPUS)], tokenizer_dir, prefix, workers=cfg.preprocess_workers)
    return PreparedData(tokenizer_dir, [prefix], None)


def tokenizer_hash(path: str) -> str:
    """sha256 of a tokenizer's model file (a directory's tokenizer.model or tokenizer.json, or the file itself)."""
    model = os.path.join(path, MODEL_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(model):
        model = os.path.join(path, "tokenizer.json")
    return file_sha256(model)


def verify_shards(prefixes: Sequence[str], vocab_size: Optional[int] = None, check_tokens: bool = False) -> None:
    """Raise ShardError naming the file if any `.bin/.idx` pair is missing, truncated or inconsistent."""
    for prefix in prefixes:
        indexed.verify_shard(prefix, vocab_size=vocab_size, check_tokens=check_tokens)


def check_shard_tokenizer(prefix: str, tokenizer: Tokenizer) -> None:
    """Refuse a shard whose manifest names another tokenizer (shards without a manifest cannot be checked)."""
    from data.preprocess import read_manifest

    manifest = read_manifest(prefix)
    if manifest is None:
        return
    made_with = manifest["tokenizer"]
    if made_with["sha256"] != tokenizer.model_sha256:
        raise ValueError(f"shard {prefix} was tokenized with {made_with['path']} (sha256 {made_with['sha256'][:12]}), "
                         f"not with {tokenizer.path} (sha256 {tokenizer.model_sha256[:12]}); train with the shard's "
                         f"tokenizer (data.tokenizer_dir) or preprocess the shard again")


def check_vocab(model_vocab_size: int, tokenizer: Tokenizer) -> None:
    """Refuse a model whose embedding table cannot hold every token id."""
    if model_vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} tokens at {tokenizer.path}); use at least {tokenizer.vocab_size}")


def build_datasets(
    prepared: PreparedData,
    tokenizer: Tokenizer,
    *,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int = 0,
    split: str = "969,30,1",
    index_cache_dir: Optional[str] = None,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    document_mask: bool = False,
    reset_position_ids: bool = False,
):
    """Train, valid and test GPTDatasets (a BlendedDataset when the blend has several prefixes) with megatron-core's
    BlendedMegatronDatasetBuilder; each sample is a dict of `tokens`, `labels`, `loss_mask`, `position_ids` (and
    `attention_mask` if asked for), shuffled deterministically by `seed`. A split with 0 samples asked is None.
    With `document_mask` or `reset_position_ids` each split is a :class:`PackedDocumentsDataset` over it (the same
    samples in the same order, with `document_ids` and/or positions restarting per document).

    Works with or without a torch.distributed process group. With `index_cache_dir`, megatron builds the index cache
    on rank 0 first; a file lock makes concurrent independent runs sharing the cache safe too.
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be positive")
    for name, value in (("train_samples", train_samples), ("valid_samples", valid_samples),
                        ("test_samples", test_samples)):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    proportions = parse_split(split)
    for name, wanted, proportion in zip(("valid", "test"), (valid_samples, test_samples), proportions[1:]):
        if wanted > 0 and proportion == 0:
            raise ValueError(f"{name}_samples={wanted} but split={split!r} gives the {name} split no documents")
    sizes = [train_samples, valid_samples, test_samples]
    document_counts = {prefix: indexed.verify_shard(prefix, vocab_size=tokenizer.vocab_size).num_documents
                       for prefix in prepared.prefixes}
    for prefix in prepared.prefixes:
        check_shard_tokenizer(prefix, tokenizer)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(prepared.prefixes), list(prepared.weights) if prepared.weights is not None else None),
        split=split,
        path_to_cache=resolve_path(index_cache_dir) if index_cache_dir else None,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=True,
    )
    # A split nobody asks samples of is not built: megatron would loop forever on a split left with no documents.
    config.split_matrix = [bookends if size > 0 else None for bookends, size in zip(config.split_matrix, sizes)]
    _check_split_documents(config.split_matrix, document_counts, split)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank or (lambda: True), config)
    lock = contextlib.nullcontext()
    if index_cache_dir and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        # Only rank 0 writes the cache; other ranks read it after megatron's barrier, so they must not take the lock.
        lock = file_lock(os.path.join(resolve_path(index_cache_dir), ".build.lock"))
    with lock:
        datasets = builder.build()
    if document_mask or reset_position_ids:
        datasets = [PackedDocumentsDataset(d, tokenizer.eod, document_mask, reset_position_ids) if d is not None
                    else None for d in datasets]
    return tuple(dataset if size > 0 else None for dataset, size in zip(datasets, sizes))


def document_ids(tokens, eod: int):
    """Each token's document within its packed sample (int32, the shape of ``tokens``, along the last dimension):
    the number of EOD tokens before it, so an EOD belongs to the document it ends."""
    import torch

    ends = (tokens == eod).to(torch.int32)
    return (torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends).to(torch.int32)


def document_positions(ids):
    """Each token's position within its document (int64, along the last dimension) from :func:`document_ids`."""
    import torch

    index = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - starts


class PackedDocumentsDataset:
    """A dataset of packed samples with their documents: megatron's sample dict plus `document_ids` (with
    ``document_mask``) and positions restarting per document (with ``reset_position_ids``). Everything else, order
    and length included, is the wrapped dataset's."""

    def __init__(self, dataset, eod: int, document_mask: bool, reset_position_ids: bool) -> None:
        self.dataset = dataset
        self.eod = eod
        self.document_mask = document_mask
        self.reset_position_ids = reset_position_ids

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):
        if name == "dataset" or name.startswith("__"):  # unpickling (DataLoader workers) asks before __init__ ran
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        sample = dict(self.dataset[index])
        ids = document_ids(sample["tokens"], self.eod)
        if self.document_mask:
            sample["document_ids"] = ids
        if self.reset_position_ids:
            sample["position_ids"] = document_positions(ids)
        return sample


SPLIT_NAMES = ("train", "valid", "test")


def split_document_range(bookends, num_documents: int) -> tuple:
    """Documents [begin, end) of a shard that a split with ``bookends`` (its (start, stop) fractions in megatron's
    split matrix) holds: megatron's builder rounds both ends."""
    return int(round(bookends[0] * num_documents)), int(round(bookends[1] * num_documents))


def split_bookends(split: str) -> list:
    """megatron's split matrix of a "train,valid,test" string: (start, stop) fractions per split, None when empty."""
    parts = parse_split(split)
    total = sum(parts)
    edges = [0.0]
    for part in parts:
        edges.append(edges[-1] + part / total)
    return [(a, b) if b > a else None for a, b in zip(edges[:-1], edges[1:])]


def _check_split_documents(split_matrix, document_counts: dict, split: str) -> None:
    """Each split that is built must get at least one document of every shard (megatron's rounding, repeated)."""
    for name, bookends in zip(SPLIT_NAMES, split_matrix):
        if bookends is None:
            continue
        for prefix, count in document_counts.items():
            begin, end = split_document_range(bookends, count)
            if end <= begin:
                raise ValueError(f"split={split!r} gives the {name} split none of the {count} documents of {prefix}; "
                                 f"raise its share (e.g. '90,10,0') or ask for no {name} samples")


class MegatronPretrainingSampler:
    """Megatron-LM's pretraining batch sampler: walks the (already shuffled) dataset in order from `consumed_samples`;
    each run of `micro_batch_size * data_parallel_size` indices is one micro-batch per data-parallel rank, this rank
    taking its contiguous slice. Deterministic, so a resumed run continues the exact data order."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples}: the dataset is empty")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be positive")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} is not in [0, data_parallel_size="
                             f"{data_parallel_size})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} is not below the dataset's {total_samples} samples: "
                             f"build the dataset with more train_samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.micro_batch_times_data_parallel_size
        tail = remaining % self.micro_batch_times_data_parallel_size
        return full + (0 if self.drop_last or tail <= self.data_parallel_rank * self.micro_batch_size else 1)

    def _rank_slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start:start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for index in range(self.consumed_samples, self.total_samples):
            batch.append(index)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                yield self._rank_slice(batch)
                batch = []
        if batch and not self.drop_last and self._rank_slice(batch):
            yield self._rank_slice(batch)


def build_dataloader(dataset, *, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                     data_parallel_size: int, num_workers: int = 0) -> "torch.utils.data.DataLoader":
    """Micro-batches of `dataset` for this data-parallel rank, starting after `consumed_samples` samples (summed over
    all ranks, as the trainer counts them). Each batch is a dict of stacked tensors, [micro_batch_size, seq_length]."""
    import torch

    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                         data_parallel_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0)
