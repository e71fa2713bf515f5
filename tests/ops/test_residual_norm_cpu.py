"""The ops that join the residual stream and normalise it (ops.h: linear_add_rms_norm, moe_add_rms_norm,
moe_add, linear_add, linear_rms_normed, moe_rms_normed_add) are, on the CPU, literally the ops they stand for:
bit for bit, every row."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


def dense(rng, stack, rows, cols):
    w = (rng.standard_normal((stack, rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return ops.QMatrix("cpu", w, "F32", stack, rows, cols)


@pytest.mark.parametrize("T, cols, rows", [(1, 64, 48), (3, 40, 96)])
def test_linear_add_rms_norm_is_linear_then_add_rms_norm(T, cols, rows):
    rng = np.random.default_rng(T * 7 + rows)
    w = dense(rng, 1, rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    res = rng.standard_normal((T, rows)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, rows).astype(np.float32)
    got_res, got_y, left = ops.linear_add_rms_norm(w, x, res, nw, 1e-6, repeat=2)
    want_res, want_y = res, None
    for _ in range(2):
        want_res, want_y = ops.add_rms_norm("cpu", want_res, ops.linear(w, 0, x), nw, 1e-6)
    assert np.array_equal(got_res, want_res) and np.array_equal(got_y, want_y)
    assert left == 0


def test_moe_add_rms_norm_is_moe_then_add_rms_norm():
    rng = np.random.default_rng(3)
    E, K, H, I, Is, T = 6, 2, 32, 16, 8, 2
    mats = [dense(rng, 1, E, H), dense(rng, E, I, H), dense(rng, E, I, H), dense(rng, E, H, I), dense(rng, 1, Is, H),
            dense(rng, 1, Is, H), dense(rng, 1, H, Is), dense(rng, 1, 1, H)]
    h = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    got_res, got_h, left = ops.moe_add_rms_norm("cpu", *mats, h, res, nw, 1e-6, K)
    want_res, want_h = ops.add_rms_norm("cpu", res, ops.moe("cpu", *mats, h, K), nw, 1e-6)
    assert np.array_equal(got_res, want_res) and np.array_equal(got_h, want_h)
    assert left == 0


@pytest.mark.parametrize("T, cols, rows", [(1, 64, 48), (3, 40, 96)])
def test_linear_rms_normed_is_rms_norm_then_linear(T, cols, rows):
    rng = np.random.default_rng(T * 5 + cols)
    w = dense(rng, 1, rows, cols)
    res = rng.standard_normal((T, cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    got, one_kernel = ops.linear_rms_normed(w, res, nw, 1e-6)
    assert not one_kernel  # never on the CPU: the engine keeps rms_norm where the producer writes h
    assert np.array_equal(got, ops.linear(w, 0, ops.rms_norm("cpu", res, nw, 1e-6)))


def test_moe_add_is_moe_then_add():
    rng = np.random.default_rng(4)
    E, K, H, I, Is, T = 6, 2, 32, 16, 8, 2
    mats = [dense(rng, 1, E, H), dense(rng, E, I, H), dense(rng, E, I, H), dense(rng, E, H, I), dense(rng, 1, Is, H),
            dense(rng, 1, Is, H), dense(rng, 1, H, Is), dense(rng, 1, 1, H)]
    h = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    got = ops.moe_add("cpu", *mats, h, res, K)
    assert np.array_equal(got, ops.add("cpu", res, ops.moe("cpu", *mats, h, K)))


def test_linear_rms_normed_names_a_bad_weight():
    rng = np.random.default_rng(1)
    w = dense(rng, 1, 8, 16)
    with pytest.raises(Exception, match="linear_rms_normed.*weight"):
        ops.linear_rms_normed(w, np.ones((1, 16), np.float32), np.ones(15, np.float32), 1e-6)


def test_linear_add_rms_norm_names_a_bad_residual():
    rng = np.random.default_rng(0)
    w = dense(rng, 1, 8, 16)
    with pytest.raises(Exception, match="linear_add_rms_norm.*res"):
        ops.linear_add_rms_norm(w, np.ones((1, 16), np.float32), np.ones((1, 7), np.float32), np.ones(8, np.float32),
                                1e-6)


def moe_mats(rng, E, H, I, Is):
    return [dense(rng, 1, E, H), dense(rng, E, I, H), dense(rng, E, I, H), dense(rng, E, H, I), dense(rng, 1, Is, H),
            dense(rng, 1, Is, H), dense(rng, 1, H, Is), dense(rng, 1, 1, H)]


@pytest.mark.parametrize("T, cols, rows", [(1, 64, 48), (3, 40, 96)])
def test_linear_add_is_linear_then_add(T, cols, rows):
    rng = np.random.default_rng(T * 3 + cols)
    w = dense(rng, 1, rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    res = rng.standard_normal((T, rows)).astype(np.float32)
    got = ops.linear_add(w, x, res)
    assert np.array_equal(got, ops.add("cpu", res, ops.linear(w, 0, x)))
    assert not np.array_equal(got, res)


@pytest.mark.parametrize("T", [1, 2])
def test_moe_rms_normed_add_is_rms_norm_then_moe_add(T):
    rng = np.random.default_rng(5 + T)
    K, H = 2, 32
    mats = moe_mats(rng, 6, H, 16, 8)
    res = (rng.standard_normal((T, H)) * rng.uniform(0.1, 10.0, H)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    got, fused = ops.moe_rms_normed_add("cpu", *mats, res, nw, 1e-6, K)
    assert not fused  # never on the CPU: the engine keeps linear_add_rms_norm where the MoE block reads h
    h = ops.rms_norm("cpu", res, nw, 1e-6)
    assert np.array_equal(got, ops.moe_add("cpu", *mats, h, res, K))
    assert np.array_equal(got, ops.add("cpu", res, ops.moe("cpu", *mats, h, K)))


def test_moe_rms_normed_add_names_a_bad_weight():
    rng = np.random.default_rng(6)
    mats = moe_mats(rng, 6, 32, 16, 8)
    with pytest.raises(Exception, match="moe_rms_normed_add.*weight"):
        ops.moe_rms_normed_add("cpu", *mats, np.ones((1, 32), np.float32), np.ones(31, np.float32), 1e-6, 2)


def test_linear_add_names_a_bad_residual():
    rng = np.random.default_rng(7)
    w = dense(rng, 1, 8, 16)
    with pytest.raises(Exception, match="linear_add.*res"):
        ops.linear_add(w, np.ones((1, 16), np.float32), np.ones((1, 7), np.float32))
