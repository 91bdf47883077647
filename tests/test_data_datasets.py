"""The trainer-facing data API: config validation, prepare, megatron-core datasets and blends, the sampler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data import preprocess
from data.config import REPO_ROOT, DataConfig, parse_split
from data.datasets import (MegatronPretrainingSampler, PreparedData, ShardError, build_dataloader, build_datasets,
                           check_vocab, load_tokenizer, prepare, verify_shards)
from data.tokenizer import train_tokenizer

WORDS_A = "alpha beta gamma delta epsilon zeta eta theta".split()
WORDS_B = "one two three four five six seven eight nine ten".split()


def _documents(words, count, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=rng.integers(20, 80))) for _ in range(count)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shards of different vocabularies, so a sample's source is visible in its tokens."""
    root = tmp_path_factory.mktemp("shards")
    docs_a, docs_b = _documents(WORDS_A, 200, 0), _documents(WORDS_B, 200, 1)
    for name, docs in (("a", docs_a), ("b", docs_b)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = train_tokenizer([str(root / "a.jsonl"), str(root / "b.jsonl")], root / "tok", 320, num_threads=1)
    for name in ("a", "b"):
        preprocess.preprocess([str(root / f"{name}.jsonl")], str(root / "tok"), str(root / name))
    ids_a = {i for d in docs_a for i in tokenizer.encode(d)}
    ids_b = {i for d in docs_b for i in tokenizer.encode(d)}
    return root, ids_a - ids_b, ids_b - ids_a


def test_validate_names_the_bad_value(shards):
    root, _, _ = shards
    good = DataConfig(source="shards", tokenizer_dir=str(root / "tok"), blend=[str(root / "a"), str(root / "b")],
                      blend_weights=[0.3, 0.7])
    good.validate()
    cases = [
        (dict(blend_weights=[1.0]), "1 weights for 2 prefixes"),
        (dict(blend_weights=[0.5, -0.1]), "weight -0.1 for"),
        (dict(blend=[str(root / "a"), str(root / "missing")], blend_weights=None), str(root / "missing.bin")),
        (dict(split="90;10"), "data.split='90;10' is malformed"),
        (dict(split="0,10,0"), "leaves no training documents"),
        (dict(source="hub"), "data.source='hub'"),
        (dict(tokenizer_dir=None), "needs data.tokenizer_dir"),
        (dict(num_workers=-1), "data.num_workers=-1"),
    ]
    for overrides, message in cases:
        cfg = DataConfig(**{**good.__dict__, **overrides})
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            cfg.validate()
    with pytest.raises(ValueError, match="data.source='bundled' ignores it"):
        DataConfig(blend=[str(root / "a")]).validate()
    assert parse_split("969,30,1") == [969.0, 30.0, 1.0] and parse_split("99") == [99.0, 0.0, 0.0]


def test_config_is_a_structured_omegaconf_schema():
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(DataConfig)
    merged = OmegaConf.merge(cfg, OmegaConf.create({"blend_weights": [1.0, 2.0], "blend": ["x", "y"]}))
    assert OmegaConf.to_object(merged).blend_weights == [1.0, 2.0]
    with pytest.raises(Exception, match="unknown_key"):
        OmegaConf.merge(cfg, OmegaConf.create({"unknown_key": 1}))


def test_check_vocab_message(shards):
    root, _, _ = shards
    tokenizer = load_tokenizer(root / "tok")
    check_vocab(320, tokenizer)
    with pytest.raises(ValueError, match=r"model.vocab_size=100 is smaller than the tokenizer's vocabulary \(320 "
                                         rf"tokens at {root / 'tok'}\); use at least 320"):
        check_vocab(100, tokenizer)


def test_blend_weights_are_honoured(shards):
    root, only_a, only_b = shards
    tokenizer = load_tokenizer(root / "tok")
    prepared = PreparedData(str(root / "tok"), [str(root / "a"), str(root / "b")], [0.3, 0.7])
    train, valid, test = build_datasets(prepared, tokenizer, seq_length=32, seed=5, train_samples=10_000,
                                        valid_samples=100, split="90,10,0")
    assert test is None and len(train) >= 10_000 and len(valid) >= 100
    from_a = 0
    for i in range(10_000):
        tokens = set(train[i]["tokens"].tolist())
        in_a, in_b = bool(tokens & only_a), bool(tokens & only_b)
        assert in_a != in_b, f"sample {i} mixes both sources or neither"
        from_a += in_a
    assert abs(from_a / 10_000 - 0.3) < 0.02


def test_datasets_are_seeded_and_well_formed(shards):
    root, _, _ = shards
    tokenizer = load_tokenizer(root / "tok")
    prepared = PreparedData(str(root / "tok"), [str(root / "a")], None)
    kwargs = dict(seq_length=16, train_samples=50, valid_samples=10, split="80,20,0")
    first = build_datasets(prepared, tokenizer, seed=1, **kwargs)[0]
    same = build_datasets(prepared, tokenizer, seed=1, **kwargs)[0]
    other = build_datasets(prepared, tokenizer, seed=2, **kwargs)[0]
    tokens = torch.stack([first[i]["tokens"] for i in range(50)])
    assert torch.equal(tokens, torch.stack([same[i]["tokens"] for i in range(50)]))
    assert not torch.equal(tokens, torch.stack([other[i]["tokens"] for i in range(50)]))
    sample = first[3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # labels are the tokens shifted by one
    assert torch.equal(sample["position_ids"], torch.arange(16))
    with pytest.raises(ValueError, match="gives the test split none of the 200 documents"):
        build_datasets(prepared, tokenizer, seed=1, seq_length=16, train_samples=10, valid_samples=1, test_samples=1,
                       split="900,100,0.0001")


def test_index_cache_without_process_group(shards, tmp_path):
    root, _, _ = shards
    tokenizer = load_tokenizer(root / "tok")
    prepared = PreparedData(str(root / "tok"), [str(root / "a")], None)
    built = [build_datasets(prepared, tokenizer, seq_length=16, seed=3, train_samples=40, valid_samples=0,
                            split="90,10,0", index_cache_dir=str(tmp_path / "index"))[0] for _ in range(2)]
    assert list((tmp_path / "index").glob("*shuffle_index.npy"))
    assert all(torch.equal(built[0][i]["tokens"], built[1][i]["tokens"]) for i in range(40))


def test_corrupted_shard_is_named(shards, tmp_path):
    root, _, _ = shards
    for suffix in (".bin", ".idx"):
        (tmp_path / f"cut{suffix}").write_bytes((root / f"a{suffix}").read_bytes())
    verify_shards([str(tmp_path / "cut")])
    with open(tmp_path / "cut.bin", "r+b") as stream:
        stream.truncate(os.path.getsize(tmp_path / "cut.bin") - 2)
    with pytest.raises(ShardError, match=f"data file {tmp_path / 'cut.bin'} is .* bytes but"):
        verify_shards([str(tmp_path / "cut")])
    # A pair whose halves come from different shards.
    (tmp_path / "mixed.bin").write_bytes((root / "b.bin").read_bytes())
    (tmp_path / "mixed.idx").write_bytes((root / "a.idx").read_bytes())
    with pytest.raises(ShardError, match="mixed"):
        verify_shards([str(tmp_path / "mixed")])
    (tmp_path / "short.bin").write_bytes((root / "a.bin").read_bytes())
    (tmp_path / "short.idx").write_bytes((root / "a.idx").read_bytes()[:-8])
    with pytest.raises(ShardError, match=f"index file {tmp_path / 'short.idx'} is .* truncated"):
        verify_shards([str(tmp_path / "short")])
    tokenizer = load_tokenizer(root / "tok")
    with pytest.raises(ShardError, match="short.idx"):
        build_datasets(PreparedData(str(root / "tok"), [str(tmp_path / "short")], None), tokenizer, seq_length=8,
                       seed=0, train_samples=4, valid_samples=0)


def test_shard_made_with_another_tokenizer_is_refused(shards, tmp_path):
    root, _, _ = shards
    other = train_tokenizer([str(root / "a.jsonl")], tmp_path / "other", 300, num_threads=1)
    with pytest.raises(ValueError, match=f"shard {root / 'a'} was tokenized with {root / 'tok'}"):
        build_datasets(PreparedData(str(tmp_path / "other"), [str(root / "a")], None), other, seq_length=8, seed=0,
                       train_samples=4, valid_samples=0)


def _reference_order(total, consumed, micro, rank, size):
    """Megatron-LM's sampler written out: global batches of micro*size consecutive indices, rank r takes slice r."""
    global_batch = micro * size
    out = []
    for start in range(consumed, total - global_batch + 1, global_batch):
        out.append(list(range(start + rank * micro, start + (rank + 1) * micro)))
    return out


@pytest.mark.parametrize("micro,size,consumed", [(4, 1, 0), (3, 2, 0), (2, 4, 16), (3, 2, 12)])
def test_sampler_matches_megatron_order(micro, size, consumed):
    total = 103
    per_rank = [list(MegatronPretrainingSampler(total, consumed, micro, r, size)) for r in range(size)]
    for rank in range(size):
        assert per_rank[rank] == _reference_order(total, consumed, micro, rank, size)
    covered = sorted(i for rank in per_rank for batch in rank for i in batch)
    assert covered == list(range(consumed, consumed + len(covered)))
    # Resume: starting at a step boundary gives exactly the tail of the uninterrupted order.
    resumed = list(MegatronPretrainingSampler(total, consumed + 2 * micro * size, micro, 0, size))
    assert resumed == per_rank[0][2:]
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        MegatronPretrainingSampler(total, 0, micro, 2, 2)


def test_dataloader_resumes_where_it_stopped(shards):
    root, _, _ = shards
    tokenizer = load_tokenizer(root / "tok")
    train = build_datasets(PreparedData(str(root / "tok"), [str(root / "a")], None), tokenizer, seq_length=16,
                           seed=0, train_samples=64, valid_samples=0, split="1")[0]
    full = [b["tokens"] for b in build_dataloader(train, consumed_samples=0, micro_batch_size=2,
                                                   data_parallel_rank=1, data_parallel_size=2)]
    resumed = [b["tokens"] for b in build_dataloader(train, consumed_samples=12, micro_batch_size=2,
                                                      data_parallel_rank=1, data_parallel_size=2)]
    assert full[0].shape == (2, 16) and len(resumed) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(full[3:], resumed))
    assert torch.equal(full[0][0], train[2]["tokens"])


PREPARE_IN_PROCESS = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import data.datasets
from data.config import DataConfig
data.datasets.BUNDLED_CORPUS = Path(sys.argv[3])  # a small stand-in keeps the test fast; the code path is the same
prepared = data.datasets.prepare(DataConfig(cache_dir=sys.argv[2], bundled_vocab_size=1024))
print(json.dumps([prepared.tokenizer_dir, prepared.prefixes]))
"""


def test_prepare_bundled_concurrently(tmp_path, monkeypatch):
    """Two processes preparing the bundled corpus at once both get the same complete shard, made once."""
    import gzip

    import data.datasets

    corpus = tmp_path / "corpus.jsonl.gz"
    with gzip.open(data.datasets.BUNDLED_CORPUS, "rt") as source, gzip.open(corpus, "wt") as target:
        for _, line in zip(range(12), source):
            target.write(json.dumps({"text": json.loads(line)["text"][:20000]}) + "\n")
    command = [sys.executable, "-c", PREPARE_IN_PROCESS, str(REPO_ROOT), str(tmp_path / "cache"), str(corpus)]
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [worker.communicate(timeout=240) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs
    results = [json.loads(out) for out, _ in outputs]
    assert results[0] == results[1]
    tokenizer_dir, prefixes = results[0]
    manifest = json.loads(Path(prefixes[0] + ".manifest.json").read_text())
    assert manifest["run"]["reused_parts"] == 0 and manifest["totals"]["documents"] == 12
    verify_shards(prefixes, load_tokenizer(tokenizer_dir).vocab_size, check_tokens=True)
    monkeypatch.setattr(data.datasets, "BUNDLED_CORPUS", corpus)
    again = prepare(DataConfig(cache_dir=str(tmp_path / "cache"), bundled_vocab_size=1024))
    assert again.prefixes == prefixes and json.loads(Path(prefixes[0] + ".manifest.json").read_text()) == manifest


def test_inspect_reports_counts_epochs_and_samples(shards, capsys):
    from data import inspect as data_inspect

    root, _, _ = shards
    prefixes = [str(root / "a"), str(root / "b")]
    summaries = data_inspect.summarise_blend(prefixes, [1.0, 3.0], "90,10,0")
    for summary, prefix in zip(summaries, prefixes):
        manifest = json.loads(Path(prefix + ".manifest.json").read_text())
        assert summary.tokens == manifest["totals"]["tokens"] == sum(summary.split_tokens)
        assert summary.documents == 200 and summary.split_tokens[2] == 0
    assert [s.weight for s in summaries] == [0.25, 0.75]
    train_tokens = 10 * summaries[0].split_tokens[0]
    epochs = data_inspect.epochs_implied(summaries, train_tokens)
    assert epochs[0] == pytest.approx(2.5)
    assert epochs[1] == pytest.approx(7.5 * summaries[0].split_tokens[0] / summaries[1].split_tokens[0])

    data_inspect.main(["--blend", *prefixes, "--weights", "1", "3", "--tokenizer", str(root / "tok"), "--split",
                       "90,10,0", "--seq-length", "16", "--global-batch-size", "4", "--train-steps", "100",
                       "--samples", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["train_tokens_planned"] == 6400 and len(report["samples"]) == 2
    # Samples start mid-word and span documents (the EOD token decodes to nothing): check the characters only.
    assert all(s and set(s) <= set(" ".join(WORDS_A + WORDS_B)) for s in report["samples"])
