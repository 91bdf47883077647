"""Tokenize corpus files into one megatron-core IndexedDataset shard (`PREFIX.bin`, `PREFIX.idx`).

    python -m data.preprocess --input FILES --tokenizer DIR --out PREFIX [--workers N] [--text-field text]
        [--preset NAME] [--txt-mode file|blank_line] [--unit-mb 256] [--chunk-docs 1024] [--partition I/N]

Each document becomes one sequence followed by the end-of-document token. The inputs are cut into work units (a
file; a byte range of a large uncompressed JSON Lines file; a run of row groups of a parquet file). One pipeline
carries every unit, in input order: this process reads each unit as a stream and cuts it into chunks of documents
(JSON Lines stay raw bytes, parsed where they are tokenized); N worker processes tokenize the chunks; this process
writes the results back in order into checkpointed segment shards under `PREFIX.parts/` that appear atomically when
done. So a single compressed file keeps every worker busy, and the output is the same for any N. The segments are
then concatenated in input order. An interrupted run, rerun, reuses the finished units and segments, so the result
is byte-identical to an uninterrupted run; `PREFIX.manifest.json` records inputs (sizes, sha256), the tokenizer
hash, the options, document and token counts and the records skipped per reason. Rerunning on unchanged inputs (same
sizes and modification times, same tokenizer and options) is a no-op.

A corpus too large for one machine is tokenized by N independent jobs: `--partition I/N` (1 <= I <= N) takes the I-th
of N contiguous runs of the sorted work units (about equal input bytes each; the same for every job given the same
inputs and --unit-mb) and writes `PREFIX-I-of-N.{bin,idx,manifest.json}`. Concatenated in order, the N shards hold
exactly the tokens of one unpartitioned run. The blend entry `PREFIX-*-of-N` names all N (`expand_blend`), and
`python -m launch.slurm preprocess` submits them as one SLURM job array.

A record that cannot be read (bad JSON, no text, not UTF-8, the unreadable rest of a truncated file) is skipped and
counted. A failure to tokenize or to write stops the run with a PreprocessError naming the file and the records;
nothing uncommitted is left behind, so a rerun redoes that unit from its last committed segment.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from data import indexed, readers
from data.config import blend_shards, partition_prefix
from data.locking import file_lock
from data.tokenizer import Tokenizer, file_sha256, load_tokenizer
from diff_transformer.cli import ArgumentParser, run
from diff_transformer.fileio import (atomic_write_json, check_no_links, check_outside_training, move_aside,
                                     old_suffix)

MANIFEST_VERSION = 1
MIB = 1 << 20
# What reading a file raises when its rest cannot be read (truncated gzip/zstd, unreadable parquet).
READ_ERRORS = (OSError, EOFError, ValueError)
# The commit point of every unit, segment and manifest `.json`; the kill-and-resume tests wrap this name.
_write_json_atomic = atomic_write_json


class PreprocessError(RuntimeError):
    """Tokenizing or writing a chunk failed; the message names the file and the records of the chunk."""


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

    def describe(self) -> str:
        if self.kind == "bytes":
            return f"{self.path} (bytes {self.start} to {self.end})"
        if self.kind == "row_groups":
            return f"{self.path} (row groups {self.start} to {self.end})"
        return self.path


@dataclass(frozen=True)
class Options:
    """Everything besides the inputs that changes the output; a part or a manifest made with other options is stale."""

    tokenizer_sha256: str
    text_field: str
    txt_mode: str
    dtype: str

    def fingerprint(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class RunSettings:
    """How a run proceeds: none of it changes the output bytes."""

    workers: int = 1
    unit_bytes: int = 256 * MIB  # cut uncompressed JSON Lines and parquet files into units of about this size
    chunk_docs: int = 1024  # documents tokenized as one batch
    chunk_bytes: int = 1 * MIB  # text tokenized as one batch: small enough that N workers finish together
    segment_tokens: int = 64_000_000  # checkpoint a unit every this many tokens
    keep_parts: bool = False
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("workers", "unit_bytes", "chunk_docs", "chunk_bytes", "segment_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer of at least 1")


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


# ---- Reading: a unit's records, cut into chunks (this process) ----


@dataclass(frozen=True)
class Unreadable:
    """The end of a unit whose file could not be read to its end."""

    error: str


def _unit_records(unit: WorkUnit, options: Options) -> Iterator[Union[bytes, readers.Record]]:
    """The unit's records in order: raw JSON lines (blank lines are no records), else the readers' records."""
    if readers.file_format(unit.path) == "jsonl":
        lines = _read_line_range(unit.path, unit.start, unit.end) if unit.kind == "bytes" else _read_lines(unit.path)
        return (line for line in lines if line.strip())
    if unit.kind == "file":
        return readers.iter_records(unit.path, options.text_field, options.txt_mode)
    return _iter_row_groups(unit, options.text_field)


def _read_lines(path: str) -> Iterator[bytes]:
    with readers.open_binary(path) as stream:
        yield from stream


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


def _iter_row_groups(unit: WorkUnit, text_field: str) -> Iterator[readers.Record]:
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


def _until_unreadable(records: Iterator) -> Iterator:
    """The records, then Unreadable if reading stops early. Only the reader runs inside this `try`: a failure to
    tokenize or write is no bad record."""
    try:
        yield from records
    except READ_ERRORS as err:
        yield Unreadable(f"{type(err).__name__}: {err}")


@dataclass
class Chunk:
    """Consecutive records of one unit, tokenized as one batch: raw JSON lines (parsed by the process that encodes
    them) or the texts a reader already decoded (parquet, txt)."""

    unit: WorkUnit
    records_start: int  # index, within the unit, of the first record
    records: int = 0
    lines: list[bytes] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # records the reader already found bad
    text_bytes: int = 0
    last: bool = False  # the unit's last chunk
    unreadable: Optional[str] = None  # on the last chunk: why the rest of the file could not be read

    def add(self, record: Union[bytes, readers.Record]) -> None:
        self.records += 1
        if isinstance(record, readers.Skipped):
            self.skipped[record.reason] += 1
        elif isinstance(record, bytes):
            self.lines.append(record)
            self.text_bytes += len(record)
        else:
            self.texts.append(record)
            self.text_bytes += len(record)

    def full(self, settings: RunSettings) -> bool:
        return len(self.lines) + len(self.texts) >= settings.chunk_docs or self.text_bytes >= settings.chunk_bytes

    def payload(self) -> tuple[bytes, list[str]]:
        """What a worker needs: one bytes object for JSON lines, so that sending it costs no work per document."""
        return b"".join(self.lines), self.texts

    def where(self) -> str:
        return f"{self.unit.describe()}, records {self.records_start} to {self.records_start + self.records - 1}"


def read_chunks(unit: WorkUnit, options: Options, settings: RunSettings, resume_after: int) -> Iterator[Chunk]:
    """The unit's records after the first `resume_after` (committed before an interruption), in chunks of at most
    `chunk_docs` documents or `chunk_bytes` of text; the last chunk has `last` set."""
    chunk = Chunk(unit, resume_after)
    for position, record in enumerate(_until_unreadable(_unit_records(unit, options))):
        if isinstance(record, Unreadable):
            chunk.unreadable = record.error
            break
        if position < resume_after:
            continue  # tokenized into an earlier segment before an interruption
        chunk.add(record)
        if chunk.full(settings):
            yield chunk
            chunk = Chunk(unit, chunk.records_start + chunk.records)
    chunk.last = True
    yield chunk


# ---- Encoding: a chunk to token arrays (worker processes, or this one) ----


@dataclass
class Encoded:
    """A chunk's documents as tokens: `sizes` per document (end-of-document token included), `tokens` flat."""

    sizes: np.ndarray
    tokens: np.ndarray
    skipped: dict[str, int]  # records found bad while parsing JSON lines


def encode_chunk(tokenizer: Tokenizer, dtype: type, text_field: str, lines: bytes, texts: list[str]) -> Encoded:
    skipped: Counter = Counter()
    if lines:
        texts = []
        for record in readers.iter_jsonl_lines(lines.split(b"\n"), text_field):
            if isinstance(record, readers.Skipped):
                skipped[record.reason] += 1
            else:
                texts.append(record)
    encoded = tokenizer.encode_batch(texts, append_eod=True) if texts else []
    sizes = np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded))
    tokens = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(sizes.sum(dtype=np.int64)))
    return Encoded(sizes, tokens, dict(skipped))


# One encoder per worker process, made once by the pool initializer.
_worker_encode: Optional[Callable[[bytes, list[str]], Encoded]] = None


def _init_worker(tokenizer_path: str, dtype: str, text_field: str) -> None:
    global _worker_encode
    _worker_encode = functools.partial(encode_chunk, load_tokenizer(tokenizer_path), np.dtype(dtype).type, text_field)


def _encode_in_worker(lines: bytes, texts: list[str]) -> Encoded:
    return _worker_encode(lines, texts)


def _hash_input(path: str) -> tuple[str, str]:
    return path, file_sha256(path)


# ---- Writing: encoded chunks, in order, into committed segments (this process) ----


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


def _fsync_file(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def _commit_shard(staging: str, prefix: str) -> None:
    """Rename a written `.bin/.idx` pair into place, flushed to disk first so that a crash cannot leave a renamed but
    empty file. The directory is flushed by the `.json` commit that follows (which is what vouches for the pair)."""
    for path in (indexed.bin_path(staging), indexed.idx_path(staging)):
        _fsync_file(path)
    os.replace(indexed.bin_path(staging), indexed.bin_path(prefix))
    os.replace(indexed.idx_path(staging), indexed.idx_path(prefix))


class _Segment:
    """The segment being written: tokens streamed to a staging file, lengths kept for its index."""

    def __init__(self, prefix: str, number: int, records_start: int) -> None:
        self.prefix = prefix
        self.number = number
        self.records_start = records_start
        self.staging = f"{prefix}.tmp{os.getpid()}"
        self.out = open(indexed.bin_path(self.staging), "wb")
        self.lengths: list[np.ndarray] = []
        self.documents = self.tokens = 0
        self.skipped: Counter = Counter()

    def append(self, encoded: Encoded) -> None:
        self.out.write(encoded.tokens.tobytes())
        self.lengths.append(encoded.sizes)
        self.documents += len(encoded.sizes)
        self.tokens += len(encoded.tokens)

    def commit(self, dtype: type, records_end: int) -> None:
        self.out.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int32)
        indexed.write_index(indexed.idx_path(self.staging), dtype, lengths, np.arange(len(lengths) + 1))
        _commit_shard(self.staging, self.prefix)
        _write_json_atomic(self.prefix + ".json", {
            "segment": self.number, "records_start": self.records_start, "records_end": records_end,
            "documents": self.documents, "tokens": self.tokens, "skipped": dict(sorted(self.skipped.items()))})

    def discard(self) -> None:
        """Remove what this segment wrote: staging files, and a pair renamed into place that no `.json` vouches for."""
        self.out.close()
        paths = [indexed.bin_path(self.staging), indexed.idx_path(self.staging)]
        if not os.path.exists(self.prefix + ".json"):
            paths += [indexed.bin_path(self.prefix), indexed.idx_path(self.prefix)]
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


class _UnitWriter:
    """Writes one unit's encoded chunks, in order: a segment is committed every `segment_tokens` tokens (renamed
    into place, then its `.json` written) and the unit at its end (`part_name.json`, last, marks it complete).

    A unit interrupted midway resumes after its last committed segment: the records before it are read again (a
    compressed stream cannot seek) but not tokenized again.
    """

    def __init__(self, unit: WorkUnit, parts_dir: str, part_name: str, dtype: type, segment_tokens: int) -> None:
        self.unit = unit
        self.parts_dir = parts_dir
        self.part_name = part_name
        self.dtype = dtype
        self.segment_tokens = segment_tokens
        self.resumed = _finished_segments(parts_dir, part_name)
        self.segments = [stats["segment"] for stats in self.resumed]
        self.records = self.resumed[-1]["records_end"] if self.resumed else 0
        self.documents = sum(stats["documents"] for stats in self.resumed)
        self.tokens = sum(stats["tokens"] for stats in self.resumed)
        self.skipped: Counter = Counter()
        for stats in self.resumed:
            self.skipped.update(stats["skipped"])
        self.segment: Optional[_Segment] = None

    def add(self, chunk: Chunk, encoded: Encoded) -> None:
        segment = self._open_segment()
        segment.append(encoded)
        segment.skipped.update(chunk.skipped)
        segment.skipped.update(encoded.skipped)
        self.skipped.update(chunk.skipped)
        self.skipped.update(encoded.skipped)
        self.records += chunk.records
        self.documents += len(encoded.sizes)
        self.tokens += len(encoded.tokens)
        if segment.tokens >= self.segment_tokens:
            self._commit_segment()

    def finish(self, unreadable: Optional[str]) -> dict:
        """Commit the last segment (one at least, so that an empty unit is visibly done) and the unit's statistics."""
        if unreadable:
            self.skipped[readers.UNREADABLE_REST] += 1
            self._open_segment().skipped[readers.UNREADABLE_REST] += 1
        if self.segment is not None or not self.segments:
            self._open_segment()
            self._commit_segment()
        stats = {"unit": asdict(self.unit), "segments": self.segments, "documents": self.documents,
                 "tokens": self.tokens, "records": self.records, "skipped": dict(sorted(self.skipped.items())),
                 "error": unreadable, "resumed_segments": len(self.resumed)}
        _write_json_atomic(os.path.join(self.parts_dir, self.part_name + ".json"), stats)
        return stats

    def abort(self) -> None:
        """Remove the uncommitted segment: what stays is what a rerun may reuse."""
        if self.segment is not None:
            self.segment.discard()
            self.segment = None

    def _open_segment(self) -> _Segment:
        if self.segment is None:
            number = len(self.segments)
            self.segment = _Segment(segment_prefix(self.parts_dir, self.part_name, number), number, self.records)
        return self.segment

    def _commit_segment(self) -> None:
        self.segment.commit(self.dtype, self.records)
        self.segments.append(self.segment.number)
        self.segment = None


# ---- The pipeline ----


class _ProgressBar:
    """Tokens done (with tokens/s), documents and parts, updated as each chunk of documents is written."""

    def __init__(self, units: Sequence[WorkUnit], finished: dict) -> None:
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


@dataclass
class _Pipeline:
    """Reads the units' chunks in order, has them encoded (`encode` returns a callable that waits for the result),
    and writes the results in the same order."""

    writers: dict[int, _UnitWriter]
    options: Options
    settings: RunSettings
    encode: Callable[[Chunk], Callable[[], Encoded]]
    read_ahead: int  # chunks encoding while the writer waits for the oldest
    bar: Optional[_ProgressBar] = None

    def run(self) -> dict[int, dict]:
        stats: dict[int, dict] = {}
        in_flight: collections.deque = collections.deque()
        try:
            for chunk in self._chunks():
                in_flight.append((chunk, self.encode(chunk)))
                if len(in_flight) > self.read_ahead:
                    self._write(*in_flight.popleft(), stats)
            while in_flight:
                self._write(*in_flight.popleft(), stats)
        except BaseException:
            for writer in self.writers.values():
                writer.abort()
            raise
        return stats

    def _chunks(self) -> Iterator[Chunk]:
        for writer in self.writers.values():
            yield from read_chunks(writer.unit, self.options, self.settings, writer.records)

    def _write(self, chunk: Chunk, result: Callable[[], Encoded], stats: dict[int, dict]) -> None:
        try:
            encoded = result()
        except concurrent.futures.BrokenExecutor as err:
            raise PreprocessError(f"tokenizing {chunk.where()} failed: a worker process died (killed, out of memory or "
                                  f"crashed in the tokenizer) on this chunk or on one after it") from err
        except Exception as err:
            raise PreprocessError(f"tokenizing {chunk.where()} failed: {type(err).__name__}: {err}") from err
        writer = self.writers[chunk.unit.index]
        try:
            if chunk.records:
                writer.add(chunk, encoded)
            if chunk.last:
                stats[chunk.unit.index] = writer.finish(chunk.unreadable)
        except Exception as err:
            raise PreprocessError(f"writing {chunk.where()} to {writer.parts_dir} failed: "
                                  f"{type(err).__name__}: {err}") from err
        if self.bar:
            self.bar.chunk(len(encoded.sizes), len(encoded.tokens))
            if chunk.last:
                self.bar.part_done()


def _nothing_to_encode(dtype: type) -> Encoded:
    return Encoded(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=dtype), {})


def _tokenize_units(files: Sequence[str], tokenizer: Tokenizer, tokenizer_path: str, options: Options,
                    settings: RunSettings, writers: dict[int, _UnitWriter],
                    bar: Optional[_ProgressBar]) -> tuple[dict[int, dict], dict[str, str]]:
    """Run the pipeline over the units to do; return their statistics and the inputs' sha256."""
    dtype = np.dtype(options.dtype).type
    if settings.workers == 1:
        encode_here = functools.partial(encode_chunk, tokenizer, dtype, options.text_field)

        def encode(chunk: Chunk) -> Callable[[], Encoded]:
            return functools.partial(encode_here, *chunk.payload())

        stats = _Pipeline(writers, options, settings, encode, read_ahead=0, bar=bar).run()
        return stats, dict(_hash_input(path) for path in files)

    # spawn, not fork: the caller may be a training process with threads (gloo, torch) running.
    pool = concurrent.futures.ProcessPoolExecutor(
        settings.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
        initargs=(tokenizer_path, options.dtype, options.text_field))
    try:
        hashes = [pool.submit(_hash_input, path) for path in files]

        def encode(chunk: Chunk) -> Callable[[], Encoded]:
            if not chunk.records:
                return functools.partial(_nothing_to_encode, dtype)
            try:
                return pool.submit(_encode_in_worker, *chunk.payload()).result
            except concurrent.futures.BrokenExecutor as err:  # a worker died: report it in order, at the oldest chunk
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(err)
                return failed.result

        # Two chunks a worker: one encoding, one queued, so that no worker waits for the reader or the writer.
        stats = _Pipeline(writers, options, settings, encode, read_ahead=2 * settings.workers, bar=bar).run()
        return stats, dict(future.result() for future in hashes)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---- Partitions: one corpus, N independent jobs ----


@dataclass(frozen=True)
class Partition:
    """The `index`-th (1-based) of `count` partitions of a corpus's work units."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.index <= self.count:
            raise ValueError(f"--partition {self.index}/{self.count} is out of range: give I/N with 1 <= I <= N")

    @classmethod
    def parse(cls, text: str) -> "Partition":
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise ValueError(f"--partition {text!r} is not I/N: give e.g. 2/8, the second of 8 partitions")
        return cls(int(match.group(1)), int(match.group(2)))

    def prefix(self, out_prefix: str) -> str:
        return partition_prefix(out_prefix, self.index, self.count)


def _unit_weight(unit: WorkUnit, units_of_file: int) -> float:
    """Input bytes a unit reads (a parquet file's row-group units share its size equally)."""
    if unit.kind == "bytes":
        return unit.end - unit.start
    if unit.kind == "row_groups":
        return unit.input_bytes / units_of_file
    return unit.input_bytes


def partition_units(units: Sequence[WorkUnit], count: int) -> list[list[WorkUnit]]:
    """The units cut into `count` contiguous runs of about equal input bytes, each of one unit at least: the
    partitions, in order, are the units in order. A function of the units alone, so every job computes the same."""
    if count > len(units):
        raise ValueError(f"{count} partitions of {len(units)} work units: the inputs cut into {len(units)} units at "
                         f"this --unit-mb; give at most {len(units)} partitions or a smaller --unit-mb")
    per_file = Counter(unit.path for unit in units)
    cumulative = [0.0]
    for unit in units:
        cumulative.append(cumulative[-1] + _unit_weight(unit, per_file[unit.path]))
    bounds = [0]
    for p in range(1, count):
        target = cumulative[-1] * p / count
        candidates = range(bounds[-1] + 1, len(units) - (count - p) + 1)
        bounds.append(min(candidates, key=lambda j: (abs(cumulative[j] - target), j)))
    bounds.append(len(units))
    return [list(units[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def expand_blend(prefixes: Sequence[str], weights: Optional[Sequence[float]]) -> tuple[list[str], Optional[list[float]]]:
    """A blend with each `PREFIX-*-of-N` entry replaced by its N shards in order (``data.config.blend_shards``); the
    entry's weight is shared among them in proportion to their tokens, so the N weigh as the one shard an
    unpartitioned run writes."""
    out_prefixes: list[str] = []
    out_weights: Optional[list[float]] = None if weights is None else []
    for position, entry in enumerate(prefixes):
        shards = blend_shards(entry)
        out_prefixes.extend(shards)
        if out_weights is None:
            continue
        if len(shards) == 1:
            out_weights.append(float(weights[position]))
            continue
        tokens = [indexed.read_index(indexed.idx_path(shard)).num_tokens for shard in shards]
        out_weights.extend(float(weights[position]) * t / (sum(tokens) or 1) for t in tokens)
    return out_prefixes, out_weights


# ---- The run ----


def manifest_path(prefix: str) -> str:
    return prefix + ".manifest.json"


def read_manifest(prefix: str) -> Optional[dict]:
    try:
        with open(manifest_path(prefix)) as stream:
            return json.load(stream)
    except (OSError, json.JSONDecodeError):
        return None


def _is_up_to_date(prefix: str, files: Sequence[str], options: Options, partition: Optional[dict] = None) -> Optional[dict]:
    manifest = read_manifest(prefix)
    if manifest is None or manifest.get("version") != MANIFEST_VERSION or manifest.get("options") != asdict(options):
        return None
    if manifest.get("partition") != partition:
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


def check_output_prefix(prefix: str, files: Sequence[str], force: bool = False) -> None:
    """Refuse (ValueError naming the path) an output prefix whose files would replace what preprocessing did not
    write: a prefix that is a directory, lies under a file or in a run directory or a checkpoint, an output file
    that is one of the inputs, and a `.bin`/`.idx` pair that no manifest or parts directory of an earlier run
    vouches for (with ``force`` those are moved aside to `<file>.old-<time>` instead). Cheap: before the tokenizer
    loads."""
    real = os.path.realpath(prefix)
    if os.path.isdir(real):
        raise ValueError(f"--out {prefix} is a directory; give a prefix inside it, e.g. {os.path.join(prefix, 'corpus')}")
    probe = os.path.dirname(real)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"--out {prefix}: {probe} is a file, not a directory; give a prefix in a directory")
    check_outside_training(prefix, real, os.path.dirname(real))
    outputs = [indexed.bin_path(real), indexed.idx_path(real), manifest_path(real)]
    for path in files:
        if os.path.realpath(path) in outputs or os.path.realpath(path).startswith(real + ".parts" + os.sep):
            raise ValueError(f"--out {prefix} would write over the input {path}; give another prefix")
    ours = any(os.path.exists(path) and not os.path.islink(path) for path in (manifest_path(real), real + ".parts"))
    foreign = [p for p in outputs[:2] if os.path.exists(p)] if not ours else []
    if foreign and not force:
        raise ValueError(f"--out {prefix}: {' and '.join(foreign)} exist and no manifest of an earlier preprocessing "
                         "vouches for them; give another prefix, or add --force to move them aside")
    for path in foreign:
        print(f"moved {path} aside to {move_aside(path, old_suffix())}", file=sys.stderr)


def _check_inputs(files: Sequence[str], text_field: str, txt_mode: str) -> None:
    """Refuse bad arguments before the tokenizer loads or a worker starts."""
    if not files:
        raise ValueError("no input files given")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field={text_field!r} must name the JSON/parquet field holding the text")
    if txt_mode not in readers.TXT_MODES:
        raise ValueError(f"txt_mode={txt_mode!r} is not one of {readers.TXT_MODES}")
    for path in files:
        readers.file_format(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"input file {path} does not exist")
    if all(os.path.getsize(path) == 0 for path in files):
        raise readers.empty_corpus(files, text_field)


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
    chunk_bytes: int = 1 * MIB,
    segment_tokens: int = 64_000_000,
    keep_parts: bool = False,
    progress: bool = False,
    partition: Optional[Partition] = None,
) -> dict:
    """Tokenize `files` into `out_prefix.{bin,idx}` (with `partition`, its share into `out_prefix-I-of-N.{bin,idx}`)
    and return the manifest (see the module docstring)."""
    settings = RunSettings(workers=workers, unit_bytes=unit_bytes, chunk_docs=chunk_docs, chunk_bytes=chunk_bytes,
                           segment_tokens=segment_tokens, keep_parts=keep_parts, progress=progress)
    files = [os.path.abspath(f) for f in files]
    _check_inputs(files, text_field, txt_mode)
    units = None
    if partition is not None:  # before the tokenizer loads: too many partitions is a bad argument
        units = partition_units(plan_units(files, settings.unit_bytes), partition.count)[partition.index - 1]
    out_prefix = os.path.abspath(out_prefix if partition is None else partition.prefix(out_prefix))
    # the files and directories opened in place (the rest are renamed into place, which replaces a link)
    check_no_links([out_prefix + ".lock", out_prefix + ".parts"], out_prefix)
    # Two runs writing one prefix would race on its parts and final renames: the second waits, then finds it done.
    with file_lock(out_prefix + ".lock"):
        return _preprocess_locked(files, tokenizer_path, out_prefix, text_field, txt_mode, settings, partition, units)


def _partition_record(partition: Partition, units: Sequence[WorkUnit], files: Sequence[str], settings: RunSettings) -> dict:
    """What a partition's manifest records of the plan that chose its units: any change to it makes the shard stale."""
    return {"index": partition.index, "count": partition.count, "units": [units[0].index, units[-1].index + 1],
            "unit_bytes": settings.unit_bytes, "all_inputs": len(files)}


def _preprocess_locked(files: list[str], tokenizer_path: str, out_prefix: str, text_field: str, txt_mode: str,
                       settings: RunSettings, partition: Optional[Partition] = None,
                       units: Optional[list[WorkUnit]] = None) -> dict:
    tokenizer = load_tokenizer(tokenizer_path)
    options = Options(tokenizer.model_sha256, text_field, txt_mode,
                      np.dtype(indexed.token_dtype(tokenizer.vocab_size)).name)
    plan = None
    if partition is not None:
        plan = _partition_record(partition, units, files, settings)
        files = list(dict.fromkeys(unit.path for unit in units))  # this partition's inputs, in order
    manifest = _is_up_to_date(out_prefix, files, options, plan)
    if manifest is not None:
        if settings.progress:
            print(f"{out_prefix}: up to date ({manifest['totals']['documents']} documents, "
                  f"{manifest['totals']['tokens']} tokens); nothing to do", file=sys.stderr)
        return manifest

    started = time.perf_counter()
    parts_dir = out_prefix + ".parts"
    os.makedirs(parts_dir, exist_ok=True)
    if units is None:
        units = plan_units(files, settings.unit_bytes)
    fingerprint = options.fingerprint()
    names = [unit.part_name(fingerprint) for unit in units]
    stats = _finished_parts(units, names, parts_dir)
    reused = len(stats)
    dtype = np.dtype(options.dtype).type
    writers = {unit.index: _UnitWriter(unit, parts_dir, name, dtype, settings.segment_tokens)
               for unit, name in zip(units, names) if unit.index not in stats}

    bar = _ProgressBar(units, stats) if settings.progress else None
    try:
        done, hashes = _tokenize_units(files, tokenizer, tokenizer_path, options, settings, writers, bar)
    finally:
        if bar:
            bar.close()
    stats.update(done)

    ordered = [stats[unit.index] for unit in units]
    if partition is None and not sum(part["documents"] for part in ordered):
        shutil.rmtree(parts_dir, ignore_errors=True)  # empty units only: no shard is written, an earlier one stays
        skipped = Counter()
        for part in ordered:
            skipped.update(part["skipped"])
        raise readers.empty_corpus(files, text_field, skipped)
    _merge_parts([segment_prefix(parts_dir, name, segment) for name, part in zip(names, ordered)
                  for segment in part["segments"]], out_prefix, dtype)
    manifest = _build_manifest(files, units, ordered, hashes, tokenizer, options, out_prefix,
                               seconds=time.perf_counter() - started, reused_parts=reused,
                               resumed_segments=sum(len(writer.resumed) for writer in writers.values()))
    if plan is not None:
        manifest["partition"] = plan
    _write_json_atomic(manifest_path(out_prefix), manifest)
    if not settings.keep_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)
    if settings.progress:
        print(summary(manifest), file=sys.stderr)
    return manifest


def _finished_parts(units: Sequence[WorkUnit], names: Sequence[str], parts_dir: str) -> dict[int, dict]:
    """The statistics of the units completed by an earlier run, by unit index."""
    finished = {}
    for unit, name in zip(units, names):
        done = _read_finished_part(parts_dir, name)
        if done is not None:
            finished[unit.index] = done
    return finished


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
    check_no_links([indexed.bin_path(staging), indexed.idx_path(staging)], out_prefix)  # opened in place
    lengths = []
    with open(indexed.bin_path(staging), "wb") as out:
        for part in segment_prefixes:
            index = indexed.read_index(indexed.idx_path(part))
            if index.dtype is not dtype:
                raise indexed.ShardError(f"segment {part}.idx holds {np.dtype(index.dtype).name} tokens, expected "
                                         f"{np.dtype(dtype).name}")
            lengths.append(np.array(index.sequence_lengths))
            with open(indexed.bin_path(part), "rb") as source:
                shutil.copyfileobj(source, out, 16 * MIB)
    sequence_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int32)
    indexed.write_index(indexed.idx_path(staging), dtype, sequence_lengths, np.arange(len(sequence_lengths) + 1))
    # Drop a stale manifest first: a crash between the renames must not leave an old manifest vouching for new files.
    if os.path.exists(manifest_path(out_prefix)):
        os.remove(manifest_path(out_prefix))
    _commit_shard(staging, out_prefix)


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
    """One line: what was written, how fast, what was skipped, and every file whose rest could not be read."""
    totals = manifest["totals"]
    skipped = ", ".join(f"{reason} {count}" for reason, count in totals["skipped"].items()) or "none"
    seconds = manifest["run"]["seconds"]
    return (f"{manifest['prefix']}: {totals['documents']} documents, {totals['tokens']} tokens from "
            f"{len(manifest['inputs'])} files in {seconds:.1f} s ({totals['tokens'] / max(seconds, 1e-9):.3g} tok/s; "
            f"{manifest['run']['reused_parts']} of {manifest['run']['parts']} parts reused); skipped records: {skipped}"
            + "".join(f"; {error if i['path'] in error else i['path'] + ': ' + error}"
                      for i in manifest["inputs"] for error in i.get("errors", [])))


def partition_plan(inputs: Sequence[str], count: int, unit_mb: int = 256,
                   preset: Optional[str] = None) -> list[list[WorkUnit]]:
    """The work units each of `--partition 1/count` .. `count/count` takes of these inputs (files, globs,
    directories), as every job computes them; ValueError or FileNotFoundError naming what is wrong."""
    files = readers.expand_inputs(inputs, readers.PRESETS[preset].globs if preset else ())
    return partition_units(plan_units(files, unit_mb * MIB), count)


def build_parser(parser_class: type = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command line of `python -m data.preprocess` (also read by `python -m launch.slurm preprocess`)."""
    parser = parser_class(prog="python -m data.preprocess", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or model file")
    parser.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (reading and writing stay here)")
    parser.add_argument("--preset", choices=sorted(readers.PRESETS), help="text field and file globs of a known corpus")
    parser.add_argument("--text-field", default=None, help="JSON/parquet field holding the text (default: text)")
    parser.add_argument("--txt-mode", choices=readers.TXT_MODES, default="file",
                        help=".txt inputs: one document per file or per blank-line block")
    parser.add_argument("--unit-mb", type=int, default=256, help="cut uncompressed jsonl and parquet into units this big")
    parser.add_argument("--chunk-docs", type=int, default=1024, help="documents a worker encodes at a time")
    parser.add_argument("--segment-mtok", type=float, default=64,
                        help="checkpoint a unit every this many million tokens (resume granularity)")
    parser.add_argument("--keep-parts", action="store_true", help="keep PREFIX.parts/ after merging")
    parser.add_argument("--force", action="store_true",
                        help="PREFIX.bin/.idx that no earlier preprocessing wrote are moved aside instead of refused")
    parser.add_argument("--partition", metavar="I/N",
                        help="tokenize only the I-th of N partitions of the work units into PREFIX-I-of-N "
                             "(blend entry PREFIX-*-of-N names all N)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser(ArgumentParser)
    args = parser.parse_args(argv)
    try:
        settings = RunSettings(workers=args.workers, unit_bytes=args.unit_mb * MIB, chunk_docs=args.chunk_docs,
                               segment_tokens=int(args.segment_mtok * 1e6), keep_parts=args.keep_parts, progress=True)
        partition = Partition.parse(args.partition) if args.partition else None
    except ValueError as err:
        parser.error(str(err))
    preset = readers.PRESETS[args.preset] if args.preset else None
    text_field = args.text_field or (preset.text_field if preset else "text")
    files = readers.expand_inputs(args.input, preset.globs if preset else ())
    if partition is not None:
        try:
            partition_units(plan_units([os.path.abspath(f) for f in files], settings.unit_bytes), partition.count)
        except ValueError as err:
            parser.error(f"--partition {args.partition}: {err}")
    check_output_prefix(partition.prefix(args.out) if partition else args.out, files, args.force)
    try:
        preprocess(files, args.tokenizer, args.out, text_field=text_field, txt_mode=args.txt_mode, partition=partition,
                   **asdict(settings))
    except readers.EmptyCorpus as err:
        raise readers.given_inputs(err, args.input, files) from None


if __name__ == "__main__":
    sys.exit(run(main))
