"""CUDA conv1d_silu and gated_delta_rule against the fp32 CPU reference, and the GDN recurrence
run one token at a time against one multi-token call on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

from checks import assert_rel_close, rel_err
from lily import _core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops


# (T, C, K): decode, odd widths, several token blocks (16 per CUDA block), the real conv_dim
@pytest.mark.parametrize("T, C, K", [(1, 19, 4), (2, 99, 4), (3, 128, 2), (17, 33, 5), (40, 257, 3),
                                     (1, 8192, 4), (33, 8192, 4), (2048, 8192, 4)])
def test_conv1d_silu(T, C, K, gpu_tol):
    rng = np.random.default_rng(T * 7919 + C * 31 + K)
    u = rng.standard_normal((T, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    y_cpu, s_cpu = ops.conv1d_silu("cpu", u, w, state)
    y_gpu, s_gpu = ops.conv1d_silu("cuda", u, w, state)
    assert_rel_close("y", y_gpu, y_cpu, gpu_tol["conv1d_silu"])
    np.testing.assert_array_equal(s_gpu, s_cpu)  # the new state is a copy of inputs


def gdn_inputs(rng, T, Hk, Hv, Dk, Dv):
    W = 2 * Hk * Dk + Hv * Dv
    return dict(
        qkv=rng.standard_normal((T, W)).astype(np.float32),
        a=rng.standard_normal((T, Hv)).astype(np.float32),
        b=rng.standard_normal((T, Hv)).astype(np.float32),
        A_log=rng.uniform(-1.0, 1.0, Hv).astype(np.float32),
        dt_bias=rng.standard_normal(Hv).astype(np.float32),
        state=(rng.standard_normal((Hv, Dk, Dv)) * 0.1).astype(np.float32),
    )


def gdn(device, x, Hk, Dk):
    return ops.gated_delta_rule(device, x["qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], Hk, Dk)


# (T, Hk, Hv, Dk, Dv): fast path at every Dk it covers, Dv not a multiple of 32, the generic
# path (Dk = 20, 48), several staged token blocks, and the real dims for decode and prefill
GDN_SHAPES = [(1, 1, 1, 16, 16), (19, 2, 4, 32, 32), (33, 1, 3, 16, 24), (5, 2, 2, 20, 12), (7, 1, 2, 48, 40),
              (17, 2, 2, 64, 72), (3, 1, 1, 256, 64), (1, 16, 32, 128, 128), (37, 16, 32, 128, 128),
              (300, 16, 32, 128, 128)]


@pytest.mark.parametrize("T, Hk, Hv, Dk, Dv", GDN_SHAPES)
def test_gated_delta_rule(T, Hk, Hv, Dk, Dv, gpu_tol):
    x = gdn_inputs(np.random.default_rng(T * 131 + Hv * 17 + Dk + Dv), T, Hk, Hv, Dk, Dv)
    o_cpu, s_cpu = gdn("cpu", x, Hk, Dk)
    o_gpu, s_gpu = gdn("cuda", x, Hk, Dk)
    assert_rel_close("o", o_gpu, o_cpu, gpu_tol["gated_delta_rule"])
    assert_rel_close("state", s_gpu, s_cpu, gpu_tol["gated_delta_rule"])


# The token kernel (decode and short calls), the generic kernel (Dk = 20), the chunked kernels (T >= 64):
# each with a separate output state (the decode ping-pong; the chunked path copies and runs in place).
@pytest.mark.parametrize("T, Hk, Hv, Dk, Dv", [(1, 16, 32, 128, 128), (19, 2, 4, 32, 32), (5, 2, 2, 20, 12),
                                              (130, 16, 32, 128, 128)])
def test_gated_delta_out_of_place_equals_in_place(T, Hk, Hv, Dk, Dv):
    x = gdn_inputs(np.random.default_rng(4000 + T + Dk), T, Hk, Hv, Dk, Dv)
    o_ip, s_ip = gdn("cuda", x, Hk, Dk)
    o, new, old = ops.gated_delta_rule("cuda", x["qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], Hk,
                                       Dk, out_of_place=True)
    np.testing.assert_array_equal(old, x["state"])
    np.testing.assert_array_equal(o, o_ip)
    np.testing.assert_array_equal(new, s_ip)


@pytest.mark.parametrize("T, C, K", [(1, 8192, 4), (40, 257, 3)])
def test_conv1d_silu_out_of_place_equals_in_place(T, C, K):
    rng = np.random.default_rng(T + C + K)
    u, w, st = (rng.standard_normal(s).astype(np.float32) for s in ((T, C), (C, K), (K - 1, C)))
    y, new, old = ops.conv1d_silu("cuda", u, w, st, out_of_place=True)
    y_ip, s_ip = ops.conv1d_silu("cuda", u, w, st)
    np.testing.assert_array_equal(old, st)
    np.testing.assert_array_equal(y, y_ip)
    np.testing.assert_array_equal(new, s_ip)


@pytest.mark.parametrize("T, Hk, Hv, Dk, Dv", [(21, 2, 4, 32, 32), (5, 2, 2, 20, 12), (18, 16, 32, 128, 128)])
def test_gated_delta_steps_equal_one_call(T, Hk, Hv, Dk, Dv, gpu_tol):
    x = gdn_inputs(np.random.default_rng(T + Dk), T, Hk, Hv, Dk, Dv)
    o_all, s_all = gdn("cuda", x, Hk, Dk)
    state, outs = x["state"], []
    for t in range(T):
        step = {k: (v[t:t + 1] if k in ("qkv", "a", "b") else v) for k, v in x.items()}
        step["state"] = state
        o, state = gdn("cuda", step, Hk, Dk)
        outs.append(o)
    tol = gpu_tol["gated_delta_steps_vs_chunk"]
    assert rel_err(np.concatenate(outs), o_all) <= tol
    assert rel_err(state, s_all) <= tol


# ---- the chunked (WY) prefill path: T >= 64 at Dk = Dv = 128 (csrc/cuda/kernels/gdn_chunk.cuh) ----
# T = 1 stays on the token kernel; 63 is the last token-path length; 64 one full chunk; 65, 130,
# 300 end in a partial chunk (1, 2, 44 tokens); 2048 is the engine's prefill chunk (32 chunks).
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130, 300, 2048])
def test_gated_delta_chunked_real_widths(T, gpu_tol):
    x = gdn_inputs(np.random.default_rng(1000 + T), T, 16, 32, 128, 128)
    o_cpu, s_cpu = gdn("cpu", x, 16, 128)
    o_gpu, s_gpu = gdn("cuda", x, 16, 128)
    assert_rel_close("o", o_gpu, o_cpu, gpu_tol["gated_delta_rule"])
    assert_rel_close("state", s_gpu, s_cpu, gpu_tol["gated_delta_rule"])
    tail = (T - 1) // 64 * 64  # the last chunk's rows on their own: a partial chunk must be right too
    assert_rel_close("o (last chunk)", o_gpu[tail:], o_cpu[tail:], gpu_tol["gated_delta_rule"])


# GQA groups other than the model's 2 (value head h reads key head h // (Hv/Hk)): 1, 4, and all
# value heads on one key head.
@pytest.mark.parametrize("T, Hk, Hv", [(100, 4, 4), (100, 2, 8), (77, 1, 3)])
def test_gated_delta_chunked_gqa(T, Hk, Hv, gpu_tol):
    x = gdn_inputs(np.random.default_rng(2000 + T + Hk * 10 + Hv), T, Hk, Hv, 128, 128)
    o_cpu, s_cpu = gdn("cpu", x, Hk, 128)
    o_gpu, s_gpu = gdn("cuda", x, Hk, 128)
    assert_rel_close("o", o_gpu, o_cpu, gpu_tol["gated_delta_rule"])
    assert_rel_close("state", s_gpu, s_cpu, gpu_tol["gated_delta_rule"])


def strong_decay(x, mixed):
    """Decays strong enough that a chunk's cumulative decay exp(G) underflows to 0 in fp32:
    g = -exp(A_log) * softplus(a + dt_bias) ~ -10 .. -100 per token. mixed: only the first 40 tokens
    of every 64 decay hard, the rest as usual, so exp(G_t - G_s) between late tokens is of order 1
    while G itself is ~ -1000 (the fp64 prefix sum in the prep kernel keeps that difference exact)."""
    T = x["a"].shape[0]
    x = dict(x)
    rows = np.arange(T) % 64 < 40 if mixed else np.ones(T, bool)
    x["a"] = (x["a"] + 12.0 * rows[:, None]).astype(np.float32)
    x["A_log"] = (x["A_log"] + 1.5).astype(np.float32)
    return x


@pytest.mark.parametrize("mixed", [False, True])
def test_gated_delta_chunked_strong_decay(mixed, gpu_tol):
    T = 200
    x = strong_decay(gdn_inputs(np.random.default_rng(3000 + mixed), T, 16, 32, 128, 128), mixed)
    o_cpu, s_cpu = gdn("cpu", x, 16, 128)
    o_gpu, s_gpu = gdn("cuda", x, 16, 128)
    assert np.isfinite(o_gpu).all() and np.isfinite(s_gpu).all()
    assert_rel_close("o", o_gpu, o_cpu, gpu_tol["gated_delta_rule"])
    assert_rel_close("state", s_gpu, s_cpu, gpu_tol["gated_delta_rule"])


def test_gated_delta_chunked_continues_state(gpu_tol):
    """Two chunked calls (150 then 170 tokens) continue from the state the first left, a large one
    (|S| ~ 1), and equal one CPU call over all 320 tokens."""
    T1, T2 = 150, 170
    x = gdn_inputs(np.random.default_rng(4000), T1 + T2, 16, 32, 128, 128)
    x["state"] = (x["state"] * 10.0).astype(np.float32)
    o_cpu, s_cpu = gdn("cpu", x, 16, 128)
    first = {k: (v[:T1] if k in ("qkv", "a", "b") else v) for k, v in x.items()}
    o1, s1 = gdn("cuda", first, 16, 128)
    second = {k: (v[T1:] if k in ("qkv", "a", "b") else v) for k, v in x.items()}
    second["state"] = s1
    o2, s2 = gdn("cuda", second, 16, 128)
    assert_rel_close("o", np.concatenate([o1, o2]), o_cpu, gpu_tol["gated_delta_rule"])
    assert_rel_close("state", s2, s_cpu, gpu_tol["gated_delta_rule"])


# 300: five chunks, the last partial (44 tokens), so the scan's zero-filled q, k rows and several
# state hand-overs between 3xBF16 chunks are held to the 2e-5 tolerance too.
@pytest.mark.parametrize("T", [64, 130, 300])
def test_gated_delta_chunked_vs_steps(T, gpu_tol):
    """One chunked call against T calls of one token (the token kernel) on the GPU."""
    chunked_vs_steps(gdn_inputs(np.random.default_rng(5000 + T), T, 16, 32, 128, 128), gpu_tol)


def model_decays(x, rng):
    """Decay rates in the ranges of Qwen3-Next's initialisation (benchmarks/gdn_ref.h, decay 2): exp(A_log) in
    [1, 16], softplus(dt_bias) log-uniform in [1e-3, 1e-1], a halved: g ~ -4e-4 .. -4 per token, so most heads
    keep their state, and the products' rounding in it, over many chunks."""
    Hv = x["A_log"].shape[0]
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), Hv))
    x = dict(x)
    x["A_log"] = rng.uniform(0.0, np.log(16.0), Hv).astype(np.float32)
    x["dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus^-1(dt)
    x["a"] = (x["a"] * 0.5).astype(np.float32)
    return x


def test_gated_delta_chunked_vs_steps_model_decays(gpu_tol):
    """16 chunks with long-lived state: the kind of case where the host emulation of the kernels found the
    largest errors (docs/gdn-prefill.md, "Error budget"; 3xBF16: ~6e-6 at T = 1024)."""
    rng = np.random.default_rng(6000)
    chunked_vs_steps(model_decays(gdn_inputs(rng, 1024, 16, 32, 128, 128), rng), gpu_tol)


def chunked_vs_steps(x, gpu_tol):
    T = x["qkv"].shape[0]
    o_all, s_all = gdn("cuda", x, 16, 128)
    state, outs = x["state"], []
    for t in range(T):
        step = {k: (v[t:t + 1] if k in ("qkv", "a", "b") else v) for k, v in x.items()}
        step["state"] = state
        o, state = gdn("cuda", step, 16, 128)
        outs.append(o)
    o_steps = np.concatenate(outs)
    tol = gpu_tol["gated_delta_chunked_vs_steps"]
    assert rel_err(o_all, o_steps) <= tol, rel_err(o_all, o_steps)
    assert rel_err(s_all, state) <= tol, rel_err(s_all, state)
    # The chunked path sums in another order than the token kernel, so the two are not bit-identical;
    # identical results would mean the long call never left the token kernel.
    assert not np.array_equal(o_all, o_steps), "the T >= 64 call did not take the chunked path"


# ---- conv_gated_delta_rule: the conv inside the chunked prefill's prep (gdn_chunk::Params::u) ----
# Against conv1d_silu then gated_delta_rule on the GPU: the same arithmetic (conv_silu_out), so the same bits for
# o, the state and the conv state; against the CPU within the usual tolerance. T = 64 (one chunk: the halo
# from the conv state), 65 / 130 / 300 (partial last chunks), 2048 (the halo across chunks); Hv = Hk (one value head
# a CTA) and the model's Hv = 2 Hk; Hv = 4 Hk and T < 64 take the unfused path (same results by definition).
@pytest.mark.parametrize("T, Hk, Hv", [(64, 16, 32), (65, 2, 4), (130, 2, 2), (300, 16, 32), (2048, 16, 32),
                                       (100, 2, 8), (40, 2, 4)])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_conv_gated_delta_rule(T, Hk, Hv, out_of_place, gpu_tol):
    rng = np.random.default_rng(5000 + T + Hk + Hv)
    x = gdn_inputs(rng, T, Hk, Hv, 128, 128)
    C = x["qkv"].shape[1]
    w = (rng.standard_normal((C, 4)) * 0.5).astype(np.float32)
    cs = rng.standard_normal((3, C)).astype(np.float32)
    args = (x["qkv"], w, cs, x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], Hk, 128)
    res = ops.conv_gated_delta_rule("cuda", *args, out_of_place=out_of_place)
    o, s, c = res[:3]
    if out_of_place:  # the inputs' states as the op left them: unchanged
        np.testing.assert_array_equal(res[3], x["state"])
        np.testing.assert_array_equal(res[4], cs)
    y, c_ref = ops.conv1d_silu("cuda", x["qkv"], w, cs)
    o_ref, s_ref = ops.gated_delta_rule("cuda", y, x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], Hk, 128)
    np.testing.assert_array_equal(c, c_ref)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(s, s_ref)
    o_cpu, s_cpu, c_cpu = ops.conv_gated_delta_rule("cpu", *args)
    assert_rel_close("o", o, o_cpu, gpu_tol["gated_delta_rule"])
    assert_rel_close("state", s, s_cpu, gpu_tol["gated_delta_rule"])
    np.testing.assert_array_equal(c, c_cpu)
