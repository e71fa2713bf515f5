"""The CPU add_rms_norm (the residual add fused with the next RMSNorm) against add then rms_norm."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


@pytest.mark.parametrize("R, D", [(1, 1), (3, 19), (5, 2048), (64, 128)])
def test_add_rms_norm_is_add_then_rms_norm(R, D):
    rng = np.random.default_rng(R * 31 + D)
    x = rng.standard_normal((R, D)).astype(np.float32)
    res = rng.standard_normal((R, D)).astype(np.float32) * 3
    w = rng.standard_normal(D).astype(np.float32)
    x_out, y = ops.add_rms_norm("cpu", x, res, w, 1e-6)
    added = ops.add("cpu", x, res)
    np.testing.assert_array_equal(x_out, added)
    np.testing.assert_array_equal(y, ops.rms_norm("cpu", added, w, 1e-6))
    ms = np.mean(added.astype(np.float64) ** 2, axis=1, keepdims=True)
    np.testing.assert_allclose(y, added / np.sqrt(ms + 1e-6) * w, rtol=1e-5, atol=1e-6)


def test_add_rms_norm_names_a_bad_shape():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(Exception, match="add_rms_norm.*res"):
        ops.add_rms_norm("cpu", x, np.zeros((2, 7), np.float32), np.ones(8, np.float32), 1e-6)
    with pytest.raises(Exception, match="add_rms_norm.*weight"):
        ops.add_rms_norm("cpu", x, x, np.ones(7, np.float32), 1e-6)


@pytest.mark.parametrize("write_y", [True, False])
def test_add_rms_norm_xb_is_cuda_only(write_y):
    # the bf16 X is the CUDA prefill GEMM's operand: the CPU backend has no add_rms_norm_xb and says so
    x = np.ones((2, 8), np.float32)
    with pytest.raises(Exception, match="add_rms_norm_xb: no cpu implementation"):
        ops.add_rms_norm_xb("cpu", x, x, np.ones(8, np.float32), 1e-6, write_y=write_y)
