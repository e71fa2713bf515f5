"""MLX affine quantization in numpy, byte-exact with MLX's CPU `quantize`.

A weight [..., n] is cut into groups of `group_size` consecutive elements along its last axis and
each group is stored as unsigned codes q with one scale and one bias: w ~= scale * q + bias.
Codes are packed into uint32 words as a little-endian bit stream along each row: element k of a
word occupies bits [k*bits, (k+1)*bits), element 0 in the lowest bits (docs/model.md section 5).

Per group, in fp32 (mlx/backend/cpu/quantized.cpp):
    scale = max((w_max - w_min) / n_bins, 1e-7), negated unless |w_min| > |w_max|
    edge  = w_min if |w_min| > |w_max| else w_max        (the end of larger magnitude)
    q0 = rint(edge / scale); if q0 != 0: scale = edge / q0, bias = edge; else bias = 0
    q = clip(rint((w - bias) / scale), 0, n_bins)
Snapping the scale to edge/q0 makes the larger-magnitude end exactly representable. MLX stores
scale and bias in the weight's dtype (bf16 for our checkpoints) but computes the codes with the
fp32 values; `quantize` returns those fp32 values and leaves the narrowing to the caller.

MLX's Metal and CUDA kernels (what mlx-lm uses on a Mac) differ from its CPU path in two corners:
they round halves away from zero instead of to even, and start the group maximum at 0, so an
all-negative group spans [w_min, 0]. Checkpoints converted on a GPU can therefore differ from ours
by one code where (w - bias) / scale is an exact half, or in all-negative groups; both still
dequantize with the same formula.
"""

from __future__ import annotations

import numpy as np

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

# Rows are processed in blocks of about this many elements to bound temporaries.
_CHUNK_ELEMENTS = 1 << 20


def check_supported(bits: int, group_size: int | None = None) -> None:
    """Raise ValueError unless MLX supports this bit width (and group size, when given)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported (supported: {SUPPORTED_BITS})")
    if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size} is not supported (supported: {SUPPORTED_GROUP_SIZES})")


def _shifts(bits: int) -> np.ndarray:
    return np.arange(0, 32, bits, dtype=np.uint32)  # [32 / bits]


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes [..., n] (integers in [0, 2^bits)) into uint32 words [..., n * bits / 32]."""
    check_supported(bits)
    codes = np.asarray(codes)
    per_word = 32 // bits
    if codes.shape[-1] % per_word:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per_word} codes per word")
    words = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, per_word)
    # The fields do not overlap, so summing the shifted codes ORs them.
    return (words << _shifts(bits)).sum(axis=-1, dtype=np.uint32)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unpack uint32 words [..., m] into uint8 codes [..., m * 32 / bits]."""
    check_supported(bits)
    packed = np.asarray(packed, dtype=np.uint32)
    fields = (packed[..., None] >> _shifts(bits)) & np.uint32((1 << bits) - 1)
    return fields.astype(np.uint8).reshape(*packed.shape[:-1], -1)


def _quantize_rows(rows: np.ndarray, bits: int, group_size: int):
    """quantize() of float32 rows [r, n]: codes uint8 [r, n], scales and biases f32 [r, n / group_size]."""
    n_bins = np.float32((1 << bits) - 1)
    groups = rows.reshape(rows.shape[0], -1, group_size)
    w_max = groups.max(axis=-1)
    w_min = groups.min(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    snapped = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(snapped, edge / q0, scale)
    bias = np.where(snapped, edge, np.float32(0))
    codes = np.rint((groups - bias[..., None]) / scale[..., None])
    codes = np.clip(codes, 0, n_bins).astype(np.uint8).reshape(rows.shape)
    return codes, scale, bias


def quantize(w: np.ndarray, bits: int = 4, group_size: int = 64):
    """MLX affine quantization of w [..., n] (float, finite; computed in float32).

    Returns (packed uint32 [..., n*bits/32], scales f32 [..., n/group_size], biases f32 [...,
    n/group_size]); scales and biases are the fp32 values before MLX narrows them to the weight dtype.
    """
    check_supported(bits, group_size)
    w = np.asarray(w, dtype=np.float32)
    n = w.shape[-1]
    if w.ndim == 0 or n % group_size:
        raise ValueError(f"last dim of shape {w.shape} is not a multiple of group_size={group_size}")
    rows = w.reshape(-1, n)
    packed = np.empty((rows.shape[0], n * bits // 32), dtype=np.uint32)
    scales = np.empty((rows.shape[0], n // group_size), dtype=np.float32)
    biases = np.empty_like(scales)
    step = max(1, _CHUNK_ELEMENTS // n)
    for r in range(0, rows.shape[0], step):
        block = slice(r, r + step)
        codes, scales[block], biases[block] = _quantize_rows(rows[block], bits, group_size)
        packed[block] = pack(codes, bits)
    lead = w.shape[:-1]
    return packed.reshape(*lead, -1), scales.reshape(*lead, -1), biases.reshape(*lead, -1)


def dequantize(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int = 4, group_size: int = 64
) -> np.ndarray:
    """w = scale * q + bias in float32: packed uint32 [..., m], scales/biases [..., m*32/bits/group_size]
    (float values) -> [..., m * 32 / bits]."""
    check_supported(bits, group_size)
    codes = unpack(packed, bits)
    n = codes.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], n // group_size, group_size).astype(np.float32)
    scales = np.asarray(scales, dtype=np.float32)[..., None]
    biases = np.asarray(biases, dtype=np.float32)[..., None]
    if scales.shape[:-1] != groups.shape[:-1]:
        raise ValueError(f"scales {scales.shape[:-1]} do not match the groups {groups.shape[:-1]}")
    return (groups * scales + biases).reshape(*codes.shape[:-1], n)
