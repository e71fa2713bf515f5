"""Storage dtypes of safetensors files, and bfloat16 for numpy.

numpy has no bfloat16, so lily carries bf16 tensors as their uint16 bit patterns (the top half of
the fp32 encoding) and converts explicitly. `SAFETENSORS_DTYPES` maps each safetensors dtype string
to the numpy dtype its bytes are viewed as; float8 formats are viewed as raw uint8 bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StorageDType(NamedTuple):
    """How the bytes of one safetensors dtype are held in numpy."""

    numpy: np.dtype
    itemsize: int


def _storage(numpy_dtype: type) -> StorageDType:
    dtype = np.dtype(numpy_dtype).newbyteorder("<")
    return StorageDType(dtype, dtype.itemsize)


SAFETENSORS_DTYPES: dict[str, StorageDType] = {
    "BOOL": _storage(np.bool_),
    "U8": _storage(np.uint8),
    "I8": _storage(np.int8),
    "F8_E4M3": _storage(np.uint8),
    "F8_E5M2": _storage(np.uint8),
    "U16": _storage(np.uint16),
    "I16": _storage(np.int16),
    "F16": _storage(np.float16),
    "BF16": _storage(np.uint16),
    "U32": _storage(np.uint32),
    "I32": _storage(np.int32),
    "F32": _storage(np.float32),
    "U64": _storage(np.uint64),
    "I64": _storage(np.int64),
    "F64": _storage(np.float64),
}

# User-facing float dtype names (as in config.json "dtype") -> safetensors dtype strings.
# The float storage dtypes lily loads as they are (the vision tower, float matrices, vectors).
LOADABLE_FLOAT_DTYPES = ("F32", "F16", "BF16")
FLOAT_DTYPE_NAMES: dict[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16, round-to-nearest-even; returns uint16 bit patterns, same shape.

    Overflow rounds to +-inf as in IEEE; NaN stays NaN (quietened, sign kept).
    """
    f32 = np.asarray(values, dtype=np.float32)
    bits = f32.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit makes truncation round half to even.
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        # The carry above could turn a NaN payload into inf (or wrap); force a quiet NaN instead.
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32 exactly; same shape."""
    u16 = np.asarray(bits, dtype=np.uint16)
    return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32)


def decode_float(dtype: str, stored: np.ndarray) -> np.ndarray:
    """Float32 values of a float tensor held in its safetensors storage dtype (F64 is narrowed)."""
    if dtype == "BF16":
        return bf16_bits_to_f32(stored)
    if dtype in ("F16", "F32", "F64"):
        return np.asarray(stored).astype(np.float32)
    raise ValueError(f"dtype {dtype} is not a float type lily can decode")


def encode_float(dtype: str, values: np.ndarray) -> np.ndarray:
    """Float32 values -> the storage array of safetensors float `dtype` (BF16 rounds to nearest even)."""
    if dtype == "BF16":
        return f32_to_bf16_bits(values)
    if dtype in ("F16", "F32", "F64"):
        return np.asarray(values, dtype=np.float32).astype(SAFETENSORS_DTYPES[dtype].numpy)
    raise ValueError(f"dtype {dtype} is not a float type lily can encode")


def round_to(dtype: str, values: np.ndarray) -> np.ndarray:
    """Float32 values rounded through float `dtype` and back: what storing them would keep."""
    return decode_float(dtype, encode_float(dtype, values))
