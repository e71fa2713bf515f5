"""The CPU attention ops against fp64 numpy references written from their contracts (ops.h;
docs/model.md section 2.3), and gated_attention (the decode step between the projections) against
its op sequence."""
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


def split_q_gate_ref(p, nH):
    """q_proj's output viewed as [T, nH, 2D]: per head, the first D values are the query and the
    next D the gate (not the first and second halves of the whole row)."""
    T, D = p.shape[0], p.shape[1] // (2 * nH)
    heads = p.reshape(T, nH, 2 * D)
    return heads[:, :, :D].reshape(T, nH * D), heads[:, :, D:].reshape(T, nH * D)


def rope_ref(x, nH, rd, theta, pos0):
    """Rotate-half RoPE on dims [0, rd) of each head: dim d < rd/2 pairs with d + rd/2 at angle
    (pos0 + t) * theta^(-2d/rd); dims from rd on pass through."""
    T, D, half = x.shape[0], x.shape[1] // nH, rd // 2
    y = x.reshape(T, nH, D).astype(np.float64).copy()
    ang = (pos0 + np.arange(T))[:, None] * theta ** (-2 * np.arange(half) / rd)  # [T, half]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = y[:, :, :half].copy(), y[:, :, half:2 * half].copy()
    y[:, :, :half], y[:, :, half:2 * half] = x0 * c - x1 * s, x1 * c + x0 * s
    return y.reshape(T, nH * D)


def attention_ref(q, k_cache, v_cache, nH, nKV, pos0):
    """Causal GQA: query t (at position pos0 + t) of head i attends to cache rows [0, pos0 + t] of KV
    head i // (nH/nKV), scores scaled by 1/sqrt(D), softmax over those rows."""
    T, D = q.shape[0], q.shape[1] // nH
    o = np.zeros((T, nH, D))
    for t in range(T):
        n = pos0 + t + 1
        for i in range(nH):
            j = i // (nH // nKV)
            qi = q[t, i * D:(i + 1) * D].astype(np.float64)
            K = k_cache[:n, j * D:(j + 1) * D].astype(np.float64)
            V = v_cache[:n, j * D:(j + 1) * D].astype(np.float64)
            s = K @ qi / np.sqrt(D)
            p = np.exp(s - s.max())
            o[t, i] = (p / p.sum()) @ V
    return o.reshape(T, nH * D)


@pytest.mark.parametrize("T, nH, D", [(1, 1, 4), (3, 4, 6)])
def test_split_q_gate_matches_reference(T, nH, D):
    p = np.arange(T * nH * 2 * D, dtype=np.float32).reshape(T, nH * 2 * D)
    q, g = ops.split_q_gate("cpu", p, nH)
    q_ref, g_ref = split_q_gate_ref(p, nH)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(g, g_ref)


@pytest.mark.parametrize("T, nH, D, rd, theta, pos0", [(1, 1, 8, 8, 1e4, 0), (4, 2, 12, 4, 1e4, 5),
                                                       (2, 3, 16, 6, 1e7, 40)])
def test_rope_matches_reference(T, nH, D, rd, theta, pos0):
    x = np.random.default_rng(T + nH + D).standard_normal((T, nH * D)).astype(np.float32)
    # The kernel forms the angles in fp32 (as transformers does), hence atol ~ fp32 eps * angle.
    np.testing.assert_allclose(ops.rope("cpu", x, nH, rd, theta, pos0), rope_ref(x, nH, rd, theta, pos0),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, nH, nKV, D, pos0", [(1, 1, 1, 4, 0), (1, 4, 2, 8, 6), (3, 4, 1, 8, 2), (5, 2, 2, 16, 0)])
def test_attention_matches_reference(T, nH, nKV, D, pos0):
    rng = np.random.default_rng(T * 7 + nH + pos0)
    q = rng.standard_normal((T, nH * D)).astype(np.float32)
    max_t = pos0 + T + 3  # rows past pos0 + t must not be read: fill them with garbage
    kc = rng.standard_normal((max_t, nKV * D)).astype(np.float32)
    vc = rng.standard_normal((max_t, nKV * D)).astype(np.float32)
    kc[pos0 + T:], vc[pos0 + T:] = 1e4, np.nan
    np.testing.assert_allclose(ops.attention("cpu", q, kc, vc, nH, nKV, pos0),
                               attention_ref(q, kc, vc, nH, nKV, pos0), rtol=1e-5, atol=1e-6)


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


# The rope offset of text after an image (ops::Position::rope_delta, docs/model.md section 8.5): the
# rotations move to pos0 + delta + t while the cache rows stay at pos0 + t.
@pytest.mark.parametrize("pos0, delta", [(40, -25), (3, 0), (7, 12)])
def test_rope_delta_turns_by_the_shifted_position(pos0, delta):
    x = np.random.default_rng(pos0).standard_normal((3, 2 * 16)).astype(np.float32)
    np.testing.assert_array_equal(ops.rope("cpu", x, 2, 8, 1e4, pos0, rope_delta=delta),
                                  ops.rope("cpu", x, 2, 8, 1e4, pos0 + delta))


@pytest.mark.parametrize("T", [1, 2])
def test_gated_attention_rope_delta_moves_rotations_not_cache_rows(T):
    nH, nKV, D, rd, theta, eps, pos0, delta = 4, 2, 16, 8, 1e4, 1e-6, 30, -17
    rng = np.random.default_rng(T)
    p = rng.standard_normal((T, nH * 2 * D)).astype(np.float32)
    k = rng.standard_normal((T, nKV * D)).astype(np.float32)
    v = rng.standard_normal((T, nKV * D)).astype(np.float32)
    qn, kn = np.ones(D, np.float32), (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kc = rng.standard_normal((pos0 + T + 2, nKV * D)).astype(np.float32)
    vc = rng.standard_normal((pos0 + T + 2, nKV * D)).astype(np.float32)
    got = ops.gated_attention("cpu", p, k, v, qn, kn, eps, rd, theta, kc, vc, nH, nKV, pos0, rope_delta=delta)
    q, g = ops.split_q_gate("cpu", p, nH)
    q = ops.rope("cpu", ops.rms_norm("cpu", q.reshape(T * nH, D), qn, eps).reshape(T, nH * D), nH, rd, theta,
                 pos0 + delta)
    kr = ops.rope("cpu", ops.rms_norm("cpu", k.reshape(T * nKV, D), kn, eps).reshape(T, nKV * D), nKV, rd, theta,
                  pos0 + delta)
    kc2, vc2 = ops.kv_cache_write("cpu", kr, kc, pos0), ops.kv_cache_write("cpu", v, vc, pos0)
    o = ops.sigmoid_mul("cpu", ops.attention("cpu", q, kc2, vc2, nH, nKV, pos0), g)
    for name, a, b in zip("q gate o k_cache v_cache".split(), got, (q, g, o, kc2, vc2)):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_rope_delta_below_zero_is_refused():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(Exception, match="rope: rotary positions"):
        ops.rope("cpu", x, 1, 8, 1e4, 3, rope_delta=-4)
