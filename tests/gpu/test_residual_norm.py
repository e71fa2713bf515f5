"""CUDA linear_add_rms_norm and moe_add_rms_norm against the CUDA ops they fold (linear or moe, then
add_rms_norm): bit for bit, on the one-kernel path (one token, integer tensor-core GEMV; the add in the
epilogue, the norm by the grid's last CTA) and on the fallback; the completion counter back at zero.
Likewise moe_add (moe, then add), linear_add (linear, then add), linear_rms_normed (rms_norm, then linear: on
its one-kernel path every CTA of the GEMV normalises the residual row in rms_norm's order while staging it) and
moe_rms_normed_add (rms_norm, then moe_add: on its fast path the fused router and moe_up normalise the residual
row themselves in rms_norm's order). linear_add_moe_rms_normed_add (linear_add, then moe_rms_normed_add) with
early routing equals them to f32 accuracy (another factorisation of the router's logits), bit for bit without."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core
from lily.checkpoint import quant
from test_linear import both, random_matrix, random_words_matrix
from test_moe import moe_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops


# (T, rows, cols, bits, group): the fused kernel (T = 1, >= 1024 rows, 4/8-bit, BF16 scales) at the real
# out_proj / o_proj shapes and small-D norm mappings; two tokens (the multi-token GEMV adding in its
# epilogue, then rms_norm); the fallback (group 32 at 4 bits, few rows)
CASES = [(1, 2048, 4096, 4, 64), (1, 2048, 2048, 8, 64), (1, 1024, 512, 4, 128), (1, 1040, 256, 4, 64),
         (1, 1026, 256, 4, 64),
         (2, 2048, 1024, 4, 64), (1, 2048, 512, 4, 32), (1, 96, 64, 4, 64)]


@pytest.mark.parametrize("T, rows, cols, bits, group", CASES)
def test_linear_add_rms_norm_equals_the_two_ops(T, rows, cols, bits, group):
    rng = np.random.default_rng(rows + cols + T)
    _, w = both(random_matrix(rng, 1, rows, cols, bits, group, "BF16"))
    x = rng.standard_normal((T, cols)).astype(np.float32)
    res = rng.standard_normal((T, rows)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, rows).astype(np.float32)
    got_res, got_y, left = ops.linear_add_rms_norm(w, x, res, nw, 1e-6, repeat=3)
    want_res = res
    for _ in range(3):  # three calls on the same buffers: the counter must be reset by each
        want_res, want_y = ops.add_rms_norm("cuda", want_res, ops.linear(w, 0, x), nw, 1e-6)
    assert left == 0
    assert np.array_equal(got_res, want_res)
    assert np.array_equal(got_y, want_y)


@pytest.mark.parametrize("T, E, top_k, H, I, Is, bits, group", [
    (1, 256, 8, 2048, 512, 512, 4, 64),   # the real MoE block: moe_down_mma with the tail
    (1, 9, 4, 256, 128, 256, 4, 64),      # wider shared expert
    (1, 7, 3, 192, 64, 128, 8, 32),       # 8 bits, two groups a segment
    (2, 9, 4, 256, 128, 256, 4, 64),      # two tokens: moe, then add_rms_norm
])
def test_moe_add_rms_norm_equals_the_two_ops(T, E, top_k, H, I, Is, bits, group):
    rng = np.random.default_rng(E + H + T)
    _, gpu = moe_weights(rng, E, H, I, Is, bits, group, "BF16", 8)
    h = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    got_res, got_h, left = ops.moe_add_rms_norm("cuda", *gpu, h, res, nw, 1e-6, top_k)
    want_res, want_h = ops.add_rms_norm("cuda", res, ops.moe("cuda", *gpu, h, top_k), nw, 1e-6)
    assert left == 0
    assert np.array_equal(got_res, want_res)
    assert np.array_equal(got_h, want_h)


# (T, rows, cols, bits, group, one kernel): the layers' stacked input projections (GDN in_proj 12352 x 2048,
# attention qkv 9216 x 2048, 4-bit group 64), 8 bits, two groups a segment and a smaller D with the CTA's
# norm mapping (norm_threads(D) = 256: 1024 < D <= 2048); the fallback for D = 1024 (128 norm threads),
# D = 4096 (past one octet a thread), two tokens and too few rows for the tensor-core GEMV
NORMED_CASES = [(1, 12352, 2048, 4, 64, True), (1, 9216, 2048, 4, 64, True), (1, 2048, 2048, 8, 64, True),
                (1, 1024, 1536, 8, 32, True), (1, 1024, 1152, 4, 128, True),
                (1, 2048, 1024, 4, 64, False), (1, 1024, 4096, 4, 64, False), (2, 2048, 2048, 4, 64, False),
                (1, 96, 2048, 4, 64, False)]


@pytest.mark.parametrize("T, rows, cols, bits, group, one_kernel", NORMED_CASES)
def test_linear_rms_normed_equals_rms_norm_then_linear(T, rows, cols, bits, group, one_kernel):
    rng = np.random.default_rng(rows + cols + bits)
    w = ops.QMatrix("cuda", **random_words_matrix(rng, rows, cols, bits, group))
    res = (rng.standard_normal((T, cols)) * rng.uniform(0.1, 10.0, cols)).astype(np.float32)  # uneven, as x is
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    got, fused = ops.linear_rms_normed(w, res, nw, 1e-6)
    assert fused == one_kernel
    assert np.array_equal(got, ops.linear(w, 0, ops.rms_norm("cuda", res, nw, 1e-6)))


@pytest.mark.parametrize("T, E, top_k, H, I, Is, bits, group", [
    (1, 256, 8, 2048, 512, 512, 4, 64),   # the real MoE block: moe_down_mma adds into res
    (3, 9, 4, 256, 128, 256, 4, 64),      # three tokens, still the tensor-core chain
    (1, 7, 3, 192, 64, 128, 8, 32),       # 8 bits, two groups a segment
    (20, 9, 4, 256, 128, 256, 4, 64),     # a prompt: moe, then add
])
def test_moe_add_equals_moe_then_add(T, E, top_k, H, I, Is, bits, group):
    rng = np.random.default_rng(E + H + T + 1)
    _, gpu = moe_weights(rng, E, H, I, Is, bits, group, "BF16", 8)
    h = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    got = ops.moe_add("cuda", *gpu, h, res, top_k)
    assert np.array_equal(got, ops.add("cuda", res, ops.moe("cuda", *gpu, h, top_k)))


# (T, rows, cols, bits, group): the one-kernel path (T = 1, tensor-core GEMV: the add in its epilogue) at the
# real out_proj / o_proj shape (2048 x 4096), 8 bits, two groups a segment; the fallback (linear, then add)
# for two tokens, too few rows and 4-bit group 32
ADD_CASES = [(1, 2048, 4096, 4, 64), (1, 2048, 2048, 8, 64), (1, 1024, 1536, 8, 32), (2, 2048, 4096, 4, 64),
             (1, 96, 256, 4, 64), (1, 2048, 512, 4, 32)]


@pytest.mark.parametrize("T, rows, cols, bits, group", ADD_CASES)
def test_linear_add_equals_linear_then_add(T, rows, cols, bits, group):
    rng = np.random.default_rng(rows + cols + T + 2)
    _, w = both(random_matrix(rng, 1, rows, cols, bits, group, "BF16"))
    x = rng.standard_normal((T, cols)).astype(np.float32)
    res = rng.standard_normal((T, rows)).astype(np.float32)
    assert np.array_equal(ops.linear_add(w, x, res), ops.add("cuda", res, ops.linear(w, 0, x)))


# (T, E, top_k, H, I, Is, bits, group, one kernel path): the real MoE block (router cluster of 16 CTAs) and
# the real-widths test checkpoint's 16 experts (one CTA); fallbacks: H = 256 (no fused router), two tokens,
# and 4-bit group 32 (no tensor-core chain)
NORMED_MOE_CASES = [(1, 256, 8, 2048, 512, 512, 4, 64, True), (1, 16, 8, 2048, 512, 512, 4, 64, True),
                    (1, 9, 4, 256, 128, 256, 4, 64, False), (2, 256, 8, 2048, 512, 512, 4, 64, False),
                    (1, 40, 4, 2048, 128, 128, 4, 32, False)]


@pytest.mark.parametrize("T, E, top_k, H, I, Is, bits, group, one_kernel", NORMED_MOE_CASES)
def test_moe_rms_normed_add_equals_rms_norm_then_moe_add(T, E, top_k, H, I, Is, bits, group, one_kernel):
    rng = np.random.default_rng(E + H + T + 3)
    _, gpu = moe_weights(rng, E, H, I, Is, bits, group, "BF16", 8)
    res = (rng.standard_normal((T, H)) * rng.uniform(0.1, 10.0, H)).astype(np.float32)  # uneven, as x is
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    got, fused = ops.moe_rms_normed_add("cuda", *gpu, res, nw, 1e-6, top_k)
    assert fused == one_kernel
    want = ops.moe_add("cuda", *gpu, ops.rms_norm("cuda", res, nw, 1e-6), res, top_k)
    assert np.array_equal(got, want)


def _dequantized(m: dict) -> np.ndarray:
    """An affine random_matrix's values in fp64 [stack * rows, cols] (BF16 scales and biases)."""
    bf16 = lambda a: (a.astype(np.uint32) << 16).view(np.float32)
    w = quant.dequantize(m["weight"], bf16(m["scales"]), bf16(m["biases"]), m["bits"], m["group_size"])
    return w.reshape(-1, m["cols"]).astype(np.float64)


# (E, top_k, H, A, one_kernel): the real block (early routing: router folded through the output projection);
# the real-widths test checkpoint's 16 experts; H = 256 (no fused router): linear_add then moe_rms_normed_add
EARLY_CASES = [(256, 8, 2048, 4096, True), (16, 8, 2048, 4096, True), (9, 4, 256, 512, False)]


@pytest.mark.parametrize("E, top_k, H, A, one_kernel", EARLY_CASES)
def test_linear_add_moe_early_routing(E, top_k, H, A, one_kernel):
    """The mixer's output projection and the MoE block as one op: with early routing the router runs on
    [res ; x] through M = [router; shared gate] diag(nw) o (built on the device, checked against fp64 here),
    before the projection, and the experts take the top-k of those logits scaled by the norm's 1/rms. The
    logits differ from the direct router's by f32 rounding only, so on tokens with a clear top-k margin the
    block equals linear_add then moe_rms_normed_add to f32 accuracy; without early routing, bit for bit.
    Repeated calls give the same bits."""
    I = Is = 512 if H == 2048 else 128
    rng = np.random.default_rng(E + H + 11)
    mats = moe_weights(rng, E, H, I, Is, 4, 64, "BF16", 8)
    _, gpu = mats
    router, gate_row = random_matrix(rng, 1, E, H, 8, 64, "BF16"), random_matrix(rng, 1, 1, H, 8, 64, "BF16")
    stacked = {k: (np.concatenate([router[k], gate_row[k]], axis=1) if isinstance(router[k], np.ndarray) else router[k])
               for k in router}
    stacked["rows"] = E + 1
    gpu[0], gpu[7] = both(router)[1], both(gate_row)[1]
    router_gates = both(stacked)[1]
    o_m = random_matrix(rng, 1, H, A, 4, 64, "BF16")
    o = both(o_m)[1]
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    agree = 0
    for seed in range(4):
        r2 = np.random.default_rng(seed)
        x = (r2.standard_normal((1, A)) * 0.05).astype(np.float32)
        res = (r2.standard_normal((1, H)) * r2.uniform(0.1, 10.0, H)).astype(np.float32)
        got, early, fold = ops.linear_add_moe_rms_normed_add(o, *gpu, router_gates, x, res, nw, 1e-6, top_k)
        again = ops.linear_add_moe_rms_normed_add(o, *gpu, router_gates, x, res, nw, 1e-6, top_k)[0]
        assert early == one_kernel and (fold is not None) == one_kernel
        assert np.array_equal(got, again)
        res1 = ops.linear_add(o, x, res)
        want = ops.moe_rms_normed_add("cuda", *gpu, res1, nw, 1e-6, top_k)[0]
        if not one_kernel:
            assert np.array_equal(got, want)
            continue
        if seed == 0:
            ref = (_dequantized(stacked) * nw.astype(np.float64)) @ _dequantized(o_m)
            assert np.abs(fold - ref).max() / np.abs(ref).max() < 1e-6
        h = res1[0].astype(np.float64) / np.sqrt(np.mean(res1[0].astype(np.float64) ** 2) + 1e-6) * nw
        logits = np.sort(_dequantized(router) @ h)[::-1]
        if logits[top_k - 1] - logits[top_k] < 1e-3 * np.abs(logits).max():
            continue  # a near-tie: the two factorisations may choose differently
        agree += 1
        err = np.abs(got - want).max() / np.abs(want - res1).max()
        assert err < 1e-4, err  # f32 rounding of the logits and weights (the test's gpu_tol["moe"] is 2e-2)
    assert not one_kernel or agree > 0, "no seed with a clear top-k margin"
