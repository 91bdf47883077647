"""Preprocessing throughput: the full pipeline (read JSON Lines, tokenize, write .bin/.idx, merge, manifest) against
sentencepiece's own batch encode of the same documents, with the same number of processes, in one run.

    .venv/bin/python benchmarks/preprocess.py --workers 1 2 --files 4 --copies 2 --repeats 3

The corpus is the bundled one, cut into web-page-sized documents (~`--doc-chars` characters at paragraph breaks) and
repeated `--copies` times over `--files` uncompressed .jsonl files. Both sides start their own process pool inside
the timed region. Reported: median and best tokens/s over `--repeats` runs, alternating the two so that load from
other processes on the machine hits both alike; ratio = pipeline / sentencepiece (target >= 0.8). The load average
is printed too: on a shared machine the best run is the closer estimate of uncontended speed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
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
    parser.add_argument("--files", type=int, default=4)
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
        files = []
        for f in range(args.files):
            path = os.path.join(scratch, f"part{f:03d}.jsonl")
            with open(path, "w", encoding="utf-8") as stream:
                for doc in documents[f::args.files]:
                    stream.write(json.dumps({"text": doc, "url": "bundled"}) + "\n")
            files.append(path)
        ordered = [doc for f in range(args.files) for doc in documents[f::args.files]]
        megabytes = sum(os.path.getsize(p) for p in files) / 1e6
        print(f"# preprocessing throughput: {len(documents)} documents, {megabytes:.1f} MB JSON Lines in "
              f"{args.files} files, vocab {args.vocab_size}")
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
              f"python {platform.python_version()}\n")
        print(f"# load average before: {os.getloadavg()[0]:.1f}\n")
        print("| processes | sentencepiece tok/s (median / best) | pipeline tok/s (median / best) | ratio (median / best) |")
        print("|---:|---:|---:|---:|")
        for workers in args.workers:
            raw_rates, pipe_rates = [], []
            for _ in range(args.repeats):
                raw_tokens, raw_seconds = raw_sentencepiece(os.path.join(tokenizer_dir, MODEL_FILE), ordered,
                                                            workers, args.chunk_docs)
                pipe_tokens, pipe_seconds = pipeline(files, tokenizer_dir, scratch, workers, args.chunk_docs)
                if raw_tokens != pipe_tokens:
                    raise RuntimeError(f"token counts differ: sentencepiece {raw_tokens}, pipeline {pipe_tokens}")
                raw_rates.append(raw_tokens / raw_seconds)
                pipe_rates.append(pipe_tokens / pipe_seconds)
            raw, pipe = statistics.median(raw_rates), statistics.median(pipe_rates)
            raw_best, pipe_best = max(raw_rates), max(pipe_rates)
            print(f"| {workers} | {raw / 1e6:.2f} M / {raw_best / 1e6:.2f} M | {pipe / 1e6:.2f} M / {pipe_best / 1e6:.2f} M "
                  f"| {pipe / raw:.2f} / {pipe_best / raw_best:.2f} |", flush=True)
        print(f"\n# load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
