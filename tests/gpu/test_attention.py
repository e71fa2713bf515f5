"""CUDA split_q_gate, rope, kv_cache_write and attention against the fp32 CPU reference.

The CPU caches are F32 and the CUDA caches BF16, so attention inputs are rounded to bf16 here first:
both backends then see the same cache values and the comparison isolates kernel error. Cache rows
past pos0 + T hold NaN, which no kernel may read into a result.
"""
from __future__ import annotations

import numpy as np
import pytest

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


def rel_err(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


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
