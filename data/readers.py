"""Document readers for the formats public pretraining corpora ship in.

`iter_records(path, ...)` streams one file and yields, for every record in it, either the document text (`str`) or a
`Skipped(reason)` so that bad input is counted, never silently dropped and never fatal. `expand_inputs` turns globs and
directories into a stable, sorted file list. `PRESETS` names the text field and file globs of well-known corpora.

Formats: `.jsonl`/`.json`/`.ndjson` (one JSON object a line), optionally `.gz` or `.zst`; `.parquet` (pyarrow, streamed
by row group, only the text column read); `.txt` (optionally `.gz`/`.zst`), one document per file or per blank-line block.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator, Mapping, Optional, Sequence, Union

SKIP_REASONS = ("malformed_json", "missing_text_field", "non_utf8", "empty")
# Counted once per file by preprocessing when a file cannot be read to its end (truncated gzip/zstd, bad parquet).
UNREADABLE_REST = "unreadable_rest_of_file"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
COMPRESSION_SUFFIXES = (".gz", ".zst")
TXT_MODES = ("file", "blank_line")


@dataclass(frozen=True)
class Skipped:
    """A record that produced no document; `reason` is one of SKIP_REASONS."""

    reason: str


Record = Union[str, Skipped]


@dataclass(frozen=True)
class CorpusPreset:
    """Where a public corpus keeps its text: the record field and the file globs of its usual download layout."""

    text_field: str
    globs: tuple[str, ...]
    description: str


PRESETS: dict[str, CorpusPreset] = {
    "fineweb": CorpusPreset("text", ("**/*.parquet",), "HuggingFaceFW/fineweb parquet shards"),
    "fineweb-edu": CorpusPreset("text", ("**/*.parquet",), "HuggingFaceFW/fineweb-edu parquet shards"),
    "slimpajama": CorpusPreset("text", ("**/*.jsonl.zst",), "cerebras/SlimPajama-627B chunk*/example_*.jsonl.zst"),
    "redpajama": CorpusPreset("text", ("**/*.jsonl", "**/*.jsonl.gz"), "RedPajama-Data-1T per-source jsonl"),
    "redpajama-v2": CorpusPreset("raw_content", ("**/*.json.gz",), "RedPajama-Data-V2 documents/*.json.gz"),
    "pile": CorpusPreset("text", ("**/*.jsonl.zst",), "The Pile train/NN.jsonl.zst"),
    "dolma": CorpusPreset("text", ("**/*.json.gz",), "allenai/dolma *.json.gz"),
    "wikipedia": CorpusPreset("text", ("**/*.parquet",), "wikimedia/wikipedia 20231101.en/*.parquet"),
    "the-stack": CorpusPreset("content", ("**/*.parquet",), "bigcode/the-stack data/*/*.parquet"),
    "text": CorpusPreset("text", ("**/*.txt", "**/*.txt.gz"), "plain text files, one document per file"),
}


def file_format(path: str | os.PathLike) -> str:
    """'jsonl', 'parquet' or 'txt' from the file name; raise ValueError naming the supported suffixes otherwise."""
    name = Path(path).name.lower()
    for compression in COMPRESSION_SUFFIXES:
        if name.endswith(compression):
            name = name[: -len(compression)]
            break
    else:
        if name.endswith(".parquet"):
            return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "txt"
    raise ValueError(
        f"unsupported input file {str(path)!r}: use .jsonl/.json/.ndjson or .txt (each optionally .gz or .zst), or .parquet"
    )


def expand_inputs(inputs: Sequence[str], globs: Sequence[str] = ()) -> list[str]:
    """Files named by `inputs` (files, globs, directories), sorted and de-duplicated so that order is stable.

    A directory is searched with `globs` (a preset's) or, without them, for every supported suffix.
    """
    files: set[str] = set()
    for entry in inputs:
        if os.path.isdir(entry):
            patterns = globs or ("**/*",)
            for pattern in patterns:
                for found in glob.glob(os.path.join(entry, pattern), recursive=True):
                    if os.path.isfile(found) and _is_supported(found):
                        files.add(os.path.abspath(found))
        elif os.path.isfile(entry):
            file_format(entry)  # refuse an unsupported file now, not halfway through a run
            files.add(os.path.abspath(entry))
        else:
            matches = [m for m in glob.glob(entry, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise FileNotFoundError(f"input {entry!r} matches no file (give files, globs or directories)")
            for match in matches:
                file_format(match)
                files.add(os.path.abspath(match))
    if not files:
        raise FileNotFoundError(f"no supported input files under {list(inputs)}")
    return sorted(files)


def _is_supported(path: str) -> bool:
    try:
        file_format(path)
        return True
    except ValueError:
        return False


def open_binary(path: str | os.PathLike) -> IO[bytes]:
    """A binary stream over the file, decompressing .gz and .zst on the fly."""
    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path), buffer_size=1 << 20)
    return open(path, "rb")


class _ZstdReader(io.RawIOBase):
    """Decompresses a (multi-frame) zstd file as a stream and, unlike zstandard's stream_reader, raises EOFError when
    the file ends inside a frame, so that a truncated download is reported rather than read as a shorter corpus."""

    def __init__(self, path: str) -> None:
        import zstandard

        self._zstandard = zstandard
        self._path = path
        self._raw = open(path, "rb")
        self._pending = memoryview(b"")
        self._frame_started = False
        self._new_frame()

    def _new_frame(self) -> None:
        # Large window: some corpora (The Pile) are compressed with --long.
        self._frame = self._zstandard.ZstdDecompressor(max_window_size=2**31).decompressobj()
        self._frame_started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not len(self._pending):
            compressed = self._raw.read(1 << 20)
            if not compressed:
                if self._frame_started and not self._frame.eof:
                    raise EOFError(f"{self._path} ends inside a zstd frame: the file is truncated")
                return 0
            self._pending = memoryview(self._decompress(compressed))
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def _decompress(self, compressed: bytes) -> bytes:
        pieces = []
        while compressed:
            self._frame_started = True
            try:
                pieces.append(self._frame.decompress(compressed))
            except self._zstandard.ZstdError as err:  # not an OSError: say which file, as for a truncated one
                raise OSError(f"{self._path} holds corrupt zstd data: {err}") from err
            if not self._frame.eof:
                break
            compressed = self._frame.unused_data  # the next frame starts here
            self._new_frame()
        return b"".join(pieces)

    def close(self) -> None:
        self._raw.close()
        super().close()


BYTE_ORDER_MARK = "\ufeff"  # UTF-8's optional signature at the start of a file (Windows editors write it): not text


def iter_records(path: str | os.PathLike, text_field: str = "text", txt_mode: str = "file") -> Iterator[Record]:
    """Every record of one file in order: its text, or Skipped(reason) for a record that yields no document."""
    kind = file_format(path)
    if kind == "jsonl":
        yield from _iter_jsonl(path, text_field)
    elif kind == "parquet":
        yield from _iter_parquet(path, text_field)
    else:
        if txt_mode not in TXT_MODES:
            raise ValueError(f"txt_mode={txt_mode!r} is not one of {TXT_MODES}")
        yield from _iter_txt(path, txt_mode)


def _checked(text: str) -> Record:
    return text if text.strip() else Skipped("empty")


def _iter_jsonl(path, text_field: str) -> Iterator[Record]:
    with open_binary(path) as stream:
        yield from iter_jsonl_lines(stream, text_field)


def iter_jsonl_lines(lines: Iterable[bytes], text_field: str) -> Iterator[Record]:
    """Records of JSON Lines given as raw byte lines."""
    for raw_line in lines:
        if not raw_line.strip():
            continue  # blank lines separate nothing in JSON Lines; they are not records
        try:
            line = raw_line.decode("utf-8").removeprefix(BYTE_ORDER_MARK)  # an editor's mark before the first record
        except UnicodeDecodeError:
            yield Skipped("non_utf8")
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            yield Skipped("malformed_json")
            continue
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            yield Skipped("missing_text_field")
            continue
        text = record[text_field]
        if _has_lone_surrogate(text):
            yield Skipped("non_utf8")  # JSON "\ud800" escapes decode to text that cannot be encoded as UTF-8
            continue
        yield _checked(text)


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _iter_parquet(path, text_field: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        # Every row lacks the field: count them rather than fail, like a JSON line without it.
        for _ in range(parquet.metadata.num_rows):
            yield Skipped("missing_text_field")
        return
    for group in range(parquet.num_row_groups):
        for value in parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist():
            yield parquet_value(value)


def parquet_value(value) -> Record:
    """The record for one parquet cell of the text column (string, or binary holding UTF-8)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return Skipped("non_utf8")
    if not isinstance(value, str):
        return Skipped("missing_text_field")
    return _checked(value)


def _iter_txt(path, txt_mode: str) -> Iterator[Record]:
    with open_binary(path) as stream:
        if txt_mode == "file":
            data = stream.read()
            try:
                yield _checked(data.decode("utf-8").removeprefix(BYTE_ORDER_MARK))
            except UnicodeDecodeError:
                yield Skipped("non_utf8")
            return
        block: list[bytes] = []
        for raw_line in stream:
            if raw_line.strip():
                block.append(raw_line)
            elif block:
                yield _decode_block(block)
                block = []
        if block:
            yield _decode_block(block)


def _decode_block(lines: list[bytes]) -> Record:
    try:
        return _checked(b"".join(lines).decode("utf-8").removeprefix(BYTE_ORDER_MARK).rstrip("\r\n"))
    except UnicodeDecodeError:
        return Skipped("non_utf8")


class EmptyCorpus(ValueError):
    """The inputs hold no document: nothing to train a tokenizer on or to tokenize."""


def empty_corpus(files: Sequence[str], text_field: str, skipped: Optional[Mapping[str, int]] = None) -> EmptyCorpus:
    """The error for inputs without a document: which files, and why their records gave none."""
    shown = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
    if skipped:
        why = "every record was skipped (" + ", ".join(f"{r} {n}" for r, n in sorted(skipped.items())) + ")"
    else:
        why = "they hold no text" if len(files) > 1 else "it holds no text"
    hint = f"; is the text in another field than {text_field!r}? give --text-field" \
        if skipped and skipped.get("missing_text_field") else ""
    return EmptyCorpus(f"no documents found in {shown}: {why}{hint}")


def given_inputs(err: EmptyCorpus, inputs: Sequence[str], files: Sequence[str]) -> EmptyCorpus:
    """``err`` naming the ``--input`` values too, when they are more than the files it names (globs, directories)."""
    if sorted(os.path.abspath(i) for i in inputs) == sorted(files):
        return err
    return EmptyCorpus(f"--input {' '.join(inputs)}: {err}")


def iter_documents(files: Sequence[str], text_field: str = "text", txt_mode: str = "file") -> Iterator[str]:
    """Only the documents of several files, in order (bad records dropped): for tokenizer training and inspection."""
    for path in files:
        for record in iter_records(path, text_field, txt_mode):
            if isinstance(record, str):
                yield record
