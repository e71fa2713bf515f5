"""The CPU linear and embedding against fp64 numpy references written from their contracts (ops.h),
for each storage form of a weight: float (F32, F16, BF16) and MLX affine (docs/model.md section 5).

A weight stack W [E, out, in] is given to the op in storage form; the references below build the
storage arrays from known values, so the test shows both what the op computes
(y[t, o] = sum_i W_e[o, i] x[t, i]) and how each format stores W.
"""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


def bf16_bits(a):
    """BF16 storage of float32 values: the top 16 bits (truncation) and the value they represent."""
    bits = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def float_weight(rng, E, rows, cols, dtype):
    """(storage kwargs for QMatrix, the fp64 values the storage holds)."""
    w = rng.uniform(-0.5, 0.5, (E, rows, cols)).astype(np.float32)
    if dtype == "F32":
        stored, value = w, w
    elif dtype == "F16":
        stored, value = w.astype(np.float16).view(np.uint16), w.astype(np.float16)
    else:
        stored, value = bf16_bits(w)
    return dict(weight=stored, dtype=dtype, num_stack=E, rows=rows, cols=cols), value.astype(np.float64)


def affine_weight(rng, E, rows, cols, bits, group, scale_dtype="F32"):
    """MLX affine: w = scale * q + bias per group of `group` inputs, q an unsigned `bits`-bit code.
    Codes are packed little-endian into uint32 words: code j of a word sits at bits [j*bits, (j+1)*bits)."""
    q = rng.integers(0, 2**bits, (E, rows, cols)).astype(np.uint32)
    per = 32 // bits
    words = np.zeros((E, rows, cols // per), np.uint32)
    for j in range(per):
        words |= q[:, :, j::per] << np.uint32(j * bits)
    scales = (rng.uniform(0.5, 1.5, (E, rows, cols // group)) / (2**bits - 1)).astype(np.float32)
    biases = rng.uniform(-0.6, -0.4, (E, rows, cols // group)).astype(np.float32)
    if scale_dtype == "BF16":
        (scales, s_val), (biases, b_val) = bf16_bits(scales), bf16_bits(biases)
    else:
        s_val, b_val = scales, biases
    value = np.repeat(s_val, group, axis=2).astype(np.float64) * q + np.repeat(b_val, group, axis=2)
    return dict(weight=words, dtype="U32", num_stack=E, rows=rows, cols=cols, bits=bits, group_size=group,
                scales=scales, biases=biases, scale_dtype=scale_dtype), value


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("T", [1, 3])
def test_linear_float_weights(dtype, T):
    rng = np.random.default_rng(T + len(dtype))
    storage, W = float_weight(rng, 2, 5, 16, dtype)
    w = ops.QMatrix("cpu", **storage)
    x = rng.standard_normal((T, 16)).astype(np.float32)
    for e in range(2):
        np.testing.assert_allclose(ops.linear(w, e, x), x @ W[e].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, group, scale_dtype", [(4, 32, "F32"), (4, 64, "BF16"), (8, 32, "F32"),
                                                      (2, 64, "F32")])
@pytest.mark.parametrize("T", [1, 4])
def test_linear_affine_weights(bits, group, scale_dtype, T):
    rng = np.random.default_rng(bits * 10 + group + T)
    storage, W = affine_weight(rng, 3, 7, 128, bits, group, scale_dtype)
    w = ops.QMatrix("cpu", **storage)
    x = rng.standard_normal((T, 128)).astype(np.float32)
    for e in range(3):
        np.testing.assert_allclose(ops.linear(w, e, x), x @ W[e].T, rtol=1e-5, atol=1e-4)


def test_linear_bias_is_linear_then_add_bias():
    """linear_bias(w, x, b) = x W^T + b: on the CPU the two ops literally, so the same bits."""
    rng = np.random.default_rng(5)
    storage, W = float_weight(rng, 1, 9, 24, "BF16")
    w = ops.QMatrix("cpu", **storage)
    x = rng.standard_normal((4, 24)).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32)
    y = ops.linear_bias(w, x, b)
    np.testing.assert_array_equal(y, ops.add_bias("cpu", ops.linear(w, 0, x), b))
    np.testing.assert_allclose(y, x @ W[0].T + b, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="bias"):
        ops.linear_bias(w, x, b[:8])


def test_linear_bias_gelu_is_linear_bias_then_gelu():
    """linear_bias_gelu(w, x, b) = gelu_tanh(x W^T + b): on the CPU the ops literally, so the same bits. The
    bf16 hand-over (linear_bias_gelu_xb, linear_bias_xb) is CUDA's only."""
    rng = np.random.default_rng(6)
    storage, W = float_weight(rng, 1, 9, 24, "BF16")
    w = ops.QMatrix("cpu", **storage)
    x = (rng.standard_normal((5, 24)) * 3).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32)
    y = ops.linear_bias_gelu(w, x, b)
    np.testing.assert_array_equal(y, ops.gelu("cpu", ops.linear_bias(w, x, b), True))
    u = x.astype(np.float64) @ W[0].T + b
    np.testing.assert_allclose(y, 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3))), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(Exception, match="bias"):
        ops.linear_bias_gelu(w, x, b[:8])
    assert not ops.linear_bias_xb_supported(w, 1024)
    with pytest.raises(Exception, match="layer_norm_xb: no cpu implementation"):
        ops.layer_norm_mlp_xb(x, np.ones(24, np.float32), np.zeros(24, np.float32), 1e-6, w, b, w, b)


def test_embedding_is_a_dequantized_row():
    """y[t, :] = dequant(table)[ids[t], :]."""
    rng = np.random.default_rng(3)
    storage, W = affine_weight(rng, 1, 10, 64, 4, 32)
    ids = np.array([3, 0, 9, 3], np.int32)
    np.testing.assert_allclose(ops.embedding(ops.QMatrix("cpu", **storage), ids), W[0][ids], rtol=1e-6, atol=1e-6)
