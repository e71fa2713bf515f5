"""The CPU vision-tower ops against fp64 numpy references written from their contracts (ops.h;
docs/model.md section 8): layer_norm, add_bias, gelu, vision_position_embedding, vision_rope,
vision_attention. The position resampling is also checked against transformers' own helper."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lily import _core
from lily.errors import LilyError

ops = _core.ops
rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def positions(gh, gw, m):
    """(row, col) of a gh x gw grid's patches in merge-block order."""
    return np.array([(br * m + r, bc * m + c) for br in range(gh // m) for bc in range(gw // m)
                     for r in range(m) for c in range(m)], np.int32)


def test_layer_norm():
    x, w, b = randn(5, 37) * 3 + 1, randn(37), randn(37)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-6) * w + b
    np.testing.assert_allclose(ops.layer_norm("cpu", x, w, b, 1e-6), ref, rtol=1e-5, atol=1e-5)


def test_add_bias():
    x, b = randn(4, 9), randn(9)
    np.testing.assert_array_equal(ops.add_bias("cpu", x, b), x + b)


def test_linear_add_bias_is_linear_then_add_bias():
    w = randn(1, 7, 24)
    m = ops.QMatrix("cpu", w, "F32", 1, 7, 24)
    x, b = randn(5, 24), randn(7)
    np.testing.assert_array_equal(ops.linear_add_bias(m, x, b), ops.add_bias("cpu", ops.linear(m, 0, x), b))
    with pytest.raises(LilyError, match="linear_add_bias.*bias"):
        ops.linear_add_bias(m, x, randn(6))


@pytest.mark.parametrize("tanh_approx", [True, False])
def test_gelu(tanh_approx):
    x = randn(3, 41) * 3
    u = x.astype(np.float64)
    if tanh_approx:
        ref = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
    else:
        ref = 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
    np.testing.assert_allclose(ops.gelu("cpu", x, tanh_approx), ref, rtol=1e-5, atol=1e-6)


def position_embedding_ref(table, pos, gh, gw):
    side = int(round(math.sqrt(table.shape[0])))
    t = table.astype(np.float64).reshape(side, side, -1)
    out = []
    for r, c in pos:
        sr, sc = r * (side - 1) / max(gh - 1, 1), c * (side - 1) / max(gw - 1, 1)
        r0, c0 = int(math.floor(sr)), int(math.floor(sc))
        r1, c1 = min(r0 + 1, side - 1), min(c0 + 1, side - 1)
        fr, fc = sr - r0, sc - c0
        out.append((1 - fr) * (1 - fc) * t[r0, c0] + (1 - fr) * fc * t[r0, c1] + fr * (1 - fc) * t[r1, c0]
                   + fr * fc * t[r1, c1])
    return np.array(out)


@pytest.mark.parametrize("gh,gw", [(4, 6), (2, 2), (10, 4), (14, 14)])
def test_vision_position_embedding(gh, gw):
    table, y = randn(49, 12), randn(gh * gw, 12)
    pos = positions(gh, gw, 2)
    got = ops.vision_position_embedding("cpu", table, pos, gh, gw, y)
    np.testing.assert_allclose(got, y + position_embedding_ref(table, pos, gh, gw), rtol=1e-5, atol=1e-5)


def test_vision_position_embedding_is_transformers_resampling():
    torch = pytest.importorskip("torch")
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    table, gh, gw = randn(64, 8), 6, 10
    idx, w = get_vision_interpolation_indices_and_weights(torch.tensor([[1, gh, gw]]), 8, "bilinear", True, 2)
    ref = (torch.from_numpy(table)[idx] * w[:, :, None]).sum(1).numpy()
    got = ops.vision_position_embedding("cpu", table, positions(gh, gw, 2), gh, gw, np.zeros((gh * gw, 8), np.float32))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def vision_rope_ref(qkv, pos, nH, theta):
    N, D = qkv.shape[0], qkv.shape[1] // (3 * nH)
    half, F = D // 2, D // 4
    y = qkv.astype(np.float64).reshape(N, 3, nH, D).copy()
    f = theta ** (-4 * np.arange(F) / D)
    ang = np.concatenate([pos[:, :1] * f, pos[:, 1:] * f], axis=1)[:, None, None, :]  # [N, 1, 1, D/2]
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = y[:, :2, :, :half].copy(), y[:, :2, :, half:].copy()
    y[:, :2, :, :half], y[:, :2, :, half:] = x0 * c - x1 * s, x1 * c + x0 * s
    return y.reshape(N, -1)


def test_vision_rope():
    nH, D, gh, gw = 3, 16, 4, 6
    qkv, pos = randn(gh * gw, 3 * nH * D), positions(gh, gw, 2)
    got = ops.vision_rope("cpu", qkv, pos, nH, 10000.0)
    np.testing.assert_allclose(got, vision_rope_ref(qkv, pos, nH, 10000.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, 2 * nH * D:], qkv[:, 2 * nH * D:])  # v untouched


def vision_attention_ref(qkv, starts, nH):
    N, W = qkv.shape[0], qkv.shape[1] // 3
    D = W // nH
    x = qkv.astype(np.float64).reshape(N, 3, nH, D)
    o = np.zeros((N, nH, D))
    for a, b in zip(starts[:-1], starts[1:]):
        q, k, v = x[a:b, 0], x[a:b, 1], x[a:b, 2]                  # [n, nH, D]
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o[a:b] = np.einsum("hts,shd->thd", p, v)
    return o.reshape(N, W)


def test_vision_attention_is_per_image_and_non_causal():
    nH, D = 2, 8
    qkv, starts = randn(20, 3 * nH * D), np.array([0, 8, 20], np.int32)
    got = ops.vision_attention("cpu", qkv, starts, nH)
    np.testing.assert_allclose(got, vision_attention_ref(qkv, starts, nH), rtol=1e-5, atol=1e-5)
    # the first token sees the last of its image (non-causal), and nothing of the next image
    moved = qkv.copy()
    moved[7, 2 * nH * D:] += 1
    assert not np.allclose(ops.vision_attention("cpu", moved, starts, nH)[0], got[0])
    moved = qkv.copy()
    moved[8:, nH * D:] += 1
    np.testing.assert_array_equal(ops.vision_attention("cpu", moved, starts, nH)[:8], got[:8])


def test_vision_ops_check_their_arguments():
    with pytest.raises(LilyError, match="starts must run from 0 to 5"):
        ops.vision_attention("cpu", randn(5, 48), np.array([0, 4], np.int32), 2)
    with pytest.raises(LilyError, match="image 0 is empty"):
        ops.vision_attention("cpu", randn(5, 48), np.array([0, 0, 5], np.int32), 2)
    with pytest.raises(LilyError, match="outside the 2 x 2 grid"):
        ops.vision_position_embedding("cpu", randn(4, 3), np.array([[2, 0]], np.int32), 2, 2, randn(1, 3))
    with pytest.raises(LilyError, match="not a square"):
        ops.vision_position_embedding("cpu", randn(5, 3), np.array([[0, 0]], np.int32), 2, 2, randn(1, 3))
    with pytest.raises(LilyError, match="heads of a multiple of 4"):
        ops.vision_rope("cpu", randn(2, 3 * 2 * 6), np.zeros((2, 2), np.int32), 2, 10000.0)
