"""A minimal safetensors reader and writer, plus sharded checkpoints with an index.

File format: an 8-byte little-endian header length n, n bytes of JSON, then the data region. The
JSON maps each tensor name to {dtype, shape, data_offsets: [begin, end]} (offsets relative to the
data region) and may hold "__metadata__": {str: str}. Our writer pads the JSON with spaces to a
multiple of 8 bytes, orders tensors by name and packs them back to back.

Reading maps the file read-only (np.memmap): tensors are views in their storage dtype (BF16 as
uint16 bit patterns), nothing is copied. Writing streams one tensor at a time into a temporary file
that replaces the target only once complete, so checkpoints of many GB never sit in memory twice.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import NamedTuple, TypeVar

import numpy as np

from ..errors import CheckpointError
from .dtypes import SAFETENSORS_DTYPES

T = TypeVar("T")

# Shard size limit, as mlx-lm's default (5 GiB).
DEFAULT_SHARD_SIZE = 5 << 30
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def find_shards(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the index if there is one, else every file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            if not stat.S_ISREG(index.stat().st_mode):
                raise CheckpointError(f"{index}: not a regular file")
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{index}: malformed index ({type(e).__name__}: {str(e)[:200]})") from None
        for f in files:  # plain names inside the folder (symlinked files, as in the hub cache, are fine)
            parts = PurePosixPath(f).parts if isinstance(f, str) else ()
            if not parts or f.startswith("/") or "\\" in f or ":" in f or any(p in ("..", ".") for p in parts):
                raise CheckpointError(f"{index}: shard name {str(f)[:100]!r} is not a file name inside the "
                                      f"checkpoint folder")
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no .safetensors files (and no model.safetensors.index.json)")
    return files


class TensorInfo(NamedTuple):
    """Where one tensor lives: dtype string, shape, byte size, absolute byte offset in the file."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


class LazyTensor(NamedTuple):
    """A tensor known by dtype and shape whose storage array is produced on demand by `load()`."""

    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPES[self.dtype].itemsize


# Bits that are all ones in the exponent of a NaN or an infinity, per float storage dtype.
_EXPONENT_MASKS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000),
                   "F64": (np.uint64, 0x7FF0000000000000)}


def first_non_finite(array: np.ndarray, dtype: str, chunk: int = 1 << 24) -> int | None:
    """The flat index of the first NaN or infinity in a stored float tensor (its storage array), or
    None (also for non-float dtypes). Vectorised on the bit patterns, chunk by chunk (no big temporaries)."""
    if dtype not in _EXPONENT_MASKS:
        return None
    bits, mask = _EXPONENT_MASKS[dtype]
    flat = array.reshape(-1).view(bits)
    mask = bits(mask)
    for i in range(0, flat.size, chunk):
        part = flat[i:i + chunk]
        bad = (part & mask) == mask
        if bad.any():
            return i + int(np.argmax(bad))
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SafetensorsFile:
    """One safetensors file, validated on open and memory-mapped read-only.

    Every problem raises CheckpointError naming the file, and the tensor where there is one.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
                raise CheckpointError(f"{self.path}: not a regular file")
            size = st.st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: {size} bytes is too short for a safetensors file")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > size - 8:
                    raise CheckpointError(
                        f"{self.path}: header length {header_len} runs past the end of the file "
                        f"({size} bytes)"
                    )
                header_bytes = f.read(header_len)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read safetensors file: {e}") from e
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is a JSON {type(header).__name__}, not an object")

        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise CheckpointError(f"{self.path}: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = metadata

        data_start = 8 + header_len
        self._infos = {
            name: self._parse_entry(name, entry, data_start, size - data_start)
            for name, entry in header.items()
        }
        spans = sorted((i.offset, i.offset + i.nbytes, name) for name, i in self._infos.items() if i.nbytes)
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{self.path}: tensors {a!r} and {b!r} overlap in the file")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _parse_entry(self, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{where}: entry must hold dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of ints")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] are inverted or negative")
        if end > data_size:
            raise CheckpointError(
                f"{where}: data_offsets end {end} is past the data region ({data_size} bytes); "
                "truncated file?"
            )
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: {end - begin} bytes stored but {dtype} {shape} needs {expected}"
            )
        return TensorInfo(dtype, tuple(shape), expected, data_start + begin)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop this object's mapping; arrays already returned keep theirs alive."""
        self._map = None

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def names(self) -> list[str]:
        """Tensor names in header order."""
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

    def get(self, name: str) -> np.ndarray:
        """Read-only view of tensor `name` in its storage dtype (BF16 as uint16), shaped as stored."""
        info = self.info(name)
        if self._map is None:
            raise CheckpointError(f"{self.path}: file is closed")
        raw = self._map[info.offset : info.offset + info.nbytes]
        return raw.view(dtype=SAFETENSORS_DTYPES[info.dtype].numpy, type=np.ndarray).reshape(info.shape)

    def lazy(self, name: str) -> LazyTensor:
        """Tensor `name` as a LazyTensor whose load() returns the mapped view."""
        info = self.info(name)
        return LazyTensor(info.dtype, info.shape, lambda: self.get(name))


class SafetensorsWriter:
    """Streams tensors into one safetensors file whose header is fixed up front.

    Call `write` once per name, in the order of `names` (sorted). Used as a context manager, the
    file appears at `path` only when every tensor was written; on error nothing replaces `path`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: Mapping[str, tuple[str, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = Path(path)
        self.names = sorted(specs)
        self._specs = {name: (specs[name][0], tuple(specs[name][1])) for name in self.names}
        header: dict[str, object] = {}
        if metadata is not None:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for name in self.names:
            dtype, shape = self._specs[name]
            if dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r}: unknown dtype {dtype!r}")
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
        header_bytes += b" " * (-len(header_bytes) % 8)

        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Not tempfile.mkstemp: its files are mode 0600, ours should get the usual umask-based mode.
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        self._file = open(self._tmp, "xb")
        self._file.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        """Append tensor `name`; `array` must have the storage dtype and the declared shape."""
        if self._next >= len(self.names) or name != self.names[self._next]:
            expected = self.names[self._next] if self._next < len(self.names) else "nothing"
            raise CheckpointError(f"{self.path}: wrote {name!r} but the next tensor is {expected!r}")
        dtype, shape = self._specs[name]
        storage = SAFETENSORS_DTYPES[dtype].numpy
        same_type = array.dtype.kind == storage.kind and array.dtype.itemsize == storage.itemsize
        if not same_type or array.shape != shape:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} is {array.dtype} {array.shape}, declared {dtype} {shape}"
            )
        self._file.write(np.ascontiguousarray(array, dtype=storage).data)
        self._next += 1

    def close(self) -> None:
        """Finish the file and move it into place; fails if some tensor was not written."""
        self._file.close()
        if self._next != len(self.names):
            self.abort()
            missing = self.names[self._next]
            raise CheckpointError(f"{self.path}: {missing!r} and later tensors were never written")
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Discard the partial file."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_file(
    path: str | os.PathLike,
    tensors: Mapping[str, tuple[str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` {name: (safetensors dtype, array in storage dtype)} to one file at `path`."""
    with SafetensorsWriter(path, {n: (d, a.shape) for n, (d, a) in tensors.items()}, metadata) as writer:
        for name in writer.names:
            writer.write(name, tensors[name][1])


def _natural_key(name: str) -> list[object]:
    # "layers.2" before "layers.10", so each shard holds a contiguous run of layers.
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def plan_shards(tensors: Mapping[str, LazyTensor], shard_size: int) -> list[list[str]]:
    """Split tensor names into shards of at most `shard_size` bytes (a bigger tensor gets its own).

    Tensors of one module (`x.weight`, `x.scales`, `x.biases`) always share a shard.
    """
    modules: dict[str, list[str]] = {}
    for name in sorted(tensors, key=_natural_key):
        modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    shards: list[list[str]] = [[]]
    size = 0
    for names in modules.values():
        module_size = sum(tensors[n].nbytes for n in names)
        if shards[-1] and size + module_size > shard_size:
            shards.append([])
            size = 0
        shards[-1].extend(names)
        size += module_size
    return shards


def produced_in_order(jobs: Iterable[Callable[[], T]], workers: int) -> Iterator[T]:
    """Yield job() for each job in order, computing up to 2*workers ahead on a thread pool."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future] = deque()
        try:
            for job in jobs:
                pending.append(pool.submit(job))
                if len(pending) > 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def save_sharded(
    directory: str | os.PathLike,
    tensors: Mapping[str, LazyTensor],
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    workers: int = 1,
    on_write: Callable[[int], object] | None = None,
) -> list[Path]:
    """Write `tensors` as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}) when they exceed
    `shard_size` bytes. Tensors are loaded lazily, `workers` at a time, and written sequentially;
    `on_write(nbytes)` is called after each (progress).

    Checkpoint files of ours left in `directory` by an earlier write are removed. Returns the files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(tensors, shard_size)
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for old in directory.iterdir():
        is_ours = old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(old.name)
        if is_ours and old.name not in files:
            old.unlink()

    order = [name for shard in shards for name in sorted(shard)]
    arrays = produced_in_order((tensors[name].load for name in order), workers)
    try:
        for file, shard in zip(files, shards):
            specs = {name: (tensors[name].dtype, tensors[name].shape) for name in shard}
            with SafetensorsWriter(directory / file, specs, metadata) as writer:
                for name in writer.names:
                    writer.write(name, next(arrays))
                    if on_write is not None:
                        on_write(tensors[name].nbytes)
    finally:
        arrays.close()

    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {name: file for file, shard in zip(files, shards) for name in shard},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [directory / file for file in files]
