"""The CPU gated_attention (the decode step between the projections) against its op sequence."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


def sequence(nH, nKV, D, rd, theta, eps, pos0, p, k, v, qn, kn, kc, vc):
    T = p.shape[0]
    q, g = ops.split_q_gate("cpu", p, nH)
    q = ops.rope("cpu", ops.rms_norm("cpu", q.reshape(T * nH, D), qn, eps).reshape(T, nH * D), nH, rd, theta, pos0)
    k = ops.rope("cpu", ops.rms_norm("cpu", k.reshape(T * nKV, D), kn, eps).reshape(T, nKV * D), nKV, rd, theta, pos0)
    kc, vc = ops.kv_cache_write("cpu", k, kc, pos0), ops.kv_cache_write("cpu", v, vc, pos0)
    o = ops.sigmoid_mul("cpu", ops.attention("cpu", q, kc, vc, nH, nKV, pos0), g)
    return q, g, o, kc, vc


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("pos0", [0, 1, 37, 300])
@pytest.mark.parametrize("nH, nKV, D, rd, theta", [
    (16, 2, 256, 64, 1e7), (4, 2, 64, 16, 1e7), (6, 2, 24, 10, 1e4), (3, 3, 8, 0, 1e4), (2, 1, 6, 6, 1e6)])
def test_gated_attention_is_the_op_sequence(T, pos0, nH, nKV, D, rd, theta):
    rng = np.random.default_rng(T * 7 + pos0 * 131 + nH * 17 + D)
    eps, max_t = 1e-6, pos0 + T + 5
    p = rng.standard_normal((T, nH * 2 * D)).astype(np.float32)
    k = rng.standard_normal((T, nKV * D)).astype(np.float32)
    v = rng.standard_normal((T, nKV * D)).astype(np.float32)
    qn = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kn = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kc = rng.standard_normal((max_t, nKV * D)).astype(np.float32)
    vc = rng.standard_normal((max_t, nKV * D)).astype(np.float32)
    got = ops.gated_attention("cpu", p, k, v, qn, kn, eps, rd, theta, kc, vc, nH, nKV, pos0)
    want = sequence(nH, nKV, D, rd, theta, eps, pos0, p, k, v, qn, kn, kc, vc)
    for name, a, b in zip("q gate o k_cache v_cache".split(), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_gated_attention_names_a_bad_shape():
    p = np.zeros((1, 2 * 2 * 8), np.float32)
    kv = np.zeros((1, 8), np.float32)
    w = np.ones(8, np.float32)
    cache = np.zeros((4, 8), np.float32)
    with pytest.raises(Exception, match="gated_attention.*k_norm"):
        ops.gated_attention("cpu", p, kv, kv, w, np.ones(7, np.float32), 1e-6, 8, 1e4, cache, cache, 2, 1, 0)
    with pytest.raises(Exception, match="gated_attention.*k/v"):
        ops.gated_attention("cpu", p, np.zeros((1, 9), np.float32), kv, w, w, 1e-6, 8, 1e4, cache, cache, 2, 1, 0)
    with pytest.raises(Exception, match="kv_cache_write.*exceed"):
        ops.gated_attention("cpu", p, kv, kv, w, w, 1e-6, 8, 1e4, cache, cache, 2, 1, 4)
