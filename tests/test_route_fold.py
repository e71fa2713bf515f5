"""Decode's folded router (kernels/linear_route.cuh, ops.linear_add_route) checked on the CPU with NumPy: the
factorisation logits = s (W x + M a) at the real widths, in the kernel's fp32 summation order, against an fp64
reference and against the unfactored fp32 router over h; and the router warps' index map (every (part, row) of
the fold summed exactly once for every rows-per-warp the launcher may pick)."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

H, A, E, K = 2048, 4096, 256, 8  # Qwen3.6-35B-A3B: hidden, out_proj / o_proj input, experts, top-k
PART, F4, MAX_RPW, WARPS = 512, 4, 4, 8  # ROUTE_PART, ROUTE_F4, ROUTE_MAX_RPW, MMA_WARPS
EPS = 1e-6
f32 = np.float32


def fma32(a, b, c):
    """fmaf in fp32: the product is exact in fp64 (24 + 24 bits), one rounding of the sum (a second, of
    the fp64 sum, is below fp32's)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f32)


def warp_sum(v):
    """common.cuh's warp_sum over the last axis (32 lanes): xor butterfly at 16, 8, 4, 2, 1, fp32."""
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ o]).astype(f32)
    return v


def inv_rms(xp):
    """s = 1 / sqrt(mean(x'^2) + eps) in rms_norm's order at H = 2048: thread t (256) sums float4s t, t + 256,
    then block_sum (warp trees, then the 8 warp sums' tree)."""
    x4 = xp.reshape(-1, 4)
    sq = (((x4[:, 0] * x4[:, 0] + x4[:, 1] * x4[:, 1]).astype(f32) + x4[:, 2] * x4[:, 2]).astype(f32)
          + x4[:, 3] * x4[:, 3]).astype(f32)
    t = (f32(0) + sq[:256]).astype(f32)
    t = (t + sq[256:]).astype(f32)
    w = warp_sum(t.reshape(8, 32))[:, 0]
    ss = warp_sum(np.concatenate([w, np.zeros(24, f32)]))[0]
    return f32(1) / np.sqrt(f32(ss / f32(H) + f32(EPS)), dtype=f32)


def fold(Wr, w_post, O):
    """route_fold_w_kernel, route_fold_m_kernel: W = fp32(Wr * w_post), M = fp32(W O) accumulated in fp64."""
    W = (Wr * w_post).astype(f32)
    M = (W.astype(np.float64) @ O.astype(np.float64)).astype(f32)
    return np.concatenate([W, M], axis=1)


def part_sums(wm, xa):
    """The router warps' part sums [P, R]: lane l of part p holds float4s l + 32 k (k < 4) of the part, 16 fmas in
    value order, then warp_sum."""
    R, C = wm.shape
    P = C // PART
    out = np.empty((P, R), f32)
    for p in range(P):
        w = wm[:, p * PART:(p + 1) * PART].reshape(R, F4, 32, 4).transpose(0, 2, 1, 3).reshape(R, 32, 16)
        v = xa[p * PART:(p + 1) * PART].reshape(F4, 32, 4).transpose(1, 0, 2).reshape(32, 16)
        acc = np.zeros((R, 32), f32)
        for i in range(16):
            acc = fma32(w[:, :, i], np.broadcast_to(v[:, i], (R, 32)), acc)
        out[p] = warp_sum(acc)[:, 0]
    return out


def folded_logits(wm, x, a, y):
    """The kernel's logits: the tail's x' = x + y, s, then the part sums added in part order, times s."""
    xp = (x + y).astype(f32)
    s = inv_rms(xp)
    ps = part_sums(wm, np.concatenate([x, a]).astype(f32))
    raw = np.zeros(ps.shape[1], f32)
    for p in range(ps.shape[0]):
        raw = (raw + ps[p]).astype(f32)
    return (raw * s).astype(f32), xp


def top(logits, k):
    return set(np.argsort(-logits, kind="stable")[:k].tolist())


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(12)
    Wr = (rng.standard_normal((E + 1, H)) * 0.02).astype(f32)  # the router's rows, then the shared gate's
    w_post = rng.uniform(0.5, 1.5, H).astype(f32)
    O = (rng.standard_normal((H, A)) * 0.02).astype(f32)
    return rng, Wr, w_post, O, fold(Wr, w_post, O)


def test_the_fold_is_the_router_over_the_normed_row(layer):
    """At the real widths, over 16 random tokens (residual rows of uneven scale): the folded logits against fp64
    are as close as the unfactored fp32 router's (~1e-6 of the logits' scale), and the top-8 agree wherever the
    fp64 8th and 9th logits are apart by more than the error."""
    rng, Wr, w_post, O, wm = layer
    worst_fold = worst_plain = 0.0
    for _ in range(16):
        x = (rng.standard_normal(H) * rng.uniform(0.01, 30.0, H)).astype(f32)
        a = rng.standard_normal(A).astype(f32)
        y = (O.astype(np.float64) @ a.astype(np.float64)).astype(f32)  # the projection's output (any fp32 sum)
        xp64 = x.astype(np.float64) + y
        h64 = xp64 / np.sqrt(np.mean(xp64 * xp64) + EPS) * w_post
        ref = Wr.astype(np.float64) @ h64
        got, xp = folded_logits(wm, x, a, y)
        h32 = ((xp * inv_rms(xp)).astype(f32) * w_post).astype(f32)  # rms_norm's h
        plain = (Wr @ h32).astype(f32)
        scale = np.abs(ref).max()
        err_fold, err_plain = np.abs(got - ref).max() / scale, np.abs(plain - ref).max() / scale
        worst_fold, worst_plain = max(worst_fold, err_fold), max(worst_plain, err_plain)
        srt = np.sort(ref[:E])[::-1]
        if srt[K - 1] - srt[K] > 8 * err_fold * scale:
            assert top(got[:E], K) == top(ref[:E], K)
    print(f"max |logit err| / max |logit|: folded {worst_fold:.2e}, unfactored fp32 {worst_plain:.2e}")
    assert worst_fold < 2e-6 and worst_plain < 2e-6


def route_rows(R, P, rpw, ctas):
    """Which (part, row) each router warp sums (route_part_sums's map): warp g = 8 cta + warp, part g % P, rows
    q + i Q (q = g / P < Q, i < rpw, row < R)."""
    Q = -(-R // rpw)
    seen = np.zeros((P, R), int)
    for g in range(ctas * WARPS):
        part, q = g % P, g // P
        n = min(rpw, (R - q + Q - 1) // Q) if q < Q else 0
        for i in range(n):
            seen[part, q + i * Q] += 1
    return seen


@pytest.mark.parametrize("R", [2, 17, 41, 130, 257])
@pytest.mark.parametrize("C", [1024, 6144])
def test_every_part_of_every_row_is_summed_once(R, C):
    P = C // PART
    for rpw in range(1, MAX_RPW + 1):
        ctas = -(-P * -(-R // rpw) // WARPS)  # route_plan's CTAs for rpw
        assert (route_rows(R, P, rpw, ctas) == 1).all(), (R, C, rpw)


def test_the_cpu_keeps_the_router():
    """The fold and linear_add_route are CUDA only: on the CPU the engine runs linear_add, then
    moe_rms_normed_add (the router over h), and the op refuses with its name."""
    rng = np.random.default_rng(5)
    m = lambda rows, cols, bits: _core.ops.QMatrix("cpu", **_affine(rng, rows, cols, bits))  # noqa: E731
    router, gate, up, down = m(16, 1024, 8), m(1, 1024, 4), m(64, 1024, 4), m(1024, 64, 4)
    with pytest.raises(Exception, match="route_fold_build"):
        _core.ops.linear_add_route(m(1024, 1024, 4), router, gate, up, down, gate, gate, down, m(1, 1024, 8),
                                   np.zeros((1, 1024), f32), np.zeros((1, 1024), f32), np.ones(1024, f32), EPS, 8)


def _affine(rng, rows, cols, bits, group=64):
    """A random MLX-affine matrix in the QMatrix binding's storage arrays (BF16 scales)."""
    words = rng.integers(0, 2**32, (1, rows, cols * bits // 32), dtype=np.uint32)
    sb = (rng.uniform(0.01, 0.02, (1, rows, cols // group)).astype(f32).view(np.uint32) >> 16).astype(np.uint16)
    return dict(weight=words, dtype="U32", num_stack=1, rows=rows, cols=cols, bits=bits, group_size=group,
                scales=sb, biases=sb, scale_dtype="BF16")
