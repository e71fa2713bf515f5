"""CUDA decode's folded router (ops.linear_add_route, kernels/linear_route.cuh) against the CPU's op sequence it
replaces: linear_add, rms_norm, the router and the shared-expert gate over h, softmax top-k."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core
from test_linear import both, check, random_matrix
from test_moe import moe_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops
H, EPS = 2048, 1e-6


def dense(cpu_matrix):
    """The CPU's fp32 dequantization of a single matrix (the embedding op's rows: scale * q + bias)."""
    return ops.embedding(cpu_matrix, np.arange(cpu_matrix.rows, dtype=np.int32)).astype(np.float64)


def reference(cpu, out_cpu, x, res, nw, top_k):
    """linear_add, rms_norm, then the router and the gate on the CPU: (x', logits [E], ids ascending, weights,
    shared gate). The top-k: softmax in fp64, the K largest (ties: lower id), renormalised."""
    added = ops.linear_add(out_cpu, x, res)
    h = ops.rms_norm("cpu", added, nw, EPS)
    logits = ops.linear(cpu[0], 0, h)[0].astype(np.float64)
    gate = ops.linear(cpu[7], 0, h)[0, 0]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    ids = np.sort(np.lexsort((np.arange(len(p)), -p))[:top_k])
    return added, logits, ids, p[ids] / p[ids].sum(), 1.0 / (1.0 + np.exp(-gate))


CASES = [
    # E, top_k, out_proj bits and group, A (its input width), expert bits and group
    (16, 8, 4, 64, 4096, 4, 64),  # the real-width test checkpoint's
    (256, 8, 4, 64, 4096, 4, 64),  # Qwen3.6-35B-A3B's
    (40, 4, 8, 32, 2048, 8, 32),
    (129, 8, 4, 128, 4096, 4, 128),
    (256, 1, 8, 64, 1024, 4, 64),
]


@pytest.mark.parametrize("E,top_k,obits,ogroup,A,bits,group", CASES)
def test_linear_add_route_matches_the_router_over_h(E, top_k, obits, ogroup, A, bits, group, gpu_tol):
    # One token: x' is linear_add's bit for bit (the same GEMV plan), the fold is [W | M] to ~1e-6, the chosen
    # experts are the CPU router's wherever its K-th and (K+1)-th logits are apart (the folded logits differ by
    # fp32 rounding), their weights and the shared gate within route_fold, and the MoE block after it
    # (moe_routed_rms_normed_add) equals moe_rms_normed_add, which routes h itself, within moe_decode.
    rng = np.random.default_rng(3000 + E + A)
    cpu, gpu = moe_weights(rng, E, H, 128, 128, bits, group, "BF16", 8)
    out_cpu, out_gpu = both(random_matrix(rng, 1, H, A, obits, ogroup, "BF16"))
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    wr = np.concatenate([dense(cpu[0]), dense(cpu[7])])  # [E + 1, H]
    W = (wr * nw).astype(np.float32)
    M = W.astype(np.float64) @ dense(out_cpu)
    checked = 0
    for t in range(4):
        x = rng.standard_normal((1, A)).astype(np.float32)
        res = (rng.standard_normal((1, H)) * rng.uniform(0.01, 30.0, H)).astype(np.float32)
        added, ids, wts, shared, moe_out, wm, supported, left = ops.linear_add_route(out_gpu, *gpu, x, res, nw, EPS,
                                                                                     top_k)
        assert supported and left == 0
        if t == 0:  # fixed-order sums: the same bits on every run
            again = ops.linear_add_route(out_gpu, *gpu, x, res, nw, EPS, top_k)
            for u, v in zip((added, ids, wts, shared, moe_out, wm), again[:6]):
                np.testing.assert_array_equal(u, v)
            # W: one fp32 product of the dequantized weight (dequant_at may contract scale * q + bias into an
            # FMA where the CPU rounds twice: an ulp); M: fp64 sums of that W, rounded once
            assert np.abs(wm[:, :H] - W).max() <= 1e-6 * np.abs(W).max()
            assert np.abs(wm[:, H:] - M).max() <= 2e-6 * np.abs(M).max()
        np.testing.assert_array_equal(added, ops.linear_add(out_gpu, x, res))
        ref_added, logits, ref_ids, ref_w, ref_gate = reference(cpu, out_cpu, x, res, nw, top_k)
        check(added, ref_added, "linear_gemv", gpu_tol)
        assert abs(shared[0, 0] - ref_gate) <= gpu_tol["route_fold"]
        srt = np.sort(logits)[::-1]
        if top_k < E and srt[top_k - 1] - srt[top_k] <= 1e-3 * np.abs(logits).max():
            continue  # a near-tie: either choice is right
        checked += 1
        np.testing.assert_array_equal(ids, ref_ids)
        assert np.abs(wts - ref_w).max() <= gpu_tol["route_fold"]
        routed_by_h, fused = ops.moe_rms_normed_add("cuda", *gpu, added, nw, EPS, top_k)
        assert fused
        check(moe_out, routed_by_h, "moe_decode", gpu_tol)
    assert checked > 0, "every token sat on a near-tie: pick another seed"

