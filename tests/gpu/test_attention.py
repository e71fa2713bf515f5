"""CUDA split_q_gate, rope, kv_cache_write and attention against the fp32 CPU reference.

The CPU caches are F32 and the CUDA caches BF16, so attention inputs are rounded to bf16 here first:
both backends then see the same cache values and the comparison isolates kernel error. Cache rows
past pos0 + T hold NaN, which no kernel may read into a result.
"""
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

REAL = (16, 2, 256)  # nH, nKV, D of the model
# head dims with tensor-core kernels (32, 64, 128, 256) and one that takes the generic kernel (24)
CONFIGS = [REAL, (4, 2, 32), (4, 2, 64), (8, 1, 128), (4, 2, 24)]
MMA_DIMS = (32, 64, 128, 256)


def check(got, ref, tol):
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "non-finite output"
    err, max_abs = rel_err(got, ref), float(np.abs(got - ref).max())
    assert err <= tol, f"rel err {err:.3g} > {tol:.3g} (max abs {max_abs:.3g})"


def bf16_round(x):
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def attention_tol_key(T, nH, nKV, D):
    if D not in MMA_DIMS:
        return "attention_generic"
    return "attention_decode" if T <= 4 and T * (nH // nKV) <= 32 else "attention_prefill"


@pytest.mark.parametrize("T, nH, D", [(1, 16, 256), (3, 16, 256), (19, 3, 6), (1, 1, 1), (99, 4, 32)])
def test_split_q_gate(T, nH, D, gpu_tol):
    rng = np.random.default_rng(T * 1009 + nH * 31 + D)
    p = rng.standard_normal((T, nH * 2 * D)).astype(np.float32)
    q, g = ops.split_q_gate("cuda", p, nH)
    q_ref, g_ref = ops.split_q_gate("cpu", p, nH)
    assert gpu_tol["split_q_gate"] == 0.0
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(g, g_ref)


@pytest.mark.parametrize("pos0", [0, 17, 100000, 131000])
@pytest.mark.parametrize("T, nH, D, rotary_dim, theta", [
    (1, 16, 256, 64, 1e7),   # q of the model
    (5, 2, 256, 64, 1e7),    # k of the model
    (70, 16, 256, 64, 1e7),
    (3, 3, 24, 10, 1e4),     # tiny, odd head count and rotary_dim
    (2, 4, 32, 32, 1e6),     # full rotation
])
def test_rope(T, nH, D, rotary_dim, theta, pos0, gpu_tol):
    rng = np.random.default_rng(T * 7 + nH * 13 + D + pos0)
    x = rng.standard_normal((T, nH * D)).astype(np.float32)
    got = ops.rope("cuda", x, nH, rotary_dim, theta, pos0)
    ref = ops.rope("cpu", x, nH, rotary_dim, theta, pos0)
    check(got, ref, gpu_tol["rope"])


@pytest.mark.parametrize("T, W, max_t, pos0", [(1, 512, 40, 0), (5, 512, 40, 7), (3, 6, 10, 7), (64, 64, 64, 0)])
def test_kv_cache_write(T, W, max_t, pos0, gpu_tol):
    rng = np.random.default_rng(T * 3 + W + pos0)
    x = rng.standard_normal((T, W)).astype(np.float32) * 3
    cache = rng.standard_normal((max_t, W)).astype(np.float32)
    got = ops.kv_cache_write("cuda", x, cache, pos0)
    want = bf16_round(cache)
    want[pos0:pos0 + T] = bf16_round(x)
    assert gpu_tol["kv_cache_write"] == 0.0
    np.testing.assert_array_equal(got, want)


def run_attention(T, nH, nKV, D, max_t, pos0, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, nH * D)).astype(np.float32)
    k = bf16_round(rng.standard_normal((max_t, nKV * D)).astype(np.float32))
    v = bf16_round(rng.standard_normal((max_t, nKV * D)).astype(np.float32))
    k[pos0 + T:] = np.nan
    v[pos0 + T:] = np.nan
    got = ops.attention("cuda", q, k, v, nH, nKV, pos0)
    ref = ops.attention("cpu", q, k, v, nH, nKV, pos0)
    return got, ref


@pytest.mark.parametrize("nH, nKV, D", CONFIGS)
@pytest.mark.parametrize("pos0", [0, 1, 777])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 64, 65, 300])
@pytest.mark.parametrize("spare", [0, None], ids=["tight", "cap16384"])
def test_attention(T, nH, nKV, D, pos0, spare, gpu_tol):
    max_t = pos0 + T if spare == 0 else 16384
    got, ref = run_attention(T, nH, nKV, D, max_t, pos0, seed=T * 100003 + pos0 * 101 + D + nH + max_t)
    check(got, ref, gpu_tol[attention_tol_key(T, nH, nKV, D)])


@pytest.mark.parametrize("T", [1, 4, 70])
@pytest.mark.parametrize("max_t", [None, 16384, 131072])
def test_attention_long_context(T, max_t, gpu_tol):
    nH, nKV, D = REAL
    pos0 = 8000
    max_t = max_t or pos0 + T
    got, ref = run_attention(T, nH, nKV, D, max_t, pos0, seed=T + max_t)
    check(got, ref, gpu_tol[attention_tol_key(T, nH, nKV, D)])


@pytest.mark.parametrize("pos0", [63, 64, 4095, 4096])
@pytest.mark.parametrize("T", [1, 4])
def test_attention_decode_tile_edges(T, pos0, gpu_tol):
    """Split-KV decode where the visible rows end at or just past a 64-row tile edge."""
    nH, nKV, D = REAL
    got, ref = run_attention(T, nH, nKV, D, pos0 + T, pos0, seed=pos0 * 7 + T)
    check(got, ref, gpu_tol["attention_decode"])


def test_attention_decode_grids_share_the_merge_counter(gpu_tol):
    """Decode launches of different grids and merger counts use one arrival counter, which each
    must leave at rest: a later launch gives the same bits as before them (and does not hang)."""
    nH, nKV, D = REAL
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, nH * D)).astype(np.float32)
    k = bf16_round(rng.standard_normal((2048, nKV * D)).astype(np.float32))
    v = bf16_round(rng.standard_normal((2048, nKV * D)).astype(np.float32))
    a = ops.attention("cuda", q, k, v, nH, nKV, 1500)
    for T, (h, kv, d), pos0 in [(1, (4, 2, 32), 0), (3, (8, 1, 128), 700), (4, REAL, 5), (2, (4, 2, 64), 64)]:
        got, ref = run_attention(T, h, kv, d, pos0 + T, pos0, seed=T + pos0)
        check(got, ref, gpu_tol[attention_tol_key(T, h, kv, d)])
    np.testing.assert_array_equal(ops.attention("cuda", q, k, v, nH, nKV, 1500), a)


@pytest.mark.parametrize("T", [1, 300])
def test_attention_deterministic(T):
    nH, nKV, D = REAL
    rng = np.random.default_rng(T)
    q = rng.standard_normal((T, nH * D)).astype(np.float32)
    k = bf16_round(rng.standard_normal((2048, nKV * D)).astype(np.float32))
    v = bf16_round(rng.standard_normal((2048, nKV * D)).astype(np.float32))
    a = ops.attention("cuda", q, k, v, nH, nKV, 1500)
    b = ops.attention("cuda", q, k, v, nH, nKV, 1500)
    np.testing.assert_array_equal(a, b)


# gated_attention: the decode step between the projections in one op. On CUDA at T = 1 with a
# tensor-core head dim it is two fused kernels; it must match the CUDA op sequence bit for bit and
# the CPU sequence (with bf16 cache rows) within the op tolerances.
GATED_CONFIGS = [
    (16, 2, 256, 64, 1e7),   # the model (group 8, partial rotary)
    (4, 2, 64, 16, 1e7),     # the tiny synthetic model
    (4, 2, 32, 32, 1e6),     # full rotation
    (6, 2, 128, 10, 1e4),    # group 3, odd half
    (32, 1, 64, 64, 1e4),    # group 32: two m-tiles
    (8, 4, 256, 0, 1e4),     # no rotation
    (4, 2, 24, 8, 1e4),      # generic head dim: the per-op fallback
]


def gated_inputs(nH, nKV, D, max_t, pos0, seed):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal((1, nH * 2 * D)).astype(np.float32)
    k = (rng.standard_normal((1, nKV * D)) * 2).astype(np.float32)
    v = rng.standard_normal((1, nKV * D)).astype(np.float32)
    q_norm = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    k_norm = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kc = bf16_round(rng.standard_normal((max_t, nKV * D)).astype(np.float32))
    vc = bf16_round(rng.standard_normal((max_t, nKV * D)).astype(np.float32))
    kc[pos0:] = np.nan  # row pos0 must be written before it is read; later rows never read
    vc[pos0:] = np.nan
    return p, k, v, q_norm, k_norm, kc, vc


def gated_sequence(dev, nH, nKV, D, rd, theta, eps, pos0, p, k, v, q_norm, k_norm, kc, vc, delta=0):
    """The per-op sequence on `dev` (rotations at pos0 + delta); the CPU caches get bf16 rows, as the GPU's."""
    q, g = ops.split_q_gate(dev, p, nH)
    q = ops.rope(dev, ops.rms_norm(dev, q.reshape(nH, D), q_norm, eps).reshape(1, nH * D), nH, rd, theta, pos0,
                 rope_delta=delta)
    kr = ops.rope(dev, ops.rms_norm(dev, k.reshape(nKV, D), k_norm, eps).reshape(1, nKV * D), nKV, rd, theta, pos0,
                  rope_delta=delta)
    if dev == "cpu":
        kc, vc = kc.copy(), vc.copy()
        kc[pos0], vc[pos0] = bf16_round(kr[0]), bf16_round(v[0])
    else:
        kc, vc = ops.kv_cache_write(dev, kr, kc, pos0), ops.kv_cache_write(dev, v, vc, pos0)
    o = ops.sigmoid_mul(dev, ops.attention(dev, q, kc, vc, nH, nKV, pos0), g)
    return q, g, o, kc, vc


@pytest.mark.parametrize("nH, nKV, D, rd, theta", GATED_CONFIGS)
@pytest.mark.parametrize("pos0", [0, 1, 37, 63, 64, 5000])
def test_gated_attention_decode(nH, nKV, D, rd, theta, pos0, gpu_tol):
    eps, max_t = 1e-6, pos0 + 70
    args = gated_inputs(nH, nKV, D, max_t, pos0, seed=nH * 1000 + D + pos0)
    got = ops.gated_attention("cuda", *args[:5], eps, rd, theta, *args[5:], nH, nKV, pos0)
    q, g, o, kc, vc = got
    # Bit for bit against the CUDA op sequence (same arithmetic, fused).
    for name, a, b in zip("q gate o k_cache v_cache".split(), got,
                          gated_sequence("cuda", nH, nKV, D, rd, theta, eps, pos0, *args)):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # Against the fp32 CPU sequence.
    q_ref, g_ref, o_ref, kc_ref, vc_ref = gated_sequence("cpu", nH, nKV, D, rd, theta, eps, pos0, *args)
    np.testing.assert_array_equal(g, g_ref)
    check(q, q_ref, max(gpu_tol["rms_norm"], gpu_tol["rope"]))
    np.testing.assert_array_equal(vc[:pos0 + 1], vc_ref[:pos0 + 1])
    np.testing.assert_array_equal(kc[:pos0], kc_ref[:pos0])
    # the new key row is bf16 of a value within rms_norm/rope ulps of the CPU's: at most one bf16 ulp off
    np.testing.assert_allclose(kc[pos0], kc_ref[pos0], rtol=2.0 ** -7, atol=1e-30)
    check(o, o_ref, gpu_tol[attention_tol_key(1, nH, nKV, D)])


@pytest.mark.parametrize("pos0", [131000])
def test_gated_attention_decode_far_position(pos0, gpu_tol):
    nH, nKV, D, rd, theta, eps = 16, 2, 256, 64, 1e7, 1e-6
    args = gated_inputs(nH, nKV, D, 131072, pos0, seed=pos0)
    got = ops.gated_attention("cuda", *args[:5], eps, rd, theta, *args[5:], nH, nKV, pos0)
    want = gated_sequence("cuda", nH, nKV, D, rd, theta, eps, pos0, *args)
    for name, a, b in zip("q gate o k_cache v_cache".split(), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    o_ref = gated_sequence("cpu", nH, nKV, D, rd, theta, eps, pos0, *args)[2]
    check(got[2], o_ref, gpu_tol["attention_decode"])


def gated_prompt_sequence(dev, nH, nKV, D, rd, theta, eps, pos0, p, k, v, qn, kn, kc, vc, delta=0):
    """The per-op sequence for T tokens on `dev` (as ops::gated_attention's fallback); CPU caches get bf16 rows."""
    T = p.shape[0]
    q, g = ops.split_q_gate(dev, p, nH)
    q = ops.rope(dev, ops.rms_norm(dev, q.reshape(T * nH, D), qn, eps).reshape(T, nH * D), nH, rd, theta, pos0,
                 rope_delta=delta)
    kr = ops.rope(dev, ops.rms_norm(dev, k.reshape(T * nKV, D), kn, eps).reshape(T, nKV * D), nKV, rd, theta, pos0,
                  rope_delta=delta)
    if dev == "cpu":
        kc, vc = kc.copy(), vc.copy()
        kc[pos0:pos0 + T], vc[pos0:pos0 + T] = bf16_round(kr), bf16_round(v)
    else:
        kc, vc = ops.kv_cache_write(dev, kr, kc, pos0), ops.kv_cache_write(dev, v, vc, pos0)
    o = ops.sigmoid_mul(dev, ops.attention(dev, q, kc, vc, nH, nKV, pos0), g)
    return q, g, o, kc, vc


# A prompt's gated attention: on CUDA at D = 256 where attention runs on the wgmma kernel (more than 4
# tokens, or T * group > 32), one prep kernel (q/k norm and RoPE, the cache rows, q's bf16) and the
# attention kernel with sigmoid(gate) in its epilogue: o and the caches must equal the CUDA op sequence bit
# for bit (q and gate are not written there); below that, the per-op path: all five outputs equal.
@pytest.mark.parametrize("nH, nKV, D, rd, T, pos0, delta", [
    (16, 2, 256, 64, 3, 40, 0),      # split-KV attention (T * group <= 32): the per-op path
    (16, 2, 256, 64, 5, 40, 0),      # the fused path, a partial 128-row tile
    (16, 2, 256, 64, 130, 0, 0),     # from the first cache row, two tiles
    (16, 2, 256, 64, 300, 1000, -25),  # after earlier chunks, text after an image (rope_delta)
    (6, 2, 256, 10, 7, 3, 0),        # group 3, odd half
    (8, 4, 256, 0, 64, 64, 0),       # no rotation
    (4, 2, 64, 16, 40, 5, 0),        # head_dim 64: the per-op path (mma.sync attention)
])
def test_gated_attention_prompt(nH, nKV, D, rd, T, pos0, delta, gpu_tol):
    eps, theta = 1e-6, 1e7
    rng = np.random.default_rng(T * 7 + pos0 + D)
    p = rng.standard_normal((T, nH * 2 * D)).astype(np.float32)
    k = (rng.standard_normal((T, nKV * D)) * 2).astype(np.float32)
    v = rng.standard_normal((T, nKV * D)).astype(np.float32)
    qn = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kn = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kc = bf16_round(rng.standard_normal((pos0 + T + 40, nKV * D)).astype(np.float32))
    vc = bf16_round(rng.standard_normal((pos0 + T + 40, nKV * D)).astype(np.float32))
    kc[pos0:], vc[pos0:] = np.nan, np.nan  # rows pos0.. written before they are read; later rows never read
    args = (p, k, v, qn, kn)
    got = ops.gated_attention("cuda", *args, eps, rd, theta, kc, vc, nH, nKV, pos0, rope_delta=delta)
    want = gated_prompt_sequence("cuda", nH, nKV, D, rd, theta, eps, pos0, *args, kc, vc, delta=delta)
    fused = D == 256 and not (T <= 4 and T * (nH // nKV) <= 32)
    for name, a, b in zip("q gate o k_cache v_cache".split(), got, want):
        if fused and name in ("q", "gate"):
            continue
        np.testing.assert_array_equal(a, b, err_msg=name)
    o_ref = gated_prompt_sequence("cpu", nH, nKV, D, rd, theta, eps, pos0, *args, kc, vc, delta=delta)[2]
    assert np.isfinite(got[2]).all()
    check(got[2], o_ref, gpu_tol[attention_tol_key(T, nH, nKV, D)])


def test_gated_attention_deterministic():
    nH, nKV, D = REAL
    args = gated_inputs(nH, nKV, D, 2048, 1500, seed=9)
    a = ops.gated_attention("cuda", *args[:5], 1e-6, 64, 1e7, *args[5:], nH, nKV, 1500)
    b = ops.gated_attention("cuda", *args[:5], 1e-6, 64, 1e7, *args[5:], nH, nKV, 1500)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# Text after an image turns by its cache position + rope_delta (ops::Position): the offset is a kernel argument
# of rope_kernel and of the fused decode's prep, and the cache rows stay where the position says.
@pytest.mark.parametrize("pos0, delta", [(40, -25), (5000, -4000), (7, 12)])
def test_rope_delta(pos0, delta, gpu_tol):
    x = np.random.default_rng(pos0).standard_normal((5, 16 * 256)).astype(np.float32)
    got = ops.rope("cuda", x, 16, 64, 1e7, pos0, rope_delta=delta)
    np.testing.assert_array_equal(got, ops.rope("cuda", x, 16, 64, 1e7, pos0 + delta))
    check(got, ops.rope("cpu", x, 16, 64, 1e7, pos0, rope_delta=delta), gpu_tol["rope"])


@pytest.mark.parametrize("nH, nKV, D, rd, theta", GATED_CONFIGS)
@pytest.mark.parametrize("pos0, delta", [(37, -20), (1500, -1400)])
def test_gated_attention_decode_rope_delta(nH, nKV, D, rd, theta, pos0, delta, gpu_tol):
    eps = 1e-6
    args = gated_inputs(nH, nKV, D, pos0 + 70, pos0, seed=nH + D + pos0)
    got = ops.gated_attention("cuda", *args[:5], eps, rd, theta, *args[5:], nH, nKV, pos0, rope_delta=delta)
    want = gated_sequence("cuda", nH, nKV, D, rd, theta, eps, pos0, *args, delta=delta)
    for name, a, b in zip("q gate o k_cache v_cache".split(), got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    o_ref = gated_sequence("cpu", nH, nKV, D, rd, theta, eps, pos0, *args, delta=delta)[2]
    check(got[2], o_ref, gpu_tol[attention_tol_key(1, nH, nKV, D)])
