"""Preprocessing throughput: the full pipeline (read, tokenize, write .bin/.idx, merge, manifest) against
sentencepiece's own batch encode of the same documents, with the same number of processes, in one run, for the two
shapes corpora ship in.

    .venv/bin/python benchmarks/preprocess.py --workers 1 2 --shapes large small --copies 2 --small-files 32 --repeats 3

The corpus is the bundled one, cut into web-page-sized documents (~`--doc-chars` characters at paragraph breaks) and
repeated `--copies` times. Shapes:

- `large`: one `.jsonl.zst` file holding every document (a Wikipedia or Pile shard: a single compressed stream);
- `small`: `--small-files` uncompressed `.jsonl` files (a directory of many shards).

Both sides start their own process pool inside the timed region. Reported: median and best tokens/s over `--repeats`
runs, alternating the two so that load from other processes on the machine hits both alike; ratio = pipeline /
sentencepiece (target >= 0.8). The load average is printed too: on a shared machine the best run is the closer
estimate of uncontended speed. CPU ratio = sentencepiece CPU seconds / pipeline CPU seconds (all processes, medians):
the work each side does, which load from other processes changes less than it changes wall time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.config import BUNDLED_CORPUS  # noqa: E402
from data.preprocess import preprocess  # noqa: E402
from data.tokenizer import MODEL_FILE, train_tokenizer  # noqa: E402

_processor = None


def _init_sentencepiece(model_path: str) -> None:
    global _processor
    import sentencepiece

    _processor = sentencepiece.SentencePieceProcessor(model_file=model_path)


def _encode_count(texts: list[str]) -> int:
    # +1 a document: the pipeline writes an end-of-document token after each.
    return sum(len(ids) + 1 for ids in _processor.encode(texts, num_threads=1))


def web_sized_documents(doc_chars: int) -> list[str]:
    documents = []
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as stream:
        for line in stream:
            current = ""
            for paragraph in json.loads(line)["text"].split("\n\n"):
                current = f"{current}\n\n{paragraph}" if current else paragraph
                if len(current) >= doc_chars:
                    documents.append(current)
                    current = ""
            if current:
                documents.append(current)
    return documents


def _jsonl(documents: list[str]) -> bytes:
    return "".join(json.dumps({"text": doc, "url": "bundled"}) + "\n" for doc in documents).encode()


def write_shape(shape: str, documents: list[str], directory: str, small_files: int) -> tuple[list[str], list[str]]:
    """The input files of one shape and its documents in the order the pipeline reads them."""
    os.makedirs(directory)
    if shape == "large":
        import zstandard

        path = os.path.join(directory, "wiki.jsonl.zst")
        with open(path, "wb") as out:
            out.write(zstandard.ZstdCompressor(level=3).compress(_jsonl(documents)))
        return [path], documents
    files, ordered = [], []
    for f in range(small_files):
        path = os.path.join(directory, f"part{f:03d}.jsonl")
        with open(path, "wb") as out:
            out.write(_jsonl(documents[f::small_files]))
        files.append(path)
        ordered.extend(documents[f::small_files])
    return files, ordered


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (pool workers are joined when their pool closes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(run, *args) -> tuple[int, float, float]:
    """Tokens, wall seconds and CPU seconds of one run."""
    cpu = _cpu_seconds()
    tokens, seconds = run(*args)
    return tokens, seconds, _cpu_seconds() - cpu


def raw_sentencepiece(model_path: str, documents: list[str], workers: int, chunk_docs: int) -> tuple[int, float]:
    started = time.perf_counter()
    # Chunks small enough to balance the processes, as large as the pipeline's otherwise.
    size = max(1, min(chunk_docs, len(documents) // (8 * workers)))
    chunks = [documents[i:i + size] for i in range(0, len(documents), size)]
    if workers == 1:
        _init_sentencepiece(model_path)
        tokens = sum(_encode_count(chunk) for chunk in chunks)
    else:
        with multiprocessing.get_context("spawn").Pool(workers, _init_sentencepiece, (model_path,)) as pool:
            tokens = sum(pool.imap_unordered(_encode_count, chunks))
    return tokens, time.perf_counter() - started


def pipeline(files: list[str], tokenizer_dir: str, out_dir: str, workers: int, chunk_docs: int) -> tuple[int, float]:
    started = time.perf_counter()
    manifest = preprocess(files, tokenizer_dir, os.path.join(out_dir, f"shard-w{workers}-{time.time_ns()}"),
                          workers=workers, chunk_docs=chunk_docs)
    return manifest["totals"]["tokens"], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=("large", "small"), default=["large", "small"])
    parser.add_argument("--small-files", type=int, default=32, help="files of the `small` shape")
    parser.add_argument("--copies", type=int, default=2, help="times the corpus is repeated")
    parser.add_argument("--doc-chars", type=int, default=3000)
    parser.add_argument("--chunk-docs", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = os.path.join(scratch, "tokenizer")
        train_tokenizer([str(BUNDLED_CORPUS)], tokenizer_dir, args.vocab_size)
        documents = web_sized_documents(args.doc_chars) * args.copies
        print(f"# preprocessing throughput: {len(documents)} documents, {len(_jsonl(documents)) / 1e6:.1f} MB of "
              f"JSON Lines, vocab {args.vocab_size}")
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
              f"python {platform.python_version()}")
        print(f"# load average before: {os.getloadavg()[0]:.1f}\n")
        print("| input | processes | sentencepiece tok/s (median / best) | pipeline tok/s (median / best) "
              "| ratio (median / best) | CPU ratio |")
        print("|---|---:|---:|---:|---:|---:|")
        for shape in args.shapes:
            files, ordered = write_shape(shape, documents, os.path.join(scratch, shape), args.small_files)
            megabytes = sum(os.path.getsize(p) for p in files) / 1e6
            label = "1 .jsonl.zst" if shape == "large" else f"{len(files)} .jsonl"
            label = f"{label} ({megabytes:.1f} MB)"
            for workers in args.workers:
                raw_rates, pipe_rates, raw_cpu, pipe_cpu = [], [], [], []
                for _ in range(args.repeats):
                    raw_tokens, raw_seconds, raw_cpu_seconds = timed(
                        raw_sentencepiece, os.path.join(tokenizer_dir, MODEL_FILE), ordered, workers, args.chunk_docs)
                    pipe_tokens, pipe_seconds, pipe_cpu_seconds = timed(
                        pipeline, files, tokenizer_dir, scratch, workers, args.chunk_docs)
                    if raw_tokens != pipe_tokens:
                        raise RuntimeError(f"token counts differ: sentencepiece {raw_tokens}, pipeline {pipe_tokens}")
                    raw_rates.append(raw_tokens / raw_seconds)
                    pipe_rates.append(pipe_tokens / pipe_seconds)
                    raw_cpu.append(raw_cpu_seconds)
                    pipe_cpu.append(pipe_cpu_seconds)
                raw, pipe = statistics.median(raw_rates), statistics.median(pipe_rates)
                raw_best, pipe_best = max(raw_rates), max(pipe_rates)
                cpu_ratio = statistics.median(raw_cpu) / statistics.median(pipe_cpu)
                print(f"| {label} | {workers} | {raw / 1e6:.2f} M / {raw_best / 1e6:.2f} M "
                      f"| {pipe / 1e6:.2f} M / {pipe_best / 1e6:.2f} M | {pipe / raw:.2f} / {pipe_best / raw_best:.2f} "
                      f"| {cpu_ratio:.2f} |", flush=True)
        print(f"\n# load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
