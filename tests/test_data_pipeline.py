"""Readers, tokenizer training and preprocessing to megatron-core shards: round trips, bad input, resume."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from data import indexed, preprocess, readers
from data.config import BUNDLED_CORPUS, REPO_ROOT
from data.tokenizer import load_tokenizer, sample_sentences, train_tokenizer


def _bundled_documents(count: int, chars: int) -> list[str]:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as stream:
        return [json.loads(line)["text"][:chars] for _, line in zip(range(count), stream)]


# Edge cases a lossless tokenizer must carry through: unseen characters, tabs, runs of spaces, blank lines, CRLF.
UNUSUAL_DOCUMENTS = [
    "Naïve café — “quoted” ☃ 日本語 🙂",
    "  leading spaces,\ttabs\tand   runs of spaces  ",
    "line one\n\n\nafter blank lines\r\nwindows line end",
    "digits 1234567890 and symbols <>{}[]|\\^~",
]


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return _bundled_documents(24, 1500) + UNUSUAL_DOCUMENTS


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, documents) -> str:
    corpus = tmp_path_factory.mktemp("tok") / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer([str(corpus)], out, 512, num_threads=1)
    return str(out)


def _write_jsonl(path: Path, docs, field="text") -> None:
    payload = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(payload))
    elif path.name.endswith(".zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(payload))
    else:
        path.write_bytes(payload)


def _write_parquet(path: Path, docs, field="text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path, row_group_size=5)


def _shard_documents(prefix: str, tokenizer) -> list[str]:
    """Decode every sequence of a shard with megatron-core's own reader, checking each ends with one EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    decoded = []
    for i in range(len(dataset)):
        tokens = dataset[i]
        assert tokens[-1] == tokenizer.eod and tokenizer.eod not in tokens[:-1].tolist()
        decoded.append(tokenizer.decode(tokens[:-1].tolist()))
    return decoded


def test_tokenizer_is_lossless_and_megatron_compatible(tokenizer_dir, documents):
    tokenizer = load_tokenizer(tokenizer_dir)
    assert tokenizer.vocab_size == 512 and tokenizer.eod == 2 and tokenizer.pad == 3
    for doc in documents:
        assert tokenizer.decode(tokenizer.encode(doc)) == doc
    assert tokenizer.encode_batch(documents[:3]) == [tokenizer.encode(d) for d in documents[:3]]
    # The newline is a piece of its own, never merged away or mapped to unk.
    assert tokenizer.encode("\n") == [4]
    assert tokenizer.unique_identifiers["model_sha256"] == tokenizer.model_sha256


def test_unigram_with_special_tokens_and_sentence_bound(tmp_path, documents):
    corpus = tmp_path / "train.txt"
    corpus.write_text("\n".join(documents))
    tokenizer = train_tokenizer([str(corpus)], tmp_path / "uni", 600, model_type="unigram",
                                special_tokens=["<|user|>", "<|code|>"], max_sentences=200, num_threads=1)
    config = json.loads((tmp_path / "uni" / "tokenizer_config.json").read_text())
    assert config["model_type"] == "unigram" and config["trained_on"]["sentences_sampled"] == 200
    assert config["trained_on"]["sentences_seen"] > 200
    ids = tokenizer.encode("hello <|user|> world")
    assert len([i for i in ids if tokenizer.decode([i]) == "<|user|>"]) == 1
    unseen = "Ωμέγα ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    assert tokenizer.decode(tokenizer.encode(unseen)) == unseen  # byte fallback, no <unk>
    assert 0 not in tokenizer.encode(unseen)


def test_sentence_sample_is_bounded_uniform_and_in_order():
    docs = ["\n".join(f"line {d}-{i}" for i in range(100)) for d in range(50)]
    sample, seen = sample_sentences(docs, 500, seed=7)
    assert seen == 5000 and len(sample) == 500 and sample == sample_sentences(docs, 500, seed=7)[0]
    order = [int(s.split()[1].split("-")[0]) * 100 + int(s.split("-")[1]) for s in sample]
    assert order == sorted(order)
    # Each tenth of the corpus holds about a tenth of the sample (binomial sd ~ 6.7).
    counts = np.bincount(np.array(order) // 500, minlength=10)
    assert counts.min() > 20 and counts.max() < 80


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet", "txt-files",
                                  "docs.txt", "docs.txt.gz"])
def test_round_trip_every_format(tmp_path, tokenizer_dir, documents, name):
    """The detokenized shard equals the input documents, in order, for each reader."""
    tokenizer = load_tokenizer(tokenizer_dir)
    txt_mode = "file"
    expected = documents
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        _write_jsonl(tmp_path / name, documents)
        inputs = [str(tmp_path / name)]
    elif name.endswith(".parquet"):
        _write_parquet(tmp_path / name, documents)
        inputs = [str(tmp_path / name)]
    elif name == "txt-files":  # a directory of .txt files, one document each, read in sorted name order
        folder = tmp_path / "texts"
        folder.mkdir()
        for i, doc in enumerate(documents):
            (folder / f"{i:03d}.txt").write_text(doc, encoding="utf-8", newline="")
        inputs = [str(folder)]
    else:  # one file, documents separated by blank lines: the normalised document has no blank lines inside
        txt_mode = "blank_line"
        expected = [d.replace("\r\n", "\n").replace("\n\n\n", "\n").replace("\n\n", "\n").strip("\n")
                    for d in documents]
        payload = "\n\n".join(expected).encode()
        (tmp_path / name).write_bytes(gzip.compress(payload) if name.endswith(".gz") else payload)
        inputs = [str(tmp_path / name)]
    files = readers.expand_inputs(inputs)
    manifest = preprocess.preprocess(files, tokenizer_dir, str(tmp_path / "out" / "shard"), txt_mode=txt_mode)
    assert _shard_documents(str(tmp_path / "out" / "shard"), tokenizer) == expected
    assert manifest["totals"]["documents"] == len(expected)
    assert manifest["totals"]["tokens"] == sum(len(tokenizer.encode(d)) + 1 for d in expected)
    assert manifest["inputs"][0]["sha256"] == indexed_sha(files[0])


def indexed_sha(path: str) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_index_bytes_equal_megatron_builder(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 5000, size=n).astype(np.uint16) for n in (5, 1, 17, 3)]
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for seq in sequences:
        builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref.idx"))
    lengths = np.array([len(s) for s in sequences])
    indexed.write_index(str(tmp_path / "ours.idx"), np.uint16, lengths, np.arange(len(sequences) + 1))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()


def test_bad_records_are_counted_not_fatal(tmp_path, tokenizer_dir):
    good = ["first good document", "second good one", "third"]
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',                          # malformed JSON
        json.dumps({"content": "wrong field"}).encode(),   # missing text field
        json.dumps({"text": 17}).encode(),                 # text is not a string
        b'{"text": "caf\xe9 latin-1 byte"}',               # not UTF-8
        b'{"text": "lone surrogate \\ud800"}',             # decodes to text that is not encodable
        json.dumps({"text": "   \n "}).encode(),          # empty after whitespace
        json.dumps({"text": good[1]}).encode(),
        b"",                                               # blank line: not a record
        json.dumps([1, 2]).encode(),                       # not an object
        json.dumps({"text": good[2]}).encode(),
    ]
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "empty.txt").write_bytes(b"  \n")
    files = readers.expand_inputs([str(tmp_path)])
    manifest = preprocess.preprocess(files, tokenizer_dir, str(tmp_path / "out" / "shard"))
    assert manifest["totals"]["skipped"] == {"empty": 2, "malformed_json": 1, "missing_text_field": 3, "non_utf8": 3}
    assert manifest["totals"]["documents"] == 3 and manifest["totals"]["records"] == 12
    by_name = {Path(entry["path"]).name: entry for entry in manifest["inputs"]}
    assert by_name["bad.txt"]["skipped"] == {"non_utf8": 1}
    assert _shard_documents(str(tmp_path / "out" / "shard"), load_tokenizer(tokenizer_dir)) == good
    assert "malformed_json 1" in preprocess.summary(manifest)


def test_a_corpus_without_documents_is_refused_and_writes_no_shard(tmp_path, tokenizer_dir):
    (tmp_path / "other_field.jsonl").write_text(json.dumps({"content": "text under another name"}) + "\n" * 2)
    files = [str(tmp_path / "other_field.jsonl")]
    with pytest.raises(readers.EmptyCorpus, match=r"every record was skipped \(missing_text_field 1\); is the "
                                                  r"text in another field than 'text'\? give --text-field"):
        preprocess.preprocess(files, tokenizer_dir, str(tmp_path / "out" / "shard"))
    assert sorted(os.listdir(tmp_path / "out")) == ["shard.lock"], "no shard, no parts"
    with pytest.raises(readers.EmptyCorpus, match="no documents found in .*other_field.jsonl"):
        train_tokenizer(files, tmp_path / "tok", 400, num_threads=1)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_vocabulary_the_corpus_cannot_support_names_the_largest_it_can(tmp_path, model_type):
    corpus = tmp_path / "small.jsonl"
    _write_jsonl(corpus, [f"line {i} of a small corpus, with words and numbers {i * 7}." for i in range(100)])
    with pytest.raises(ValueError, match=rf"vocabulary size 4096 is more than this corpus supports for a "
                                         rf"{model_type} tokenizer \(at most (\d+) pieces\)") as refused:
        train_tokenizer([str(corpus)], tmp_path / "tok", 4096, model_type=model_type, num_threads=1)
    largest = int(refused.value.args[0].split("at most ")[1].split()[0])
    assert train_tokenizer([str(corpus)], tmp_path / "tok", largest, model_type=model_type, num_threads=1)
    (tmp_path / "chars.jsonl").write_text(json.dumps({"text": "".join(map(chr, range(0x4E00, 0x4F00)))}) + "\n")
    with pytest.raises(ValueError, match=r"vocabulary size 100 is too small for the characters of this corpus "
                                         r"\(they need 261 ids"):
        train_tokenizer([str(tmp_path / "chars.jsonl")], tmp_path / "tok2", 100, byte_fallback=False,
                        model_type=model_type, num_threads=1)


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_truncated_compressed_file_keeps_what_was_read(tmp_path, tokenizer_dir, documents, suffix):
    _write_jsonl(tmp_path / f"whole.jsonl{suffix}", documents * 20)
    data = (tmp_path / f"whole.jsonl{suffix}").read_bytes()
    (tmp_path / f"cut.jsonl{suffix}").write_bytes(data[:-64])  # the download stopped 64 bytes short
    manifest = preprocess.preprocess([str(tmp_path / f"cut.jsonl{suffix}")], tokenizer_dir, str(tmp_path / "out" / "s"))
    entry = manifest["inputs"][0]
    assert entry["skipped"].get("unreadable_rest_of_file") == 1
    assert entry["errors"][0].startswith("EOFError")
    decoded = _shard_documents(str(tmp_path / "out" / "s"), load_tokenizer(tokenizer_dir))
    assert 0 < len(decoded) < len(documents) * 20 and decoded == (documents * 20)[: len(decoded)]


def test_corrupt_zstd_names_the_file(tmp_path):
    import zstandard

    lines = b"".join(f'{{"text": "doc {i}"}}\n'.encode() for i in range(500))
    data = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(lines))
    data[len(data) // 2:len(data) // 2 + 16] = b"\xff" * 16  # damaged in the middle, not cut short
    (tmp_path / "bad.jsonl.zst").write_bytes(bytes(data))
    with pytest.raises(OSError, match=r"bad.jsonl.zst holds corrupt zstd data"):
        list(readers.iter_records(tmp_path / "bad.jsonl.zst"))


def test_multi_frame_zstd_is_read_whole(tmp_path):
    import zstandard

    frames = [zstandard.ZstdCompressor().compress(f'{{"text": "frame {i}"}}\n'.encode()) for i in range(3)]
    (tmp_path / "multi.jsonl.zst").write_bytes(b"".join(frames))
    assert list(readers.iter_records(tmp_path / "multi.jsonl.zst")) == ["frame 0", "frame 1", "frame 2"]


def test_large_jsonl_is_split_into_units_at_line_starts(tmp_path, tokenizer_dir, documents):
    """Byte-range units never cut or repeat a line, whatever the cut points."""
    _write_jsonl(tmp_path / "big.jsonl", documents * 3)
    tokenizer = load_tokenizer(tokenizer_dir)
    reference = preprocess.preprocess([str(tmp_path / "big.jsonl")], tokenizer_dir, str(tmp_path / "a" / "s"))
    assert reference["run"]["parts"] == 1
    for unit_bytes in (997, 4096):
        manifest = preprocess.preprocess([str(tmp_path / "big.jsonl")], tokenizer_dir, str(tmp_path / f"u{unit_bytes}" / "s"),
                                         unit_bytes=unit_bytes)
        assert manifest["run"]["parts"] > 3
        assert (tmp_path / f"u{unit_bytes}" / "s.bin").read_bytes() == (tmp_path / "a" / "s.bin").read_bytes()
        assert (tmp_path / f"u{unit_bytes}" / "s.idx").read_bytes() == (tmp_path / "a" / "s.idx").read_bytes()
    assert _shard_documents(str(tmp_path / "a" / "s"), tokenizer) == documents * 3


KILL_AFTER_COMMITS = textwrap.dedent("""
    import os, re, signal, sys
    sys.path.insert(0, {root!r})
    from data import preprocess
    original, finished = preprocess._write_json_atomic, []
    def write_then_die(path, payload):
        original(path, payload)
        if re.search({pattern!r}, os.path.basename(path)):
            finished.append(path)
        if len(finished) == {commits}:
            os.kill(os.getpid(), signal.SIGKILL)  # an abrupt death right after a commit
    preprocess._write_json_atomic = write_then_die
    preprocess.main(sys.argv[1:])
""")
UNIT_DONE = r"^[0-9]{6}-[0-9a-f]{16}\.json$"  # a whole work unit committed
SEGMENT_DONE = r"\.s[0-9]{5}\.json$"  # one checkpointed segment of a unit committed


def test_resume_after_kill_is_byte_identical(tmp_path, tokenizer_dir, documents):
    inputs = []
    for i in range(4):
        _write_jsonl(tmp_path / f"in{i}.jsonl", documents[i * 7:(i + 1) * 7] * 2)
        inputs.append(str(tmp_path / f"in{i}.jsonl"))
    args = ["--input", *inputs, "--tokenizer", tokenizer_dir, "--unit-mb", "1"]
    preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "clean" / "s"))

    script = tmp_path / "killed.py"
    script.write_text(KILL_AFTER_COMMITS.format(root=str(REPO_ROOT), pattern=UNIT_DONE, commits=2))
    killed = subprocess.run([sys.executable, str(script), *args, "--out", str(tmp_path / "resumed" / "s")],
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "resumed" / "s.bin").exists()
    assert len([p for p in (tmp_path / "resumed" / "s.parts").glob("*.json") if ".s0" not in p.name]) == 2

    manifest = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "resumed" / "s"))
    assert manifest["run"]["reused_parts"] == 2 and manifest["run"]["parts"] == 4
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "resumed" / f"s{suffix}").read_bytes() == (tmp_path / "clean" / f"s{suffix}").read_bytes()
    assert not (tmp_path / "resumed" / "s.parts").exists()

    # Unchanged inputs: a no-op that leaves the files untouched; a touched input is redone.
    before = os.stat(tmp_path / "resumed" / "s.bin").st_mtime_ns
    again = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "resumed" / "s"))
    assert again == manifest and os.stat(tmp_path / "resumed" / "s.bin").st_mtime_ns == before
    with open(inputs[0], "a") as stream:
        stream.write(json.dumps({"text": "one more"}) + "\n")
    redone = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "resumed" / "s"))
    assert redone["totals"]["documents"] == manifest["totals"]["documents"] + 1


def test_resume_inside_a_compressed_file(tmp_path, tokenizer_dir, documents):
    """A compressed file is one unit; killed midway, its checkpointed segments are kept and not tokenized again."""
    _write_jsonl(tmp_path / "big.jsonl.gz", documents * 6)
    clean = preprocess.preprocess([str(tmp_path / "big.jsonl.gz")], tokenizer_dir, str(tmp_path / "clean" / "s"),
                                  chunk_docs=8, segment_tokens=2000)
    assert clean["run"]["parts"] == 1
    script = tmp_path / "killed.py"
    script.write_text(KILL_AFTER_COMMITS.format(root=str(REPO_ROOT),
                                                pattern=SEGMENT_DONE, commits=3))
    killed = subprocess.run([sys.executable, str(script), "--input", str(tmp_path / "big.jsonl.gz"), "--tokenizer",
                             tokenizer_dir, "--out", str(tmp_path / "resumed" / "s"), "--chunk-docs", "8",
                             "--segment-mtok", "0.002"], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    resumed = preprocess.preprocess([str(tmp_path / "big.jsonl.gz")], tokenizer_dir, str(tmp_path / "resumed" / "s"),
                                    chunk_docs=8, segment_tokens=2000)
    assert resumed["run"]["resumed_segments"] == 3
    assert resumed["totals"] == clean["totals"]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "resumed" / f"s{suffix}").read_bytes() == (tmp_path / "clean" / f"s{suffix}").read_bytes()


def test_parallel_workers_write_the_same_shard(tmp_path, tokenizer_dir, documents):
    inputs = []
    for i in range(3):
        _write_jsonl(tmp_path / f"in{i}.jsonl", documents[i::3])
        inputs.append(str(tmp_path / f"in{i}.jsonl"))
    _write_parquet(tmp_path / "in3.parquet", documents)
    inputs.append(str(tmp_path / "in3.parquet"))
    serial = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "one" / "s"), workers=1)
    parallel = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "two" / "s"), workers=2)
    assert parallel["totals"] == serial["totals"]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "one" / f"s{suffix}").read_bytes() == (tmp_path / "two" / f"s{suffix}").read_bytes()


def test_presets_and_input_expansion(tmp_path, tokenizer_dir):
    (tmp_path / "b").mkdir()
    _write_jsonl(tmp_path / "b" / "2.jsonl", ["two"], field="raw_content")
    _write_jsonl(tmp_path / "a.jsonl", ["one"], field="raw_content")
    (tmp_path / "notes.md").write_text("ignored: not a corpus format")
    files = readers.expand_inputs([str(tmp_path)])
    assert [Path(f).relative_to(tmp_path).as_posix() for f in files] == ["a.jsonl", "b/2.jsonl"]
    preset = readers.PRESETS["redpajama-v2"]
    assert preset.text_field == "raw_content"
    assert list(readers.iter_documents(files, preset.text_field)) == ["one", "two"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        readers.expand_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(ValueError, match="unsupported input file"):
        readers.expand_inputs([str(tmp_path / "notes.md")])


def test_existing_sentencepiece_model_is_accepted(tmp_path, tokenizer_dir, documents):
    from data.tokenizer import MODEL_FILE, import_sentencepiece

    model = Path(tokenizer_dir) / MODEL_FILE
    bare = load_tokenizer(model)
    imported = import_sentencepiece(model, tmp_path / "imported")
    for tokenizer in (bare, imported):
        assert tokenizer.vocab_size == 512 and tokenizer.eod == 2
        assert tokenizer.model_sha256 == load_tokenizer(tokenizer_dir).model_sha256
        assert tokenizer.encode(documents[0]) == load_tokenizer(tokenizer_dir).encode(documents[0])
    with pytest.raises(FileNotFoundError, match="holds neither tokenizer.model nor tokenizer.json"):
        load_tokenizer(tmp_path)


def test_sentence_sample_skips_overlong_lines():
    sample, seen = sample_sentences(["short line\n" + "x" * 5000 + "\nanother"], 10, seed=0, max_sentence_bytes=100)
    assert sample == ["short line", "another"] and seen == 2


def test_hugging_face_tokenizer_json(tmp_path):
    hf = pytest.importorskip("tokenizers")
    texts = ["hello world, this is a test of the tokenizer", "another line of text"] * 50
    model = hf.Tokenizer(hf.models.BPE())
    model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = hf.decoders.ByteLevel()
    model.train_from_iterator(texts, hf.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"], initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
    model.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.library == "huggingface" and tokenizer.eod == 0 and tokenizer.pad == 1
    assert tokenizer.decode(tokenizer.encode("hello world ☃")) == "hello world ☃"
    assert tokenizer.encode_batch(["hi there"], append_eod=True) == [tokenizer.encode("hi there") + [0]]


def test_tiktoken_rank_file(tmp_path):
    pytest.importorskip("tiktoken")
    import base64

    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"he": 256, b"ll": 257})
    (tmp_path / "mini.tiktoken").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    tokenizer = load_tokenizer(tmp_path / "mini.tiktoken")
    assert tokenizer.vocab_size == 259 and tokenizer.eod == 258
    assert tokenizer.encode("hello") == [256, 257, ord("o")]
    assert tokenizer.decode(tokenizer.encode("hello ☃")) == "hello ☃"
    assert tokenizer.encode_batch(["hello"], append_eod=True) == [[256, 257, ord("o"), 258]]


def test_partitions_concatenate_to_the_unpartitioned_shard(tmp_path, tokenizer_dir, documents, capsys):
    """--partition I/N for I = 1..3: each shard a contiguous run of the work units; in order, their tokens are the
    one unpartitioned run's; the blend entry PREFIX-*-of-3 names the three."""
    from data.datasets import prepare
    from data.config import DataConfig

    inputs = []
    for i, docs in enumerate((documents[:10] * 2, documents[10:14], documents[14:] * 3)):
        _write_jsonl(tmp_path / f"in{i}.jsonl{'.gz' if i == 1 else ''}", docs)
        inputs.append(str(tmp_path / f"in{i}.jsonl{'.gz' if i == 1 else ''}"))
    unit_bytes = 8192  # several byte-range units per plain file, the compressed file one unit
    whole = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "one" / "s"), unit_bytes=unit_bytes)
    assert whole["run"]["parts"] >= 6
    parts = [preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "three" / "s"), unit_bytes=unit_bytes,
                                   partition=preprocess.Partition(i, 3)) for i in (1, 2, 3)]
    prefixes = [str(tmp_path / "three" / f"s-{i}-of-3") for i in (1, 2, 3)]
    assert [m["prefix"] for m in parts] == prefixes
    assert [m["partition"]["units"] for m in parts][0][0] == 0
    assert [m["partition"]["units"][1] for m in parts][-1] == whole["run"]["parts"]
    assert all(a["partition"]["units"][1] == b["partition"]["units"][0] for a, b in zip(parts, parts[1:]))
    assert all(m["totals"]["documents"] > 0 for m in parts)
    concatenated = b"".join((tmp_path / "three" / f"s-{i}-of-3.bin").read_bytes() for i in (1, 2, 3))
    assert concatenated == (tmp_path / "one" / "s.bin").read_bytes()
    lengths = np.concatenate([indexed.read_index(p + ".idx").sequence_lengths for p in prefixes])
    assert lengths.tolist() == indexed.read_index(str(tmp_path / "one" / "s.idx")).sequence_lengths.tolist()
    assert sum(m["totals"]["tokens"] for m in parts) == whole["totals"]["tokens"]

    # A partition rerun on unchanged inputs is a no-op.
    before = os.stat(prefixes[1] + ".bin").st_mtime_ns
    again = preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "three" / "s"), unit_bytes=unit_bytes,
                                  partition=preprocess.Partition(2, 3))
    assert again == parts[1] and os.stat(prefixes[1] + ".bin").st_mtime_ns == before

    # The blend entry: the three shards in order, the entry's weight shared by their tokens.
    entry = str(tmp_path / "three" / "s-*-of-3")
    assert preprocess.expand_blend([entry, "other"], None) == (prefixes + ["other"], None)
    expanded, weights = preprocess.expand_blend([entry, "other"], [0.6, 0.4])
    tokens = [m["totals"]["tokens"] for m in parts]
    assert weights == pytest.approx([0.6 * t / sum(tokens) for t in tokens] + [0.4])
    prepared = prepare(DataConfig(source="shards", tokenizer_dir=tokenizer_dir, blend=[entry]))
    assert prepared.prefixes == prefixes

    # Refusals: a missing partition, more partitions than work units, a malformed --partition.
    os.remove(prefixes[2] + ".idx")
    with pytest.raises(ValueError, match=r"partition 3 \(.*s-3-of-3.idx\) does not exist.*--partition 3/3"):
        prepare(DataConfig(source="shards", tokenizer_dir=tokenizer_dir, blend=[entry]))
    with pytest.raises(ValueError, match="give at most"):
        preprocess.preprocess(inputs, tokenizer_dir, str(tmp_path / "many" / "s"), partition=preprocess.Partition(1, 4))
    for bad in ("4/3", "0/3", "two/3"):
        with pytest.raises(SystemExit) as exit_info:
            preprocess.main(["--input", *inputs, "--tokenizer", tokenizer_dir, "--out", str(tmp_path / "bad" / "s"),
                             "--partition", bad])
        assert exit_info.value.code == 2
        assert "--partition" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "many").exists()
