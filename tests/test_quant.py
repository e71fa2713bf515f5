"""lily.checkpoint.quant against a scalar re-implementation of MLX's CPU affine quantize (one group at a time)."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


from lily.checkpoint import quant
from lily.checkpoint import dtypes

F32 = np.float32
COMBOS = [(bits, group) for bits in (2, 4, 8) for group in (32, 64, 128)]


def reference_quantize(w: np.ndarray, bits: int, group_size: int):
    """mlx/backend/cpu/quantized.cpp `quantize`, transcribed loop by loop with float32 scalars."""
    n_bins = F32((1 << bits) - 1)
    per_word = 32 // bits
    rows = w.reshape(-1, w.shape[-1]).astype(F32)
    packed, scales, biases = [], [], []
    for row in rows:
        for g in range(0, len(row), group_size):
            group = row[g : g + group_size]
            w_min, w_max = F32(np.inf), F32(-np.inf)
            for x in group:
                w_max, w_min = max(w_max, x), min(w_min, x)
            mask = abs(w_min) > abs(w_max)
            scale = max(F32((w_max - w_min) / n_bins), F32(1e-7))
            scale = scale if mask else -scale
            edge = w_min if mask else w_max
            q0 = np.rint(F32(edge / scale))
            bias = F32(0)
            if q0 != 0:
                scale = F32(edge / q0)
                bias = edge
            scales.append(scale)
            biases.append(bias)
            for j in range(0, group_size, per_word):
                word = 0
                for k in range(per_word):
                    q = np.rint(F32(F32(group[j + k] - bias) / scale))
                    q = min(max(q, F32(0)), n_bins)
                    word |= int(q) << (k * bits)
                packed.append(word)
    lead = w.shape[:-1]
    return (
        np.array(packed, dtype=np.uint32).reshape(*lead, -1),
        np.array(scales, dtype=F32).reshape(*lead, -1),
        np.array(biases, dtype=F32).reshape(*lead, -1),
    )


def _awkward_rows(group_size: int, rng: np.random.Generator) -> np.ndarray:
    """Groups that hit every branch: zeros, constants, one-signed, max dominant, min dominant, ties."""
    g = group_size
    ramp = np.linspace(-1, 1, g, dtype=F32)
    rows = [
        np.zeros(g, F32),
        np.full(g, 0.3, F32),
        np.full(g, -0.3, F32),
        -np.abs(rng.standard_normal(g).astype(F32)),
        np.abs(rng.standard_normal(g).astype(F32)) + 1,
        ramp * 3 + 0.5,
        ramp * 3 - 0.5,
        np.round(ramp * 30) / 4,  # many values on exact half steps
        dtypes.round_to("BF16", rng.standard_normal(g).astype(F32) * 0.02),
    ]
    return np.stack(rows)


def _assert_same(ours, reference):
    np.testing.assert_array_equal(ours[0], reference[0])
    # Compare fp32 bit patterns so -0.0 / 0.0 and every last ulp count.
    np.testing.assert_array_equal(ours[1].view(np.uint32), reference[1].view(np.uint32))
    np.testing.assert_array_equal(ours[2].view(np.uint32), reference[2].view(np.uint32))


@pytest.mark.parametrize("bits,group_size", COMBOS)
def test_byte_exact_with_reference(bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    w = np.concatenate(
        [
            _awkward_rows(group_size, rng),
            rng.standard_normal((7, group_size)).astype(F32) * rng.uniform(0.01, 10, (7, 1)).astype(F32),
        ]
    )
    w = np.concatenate([w, w[::-1] * F32(-0.5)], axis=1)  # two groups per row
    _assert_same(quant.quantize(w, bits, group_size), reference_quantize(w, bits, group_size))


def test_chunking_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 40, 256)).astype(F32)
    whole = quant.quantize(w, 4, 64)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 300)  # one row per chunk
    _assert_same(quant.quantize(w, 4, 64), whole)


@pytest.mark.parametrize("bits,group_size", COMBOS)
def test_round_trip_error(bits, group_size):
    rng = np.random.default_rng(bits + group_size)
    w = rng.standard_normal((64, 4 * group_size)).astype(F32) * F32(0.05)
    packed, scales, biases = quant.quantize(w, bits, group_size)
    codes = quant.unpack(packed, bits).reshape(64, 4, group_size)
    error = np.abs(quant.dequantize(packed, scales, biases, bits, group_size) - w).reshape(64, 4, group_size)
    step = np.abs(scales)[..., None]
    inner = (codes > 0) & (codes < (1 << bits) - 1)
    # Rounding to the nearest code: half a step (plus fp32 slack). Only the clipped end codes, whose
    # range was shortened by snapping the scale, may be further off, by less than one more step.
    assert np.all(error[inner] <= step.repeat(group_size, -1)[inner] * 0.5001 + 1e-7)
    assert np.all(error <= step * 1.5)
    # The end of larger magnitude is reproduced exactly (that is what the snapping is for).
    groups = w.reshape(64, 4, group_size)
    edge = np.where(np.abs(groups.min(-1)) > np.abs(groups.max(-1)), groups.min(-1), groups.max(-1))
    np.testing.assert_array_equal(biases, edge)


def test_packing_order():
    assert quant.pack(np.arange(8), 4).tolist() == [0x76543210]
    assert quant.pack(np.array([1, 2, 3, 4]), 8).tolist() == [0x04030201]
    assert quant.pack(np.array([1, 2, 3, 0] * 4), 2).tolist() == [0b00111001 * 0x01010101]
    # Word m of a row holds columns [m*32/bits, (m+1)*32/bits).
    codes = np.arange(16).reshape(1, 16) % 16
    assert quant.pack(codes, 4).tolist() == [[0x76543210, 0xFEDCBA98]]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(2, 3, 128), dtype=np.uint8)
    packed = quant.pack(codes, bits)
    assert packed.dtype == np.uint32 and packed.shape == (2, 3, 128 * bits // 32)
    unpacked = quant.unpack(packed, bits)
    assert unpacked.dtype == np.uint8
    np.testing.assert_array_equal(unpacked, codes)


def test_shapes_of_stacked_weights():
    w = np.random.default_rng(0).standard_normal((8, 16, 128)).astype(F32)
    packed, scales, biases = quant.quantize(w, 4, 64)
    assert packed.shape == (8, 16, 16) and scales.shape == biases.shape == (8, 16, 2)
    assert scales.dtype == biases.dtype == np.float32
    assert quant.dequantize(packed, scales, biases, 4, 64).shape == w.shape


def test_unsupported_arguments():
    w = np.zeros((2, 64), F32)
    for bits in (3, 5, 6):
        with pytest.raises(ValueError, match="bits"):
            quant.quantize(w, bits, 64)
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize(w, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        quant.quantize(np.zeros((2, 96), F32), 4, 64)
    with pytest.raises(ValueError, match="scales"):
        quant.dequantize(np.zeros((2, 8), np.uint32), np.zeros((2, 2), F32), np.zeros((2, 2), F32), 4, 64)


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    groups=st.integers(1, 3),
    combo=st.sampled_from(COMBOS),
    magnitude=st.sampled_from([1e-6, 1e-2, 1.0, 300.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_reference_on_random_shapes(lead, groups, combo, magnitude, seed):
    bits, group_size = combo
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((*lead, groups * group_size)) * magnitude).astype(F32)
    ours = quant.quantize(w, bits, group_size)
    assert ours[0].shape == (*lead, groups * group_size * bits // 32)
    assert ours[1].shape == (*lead, groups)
    _assert_same(ours, reference_quantize(w, bits, group_size))
