"""lily.checkpoint.safetensors_io: round trips, interop with the `safetensors` package, malformed files, shards."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest


from lily.checkpoint import safetensors_io as sio
from lily.checkpoint import dtypes
from lily.errors import CheckpointError


def _random(dtype: str, shape, rng) -> np.ndarray:
    storage = dtypes.SAFETENSORS_DTYPES[dtype].numpy
    if storage.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if storage.kind == "f":
        return rng.standard_normal(shape).astype(storage)
    info = np.iinfo(storage)
    return rng.integers(info.min, info.max, shape, dtype=storage, endpoint=True)


def test_round_trip_of_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {}
    for i, dtype in enumerate(dtypes.SAFETENSORS_DTYPES):
        tensors[f"t{i}.{dtype}"] = (dtype, _random(dtype, (3, i + 1), rng))
    tensors["scalar"] = ("F32", np.array(2.5, np.float32))
    tensors["empty"] = ("BF16", np.zeros((0, 4), np.uint16))
    path = tmp_path / "all.safetensors"
    sio.save_file(path, tensors, {"format": "pt", "note": "x"})

    with sio.SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "note": "x"}
        assert sorted(f.names()) == sorted(tensors)
        for name, (dtype, array) in tensors.items():
            info = f.info(name)
            assert (info.dtype, info.shape, info.nbytes) == (dtype, array.shape, array.nbytes)
            got = f.get(name)
            assert got.dtype == dtypes.SAFETENSORS_DTYPES[dtype].numpy and not got.flags.writeable
            np.testing.assert_array_equal(got, array)


def test_layout_of_written_file(tmp_path):
    path = tmp_path / "a.safetensors"
    sio.save_file(path, {"b": ("U8", np.arange(3, dtype=np.uint8)), "a": ("F32", np.ones(2, np.float32))})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert list(header) == ["a", "b"]  # sorted by name, no __metadata__ when none was given
    assert header["a"]["data_offsets"] == [0, 8] and header["b"]["data_offsets"] == [8, 11]
    assert len(raw) == 8 + n + 11
    assert not list(tmp_path.glob(".*tmp"))


def test_files_we_write_load_with_safetensors_package(tmp_path):
    import safetensors.numpy as safetensors_numpy
    import torch
    from safetensors import safe_open

    rng = np.random.default_rng(1)
    names = ("F32", "F16", "F64", "I8", "U8", "I32", "I64", "U32", "BOOL")
    plain = {d: _random(d, (4, 5), rng) for d in names}
    path = tmp_path / "ours.safetensors"
    bf16 = dtypes.f32_to_bf16_bits(rng.standard_normal((6, 7)).astype(np.float32))
    sio.save_file(path, {**{k: (k, v) for k, v in plain.items()}, "bf16": ("BF16", bf16)}, {"format": "pt"})

    plain_path = tmp_path / "plain.safetensors"
    sio.save_file(plain_path, {k: (k, v) for k, v in plain.items()})
    loaded = safetensors_numpy.load_file(plain_path)
    for k, v in plain.items():
        np.testing.assert_array_equal(loaded[k], v)
    with safe_open(path, framework="pt") as f:
        t = f.get_tensor("bf16")
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.view(torch.int16).numpy().view(np.uint16), bf16)


def test_files_from_safetensors_package_load_with_ours(tmp_path):
    import safetensors.numpy as safetensors_numpy
    import torch
    import safetensors.torch as safetensors_torch

    rng = np.random.default_rng(2)
    plain = {"w": rng.standard_normal((3, 8)).astype(np.float32), "ids": np.arange(5, dtype=np.int64)}
    safetensors_numpy.save_file(plain, tmp_path / "np.safetensors", metadata={"k": "v"})
    with sio.SafetensorsFile(tmp_path / "np.safetensors") as f:
        assert f.metadata == {"k": "v"}
        for k, v in plain.items():
            np.testing.assert_array_equal(f.get(k), v)

    t = torch.randn(5, 6).to(torch.bfloat16)
    safetensors_torch.save_file({"x": t, "y": torch.ones(3)}, tmp_path / "pt.safetensors")
    with sio.SafetensorsFile(tmp_path / "pt.safetensors") as f:
        assert f.info("x").dtype == "BF16"
        np.testing.assert_array_equal(f.get("x"), t.view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(dtypes.bf16_bits_to_f32(f.get("x")), t.float().numpy())


def _raw_file(path: Path, header, data: bytes = b"", header_len: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + body + data)
    return path


GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def _entry(**overrides):
    return {"w": {**GOOD["w"], **overrides}}


MALFORMED = {
    "short": lambda p: (p.write_bytes(b"\x01\x02\x03"), p)[1],
    "header_past_end": lambda p: _raw_file(p, GOOD, bytes(8), header_len=10_000),
    "not_json": lambda p: _raw_file(p, b"{not json", bytes(8)),
    "not_utf8": lambda p: _raw_file(p, b"\xff\xfe\xfd", bytes(8)),
    "not_object": lambda p: _raw_file(p, [1, 2], bytes(8)),
    "bad_metadata": lambda p: _raw_file(p, {"__metadata__": {"a": 1}, **GOOD}, bytes(8)),
    "entry_not_object": lambda p: _raw_file(p, {"w": [1]}, bytes(8)),
    "unknown_dtype": lambda p: _raw_file(p, _entry(dtype="F128"), bytes(8)),
    "bad_shape": lambda p: _raw_file(p, _entry(shape=[2.0]), bytes(8)),
    "offsets_not_ints": lambda p: _raw_file(p, _entry(data_offsets=[0, "8"]), bytes(8)),
    "offsets_bool": lambda p: _raw_file(p, _entry(data_offsets=[False, 8]), bytes(8)),
    "offsets_inverted": lambda p: _raw_file(p, _entry(data_offsets=[8, 0]), bytes(8)),
    "truncated": lambda p: _raw_file(p, GOOD, bytes(5)),
    "size_mismatch": lambda p: _raw_file(p, _entry(shape=[3]), bytes(8)),
}
NAMES_A_TENSOR = {
    "entry_not_object", "unknown_dtype", "bad_shape", "offsets_not_ints", "offsets_bool", "offsets_inverted",
    "truncated", "size_mismatch",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_checkpoint_error(tmp_path, case):
    path = MALFORMED[case](tmp_path / f"broken_{case}.safetensors")
    with pytest.raises(CheckpointError) as excinfo:
        sio.SafetensorsFile(path)
    message = str(excinfo.value)
    assert path.name in message
    if case in NAMES_A_TENSOR:
        assert "'w'" in message


def test_good_file_and_missing_tensor(tmp_path):
    path = _raw_file(tmp_path / "ok.safetensors", GOOD, np.array([1.5, -2], np.float32).tobytes())
    f = sio.SafetensorsFile(path)
    np.testing.assert_array_equal(f.get("w"), [1.5, -2])
    with pytest.raises(CheckpointError, match=r"ok\.safetensors.*'nope'"):
        f.get("nope")
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        sio.SafetensorsFile(tmp_path / "missing.safetensors")


def test_writer_rejects_misuse_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"previous")
    specs = {"a": ("F32", (2,)), "b": ("BF16", (3,))}
    with pytest.raises(CheckpointError, match="'b'"):
        with sio.SafetensorsWriter(path, specs) as writer:
            writer.write("b", np.zeros(3, np.uint16))  # out of order
    with pytest.raises(CheckpointError, match="declared"):
        with sio.SafetensorsWriter(path, specs) as writer:
            writer.write("a", np.zeros(2, np.float64))
    with pytest.raises(CheckpointError, match="never written"):
        with sio.SafetensorsWriter(path, specs) as writer:
            writer.write("a", np.zeros(2, np.float32))
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def _lazy(array: np.ndarray, dtype: str):
    return sio.LazyTensor(dtype, array.shape, lambda: array)


def test_sharded_save_with_index(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {}
    for layer in range(12):
        for part, shape in (("weight", (16, 8)), ("scales", (16, 2)), ("biases", (16, 2))):
            tensors[f"layers.{layer}.proj.{part}"] = _lazy(rng.integers(0, 9, shape, dtype=np.uint32), "U32")
    (tmp_path / "model.safetensors").write_bytes(b"stale")
    files = sio.save_sharded(tmp_path, tensors, shard_size=1200, metadata={"format": "mlx"}, workers=3)

    assert len(files) > 2
    count = len(files)
    names = [f.name for f in files]
    assert names == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for layer in range(12):  # a module's tensors share a shard; layers run in numeric order
        parts = ("weight", "scales", "biases")
        assert len({index["weight_map"][f"layers.{layer}.proj.{p}"] for p in parts}) == 1
    assert index["weight_map"]["layers.2.proj.weight"] <= index["weight_map"]["layers.10.proj.weight"]
    for file in files:
        with sio.SafetensorsFile(file) as f:
            assert f.metadata == {"format": "mlx"}
            assert sum(f.info(n).nbytes for n in f.names()) <= 1200
            for name in f.names():
                assert index["weight_map"][name] == file.name
                np.testing.assert_array_equal(f.get(name), tensors[name].load())

    # Writing a small set into the same directory removes the old shards and index.
    sio.save_sharded(tmp_path, {"x": _lazy(np.ones(2, np.float32), "F32")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_bf16_conversion_matches_torch():
    import torch
    rng = np.random.default_rng(4)
    # Ties to even both ways, overflow to inf, subnormals, signed zeros, infinities.
    special = [0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.4e38, -3.4e38,
               1e-40, np.inf, -np.inf, 2**-133]
    scaled = rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)
    values = np.concatenate([special, scaled]).astype(np.float32)
    reference = torch.from_numpy(values).to(torch.bfloat16)
    ours = dtypes.f32_to_bf16_bits(values)
    np.testing.assert_array_equal(ours, reference.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(dtypes.bf16_bits_to_f32(ours), reference.float().numpy())
    # NaNs stay NaN, including payloads the rounding carry would push into inf or wrap around.
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)
    assert np.all(np.isnan(dtypes.bf16_bits_to_f32(dtypes.f32_to_bf16_bits(nans))))
