"""A run's checkpoint directory on disk: names, the ``latest`` pointer, retention, free space, and the manifest that
makes every checkpoint verifiable. Standard library only, so that train.py's start-up checks and the command lines
read checkpoints before (or without) importing torch.

    step_00000100/          a complete checkpoint: its files, trainer_state.json, then manifest.json
    step_00000300.damaged/  a checkpoint that failed verification, moved aside (kept as evidence, never loaded)
    latest                  the name of the newest complete checkpoint (replaced atomically)
    .step_00000400.tmp/     a save in progress (or one killed mid-way); never loaded, removed by the next save

**The manifest** (``manifest.json``, written last inside the temporary directory, before the rename that makes the
checkpoint visible) records every file's size and crc32. Each rank records the files it wrote, where it wrote them
(megatron-core's torch_dist writer, in its background process for an asynchronous save), in a ``.files.rank*.json``
record that rank 0 merges, adding what it wrote itself (``common.pt``, ``.metadata``, ``trainer_state.json``).
crc32 (zlib: about 4 GB/s a core here, and it releases the GIL, so the files of one rank hash in parallel) finds a
flipped byte or a truncated, missing or replaced file; it is no defence against tampering.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import pickle
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from diff_transformer.fileio import atomic_write_json, move_aside  # noqa: F401  (move_aside: importable from here)

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
# trainer_state.json's format: 2 and later are committed with a manifest (a checkpoint of format 1 predates it)
FORMAT_WITH_MANIFEST = 2
DAMAGED_SUFFIX = ".damaged"
RANK_RECORD_PREFIX = ".files.rank"  # a rank's record of the files it wrote (and its temporary file while written)
_RANK_RECORD = RANK_RECORD_PREFIX + "{rank:05d}.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_CHUNK_BYTES = 8 << 20

logger = logging.getLogger("diff_transformer")


# ------------------------------------------------------------------------------------------------------------------
# Names, the latest pointer, retention
# ------------------------------------------------------------------------------------------------------------------
def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(cfg, run_dir: str) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir, CHECKPOINTS_DIRNAME)


def is_complete(path: str) -> bool:
    """A checkpoint is complete once its trainer_state.json exists: it is written after every tensor file."""
    return os.path.isfile(os.path.join(path, STATE_FILE))


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def incomplete_checkpoints(root: str) -> List[str]:
    """``step_*`` directories under ``root`` without their trainer_state.json: never loadable (saves are renamed into
    place complete), so damaged; a save of their step could not be renamed over them."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, name) for name in os.listdir(root)
                  if _STEP_DIR.match(name) and not is_complete(os.path.join(root, name)))


def _read_pointer(root: str) -> Tuple[bool, Optional[str]]:
    """(whether ``latest`` exists, the checkpoint name it holds or None when it holds anything else)."""
    pointer = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(pointer):
        return False, None
    with open(pointer, "rb") as f:
        raw = f.read(4096)
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return True, None
    return True, name if _STEP_DIR.match(name) else None


def pointer_target(root: str) -> Optional[str]:
    """The checkpoint name ``latest`` holds, or None when there is no pointer or it holds no checkpoint name."""
    return _read_pointer(root)[1]


def pointer_problem(root: str) -> Optional[str]:
    """What is wrong with ``latest`` under ``root`` (it holds no checkpoint name, or names one that is missing or
    incomplete), or None when it names a complete checkpoint or there is no pointer."""
    exists, name = _read_pointer(root)
    if not exists:
        return None
    if name is None:
        return f"{os.path.join(root, LATEST_FILE)} holds no checkpoint name (step_NNNNNNNN)"
    path = os.path.join(root, name)
    if is_complete(path):
        return None
    why = "is missing" if not os.path.exists(path) else f"is incomplete (no {STATE_FILE})"
    return f"{os.path.join(root, LATEST_FILE)} names {name}, which {why}"


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint that ``latest`` names; the newest complete one when the pointer is absent or unusable."""
    problem = pointer_problem(root)
    name = pointer_target(root)
    if name is not None and problem is None:
        return os.path.join(root, name)
    if problem is not None:
        logger.warning("%s; using the newest complete checkpoint", problem)
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def rerun_advice(root: str) -> str:
    """How to go on after a run stopped, true for what ``root`` holds: the same command resumes the latest
    checkpoint; with none saved yet, a rerun must start over (overwrite_run=true keeps the stopped run aside)."""
    if list_checkpoints(root):
        return f"rerun the same command (it resumes from {pointer_target(root) or 'the newest checkpoint'})"
    return ("rerun the same command with overwrite_run=true (no checkpoint was saved yet: the run starts again from "
            "step 0 and the stopped one is kept aside)")


def resolve_checkpoint_path(path: str) -> str:
    """The checkpoint meant by ``path``, a path a user gave: a step_* checkpoint; a checkpoints directory or a run
    directory (its ``checkpoints/``), then the checkpoint its ``latest`` names (the newest complete one when there is
    no pointer); or a ``latest`` pointer file, then the checkpoint it names. A pointer that names no complete
    checkpoint is refused, never replaced by another checkpoint (ValueError naming what is there)."""
    if os.path.isfile(path) and os.path.basename(path) == LATEST_FILE:
        path = os.path.dirname(path) or "."
    if is_complete(path):
        return path
    for root in (path, os.path.join(path, CHECKPOINTS_DIRNAME)):
        problem = pointer_problem(root)
        if problem is not None:
            found = list_checkpoints(root)
            newest = f"the newest complete one is {found[-1][1]}" if found else f"{root} holds no complete checkpoint"
            raise ValueError(f"{problem}: give the step_* checkpoint to load ({newest})")
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise ValueError(
        f"{path} is not a checkpoint: give a step_* checkpoint directory (holding {STATE_FILE}), a checkpoints "
        f"directory or run directory holding one, or a {LATEST_FILE} file"
    )


def read_trainer_state(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def saved_engine(saved: Dict[str, Any]) -> str:
    """The engine that wrote a checkpoint (checkpoints from before engines were recorded are megatron-core's)."""
    return saved["layout"].get("engine", "megatron")


def describe(path: str) -> Dict[str, Any]:
    """What a checkpoint says about itself (``checkpoint inspect``), read from its trainer_state.json."""
    path = resolve_checkpoint_path(path)
    try:
        state = read_trainer_state(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {path}: {STATE_FILE} is unreadable ({err})") from None
    model = state["config"]["model"]
    return {
        "path": path,
        "step": state["step"],
        "consumed_samples": state["consumed_samples"],
        "skipped_steps": state.get("skipped_steps", 0),
        "layout": state["layout"],
        "model": model,
        "num_parameters": state.get("num_parameters"),
        "size_bytes": directory_bytes(path),
        "wandb_run_id": state.get("wandb_run_id"),
        "saved_at": state.get("saved_at"),
        "save_seconds": state.get("save_seconds"),
        "engine": saved_engine(state),
        "weights_only": bool(state.get("weights_only")),
        "converted_from": state.get("converted_from"),
    }


def checkpoints_to_delete(steps: List[int], keep_last: int, keep_every: int) -> List[int]:
    """Steps that fall outside the newest ``keep_last`` and the multiples of ``keep_every``."""
    newest = set(sorted(steps)[-keep_last:])
    return [s for s in sorted(steps) if s not in newest and not (keep_every and s % keep_every == 0)]


def apply_retention(root: str, keep_last: int, keep_every: int) -> List[str]:
    removed = []
    by_step = dict(list_checkpoints(root))
    for step in checkpoints_to_delete(list(by_step), keep_last, keep_every):
        shutil.rmtree(by_step[step], ignore_errors=True)
        removed.append(by_step[step])
    return removed


def partial_saves(root: str) -> List[str]:
    """Temporary directories of saves that never completed (a process killed mid-save)."""
    if not os.path.isdir(root):
        return []
    return sorted(
        os.path.join(root, name) for name in os.listdir(root) if name.startswith(".step_") and name.endswith(".tmp")
    )


# ------------------------------------------------------------------------------------------------------------------
# Sizes and free space
# ------------------------------------------------------------------------------------------------------------------
def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def checkpoint_bytes(path: str) -> int:
    try:
        manifest = read_manifest(path)
    except ValueError:
        manifest = None
    return int(manifest["bytes"]) if manifest and "bytes" in manifest else directory_bytes(path)


def room_choices(root: str, keep_last: int) -> str:
    """What to do when the checkpoint disk at ``root`` has no room, true for what ``root`` holds."""
    return (
        f"free space there and {rerun_advice(root)}; or move {root} to a disk with room and rerun with "
        f"checkpoint.dir set to its new place (checkpoint.resume=auto finds the moved checkpoints); or keep fewer "
        f"checkpoints (checkpoint.keep_last, now {keep_last})"
    )


def ensure_free_space(root: str, needed_bytes: int, keep_last: int = 1) -> None:
    """Refuse (ValueError) to start a run whose checkpoint disk cannot hold one more checkpoint (start-up check)."""
    free = free_bytes(root)
    if free < needed_bytes:
        raise ValueError(
            f"the checkpoint disk at {root} has {format_bytes(free)} free, less than one checkpoint "
            f"({format_bytes(needed_bytes)}); {room_choices(root, keep_last)}; or skip this check "
            "(checkpoint.check_free_space=false)"
        )


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more, to three significant digits (1.53 MiB,
    312 KiB, 17 B): a size never reads as 0.00 of a unit too large for it."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.0f} {units[unit]}" if value >= 100 else f"{value:.3g} {units[unit]}"


# ------------------------------------------------------------------------------------------------------------------
# Checksums and the manifest
# ------------------------------------------------------------------------------------------------------------------
def file_crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK_BYTES)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _hash_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def record_files(paths: Iterable[str], root: str, checksums: bool = True) -> Dict[str, Dict[str, object]]:
    """{path relative to ``root``: {"bytes": size, "crc32": hex}} of ``paths`` (no crc32 when ``checksums`` is
    false), hashed on several threads."""
    paths = list(paths)

    def one(path: str) -> Tuple[str, Dict[str, object]]:
        entry: Dict[str, object] = {"bytes": os.path.getsize(path)}
        if checksums:
            entry["crc32"] = file_crc32(path)
        return os.path.relpath(path, root), entry

    if len(paths) <= 1:
        return dict(one(p) for p in paths)
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), _hash_threads())) as pool:
        return dict(pool.map(one, paths))


def write_rank_record(directory: str, rank: int, paths: Iterable[str], checksums: bool = True) -> None:
    """The record of the files one rank wrote into ``directory`` (merged into the manifest by rank 0)."""
    atomic_write_json(os.path.join(directory, _RANK_RECORD.format(rank=rank)), record_files(paths, directory, checksums))


def _walk_files(directory: str) -> List[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(directory) for f in files)


def write_manifest(directory: str, checksums: bool = True) -> Dict[str, object]:
    """Merge the ranks' records, record every file they did not (this rank's own, trainer_state.json), write
    ``manifest.json`` and drop the records. Call last, once every file of the checkpoint is written."""
    files: Dict[str, Dict[str, object]] = {}
    records = [p for p in _walk_files(directory) if os.path.basename(p).startswith(RANK_RECORD_PREFIX)]
    for record in records:
        with open(record) as f:
            files.update(json.load(f))
    rest = [
        p for p in _walk_files(directory)
        if p not in records and os.path.relpath(p, directory) not in files and os.path.basename(p) != MANIFEST_FILE
    ]
    files.update(record_files(rest, directory, checksums))
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "checksum": "crc32" if checksums else None,
        "files": dict(sorted(files.items())),
        "bytes": sum(int(e["bytes"]) for e in files.values()),
    }
    atomic_write_json(os.path.join(directory, MANIFEST_FILE), manifest)
    for record in records:
        os.remove(record)
    return manifest


def write_checkpoint_state(directory: str, state: Dict[str, object], checksums: bool = True) -> Dict[str, object]:
    """Commit a checkpoint's files: ``trainer_state.json`` (which marks it complete), then the manifest of every
    file; the caller then renames ``directory`` into place. Returns the manifest."""
    atomic_write_json(os.path.join(directory, STATE_FILE), state)
    return write_manifest(directory, checksums)


@dataclass
class Verification:
    """What ``verify`` found: ``problems`` (one line each, naming the file; empty when the checkpoint is sound),
    whether a manifest vouched for the files, and how much was read."""

    path: str
    problems: List[str] = field(default_factory=list)
    has_manifest: bool = False
    checksums: bool = False
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        return "; ".join(self.problems)


def read_manifest(path: str) -> Optional[Dict[str, object]]:
    """The manifest of checkpoint ``path``; None when it has none; ValueError when it cannot be read."""
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("it lists no files")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{MANIFEST_FILE} is unreadable ({err})") from None
    return manifest


def state_format(path: str) -> Optional[int]:
    """trainer_state.json's format_version, or None when the file cannot be read."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return int(json.load(f).get("format_version", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        return None


# ------------------------------------------------------------------------------------------------------------------
# What this code refuses to load: a newer format, and a .metadata that would run code
# ------------------------------------------------------------------------------------------------------------------
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a torch_dist checkpoint: a pickle
_DCP = "torch.distributed.checkpoint"
# Every global a torch_dist .metadata may name (recorded from real checkpoints): torch's checkpoint dataclasses and
# enums, torch.Size, the dtypes and the layout reader. A pickle may construct anything it names, so nothing else.
_TORCH_DTYPES = (
    "float32", "float16", "bfloat16", "float64", "complex64", "complex128", "int64", "int32", "int16", "int8",
    "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu",
)
DCP_METADATA_GLOBALS = frozenset(
    [("torch", "Size"), ("torch.serialization", "_get_layout"), (f"{_DCP}.filesystem", "_StorageInfo")]
    + [("torch", name) for name in _TORCH_DTYPES]
    + [(f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")]
    + [("builtins", name) for name in ("set", "frozenset", "slice")]
    + [("collections", "OrderedDict")]
)


class CheckpointRefused(ValueError):
    """A checkpoint this code will not load: a file that would run code when read, or a format newer than it
    reads. Unlike damage, never passed over for an older checkpoint: someone has to look."""


class _Inert:
    """What a global admitted by the check stands for when nothing is to be built: takes any arguments and state."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the globals of DCP_METADATA_GLOBALS (``build``: the real ones, else inert stand-ins, so that
    checking a file imports nothing); any other raises CheckpointRefused naming the file and the global."""

    def __init__(self, file, path: str, build: bool):
        super().__init__(file)
        self.path, self.build = path, build

    def find_class(self, module: str, name: str):
        if (module, name) not in DCP_METADATA_GLOBALS:
            raise CheckpointRefused(
                f"{self.path} names {module}.{name}, which a torch_dist checkpoint's metadata never holds: loading it "
                "could run code planted in the file, so it is refused; load only checkpoints from a source you trust"
            )
        return super().find_class(module, name) if self.build else _Inert

    def persistent_load(self, pid):
        raise CheckpointRefused(f"{self.path} holds a persistent reference, which a torch_dist .metadata never does")


def read_dcp_metadata(path: str, build: bool = True):
    """torch_dist's ``.metadata`` at ``path``, unpickled with only the format's own classes (``build`` False: checked
    only, with stand-ins and without importing torch). CheckpointRefused for anything else."""
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f, path, build).load()
        except CheckpointRefused:
            raise
        except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
            raise ValueError(f"{path} is unreadable ({type(err).__name__}: {err})") from None


def check_readable(path: str) -> None:
    """Refuse (CheckpointRefused) a checkpoint this code must not load: trainer_state.json or the manifest of a newer
    format than it reads, or a ``.metadata`` naming anything but the format's classes."""
    newest = (
        (STATE_FILE, state_format(path), FORMAT_WITH_MANIFEST, "format_version"),
        (MANIFEST_FILE, _manifest_version(path), MANIFEST_VERSION, "manifest_version"),
    )
    for name, found, known, key in newest:
        if found is not None and found > known:
            raise CheckpointRefused(
                f"checkpoint {path} has {key} {found} in its {name}, newer than this code reads ({key} {known}): "
                "load it with the version of this framework that saved it, or a newer one"
            )
    metadata = os.path.join(path, DCP_METADATA)
    if os.path.isfile(metadata):
        try:
            read_dcp_metadata(metadata, build=False)
        except CheckpointRefused:
            raise
        except ValueError:
            pass  # damage, not danger: verification names it (or the loader does, for an unmanifested checkpoint)


def _manifest_version(path: str) -> Optional[int]:
    try:
        with open(os.path.join(path, MANIFEST_FILE)) as f:
            return int(json.load(f).get("manifest_version", MANIFEST_VERSION))
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def verify(path: str, checksums: bool = True) -> Verification:
    """Check checkpoint ``path`` against its manifest: every listed file present, of its size, and (``checksums``)
    of its crc32. A checkpoint of format 1 has no manifest: reported with ``has_manifest`` false and no problem
    (the caller decides what an unverified checkpoint is worth). A checkpoint it must not load at all (a newer
    format, a ``.metadata`` that would run code) raises CheckpointRefused (``check_readable``)."""
    start = time.perf_counter()
    result = Verification(path)
    if not os.path.isdir(path):
        result.problems.append(f"{path} is not a directory")
        return result
    check_readable(path)
    try:
        manifest = read_manifest(path)
    except ValueError as err:
        result.problems.append(str(err))
        return result
    if manifest is None:
        if not os.path.isfile(os.path.join(path, STATE_FILE)):
            result.problems.append(f"{STATE_FILE} is missing")
        elif (state_format(path) or FORMAT_WITH_MANIFEST) >= FORMAT_WITH_MANIFEST:
            result.problems.append(f"{MANIFEST_FILE} is missing (the checkpoint was saved with one)")
        return result
    result.has_manifest = True
    result.checksums = checksums and manifest.get("checksum") == "crc32"
    listed: Dict[str, Dict[str, object]] = manifest["files"]  # type: ignore[assignment]
    to_hash = []
    for name, entry in listed.items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            result.problems.append(f"{name}: missing")
            continue
        size, recorded = os.path.getsize(file_path), int(entry["bytes"])
        if size != recorded:
            how = "truncated" if size < recorded else "grown"
            result.problems.append(f"{name}: {size:,} bytes, the manifest records {recorded:,} ({how})")
            continue
        result.files += 1
        result.bytes += size
        if result.checksums and "crc32" in entry:
            to_hash.append((name, file_path, entry["crc32"]))
    if to_hash:
        with concurrent.futures.ThreadPoolExecutor(min(len(to_hash), _hash_threads())) as pool:
            found = list(pool.map(lambda item: file_crc32(item[1]), to_hash))
        for (name, _, recorded), crc in zip(to_hash, found):
            if crc != recorded:
                result.problems.append(f"{name}: crc32 {crc}, the manifest records {recorded} (contents changed)")
    result.seconds = time.perf_counter() - start
    return result
