"""Inspect a blend before training: tokens per shard and split, epochs the planned steps imply, the share of tokens in
documents at least a sequence long (what long-context training learns long-range dependencies from: shorter
documents are packed with their neighbours), the document-length distribution and the share of the causal attention
work that document masking (data.document_mask) removes at the sequence length, decoded samples.

    python -m data.inspect --blend PREFIX [PREFIX ...] [--weights W ...] --tokenizer DIR \\
        --seq-length 2048 --global-batch-size 128 --train-steps 40000 [--split 969,30,1] [--samples 3]
    python -m data.inspect --bundled [--seq-length ...]            # the bundled corpus (prepared if needed)
    python -m data.inspect --config RUN_DIR/config.yaml            # a run's resolved config
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from data import indexed, preprocess
from data.config import parse_split
from diff_transformer.cli import ArgumentParser, run


@dataclass
class ShardSummary:
    prefix: str
    documents: int
    tokens: int
    split_tokens: List[int]  # train, valid, test
    weight: float  # normalised share of the blend
    skipped: dict
    long_share: Optional[float] = None  # share of the tokens in documents of at least the sequence length
    lengths: Optional[dict] = None  # document lengths in tokens (with the EOD): mean and percentiles
    masked_share: Optional[float] = None  # share of the causal attention work document masking removes


# Documents read for the masked share: enough for a stable figure, bounded memory on any shard
MASKED_SHARE_DOCUMENTS = 10_000_000


def length_distribution(lengths: np.ndarray) -> Optional[dict]:
    """Mean and 10th, 50th, 90th and 99th percentiles of document lengths (None without documents)."""
    if not len(lengths):
        return None
    percentiles = np.percentile(lengths, [10, 50, 90, 99])
    return {"mean": float(lengths.mean()), **{f"p{q}": float(v) for q, v in zip((10, 50, 90, 99), percentiles)}}


def masked_attention_share(lengths: np.ndarray, seq_length: int) -> Optional[float]:
    """The share of the causal attention work (s²/2 a sample) that document masking removes when documents of these
    lengths are packed in this order into samples of ``seq_length`` tokens: 1 − Σ L²/(samples·s²) over the pieces L
    the samples' edges and the documents' ends cut (None: not one whole sample)."""
    lengths = lengths[:MASKED_SHARE_DOCUMENTS].astype(np.int64)
    samples = int(lengths.sum()) // seq_length
    if samples == 0:
        return None
    covered = samples * seq_length
    ends = np.cumsum(lengths)
    cuts = np.union1d(ends[ends < covered], np.arange(0, covered + 1, seq_length, dtype=np.int64))
    pieces = np.diff(cuts).astype(np.float64)
    return float(1.0 - (pieces ** 2).sum() / (samples * float(seq_length) ** 2))


def summarise_blend(prefixes: Sequence[str], weights: Optional[Sequence[float]], split: str,
                    vocab_size: Optional[int] = None, seq_length: Optional[int] = None) -> List[ShardSummary]:
    """Token counts per shard and split, by megatron-core's document ranges (rounded split book-ends); with
    ``seq_length``, the share of each shard's tokens in documents at least that long (with the end-of-document
    token)."""
    proportions = np.array(parse_split(split))
    bookends = np.concatenate([[0.0], np.cumsum(proportions / proportions.sum())])
    summaries = []
    for prefix in prefixes:
        index = indexed.verify_shard(prefix, vocab_size=vocab_size)
        documents = index.num_documents
        per_document = np.add.reduceat(index.sequence_lengths.astype(np.int64), index.document_indices[:-1]) \
            if documents else np.zeros(0, dtype=np.int64)
        edges = [int(round(b * documents)) for b in bookends]
        split_tokens = [int(per_document[edges[i]:edges[i + 1]].sum()) for i in range(3)]
        manifest = preprocess.read_manifest(prefix) or {}
        long_share = masked_share = None
        if seq_length is not None and index.num_tokens:
            long_share = float(per_document[per_document >= seq_length].sum() / per_document.sum())
            masked_share = masked_attention_share(per_document, seq_length)
        summaries.append(ShardSummary(prefix, documents, index.num_tokens, split_tokens, 0.0,
                                      manifest.get("totals", {}).get("skipped", {}), long_share,
                                      length_distribution(per_document), masked_share))
    if weights is None:  # megatron weights by size when none are given
        raw = np.array([s.tokens for s in summaries], dtype=np.float64)
    else:
        raw = np.array(weights, dtype=np.float64)
    for summary, share in zip(summaries, raw / raw.sum()):
        summary.weight = float(share)
    return summaries


def epochs_implied(summaries: Sequence[ShardSummary], train_tokens: int) -> List[float]:
    """How many passes over its train split each shard makes when the run draws `train_tokens` by the weights."""
    return [s.weight * train_tokens / s.split_tokens[0] if s.split_tokens[0] else float("inf") for s in summaries]


# Past about four passes, repeated tokens are worth much less than fresh ones (Muennighoff et al. 2023).
EPOCHS_WARNING = 4.0


def epochs_lines(summaries: Sequence[ShardSummary], train_tokens: int,
                 threshold: float = EPOCHS_WARNING) -> tuple[List[str], List[str]]:
    """(one line per blend entry: its epochs over the planned training, warnings for those above ``threshold``)."""
    lines, warnings = [], []
    for summary, epochs in zip(summaries, epochs_implied(summaries, train_tokens)):
        name = "/".join(summary.prefix.rstrip("/").split("/")[-2:])
        lines.append(f"{name}: {epochs:.2f} epochs of its train split ({summary.split_tokens[0]:,} tokens, weight "
                     f"{summary.weight:.3f}) over {train_tokens:,} planned train tokens")
        if epochs > threshold:
            warnings.append(f"{summary.prefix} is seen {epochs:.1f} times over training (above {threshold:g} epochs, "
                            "repeated tokens are worth much less than fresh ones): add data to the blend, lower its "
                            "weight, or train fewer steps (python -m data.inspect --config RUN_DIR/config.yaml "
                            "shows every shard)")
    return lines, warnings


def report(summaries: Sequence[ShardSummary], *, seq_length: int, global_batch_size: int, train_steps: int) -> str:
    train_tokens = train_steps * global_batch_size * seq_length
    lines = [f"{'shard':<60} {'weight':>7} {'documents':>10} {'tokens':>14} {'train':>14} {'valid':>12} "
             f"{'test':>10} {'epochs':>7} {'>=seq':>6}"]
    for summary, epochs in zip(summaries, epochs_implied(summaries, train_tokens)):
        name = summary.prefix if len(summary.prefix) <= 60 else "..." + summary.prefix[-57:]
        lines.append(f"{name:<60} {summary.weight:>7.3f} {summary.documents:>10,} {summary.tokens:>14,} "
                     f"{summary.split_tokens[0]:>14,} {summary.split_tokens[1]:>12,} {summary.split_tokens[2]:>10,} "
                     f"{epochs:>7.2f} " + ("     -" if summary.long_share is None else f"{summary.long_share:>6.1%}"))
        if summary.lengths is not None:
            q = summary.lengths
            masked = "-" if summary.masked_share is None else f"{summary.masked_share:.1%}"
            lines.append(f"    document tokens: mean {q['mean']:,.0f}, p10 {q['p10']:,.0f}, p50 {q['p50']:,.0f}, "
                         f"p90 {q['p90']:,.0f}, p99 {q['p99']:,.0f}; document masking removes {masked} of the "
                         f"attention work at {seq_length} tokens")
        if summary.skipped:
            lines.append(f"    skipped at preprocessing: {summary.skipped}")
    masked = [(s.weight, s.masked_share) for s in summaries if s.masked_share is not None]
    if masked:
        weight = sum(w for w, _ in masked)
        lines.append(f"document masking (data.document_mask) removes {sum(w * m for w, m in masked) / weight:.1%} of "
                     f"the causal attention work of the blend at {seq_length} tokens (by the weights)")
    total = sum(s.tokens for s in summaries)
    lines.append(f"total {total:,} tokens; planned {train_steps:,} steps x {global_batch_size} sequences x "
                 f"{seq_length} tokens = {train_tokens:,} train tokens; >=seq: the share of a shard's tokens in "
                 f"documents of at least {seq_length} tokens (shorter ones share their samples with their neighbours)")
    return "\n".join(lines)


def decode_samples(prepared, tokenizer, *, seq_length: int, seed: int, split: str, count: int, chars: int) -> List[str]:
    """The first `count` training samples as the trainer will see them, decoded."""
    from data.datasets import build_datasets

    train = build_datasets(prepared, tokenizer, seq_length=seq_length, seed=seed, train_samples=count,
                           valid_samples=0, split=split)[0]
    texts = []
    for i in range(min(count, len(train))):
        text = tokenizer.decode(train[i]["tokens"].tolist())
        texts.append(text if len(text) <= chars else text[:chars] + " [...]")
    return texts


def _from_run_config(path: str, args: argparse.Namespace) -> None:
    import yaml
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path} is not YAML ({str(err).splitlines()[0]}): give a run directory's "
                         "config.yaml") from None
    needed = ("data", "model.seq_length", "trainer.global_batch_size", "trainer.max_steps")
    missing = [key for key in needed if not isinstance(cfg, DictConfig) or OmegaConf.select(cfg, key) is None]
    if missing:
        raise ValueError(f"--config {path} has no {', '.join(missing)}: give a run directory's config.yaml")
    args.data_cfg = cfg.data
    args.seq_length = args.seq_length if args.seq_length is not None else cfg.model.seq_length
    args.global_batch_size = args.global_batch_size if args.global_batch_size is not None else cfg.trainer.global_batch_size
    args.train_steps = args.train_steps if args.train_steps is not None else cfg.trainer.max_steps
    args.seed = cfg.get("seed", args.seed)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = ArgumentParser(prog="python -m data.inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--blend", nargs="+", help="shard prefixes")
    source.add_argument("--bundled", action="store_true", help="the bundled corpus (prepared into data/cache)")
    source.add_argument("--config", help="a run directory's resolved config.yaml")
    parser.add_argument("--weights", nargs="+", type=float, help="one weight per prefix (default: by size)")
    parser.add_argument("--tokenizer", help="tokenizer directory (needed with --blend)")
    parser.add_argument("--split", default=None, help="train,valid,test (default 969,30,1 or the config's)")
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--train-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--samples", type=int, default=3, help="decode this many training samples (0: none)")
    parser.add_argument("--chars", type=int, default=400, help="print at most this many characters a sample")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    for option, value, least in (("--seq-length", args.seq_length, 1), ("--global-batch-size", args.global_batch_size, 1),
                                 ("--train-steps", args.train_steps, 0), ("--samples", args.samples, 0),
                                 ("--chars", args.chars, 1)):
        if value is not None and value < least:  # 0 would silently mean the default
            parser.error(f"{option} {value} must be at least {least}")
    if args.weights is not None and not all(w >= 0 for w in args.weights):
        parser.error(f"--weights {' '.join(map(str, args.weights))}: weights must be >= 0")
    if args.weights is not None and not sum(args.weights) > 0:
        parser.error(f"--weights {' '.join(map(str, args.weights))} sum to 0: at least one must be positive")

    from data.config import DataConfig
    from data.datasets import PreparedData, load_tokenizer, prepare

    args.data_cfg = None
    if args.config:
        _from_run_config(args.config, args)
    if args.bundled:
        args.data_cfg = DataConfig()
    if args.data_cfg is not None:
        prepared = prepare(args.data_cfg)
        split = args.split or args.data_cfg.split
    else:
        if not args.tokenizer:
            parser.error("--blend needs --tokenizer")
        if args.weights is not None and len(args.weights) != len(args.blend):
            parser.error(f"--weights has {len(args.weights)} values for {len(args.blend)} prefixes in --blend")
        prepared = PreparedData(os.path.abspath(args.tokenizer), [os.path.abspath(p) for p in args.blend], args.weights)
        split = args.split or "969,30,1"
    seq_length = args.seq_length if args.seq_length is not None else 2048
    global_batch_size = args.global_batch_size if args.global_batch_size is not None else 1
    train_steps = args.train_steps if args.train_steps is not None else 0
    tokenizer = load_tokenizer(prepared.tokenizer_dir)
    summaries = summarise_blend(prepared.prefixes, prepared.weights, split, tokenizer.vocab_size, seq_length)
    samples = []
    if args.samples > 0:
        samples = decode_samples(prepared, tokenizer, seq_length=seq_length, seed=args.seed, split=split,
                                 count=args.samples, chars=args.chars)
    if args.json:
        train_tokens = train_steps * global_batch_size * seq_length
        json.dump({"tokenizer": {"path": tokenizer.path, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod},
                   "split": split, "train_tokens_planned": train_tokens,
                   "shards": [dict(vars(s), epochs=e) for s, e in zip(summaries, epochs_implied(summaries, train_tokens))],
                   "samples": samples}, sys.stdout, indent=2)
        print()
        return
    print(f"tokenizer {tokenizer.path} (vocab {tokenizer.vocab_size}, eod {tokenizer.eod}); split {split}")
    print(report(summaries, seq_length=seq_length, global_batch_size=global_batch_size, train_steps=train_steps))
    for i, text in enumerate(samples):
        print(f"\n--- train sample {i} ({seq_length} tokens) ---\n{text}")


if __name__ == "__main__":
    sys.exit(run(main))
