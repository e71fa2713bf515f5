"""Snapshot files: a session's state saved to disk and loaded back (``Snapshot.save``,
``Model.load_snapshot``, ``Session.restore(path)``); docs/generation.md describes the format.

Layout (all integers little-endian)::

    0   magic      8 bytes  b"LILYSNAP"
    8   version    u32      1
    12  flags      u32      0 (reserved)
    16  header_len u64      length of the JSON header that follows
    24  header     JSON (UTF-8), padded with spaces so that the data starts at a multiple of 64
    ..  data       the blobs, each at data_start + its offset (64-aligned), raw little-endian values

The header names the model (a hash of its config, which it also stores, and a fingerprint of its
weights: every tensor's name, storage form, shape and a few sampled bytes), the device and dtypes the
state was kept in, the position, and each blob (name, dtype, shape, offset, nbytes, crc32): the token
ids (I32 [position]) and then per layer the GDN conv and recurrent states or the attention K and V
rows in use. A file is written to a temporary name in the same folder and renamed into place, so
a reader sees either the old file or the whole new one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from .errors import LilyError

MAGIC = b"LILYSNAP"
VERSION = 1
PREFIX = struct.Struct("<8sIIQ")  # magic, version, flags, header_len
ALIGN = 64
PIECE = 64 << 20  # bytes moved between the device and the file per call (bounds host memory)
DTYPE_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4}
CRC_WIDTH = 8  # crc32 as 8 hex digits: the header keeps its length when the sums are filled in


class SnapshotFileError(LilyError):
    """A snapshot file is unreadable, of another format version or model, or does not fit the session."""


def model_identity(model) -> dict:
    """The model fields a snapshot file records (computed once per model, cached on it)."""
    ident = getattr(model, "_snapshot_identity", None)
    if ident is None:
        config = dataclasses.asdict(model.config)
        config_text = json.dumps(config, sort_keys=True, default=str)
        with model._lock:
            signature = model._engine.weight_signature()
        ident = {"config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
                 "weights_sha256": hashlib.sha256(signature.encode()).hexdigest(),
                 "checkpoint": str(model.path), "layout": model.layout,
                 "config": json.loads(config_text)}
        model._snapshot_identity = ident
    return ident


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header_bytes(header: dict) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (_align(PREFIX.size + len(text)) - PREFIX.size - len(text))


def save(snapshot, path: str | os.PathLike) -> Path:
    """Write ``snapshot`` (a lily.Snapshot) to ``path`` atomically; returns the path."""
    model = snapshot._model()
    if model is None or model.closed:
        raise SnapshotFileError("Snapshot.save: the model this snapshot was taken from is closed or gone")
    ident = model_identity(model)
    core = snapshot._core
    path = Path(path).expanduser()
    if path.is_dir():
        raise SnapshotFileError(f"{path}: is a folder; Snapshot.save needs a file name")
    tokens = np.asarray(snapshot.tokens, dtype="<i4")
    if tokens.size != core.position:
        raise SnapshotFileError(f"Snapshot.save: the snapshot holds {core.position} positions but "
                                f"{tokens.size} token ids")
    blobs, offset = [], 0
    for name, dtype, shape, nbytes in [("tokens", "I32", (tokens.size,), tokens.nbytes)] + core.parts():
        blobs.append({"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes,
                      "crc32": "0" * CRC_WIDTH})
        offset = _align(offset + nbytes)
    from ._version import __version__

    header = {"format": "lily-snapshot", "version": VERSION, "lily_version": __version__, "model": ident,
              "device": core.device, "position": core.position, "rope_delta": core.rope_delta,
              "images": None if snapshot.images is None else [list(s) for s in snapshot.images], "data_size": offset,
              "blobs": blobs}
    head = _header_bytes(header)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(PREFIX.pack(MAGIC, VERSION, 0, len(head)))
            f.write(head)
            data_start = f.tell()
            buf = np.empty(min(PIECE, max((b["nbytes"] for b in blobs), default=0)), np.uint8)
            for i, b in enumerate(blobs):
                f.seek(data_start + b["offset"])
                crc = 0
                if i == 0:
                    raw = tokens.tobytes()
                    f.write(raw)
                    crc = zlib.crc32(raw)
                else:
                    for at in range(0, b["nbytes"], PIECE):
                        piece = buf[:min(PIECE, b["nbytes"] - at)]
                        with model._lock:
                            core.read(i - 1, at, piece)
                        f.write(piece)
                        crc = zlib.crc32(piece, crc)
                b["crc32"] = f"{crc:0{CRC_WIDTH}x}"
            f.truncate(data_start + offset)
            final = _header_bytes(header)
            assert len(final) == len(head)
            f.seek(PREFIX.size)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise SnapshotFileError(f"{path}: could not write the snapshot file ({e.strerror or e})") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def read_header(path: str | os.PathLike) -> dict:
    """The header of a snapshot file (checked: magic, version, blob table, file size), plus
    'data_start'. Reads no state."""
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            size = os.fstat(f.fileno()).st_size
            if len(prefix) < PREFIX.size:
                if MAGIC.startswith(prefix[:8]) and prefix:
                    raise SnapshotFileError(f"{path}: truncated snapshot file ({size} bytes, no complete header)")
                raise SnapshotFileError(f"{path}: not a lily snapshot file (too short: {size} bytes)")
            magic, version, _flags, header_len = PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise SnapshotFileError(f"{path}: not a lily snapshot file (starts with {magic!r}, expected "
                                        f"{MAGIC!r})")
            if version != VERSION:
                raise SnapshotFileError(f"{path}: snapshot format version {version} is not supported (this lily "
                                        f"reads version {VERSION}{'; upgrade lily' if version > VERSION else ''})")
            if PREFIX.size + header_len > size:
                raise SnapshotFileError(f"{path}: truncated snapshot file ({size} bytes, the header alone needs "
                                        f"{PREFIX.size + header_len})")
            raw = f.read(header_len)
    except FileNotFoundError:
        raise SnapshotFileError(f"{path}: no such snapshot file") from None
    except IsADirectoryError:
        raise SnapshotFileError(f"{path}: is a folder, not a snapshot file") from None
    except OSError as e:
        raise SnapshotFileError(f"{path}: cannot read the snapshot file ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
        position, data_size, blobs = int(header["position"]), int(header["data_size"]), header["blobs"]
        for b in blobs:
            b["nbytes"], b["offset"] = int(b["nbytes"]), int(b["offset"])
            b["shape"] = [int(d) for d in b["shape"]]
            str(b["name"]), str(b["dtype"]), str(b["crc32"])
        header["model"]["config_sha256"], header["model"]["weights_sha256"], header["device"]
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotFileError(f"{path}: corrupt snapshot header ({type(e).__name__}: {e})") from None
    if position < 0 or any(b["offset"] < 0 or b["nbytes"] < 0 or b["offset"] + b["nbytes"] > data_size
                           for b in blobs):
        raise SnapshotFileError(f"{path}: corrupt snapshot header (a blob lies outside the data)")
    header["data_start"] = PREFIX.size + header_len
    expected = header["data_start"] + data_size
    if size < expected:
        raise SnapshotFileError(f"{path}: truncated snapshot file ({size} bytes, expected {expected})")
    return header


def _check_model(path: Path, header: dict, model) -> None:
    saved, ident = header["model"], model_identity(model)
    if saved["config_sha256"] != ident["config_sha256"]:
        theirs = saved.get("config") if isinstance(saved.get("config"), dict) else {}
        diff = [k for k in sorted(set(theirs) | set(ident["config"])) if theirs.get(k) != ident["config"].get(k)]
        what = ", ".join(f"{k} {theirs.get(k)!r} vs {ident['config'].get(k)!r}" for k in diff[:4])
        raise SnapshotFileError(f"{path}: the snapshot was saved from another model (config differs"
                                f"{': ' + what if what else ''}; saved from {saved.get('checkpoint', '?')})")
    if saved["weights_sha256"] != ident["weights_sha256"]:
        raise SnapshotFileError(f"{path}: the snapshot was saved from another model (same config, different "
                                f"weights or quantization; saved from {saved.get('checkpoint', '?')}, this model is "
                                f"{model.path})")


def load(model, path: str | os.PathLike, max_context: int | None = None):
    """The state (a core Snapshot on ``model``'s device) and token ids of the file at ``path``, for
    ``Model.load_snapshot`` to wrap in a lily.Snapshot, after checking that it is a
    snapshot file of this format version and this model, complete, in this device's dtypes and within
    ``max_context`` tokens (default: the model's max_position_embeddings)."""
    from . import _core

    path = Path(path).expanduser()
    header = read_header(path)
    _check_model(path, header, model)
    position = header["position"]
    limit = model.config.max_position_embeddings if max_context is None else max_context
    if position > limit:
        raise SnapshotFileError(f"{path}: the snapshot holds {position} tokens but this session's max_context "
                                f"is {limit}" if max_context is not None else
                                f"{path}: the snapshot holds {position} tokens, more than the model's "
                                f"max_position_embeddings ({limit})")
    expected = [("tokens", "I32", [position])] + [(n, d, list(s)) for n, d, s, _ in
                                                  _core.Snapshot.layout(model._engine, position)]
    blobs = header["blobs"]
    got = [(b["name"], b["dtype"], b["shape"]) for b in blobs]
    if [n for n, _, _ in got] != [n for n, _, _ in expected]:
        raise SnapshotFileError(f"{path}: corrupt snapshot (its blobs are not this model's state parts)")
    for (name, dtype, shape), (_, want_dtype, want_shape) in zip(got, expected):
        if dtype != want_dtype:
            raise SnapshotFileError(
                f"{path}: the snapshot was saved from a {header['device']} session, which keeps {name} in "
                f"{dtype}; a {model.device} session keeps it in {want_dtype}. Load it into a "
                f"{header['device']} session (device={header['device']!r})")
        if shape != want_shape:
            raise SnapshotFileError(f"{path}: corrupt snapshot ({name} has shape {shape}, expected {want_shape} "
                                    f"for {position} tokens)")
    for b in blobs:
        if b["nbytes"] != DTYPE_SIZE[b["dtype"]] * int(np.prod(b["shape"], dtype=np.int64)):
            raise SnapshotFileError(f"{path}: corrupt snapshot ({b['name']}: {b['nbytes']} bytes for shape "
                                    f"{b['shape']} {b['dtype']})")
    with model._lock:
        core = _core.Snapshot.blank(model._engine, position)
    rope_delta = header.get("rope_delta", 0)  # absent from files written before images
    if isinstance(rope_delta, bool) or not isinstance(rope_delta, int) or abs(rope_delta) > 1 << 31:
        raise SnapshotFileError(f"{path}: corrupt snapshot (rope_delta {rope_delta!r})")
    core.rope_delta = rope_delta
    data_start = header["data_start"]
    with open(path, "rb") as f:
        def read(b, at, n, out=None):
            f.seek(data_start + b["offset"] + at)
            data = f.read(n) if out is None else out[:f.readinto(out)]
            if len(data) != n:
                raise SnapshotFileError(f"{path}: truncated snapshot file (blob {b['name']} ends early)")
            return data

        def check_crc(b, crc):
            if f"{crc:0{CRC_WIDTH}x}" != b["crc32"]:
                raise SnapshotFileError(f"{path}: corrupt snapshot file (checksum of {b['name']} does not match)")

        raw = read(blobs[0], 0, blobs[0]["nbytes"])
        check_crc(blobs[0], zlib.crc32(raw))
        tokens = np.frombuffer(raw, dtype="<i4")
        bad = np.flatnonzero((tokens < 0) | (tokens >= model.config.vocab_size))
        if bad.size:
            raise SnapshotFileError(f"{path}: corrupt snapshot (token id {int(tokens[bad[0]])} at index "
                                    f"{int(bad[0])} is outside the vocabulary)")
        buf = np.empty(min(PIECE, max((b["nbytes"] for b in blobs[1:]), default=0)), np.uint8)
        for i, b in enumerate(blobs[1:]):
            crc = 0
            for at in range(0, b["nbytes"], PIECE):
                piece = buf[:min(PIECE, b["nbytes"] - at)]
                read(b, at, piece.size, piece)
                crc = zlib.crc32(piece, crc)
                with model._lock:
                    core.write(i, at, piece)
            check_crc(b, crc)
    return core, tuple(int(t) for t in tokens), _image_spans(header, tokens, model, path)


def _image_spans(header: dict, tokens: np.ndarray, model, path) -> tuple | None:
    """The snapshot's image spans (start, end, digest); None (never reused as a prefix) when the file
    does not say and its tokens hold image tokens."""
    spans = header.get("images", [] if model.config.image_token_id not in tokens else None)
    if spans is None:
        return None
    if not isinstance(spans, list) or not all(
            isinstance(s, list) and len(s) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in s[:2])
            and 0 <= s[0] < s[1] <= tokens.size and isinstance(s[2], str) for s in spans):
        raise SnapshotFileError(f"{path}: corrupt snapshot (image spans)")
    return tuple((s[0], s[1], s[2]) for s in spans)
