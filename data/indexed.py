"""The megatron-core IndexedDataset `.bin/.idx` format, read and written with numpy and checked for integrity.

Byte layout of `.idx` (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`): the 9-byte magic `MMIDIDX\\0\\0`,
version u64 = 1, dtype code u8, sequence count u64, document count u64, then int32 sequence lengths, int64 byte
offsets of each sequence in `.bin`, int64 document boundaries (sequence indices, starting at 0). `.bin` is the tokens.
Writing it here (rather than through megatron's IndexedDatasetBuilder) keeps preprocessing workers free of the
megatron-core import and of per-token Python lists; tests check the bytes equal the builder's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
# megatron-core's DType codes.
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
               np.uint16: 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class ShardError(ValueError):
    """A `.bin/.idx` pair is missing, truncated or inconsistent; the message names the file."""


def token_dtype(vocab_size: int) -> type:
    """megatron-core's choice (DType.optimal_dtype): uint16 below 65500 ids, int32 otherwise."""
    return np.uint16 if vocab_size < 65500 else np.int32


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def write_index(path: str, dtype: type, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an `.idx` file exactly as megatron-core's `_IndexWriter` does."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as stream:
        stream.write(INDEX_MAGIC)
        stream.write(struct.pack("<Q", INDEX_VERSION))
        stream.write(struct.pack("<B", DTYPE_CODES[dtype]))
        stream.write(struct.pack("<Q", len(lengths)))
        stream.write(struct.pack("<Q", len(documents)))
        stream.write(lengths.tobytes(order="C"))
        stream.write(pointers.tobytes(order="C"))
        stream.write(documents.tobytes(order="C"))


@dataclass
class IndexContents:
    dtype: type
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)


def read_index(path: str) -> IndexContents:
    """Parse an `.idx` file, raising ShardError (naming the file) when its header or length is wrong."""
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise ShardError(f"index file {path} is missing ({err.strerror})") from None
    with open(path, "rb") as stream:
        header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise ShardError(f"index file {path} is not a megatron-core .idx file (bad or truncated header)")
    version, code, sequence_count, document_count = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
    if version != INDEX_VERSION or code not in CODE_DTYPES:
        raise ShardError(f"index file {path} has version {version} / dtype code {code}; expected version 1 and one "
                         f"of the codes {sorted(CODE_DTYPES)}")
    expected = HEADER_BYTES + sequence_count * (4 + 8) + document_count * 8
    if size != expected:
        raise ShardError(f"index file {path} is {size} bytes but its header ({sequence_count} sequences, "
                         f"{document_count} document boundaries) implies {expected}: the file is truncated or corrupt")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    offset = HEADER_BYTES
    lengths = np.frombuffer(data, dtype=np.int32, count=sequence_count, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(data, dtype=np.int64, count=sequence_count, offset=offset)
    offset += pointers.nbytes
    documents = np.frombuffer(data, dtype=np.int64, count=document_count, offset=offset)
    return IndexContents(CODE_DTYPES[code], lengths, pointers, documents)


def verify_shard(prefix: str, *, vocab_size: Optional[int] = None, check_tokens: bool = False,
                 allow_empty: bool = False) -> IndexContents:
    """Check that `prefix.bin` and `prefix.idx` are a consistent pair; raise ShardError naming the bad file.

    Cheap checks (sizes, offsets, document boundaries) always; with `check_tokens`, also that every token id is
    below `vocab_size` (a full read of `.bin`). A shard with no tokens is refused unless `allow_empty` (a part of a
    file whose records were all skipped is legitimately empty; a training shard is not).
    """
    index = read_index(idx_path(prefix))
    data_path = bin_path(prefix)
    try:
        bin_size = os.path.getsize(data_path)
    except OSError as err:
        raise ShardError(f"data file {data_path} is missing ({err.strerror})") from None
    itemsize = np.dtype(index.dtype).itemsize
    expected = index.num_tokens * itemsize
    if bin_size != expected:
        raise ShardError(f"data file {data_path} is {bin_size} bytes but {idx_path(prefix)} describes "
                         f"{index.num_tokens} tokens of {itemsize} bytes = {expected} bytes: the pair is truncated "
                         f"or mismatched; rerun preprocessing")
    if len(index.sequence_lengths):
        if (index.sequence_lengths < 0).any():
            raise ShardError(f"index file {idx_path(prefix)} has negative sequence lengths")
        ends = index.sequence_pointers + index.sequence_lengths.astype(np.int64) * itemsize
        if index.sequence_pointers[0] != 0 or (index.sequence_pointers[1:] != ends[:-1]).any():
            raise ShardError(f"index file {idx_path(prefix)} has sequence offsets that do not tile {data_path}")
    documents = index.document_indices
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(index.sequence_lengths) or \
            (np.diff(documents) < 0).any():
        raise ShardError(f"index file {idx_path(prefix)} has document boundaries that do not cover its "
                         f"{len(index.sequence_lengths)} sequences")
    if index.num_tokens == 0 and not allow_empty:
        raise ShardError(f"data file {data_path} holds no tokens (every input record was skipped?); see "
                         f"{prefix}.manifest.json")
    if check_tokens and vocab_size is not None and index.num_tokens:
        tokens = np.memmap(data_path, dtype=index.dtype, mode="r")
        largest = int(tokens.max())
        if largest >= vocab_size:
            raise ShardError(f"data file {data_path} holds token id {largest}, outside the tokenizer's vocabulary "
                             f"of {vocab_size}: it was made with another tokenizer")
    return index
