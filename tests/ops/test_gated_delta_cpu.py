"""The CPU Gated DeltaNet ops against fp64 numpy references written from their contracts.

ops.h: conv1d_silu, gated_delta_rule (and conv_gated_delta_rule, the two in one), gated_rms_norm. The equations are docs/model.md section 2.2;
each reference below is that text in numpy, one token and one head at a time, so it can be read
side by side with the contract.
"""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


def silu(u):
    return u / (1 + np.exp(-u))


def conv1d_silu_ref(u, w, state):
    """y[t, c] = silu(sum_j w[c, j] * u[t - K + 1 + j, c]); inputs before the call come from state
    [K-1, C] (oldest first), and the state keeps the last K-1 inputs."""
    K = w.shape[1]
    seq = np.concatenate([state, u]).astype(np.float64)  # [K-1 + T, C]
    T = u.shape[0]
    y = np.stack([silu(np.sum(w.T * seq[t:t + K], axis=0)) for t in range(T)])
    return y, seq[-(K - 1):]


def gated_delta_ref(qkv, a, b, A_log, dt_bias, state, Hk, Dk):
    """The delta rule, token by token. qkv [T, 2*Hk*Dk + Hv*Dv] holds q | k | v head-major; value head
    h reads key head h // (Hv/Hk); the state S [Hv, Dk, Dv] is indexed [key dim, value dim]."""
    T, Hv, Dv = qkv.shape[0], state.shape[0], state.shape[2]
    S = state.astype(np.float64).copy()
    o = np.zeros((T, Hv, Dv))
    for t in range(T):
        q = qkv[t, :Hk * Dk].reshape(Hk, Dk).astype(np.float64)
        k = qkv[t, Hk * Dk:2 * Hk * Dk].reshape(Hk, Dk).astype(np.float64)
        v = qkv[t, 2 * Hk * Dk:].reshape(Hv, Dv).astype(np.float64)
        q = q / np.sqrt(np.sum(q * q, axis=1, keepdims=True) + 1e-6) / np.sqrt(Dk)  # eps inside the sum
        k = k / np.sqrt(np.sum(k * k, axis=1, keepdims=True) + 1e-6)               # k is not scaled
        beta = 1 / (1 + np.exp(-np.float64(b[t])))                                   # sigmoid(b)
        g = -np.exp(np.float64(A_log)) * np.log1p(np.exp(np.float64(a[t]) + dt_bias))  # softplus(a + dt_bias)
        for h in range(Hv):
            kh = h // (Hv // Hk)
            S[h] *= np.exp(g[h])                           # decay first
            m = S[h].T @ k[kh]                             # what the state predicts for v
            S[h] += np.outer(k[kh], beta[h] * (v[h] - m))  # write the correction
            o[t, h] = S[h].T @ q[kh]                       # read the updated state
    return o.reshape(T, Hv * Dv), S


def gated_rms_norm_ref(x, z, w, eps):
    """y = w * x / sqrt(mean(x^2) + eps) * silu(z), per row: the norm before the gate, plain w."""
    x, z = x.astype(np.float64), z.astype(np.float64)
    return w * x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * silu(z)


def gdn_inputs(seed, T, Hk, Hv, Dk, Dv):
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return dict(qkv=f32(rng.standard_normal((T, 2 * Hk * Dk + Hv * Dv))), a=f32(rng.standard_normal((T, Hv))),
                b=f32(rng.standard_normal((T, Hv))), A_log=f32(rng.uniform(-1, 1, Hv)),
                dt_bias=f32(rng.standard_normal(Hv)), state=f32(0.1 * rng.standard_normal((Hv, Dk, Dv))))


@pytest.mark.parametrize("T, C, K", [(1, 3, 2), (5, 8, 4), (9, 5, 3)])
def test_conv1d_silu_matches_reference(T, C, K):
    rng = np.random.default_rng(T * 10 + C)
    u = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    y, new_state = ops.conv1d_silu("cpu", u, w, state)
    y_ref, state_ref = conv1d_silu_ref(u, w, state)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new_state, state_ref.astype(np.float32))


# (T, Hk, Hv, Dk, Dv): one head; two value heads per key head (the model's grouping); Dk != Dv.
@pytest.mark.parametrize("T, Hk, Hv, Dk, Dv", [(1, 1, 1, 4, 4), (6, 1, 2, 8, 8), (7, 2, 4, 4, 6), (3, 2, 2, 16, 8)])
def test_gated_delta_rule_matches_reference(T, Hk, Hv, Dk, Dv):
    x = gdn_inputs(T * 100 + Hv * 10 + Dk, T, Hk, Hv, Dk, Dv)
    o, state = ops.gated_delta_rule("cpu", x["qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], Hk, Dk)
    o_ref, state_ref = gated_delta_ref(x["qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], Hk, Dk)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, state_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 5])
def test_out_of_place_leaves_the_input_and_equals_in_place(T):
    x = gdn_inputs(T, T, 2, 4, 8, 8)
    args = ("cpu", x["qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], 2, 8)
    o, new, old = ops.gated_delta_rule(*args, out_of_place=True)
    o_ip, s_ip = ops.gated_delta_rule(*args)
    np.testing.assert_array_equal(old, x["state"])
    np.testing.assert_array_equal(o, o_ip)
    np.testing.assert_array_equal(new, s_ip)
    rng = np.random.default_rng(T)
    u, w, st = (rng.standard_normal(s).astype(np.float32) for s in ((T, 6), (6, 4), (3, 6)))
    y, new, old = ops.conv1d_silu("cpu", u, w, st, out_of_place=True)
    y_ip, s_ip = ops.conv1d_silu("cpu", u, w, st)
    np.testing.assert_array_equal(old, st)
    np.testing.assert_array_equal(y, y_ip)
    np.testing.assert_array_equal(new, s_ip)


@pytest.mark.parametrize("out_of_place", [False, True])
def test_conv_gated_delta_rule_is_conv_then_rule(out_of_place):
    """conv_gated_delta_rule: conv1d_silu, then gated_delta_rule on its output (the same bits on the CPU)."""
    x = gdn_inputs(11, 9, 2, 4, 8, 8)
    rng = np.random.default_rng(11)
    C = x["qkv"].shape[1]
    w, cs = rng.standard_normal((C, 4)).astype(np.float32), rng.standard_normal((3, C)).astype(np.float32)
    res = ops.conv_gated_delta_rule("cpu", x["qkv"], w, cs, x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"],
                                    2, 8, out_of_place=out_of_place)
    y, c_ref = ops.conv1d_silu("cpu", x["qkv"], w, cs)
    o_ref, s_ref = ops.gated_delta_rule("cpu", y, x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], 2, 8)
    for got, want in zip(res[:3], (o_ref, s_ref, c_ref)):
        np.testing.assert_array_equal(got, want)
    if out_of_place:  # the input states as the op left them
        np.testing.assert_array_equal(res[3], x["state"])
        np.testing.assert_array_equal(res[4], cs)


def test_gated_delta_rule_in_two_calls_equals_one():
    """The state carries the whole history: T tokens in one call or split in two give the same."""
    x = gdn_inputs(7, 8, 1, 2, 8, 8)
    args = lambda s, e, st: ("cpu", x["qkv"][s:e], x["a"][s:e], x["b"][s:e], x["A_log"], x["dt_bias"], st, 1, 8)  # noqa: E731
    o_all, s_all = ops.gated_delta_rule(*args(0, 8, x["state"]))
    o_1, s_1 = ops.gated_delta_rule(*args(0, 3, x["state"]))
    o_2, s_2 = ops.gated_delta_rule(*args(3, 8, s_1))
    np.testing.assert_allclose(np.concatenate([o_1, o_2]), o_all, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s_2, s_all, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("R, D", [(1, 4), (6, 16)])
def test_gated_rms_norm_matches_reference(R, D):
    rng = np.random.default_rng(R + D)
    x = rng.standard_normal((R, D)).astype(np.float32)
    z = rng.standard_normal((R, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    np.testing.assert_allclose(ops.gated_rms_norm("cpu", x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6),
                               rtol=1e-5, atol=1e-6)
