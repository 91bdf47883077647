"""Tokenize corpus files into one megatron-core IndexedDataset shard (`PREFIX.bin`, `PREFIX.idx`).

    python -m data.preprocess --input FILES --tokenizer DIR --out PREFIX [--workers N] [--text-field text]
        [--preset NAME] [--txt-mode file|blank_line] [--unit-mb 256] [--chunk-docs 1024]

Each document becomes one sequence followed by the end-of-document token. The inputs are cut into work units (a
file; a byte range of a large uncompressed JSON Lines file; a run of row groups of a parquet file) that N worker
processes tokenize in parallel, streaming, each into checkpointed segment shards under `PREFIX.parts/` that appear
atomically when done. The segments are then concatenated in input order. An interrupted run, rerun, reuses the
finished units and segments, so the result is byte-identical to an uninterrupted run; `PREFIX.manifest.json` records inputs (sizes, sha256), the tokenizer
hash, the options, document and token counts and the records skipped per reason. Rerunning on unchanged inputs (same
sizes and modification times, same tokenizer and options) is a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from data import indexed, readers
from data.locking import file_lock
from data.tokenizer import Tokenizer, file_sha256, load_tokenizer

MANIFEST_VERSION = 1
MIB = 1 << 20


@dataclass(frozen=True)
class WorkUnit:
    """A slice of one input file: the whole file, bytes [start, end) of a JSON Lines file (a line belongs to the
    range holding its first byte) or row groups [start, end) of a parquet file."""

    index: int
    path: str
    kind: str  # "file" | "bytes" | "row_groups"
    start: int
    end: int
    input_bytes: int
    input_mtime_ns: int

    def part_name(self, fingerprint: str) -> str:
        key = json.dumps([asdict(self), fingerprint], sort_keys=True)
        return f"{self.index:06d}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"

    @property
    def work_bytes(self) -> int:
        return self.end - self.start if self.kind == "bytes" else self.input_bytes


@dataclass(frozen=True)
class Options:
    """Everything besides the inputs that changes the output; a part or a manifest made with other options is stale."""

    tokenizer_sha256: str
    text_field: str
    txt_mode: str
    dtype: str

    def fingerprint(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def plan_units(files: Sequence[str], unit_bytes: int) -> list[WorkUnit]:
    """Cut the inputs into work units of at most about `unit_bytes` where the format allows a cut."""
    units: list[WorkUnit] = []
    for path in files:
        stat = os.stat(path)
        kind = readers.file_format(path)
        compressed = path.endswith(readers.COMPRESSION_SUFFIXES)
        if kind == "jsonl" and not compressed and stat.st_size > unit_bytes:
            for start in range(0, stat.st_size, unit_bytes):
                units.append(WorkUnit(len(units), path, "bytes", start, min(start + unit_bytes, stat.st_size),
                                      stat.st_size, stat.st_mtime_ns))
        elif kind == "parquet" and stat.st_size > unit_bytes:
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(path).metadata
            group_start, group_bytes = 0, 0
            for group in range(metadata.num_row_groups):
                group_bytes += metadata.row_group(group).total_byte_size
                if group_bytes >= unit_bytes or group == metadata.num_row_groups - 1:
                    units.append(WorkUnit(len(units), path, "row_groups", group_start, group + 1, stat.st_size,
                                          stat.st_mtime_ns))
                    group_start, group_bytes = group + 1, 0
        else:
            units.append(WorkUnit(len(units), path, "file", 0, -1, stat.st_size, stat.st_mtime_ns))
    return units


def _iter_unit_records(unit: WorkUnit, text_field: str, txt_mode: str) -> Iterator[readers.Record]:
    if unit.kind == "file":
        yield from readers.iter_records(unit.path, text_field, txt_mode)
    elif unit.kind == "row_groups":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(unit.path)
        if text_field not in parquet.schema_arrow.names:
            for group in range(unit.start, unit.end):
                for _ in range(parquet.metadata.row_group(group).num_rows):
                    yield readers.Skipped("missing_text_field")
            return
        for group in range(unit.start, unit.end):
            for value in parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist():
                yield readers.parquet_value(value)
    else:
        yield from readers.iter_jsonl_lines(_read_line_range(unit.path, unit.start, unit.end), text_field)


def _read_line_range(path: str, start: int, end: int) -> Iterator[bytes]:
    """The lines whose first byte lies in [start, end)."""
    with open(path, "rb", buffering=4 * MIB) as stream:
        if start > 0:
            stream.seek(start - 1)
            if stream.read(1) != b"\n":
                stream.readline()  # the line under way at `start` belongs to the previous range
        position = stream.tell()
        while position < end:
            line = stream.readline()
            if not line:
                break
            yield line
            position += len(line)


# One tokenizer per worker process, loaded once by the pool initializer.
_worker_tokenizer: Optional[Tokenizer] = None
_worker_report: Optional[Callable[[int, int], None]] = None


def _init_worker(tokenizer_path: str, reports) -> None:
    global _worker_tokenizer, _worker_report
    _worker_tokenizer = load_tokenizer(tokenizer_path)
    if reports is not None:
        _worker_report = lambda documents, tokens: reports.put((documents, tokens))  # noqa: E731


def _drain(reports, bar: "_ProgressBar", wait: float) -> None:
    """Apply the workers' chunk reports to the bar, waiting up to `wait` seconds for the first."""
    import queue

    try:
        bar.chunk(*reports.get(timeout=wait) if wait else reports.get_nowait())
        while True:
            bar.chunk(*reports.get_nowait())
    except queue.Empty:
        pass


class _ProgressBar:
    """Tokens done (with tokens/s), documents and parts, updated as each chunk of documents is encoded."""

    def __init__(self, units: Sequence[WorkUnit], finished: dict, started: float) -> None:
        from tqdm import tqdm

        self.parts_total = len(units)
        self.parts_done = len(finished)
        self.documents = sum(s["documents"] for s in finished.values())
        self.bar = tqdm(initial=sum(s["tokens"] for s in finished.values()), unit="tok", unit_scale=True,
                        desc="tokenizing", file=sys.stderr, smoothing=0.1)
        if finished:
            self.bar.write(f"resuming: {len(finished)} of {len(units)} parts already done")
        self._postfix()

    def _postfix(self) -> None:
        self.bar.set_postfix_str(f"{self.documents:,} docs, parts {self.parts_done}/{self.parts_total}")

    def chunk(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.bar.update(tokens)
        self._postfix()

    def part_done(self) -> None:
        self.parts_done += 1
        self._postfix()

    def close(self) -> None:
        self.bar.close()


def segment_prefix(parts_dir: str, part_name: str, segment: int) -> str:
    return os.path.join(parts_dir, f"{part_name}.s{segment:05d}")


def _finished_segments(parts_dir: str, part_name: str) -> list[dict]:
    """The unit's checkpointed segments, in order, up to the first missing or damaged one."""
    segments = []
    while True:
        prefix = segment_prefix(parts_dir, part_name, len(segments))
        try:
            with open(prefix + ".json") as stream:
                stats = json.load(stream)
            index = indexed.verify_shard(prefix, allow_empty=True)
        except (OSError, json.JSONDecodeError, indexed.ShardError):
            return segments
        if index.num_tokens != stats["tokens"] or index.num_documents != stats["documents"]:
            return segments
        segments.append(stats)


def tokenize_unit(unit: WorkUnit, parts_dir: str, part_name: str, options: Options, chunk_docs: int,
                  chunk_bytes: int, segment_tokens: int, tokenizer: Optional[Tokenizer] = None,
                  report: Optional[Callable[[int, int], None]] = None) -> dict:
    """Tokenize one unit into segments `parts_dir/part_name.sNNNNN.{bin,idx,json}` and return its statistics (also
    written as `part_name.json`, last, which marks the unit complete).

    A segment is committed (renamed into place, then its `.json` written) every `segment_tokens` tokens, so a unit
    interrupted midway resumes after its last segment: the records before it are read again (a compressed stream
    cannot seek) but not tokenized again.
    """
    tokenizer = tokenizer or _worker_tokenizer
    report = report or _worker_report
    dtype = np.dtype(options.dtype).type
    started = time.perf_counter()
    done = _finished_segments(parts_dir, part_name)
    resume_after = done[-1]["records_end"] if done else 0
    segments = [stats["segment"] for stats in done]
    skipped: Counter = Counter()
    for stats in done:
        skipped.update(stats["skipped"])
    documents = sum(stats["documents"] for stats in done)
    tokens = sum(stats["tokens"] for stats in done)
    records = resume_after
    error = None

    class Segment:
        """The segment being written: tokens streamed to a staging file, lengths kept for its index."""

        def __init__(self) -> None:
            self.number = len(segments)
            self.prefix = segment_prefix(parts_dir, part_name, self.number)
            self.staging = f"{self.prefix}.tmp{os.getpid()}"
            self.out = open(self.staging + ".bin", "wb")
            self.lengths: list[np.ndarray] = []
            self.records_start = records
            self.documents = self.tokens = 0
            self.skipped: Counter = Counter()

        def commit(self) -> None:
            self.out.close()
            lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int32)
            indexed.write_index(self.staging + ".idx", dtype, lengths, np.arange(len(lengths) + 1))
            os.replace(self.staging + ".bin", self.prefix + ".bin")
            os.replace(self.staging + ".idx", self.prefix + ".idx")
            _write_json_atomic(self.prefix + ".json", {
                "segment": self.number, "records_start": self.records_start, "records_end": records,
                "documents": self.documents, "tokens": self.tokens, "skipped": dict(sorted(self.skipped.items()))})
            segments.append(self.number)

    segment = Segment()

    def flush(texts: list[str]) -> None:
        nonlocal documents, tokens, segment
        encoded = tokenizer.encode_batch(texts, append_eod=True)
        sizes = np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded))
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(sizes.sum(dtype=np.int64)))
        segment.out.write(flat.tobytes())
        segment.lengths.append(sizes)
        segment.documents += len(texts)
        segment.tokens += len(flat)
        documents += len(texts)
        tokens += len(flat)
        if report is not None:
            report(len(texts), len(flat))
        if segment.tokens >= segment_tokens:
            segment.commit()
            segment = Segment()

    texts: list[str] = []
    pending_bytes = 0
    try:
        for position, record in enumerate(_iter_unit_records(unit, options.text_field, options.txt_mode)):
            if position < resume_after:
                continue  # tokenized into an earlier segment before an interruption
            records += 1
            if isinstance(record, readers.Skipped):
                skipped[record.reason] += 1
                segment.skipped[record.reason] += 1
                continue
            texts.append(record)
            pending_bytes += len(record)
            if len(texts) >= chunk_docs or pending_bytes >= chunk_bytes:
                flush(texts)
                texts, pending_bytes = [], 0
    except (OSError, EOFError, ValueError) as err:  # truncated gzip/zstd, unreadable parquet: keep what was read
        skipped[readers.UNREADABLE_REST] += 1
        segment.skipped[readers.UNREADABLE_REST] += 1
        error = f"{type(err).__name__}: {err}"
    if texts:
        flush(texts)
    if segment.tokens or segment.skipped or not segments:
        segment.commit()
    else:
        segment.out.close()
        os.remove(segment.staging + ".bin")
    stats = {"unit": asdict(unit), "segments": segments, "documents": documents, "tokens": tokens,
             "records": records, "skipped": dict(sorted(skipped.items())), "error": error,
             "resumed_segments": len(done), "seconds": round(time.perf_counter() - started, 3)}
    _write_json_atomic(os.path.join(parts_dir, part_name + ".json"), stats)
    return stats


def _hash_input(path: str) -> tuple[str, str]:
    return path, file_sha256(path)


def _write_json_atomic(path: str, payload: dict) -> None:
    staging = f"{path}.tmp{os.getpid()}"
    with open(staging, "w") as stream:
        json.dump(payload, stream, indent=2)
        stream.write("\n")
    os.replace(staging, path)


def manifest_path(prefix: str) -> str:
    return prefix + ".manifest.json"


def read_manifest(prefix: str) -> Optional[dict]:
    try:
        with open(manifest_path(prefix)) as stream:
            return json.load(stream)
    except (OSError, json.JSONDecodeError):
        return None


def _is_up_to_date(prefix: str, files: Sequence[str], options: Options) -> Optional[dict]:
    manifest = read_manifest(prefix)
    if manifest is None or manifest.get("version") != MANIFEST_VERSION or manifest.get("options") != asdict(options):
        return None
    recorded = [(i["path"], i["bytes"], i["mtime_ns"]) for i in manifest["inputs"]]
    current = []
    for path in files:
        stat = os.stat(path)
        current.append((path, stat.st_size, stat.st_mtime_ns))
    if recorded != current:
        return None
    for path, size in ((indexed.bin_path(prefix), manifest["output"]["bin_bytes"]),
                       (indexed.idx_path(prefix), manifest["output"]["idx_bytes"])):
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return None
    return manifest


def preprocess(
    files: Sequence[str],
    tokenizer_path: str,
    out_prefix: str,
    *,
    workers: int = 1,
    text_field: str = "text",
    txt_mode: str = "file",
    unit_bytes: int = 256 * MIB,
    chunk_docs: int = 1024,
    chunk_bytes: int = 8 * MIB,
    segment_tokens: int = 64_000_000,
    keep_parts: bool = False,
    progress: bool = False,
) -> dict:
    """Tokenize `files` into `out_prefix.{bin,idx}` and return the manifest (see the module docstring)."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    if txt_mode not in readers.TXT_MODES:
        raise ValueError(f"txt_mode={txt_mode!r} is not one of {readers.TXT_MODES}")
    files = [os.path.abspath(f) for f in files]
    out_prefix = os.path.abspath(out_prefix)
    # Two runs writing one prefix would race on its parts and final renames: the second waits, then finds it done.
    with file_lock(out_prefix + ".lock"):
        return _preprocess_locked(files, tokenizer_path, out_prefix, workers, text_field, txt_mode, unit_bytes,
                                  chunk_docs, chunk_bytes, segment_tokens, keep_parts, progress)


def _preprocess_locked(files, tokenizer_path, out_prefix, workers, text_field, txt_mode, unit_bytes, chunk_docs,
                       chunk_bytes, segment_tokens, keep_parts, progress) -> dict:
    tokenizer = load_tokenizer(tokenizer_path)
    options = Options(tokenizer.model_sha256, text_field, txt_mode, np.dtype(indexed.token_dtype(tokenizer.vocab_size)).name)
    manifest = _is_up_to_date(out_prefix, files, options)
    if manifest is not None:
        if progress:
            print(f"{out_prefix}: up to date ({manifest['totals']['documents']} documents, "
                  f"{manifest['totals']['tokens']} tokens); nothing to do", file=sys.stderr)
        return manifest

    started = time.perf_counter()
    os.makedirs(os.path.dirname(out_prefix), exist_ok=True)
    parts_dir = out_prefix + ".parts"
    os.makedirs(parts_dir, exist_ok=True)
    units = plan_units(files, unit_bytes)
    fingerprint = options.fingerprint()
    names = [unit.part_name(fingerprint) for unit in units]
    stats: dict[int, dict] = {}
    for unit, name in zip(units, names):
        done = _read_finished_part(parts_dir, name)
        if done is not None:
            stats[unit.index] = done
    todo = [unit for unit in units if unit.index not in stats]
    reused = len(units) - len(todo)

    bar = _ProgressBar(units, stats, started) if progress else None
    hashes: dict[str, str] = {}
    processes = min(workers, max(len(todo), 1))
    if processes == 1:
        for unit in todo:
            stats[unit.index] = tokenize_unit(unit, parts_dir, names[unit.index], options, chunk_docs, chunk_bytes,
                                              segment_tokens, tokenizer, report=bar.chunk if bar else None)
            if bar:
                bar.part_done()
        hashes = dict(_hash_input(path) for path in files)
    else:
        # spawn, not fork: the caller may be a training process with threads (gloo, torch) running.
        context = multiprocessing.get_context("spawn")
        reports = context.Queue() if bar else None
        with context.Pool(processes, initializer=_init_worker, initargs=(tokenizer_path, reports)) as pool:
            pending = {u.index: pool.apply_async(tokenize_unit, (u, parts_dir, names[u.index], options, chunk_docs,
                                                                 chunk_bytes, segment_tokens))
                       for u in sorted(todo, key=lambda u: -u.work_bytes)}  # largest first: less idle time at the end
            hash_results = pool.map_async(_hash_input, files)
            while pending:
                if reports is not None:
                    _drain(reports, bar, wait=0.2)
                for index in [i for i, result in pending.items() if result.ready()]:
                    stats[index] = pending.pop(index).get()  # re-raises a worker's exception here
                    if bar:
                        bar.part_done()
                if reports is None and pending:
                    next(iter(pending.values())).wait(0.2)
            hashes = dict(hash_results.get())
            if reports is not None:
                _drain(reports, bar, wait=0)
    if bar:
        bar.close()

    ordered = [stats[unit.index] for unit in units]
    dtype = np.dtype(options.dtype).type
    _merge_parts([segment_prefix(parts_dir, name, segment) for name, stats in zip(names, ordered)
                  for segment in stats["segments"]], out_prefix, dtype)
    manifest = _build_manifest(files, units, ordered, hashes, tokenizer, options, out_prefix,
                               seconds=time.perf_counter() - started, reused_parts=reused,
                               resumed_segments=sum(stats[u.index].get("resumed_segments", 0) for u in todo))
    _write_json_atomic(manifest_path(out_prefix), manifest)
    if not keep_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)
    if progress:
        print(summary(manifest), file=sys.stderr)
    return manifest


def _read_finished_part(parts_dir: str, name: str) -> Optional[dict]:
    """The statistics of a completed unit whose segments are all intact, else None (the unit is (re)done)."""
    try:
        with open(os.path.join(parts_dir, name + ".json")) as stream:
            stats = json.load(stream)
    except (OSError, json.JSONDecodeError):
        return None
    segments = _finished_segments(parts_dir, name)
    if len(segments) != len(stats["segments"]) or sum(s["tokens"] for s in segments) != stats["tokens"]:
        os.remove(os.path.join(parts_dir, name + ".json"))  # a damaged segment: redo the unit from there
        return None
    return stats


def _merge_parts(segment_prefixes: Sequence[str], out_prefix: str, dtype: type) -> None:
    """Concatenate the segments into `out_prefix.{bin,idx}`, each file renamed into place only when complete."""
    staging = f"{out_prefix}.tmp{os.getpid()}"
    lengths = []
    with open(staging + ".bin", "wb") as out:
        for part in segment_prefixes:
            index = indexed.read_index(indexed.idx_path(part))
            if index.dtype is not dtype:
                raise indexed.ShardError(f"segment {part}.idx holds {np.dtype(index.dtype).name} tokens, expected "
                                         f"{np.dtype(dtype).name}")
            lengths.append(np.array(index.sequence_lengths))
            with open(indexed.bin_path(part), "rb") as source:
                shutil.copyfileobj(source, out, 16 * MIB)
    sequence_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int32)
    indexed.write_index(staging + ".idx", dtype, sequence_lengths, np.arange(len(sequence_lengths) + 1))
    # Drop a stale manifest first: a crash between the renames must not leave an old manifest vouching for new files.
    if os.path.exists(manifest_path(out_prefix)):
        os.remove(manifest_path(out_prefix))
    os.replace(staging + ".bin", indexed.bin_path(out_prefix))
    os.replace(staging + ".idx", indexed.idx_path(out_prefix))


def _build_manifest(files, units, ordered_stats, hashes, tokenizer, options, out_prefix, *, seconds, reused_parts,
                    resumed_segments):
    per_input = {path: {"documents": 0, "tokens": 0, "records": 0, "skipped": Counter(), "errors": []} for path in files}
    for unit, part in zip(units, ordered_stats):
        entry = per_input[unit.path]
        entry["documents"] += part["documents"]
        entry["tokens"] += part["tokens"]
        entry["records"] += part["records"]
        entry["skipped"].update(part["skipped"])
        if part.get("error"):
            entry["errors"].append(part["error"])
    inputs = []
    for path in files:
        stat = os.stat(path)
        entry = per_input[path]
        inputs.append({"path": path, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": hashes[path],
                       "documents": entry["documents"], "tokens": entry["tokens"], "records": entry["records"],
                       "skipped": dict(sorted(entry["skipped"].items())), "errors": entry["errors"]})
    skipped_total = Counter()
    for entry in inputs:
        skipped_total.update(entry["skipped"])
    documents = sum(e["documents"] for e in inputs)
    tokens = sum(e["tokens"] for e in inputs)
    return {
        "version": MANIFEST_VERSION,
        "prefix": out_prefix,
        "output": {"bin": indexed.bin_path(out_prefix), "idx": indexed.idx_path(out_prefix),
                   "bin_bytes": os.path.getsize(indexed.bin_path(out_prefix)),
                   "idx_bytes": os.path.getsize(indexed.idx_path(out_prefix)), "dtype": options.dtype},
        "tokenizer": {"path": tokenizer.path, "library": tokenizer.library, "sha256": tokenizer.model_sha256,
                      "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod},
        "options": asdict(options),
        "inputs": inputs,
        "parts": [{"input": unit.path, "kind": unit.kind, "start": unit.start, "end": unit.end,
                   "documents": part["documents"], "tokens": part["tokens"], "skipped": part["skipped"]}
                  for unit, part in zip(units, ordered_stats)],
        "totals": {"documents": documents, "tokens": tokens, "records": sum(e["records"] for e in inputs),
                   "skipped": dict(sorted(skipped_total.items()))},
        "run": {"seconds": round(seconds, 3), "reused_parts": reused_parts, "parts": len(units),
                "resumed_segments": resumed_segments},
    }


def summary(manifest: dict) -> str:
    totals = manifest["totals"]
    skipped = ", ".join(f"{reason} {count}" for reason, count in totals["skipped"].items()) or "none"
    seconds = manifest["run"]["seconds"]
    return (f"{manifest['prefix']}: {totals['documents']} documents, {totals['tokens']} tokens from "
            f"{len(manifest['inputs'])} files in {seconds:.1f} s ({totals['tokens'] / max(seconds, 1e-9):.3g} tok/s; "
            f"{manifest['run']['reused_parts']} of {manifest['run']['parts']} parts reused); skipped records: {skipped}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or model file")
    parser.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--preset", choices=sorted(readers.PRESETS), help="text field and file globs of a known corpus")
    parser.add_argument("--text-field", default=None, help="JSON/parquet field holding the text (default: text)")
    parser.add_argument("--txt-mode", choices=readers.TXT_MODES, default="file",
                        help=".txt inputs: one document per file or per blank-line block")
    parser.add_argument("--unit-mb", type=int, default=256, help="cut uncompressed jsonl and parquet into units this big")
    parser.add_argument("--chunk-docs", type=int, default=1024, help="documents a worker encodes at a time")
    parser.add_argument("--segment-mtok", type=float, default=64,
                        help="checkpoint a unit every this many million tokens (resume granularity)")
    parser.add_argument("--keep-parts", action="store_true", help="keep PREFIX.parts/ after merging")
    args = parser.parse_args(argv)
    preset = readers.PRESETS[args.preset] if args.preset else None
    text_field = args.text_field or (preset.text_field if preset else "text")
    files = readers.expand_inputs(args.input, preset.globs if preset else ())
    preprocess(files, args.tokenizer, args.out, workers=args.workers, text_field=text_field, txt_mode=args.txt_mode,
               unit_bytes=args.unit_mb * MIB, chunk_docs=args.chunk_docs, segment_tokens=int(args.segment_mtok * 1e6),
               keep_parts=args.keep_parts, progress=True)


if __name__ == "__main__":
    main()
