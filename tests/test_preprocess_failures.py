"""Preprocessing stops on a tokenizer or writer failure, naming the file and the records; it commits nothing of the
failing unit past its last checkpoint, and a rerun without the fault is byte-identical to an uninterrupted run. One
compressed file keeps every worker busy."""

from __future__ import annotations

import gzip
import json
import re
import textwrap
from pathlib import Path

import pytest

from data import indexed, preprocess
from data.config import BUNDLED_CORPUS, REPO_ROOT
from data.tokenizer import Tokenizer, train_tokenizer

DOCUMENTS = 200
POISON = "POISONED DOCUMENT"


def _write_jsonl(path: Path, docs: list[str]) -> None:
    payload = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    if path.name.endswith(".zst"):
        import zstandard

        payload = zstandard.ZstdCompressor().compress(payload)
    path.write_bytes(payload)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """first.jsonl (10 documents) and second.jsonl.zst (200), their tokenizer and an uninterrupted run's shard."""
    root = tmp_path_factory.mktemp("corpus")
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as stream:
        text = "".join(json.loads(line)["text"] for _, line in zip(range(4), stream))
    docs = [text[i * 300:(i + 1) * 300] for i in range(DOCUMENTS + 10)]
    _write_jsonl(root / "first.jsonl", docs[:10])
    _write_jsonl(root / "second.jsonl.zst", docs[10:])
    inputs = [str(root / "first.jsonl"), str(root / "second.jsonl.zst")]
    train_tokenizer(inputs, root / "tok", 400, num_threads=1)
    clean = preprocess.preprocess(inputs, str(root / "tok"), str(root / "clean" / "s"))
    assert clean["totals"]["documents"] == DOCUMENTS + 10
    return {"root": root, "inputs": inputs, "tokenizer": str(root / "tok"), "docs": docs}


def _same_shard(prefix: Path, reference: Path) -> bool:
    return all(Path(f"{prefix}{suffix}").read_bytes() == Path(f"{reference}{suffix}").read_bytes()
               for suffix in (".bin", ".idx"))


def _unit_files(parts_dir: Path, unit: int) -> list[str]:
    return sorted(p.name for p in parts_dir.iterdir() if p.name.startswith(f"{unit:06d}-"))


def test_tokenizer_failure_stops_the_run_and_a_rerun_is_identical(corpus, tmp_path, monkeypatch):
    """A ValueError from the third encode_batch call (the second chunk of second.jsonl.zst) is no bad record."""
    calls = []
    encode_batch = Tokenizer.encode_batch

    def fail_third_call(self, texts, append_eod=False):
        calls.append(len(texts))
        if len(calls) == 3:
            raise ValueError("injected tokenizer fault")
        return encode_batch(self, texts, append_eod)

    monkeypatch.setattr(Tokenizer, "encode_batch", fail_third_call)
    out = tmp_path / "run" / "s"
    with pytest.raises(RuntimeError, match=r"second\.jsonl\.zst, records 32 to 63 failed: ValueError: injected") as raised:
        preprocess.preprocess(corpus["inputs"], corpus["tokenizer"], str(out), chunk_docs=32)
    assert isinstance(raised.value, preprocess.PreprocessError)
    assert calls == [10, 32, 32]
    parts = out.parent / "s.parts"
    assert len([name for name in _unit_files(parts, 0) if name.endswith(".json")]) == 2  # segment and unit: done
    assert _unit_files(parts, 1) == []  # no segment, no staging file, no unit record of the failed file
    assert not Path(f"{out}.bin").exists() and not Path(f"{out}.manifest.json").exists()

    monkeypatch.undo()
    manifest = preprocess.preprocess(corpus["inputs"], corpus["tokenizer"], str(out), chunk_docs=32)
    assert manifest["run"]["reused_parts"] == 1 and manifest["totals"]["documents"] == DOCUMENTS + 10
    assert _same_shard(out, corpus["root"] / "clean" / "s")


@pytest.mark.parametrize("fault", ["index", "record"])
def test_writer_failure_keeps_the_committed_segments_and_resumes_after_them(corpus, tmp_path, monkeypatch, fault):
    """A full disk while committing the second segment (writing its .idx, or its .json once its .bin/.idx are in
    place): the first segment stays, the second leaves nothing behind."""
    module, name = (indexed, "write_index") if fault == "index" else (preprocess, "_write_json_atomic")
    original = getattr(module, name)
    calls = []

    def disk_full_on_second_call(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, disk_full_on_second_call)
    out = tmp_path / "run" / "s"
    inputs = corpus["inputs"][1:]
    with pytest.raises(RuntimeError, match=r"writing .*second\.jsonl\.zst, records \d+ to \d+ .*No space left") as raised:
        preprocess.preprocess(inputs, corpus["tokenizer"], str(out), chunk_docs=16, segment_tokens=1000)
    assert isinstance(raised.value, preprocess.PreprocessError)
    names = _unit_files(out.parent / "s.parts", 0)
    assert names == sorted(f"{names[0].split('.')[0]}.s00000{suffix}" for suffix in (".bin", ".idx", ".json"))

    monkeypatch.undo()
    resumed = preprocess.preprocess(inputs, corpus["tokenizer"], str(out), chunk_docs=16, segment_tokens=1000)
    assert resumed["run"]["resumed_segments"] == 1
    clean = preprocess.preprocess(inputs, corpus["tokenizer"], str(tmp_path / "clean" / "s"))
    assert resumed["totals"] == clean["totals"]
    assert _same_shard(out, tmp_path / "clean" / "s")


# Loaded by every spawned worker (through PYTHONPATH): logs which process encodes each chunk, holds the first chunk
# until a second worker has one too (so that the test does not depend on how fast workers start), and fails on the
# poisoned document, by an exception or by the worker's death.
WORKER_HOOK = textwrap.dedent("""
    import os, time
    from data.tokenizer import Tokenizer

    log = os.environ["PREPROCESS_TEST_LOG"]
    encode_batch = Tokenizer.encode_batch

    def logged(self, texts, append_eod=False):
        with open(log, "a") as stream:
            stream.write(f"{os.getpid()}\\n")
        if any(os.environ["PREPROCESS_TEST_POISON"] in text for text in texts):
            if os.environ.get("PREPROCESS_TEST_FAULT") == "exit":
                os._exit(3)
            raise ValueError("poisoned document")
        deadline = time.monotonic() + 30
        while len(set(open(log).read().split())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return encode_batch(self, texts, append_eod)

    Tokenizer.encode_batch = logged
""")


@pytest.fixture
def worker_hook(tmp_path, monkeypatch) -> Path:
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(WORKER_HOOK)
    log = tmp_path / "encode_calls.log"
    log.touch()
    monkeypatch.setenv("PYTHONPATH", f"{hook_dir}:{REPO_ROOT}")
    monkeypatch.setenv("PREPROCESS_TEST_LOG", str(log))
    monkeypatch.setenv("PREPROCESS_TEST_POISON", POISON)
    return log


def test_one_compressed_file_is_encoded_by_every_worker(corpus, tmp_path, worker_hook):
    compressed = corpus["inputs"][1:]
    one = preprocess.preprocess(compressed, corpus["tokenizer"], str(tmp_path / "one" / "s"), workers=1)
    assert worker_hook.read_text() == ""  # one worker: encoded in this process
    two = preprocess.preprocess(compressed, corpus["tokenizer"], str(tmp_path / "two" / "s"), workers=2, chunk_docs=16)
    assert two["run"]["parts"] == 1 and two["totals"] == one["totals"]
    assert len(set(worker_hook.read_text().split())) == 2
    assert _same_shard(tmp_path / "two" / "s", tmp_path / "one" / "s")


@pytest.mark.parametrize("fault", ["raise", "exit"])
def test_worker_failure_names_the_file_and_records(corpus, tmp_path, worker_hook, monkeypatch, fault):
    docs = list(corpus["docs"][10:])
    docs[100] = f"{POISON} {docs[100]}"
    _write_jsonl(tmp_path / "poisoned.jsonl.zst", docs)
    monkeypatch.setenv("PREPROCESS_TEST_FAULT", fault)
    # A dead worker fails every chunk in flight: the oldest, which the error names, may come before the poisoned one.
    expected = (r"records (96) to 111 failed: ValueError: poisoned document" if fault == "raise" else
                r"records (\d+) to \d+ failed: a worker process died")
    with pytest.raises(preprocess.PreprocessError, match=rf"poisoned\.jsonl\.zst, {expected}") as raised:
        preprocess.preprocess([str(tmp_path / "poisoned.jsonl.zst")], corpus["tokenizer"], str(tmp_path / "out" / "s"),
                              workers=2, chunk_docs=16)
    assert int(re.search(expected, str(raised.value)).group(1)) <= 96
    assert _unit_files(tmp_path / "out" / "s.parts", 0) == []


def test_bad_arguments_are_refused_before_any_work(corpus, tmp_path, capsys):
    inputs, out = corpus["inputs"], str(tmp_path / "s")
    for option, message in ((dict(workers=0), "workers=0 must be"), (dict(chunk_docs=-1), "chunk_docs=-1 must be"),
                            (dict(segment_tokens=0), "segment_tokens=0 must be"), (dict(text_field=""), "text_field=''"),
                            (dict(txt_mode="lines"), "txt_mode='lines'")):
        with pytest.raises(ValueError, match=message):
            preprocess.preprocess(inputs, "no-such-tokenizer", out, **option)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        preprocess.preprocess([*inputs, str(tmp_path / "missing.jsonl")], "no-such-tokenizer", out)
    with pytest.raises(SystemExit):
        preprocess.main(["--input", *inputs, "--tokenizer", corpus["tokenizer"], "--out", out, "--chunk-docs", "0"])
    assert "chunk_docs=0 must be an integer of at least 1" in capsys.readouterr().err
    assert not (tmp_path / "s.parts").exists()
