"""CUDA rms_norm, gated_rms_norm, sigmoid_mul, add and split_columns against the fp32 CPU reference."""
from __future__ import annotations

import numpy as np
import pytest

from checks import rel_err
from lily import _core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops

# (rows, cols): odd sizes (scalar path), multiples of 4 (float4 path), the real widths; rows of <= 256
# floats take a warp each, 8 rows a block (row counts not a multiple of 8 too), wider ones a block each
SHAPES = [(1, 1), (3, 19), (19, 99), (7, 128), (13, 256), (9, 260), (2, 2047), (5, 2048), (99, 4096), (1024, 128),
          (33, 8192)]


def check(got, ref, tol):
    assert got.shape == ref.shape
    err, max_abs = rel_err(got, ref), float(np.abs(got - ref).max())
    assert err <= tol, f"rel err {err:.3g} > {tol:.3g} (max abs {max_abs:.3g})"


@pytest.mark.parametrize("R, D", SHAPES)
def test_rms_norm(R, D, gpu_tol):
    rng = np.random.default_rng(R * 10007 + D)
    x = rng.standard_normal((R, D)).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    check(ops.rms_norm("cuda", x, w, 1e-6), ops.rms_norm("cpu", x, w, 1e-6), gpu_tol["rms_norm"])


@pytest.mark.parametrize("R, D", SHAPES)
def test_gated_rms_norm(R, D, gpu_tol):
    rng = np.random.default_rng(R * 10009 + D)
    x = rng.standard_normal((R, D)).astype(np.float32)
    z = rng.standard_normal((R, D)).astype(np.float32) * 2
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    check(ops.gated_rms_norm("cuda", x, z, w, 1e-6), ops.gated_rms_norm("cpu", x, z, w, 1e-6), gpu_tol["rms_norm"])


@pytest.mark.parametrize("D", [99, 128, 256, 260])
def test_norm_rows_alone(D):
    # a row's result does not depend on where it sits in the grid (a warp of a block of 8 rows, or a block)
    rng = np.random.default_rng(D)
    x, z = rng.standard_normal((2, 21, D)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    gated, plain = ops.gated_rms_norm("cuda", x, z, w, 1e-6), ops.rms_norm("cuda", x, w, 1e-6)
    for r in (0, 7, 8, 20):
        np.testing.assert_array_equal(gated[r:r + 1], ops.gated_rms_norm("cuda", x[r:r + 1], z[r:r + 1], w, 1e-6))
        np.testing.assert_array_equal(plain[r:r + 1], ops.rms_norm("cuda", x[r:r + 1], w, 1e-6))


@pytest.mark.parametrize("R, D", SHAPES)
def test_sigmoid_mul_and_add(R, D, gpu_tol):
    rng = np.random.default_rng(R * 10037 + D)
    x = rng.standard_normal((R, D)).astype(np.float32)
    y = rng.standard_normal((R, D)).astype(np.float32) * 4
    check(ops.sigmoid_mul("cuda", x, y), ops.sigmoid_mul("cpu", x, y), gpu_tol["elementwise"])
    check(ops.add("cuda", x, y), ops.add("cpu", x, y), gpu_tol["elementwise"])


@pytest.mark.parametrize("T, widths", [(146, [8192, 4096, 32, 32]), (300, [8192, 512, 512]), (33, [3, 5, 7]),
                                       (5, [12]), (1, [4, 1, 3, 8])])
def test_split_columns(T, widths):
    # a copy: exact on both backends (float4 words where every width is a multiple of 4, else floats)
    rng = np.random.default_rng(T * 31 + len(widths))
    y = rng.standard_normal((T, sum(widths))).astype(np.float32)
    bounds = np.cumsum([0] + widths)
    for dev in ("cuda", "cpu"):
        parts = ops.split_columns(dev, y, widths)
        assert [p.shape for p in parts] == [(T, w) for w in widths]
        for p, b0, b1 in zip(parts, bounds[:-1], bounds[1:]):
            assert np.array_equal(p, y[:, b0:b1])


@pytest.mark.parametrize("R, D", SHAPES)
def test_add_rms_norm(R, D, gpu_tol):
    # the fused residual add + RMSNorm: against the CPU, and bit-identical to add then rms_norm on the GPU
    rng = np.random.default_rng(R * 7919 + D)
    x = rng.standard_normal((R, D)).astype(np.float32)
    res = rng.standard_normal((R, D)).astype(np.float32) * 3
    w = rng.standard_normal(D).astype(np.float32)
    xg, yg = ops.add_rms_norm("cuda", x, res, w, 1e-6)
    xc, yc = ops.add_rms_norm("cpu", x, res, w, 1e-6)
    check(xg, xc, gpu_tol["elementwise"])
    check(yg, yc, gpu_tol["rms_norm"])
    added = ops.add("cuda", x, res)
    np.testing.assert_array_equal(xg, added)
    np.testing.assert_array_equal(yg, ops.rms_norm("cuda", added, w, 1e-6))


def xb_of(y):
    """y [R, D] (D % 8 == 0) as the prefill GEMM's bf16 X (kernels/xb_layout.cuh), uint16: each value rounded to
    nearest even, and inside each block of 8 position 2c + e holding y's value c + 4e."""
    b = np.ascontiguousarray(y, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # finite values: no NaN payloads to keep
    R, D = y.shape
    return r.reshape(R, D // 8, 2, 4).transpose(0, 1, 3, 2).reshape(R, D)


def from_xb(xb):
    """xb_of's values back as float32 in y's order (each the bf16 value it holds)."""
    R, D = xb.shape
    v = xb.reshape(R, D // 8, 4, 2).transpose(0, 1, 3, 2).reshape(R, D)
    return (v.astype(np.uint32) << 16).view(np.float32)


# D % 8 == 0 (the Xb packs 8 values a 16-byte store): odd row counts, a block of 32 to 256 threads a row
# (norm_threads), the model's D = 2048 and a smaller D
XB_SHAPES = [(1, 8), (3, 136), (7, 256), (19, 1000), (33, 2048), (131, 2048), (5, 4096)]


@pytest.mark.parametrize("write_y", [True, False])
@pytest.mark.parametrize("R, D", XB_SHAPES)
def test_add_rms_norm_xb(R, D, write_y, gpu_tol):
    # A prompt's norms (engine.cpp): add_rms_norm_xb writes x and y as add_rms_norm does and y's bf16 X as the
    # prefill GEMM's conversion packs it; without y (write_y False: every reader takes the Xb) the same x and Xb
    # and no y. Against the CPU: x, and the Xb within its bf16 rounding.
    rng = np.random.default_rng(R * 7907 + D)
    x = rng.standard_normal((R, D)).astype(np.float32)
    res = rng.standard_normal((R, D)).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, D).astype(np.float32)
    x_ref, y_ref = ops.add_rms_norm("cuda", x, res, w, 1e-6)
    xg, yg, xb = ops.add_rms_norm_xb("cuda", x, res, w, 1e-6, write_y=write_y)
    np.testing.assert_array_equal(xg, x_ref)
    np.testing.assert_array_equal(xb, xb_of(y_ref))
    if write_y:
        np.testing.assert_array_equal(yg, y_ref)
    else:
        assert yg is None
    xc, yc = ops.add_rms_norm("cpu", x, res, w, 1e-6)
    check(xg, xc, gpu_tol["elementwise"])
    check(from_xb(xb), yc, gpu_tol["bf16_round"])


def test_add_rms_norm_xb_needs_whole_blocks():
    x = np.ones((2, 12), np.float32)
    with pytest.raises(Exception, match="add_rms_norm_xb"):
        ops.add_rms_norm_xb("cuda", x, x, np.ones(12, np.float32), 1e-6, write_y=False)
