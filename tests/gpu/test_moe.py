"""CUDA MoE block against the fp32 CPU reference: tiny odd expert counts and the real dims."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core
from test_linear import both, check, random_matrix
from test_norms import from_xb

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops


def moe_weights(rng, E, H, I, Is, bits, group, sdt, router_bits):
    """CPU and CUDA copies of (router, gate, up, down, shared gate, up, down, shared_expert_gate)."""
    mats = [
        random_matrix(rng, 1, E, H, router_bits, group, sdt),
        random_matrix(rng, E, I, H, bits, group, sdt),
        random_matrix(rng, E, I, H, bits, group, sdt),
        random_matrix(rng, E, H, I, bits, group, sdt),
        random_matrix(rng, 1, Is, H, bits, group, sdt),
        random_matrix(rng, 1, Is, H, bits, group, sdt),
        random_matrix(rng, 1, H, Is, bits, group, sdt),
        random_matrix(rng, 1, 1, H, router_bits, group, sdt),
    ]
    pairs = [both(m) for m in mats]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def stable_rows(router_cpu, h, top_k, margin):
    """Tokens whose k-th and (k+1)-th router logits differ by more than `margin`: CPU and GPU round
    the router differently, so nearer ties may legitimately pick different experts."""
    logits = np.sort(ops.linear(router_cpu, 0, h), axis=1)[:, ::-1]
    if top_k == logits.shape[1]:
        return np.ones(len(h), bool)
    return logits[:, top_k - 1] - logits[:, top_k] > margin


def moe_vs_cpu(cpu, gpu, h, top_k, margin, key, tol):
    """The CUDA MoE output for h, checked against the CPU's on the tokens with a clear top-k margin."""
    ref = ops.moe("cpu", *cpu, h, top_k)
    out = ops.moe("cuda", *gpu, h, top_k)
    ok = stable_rows(cpu[0], h, top_k, margin)
    assert ok.any(), "no token has a clear top-k margin: pick another seed"
    check(out[ok], ref[ok], key, tol)
    return out


CASES = [
    # E, top_k, H, I, Is, bits, group, scale dtype, router bits
    (5, 1, 64, 32, 32, 4, 32, "BF16", 8),
    (6, 2, 96, 64, 32, 8, 32, "BF16", 8),
    (7, 4, 128, 192, 64, 4, 64, "BF16", 8),
    (7, 3, 64, 32, 64, 4, 32, "F32", 4),  # generic kernels throughout
    (5, 5, 64, 32, 32, 0, 0, "F32", 0),   # dense fp32, every expert chosen
    (6, 2, 64, 64, 128, 2, 64, "F16", 8),
    (6, 2, 96, 64, 64, 8, 32, "BF16", 8),      # tensor-core decode chain, 8 bits
    (5, 3, 256, 128, 128, 4, 128, "BF16", 8),  # tensor-core prefill, two steps per group; decode: gemv_mma, one group a segment
    (9, 4, 256, 128, 256, 4, 64, "BF16", 8),   # decode on gemv_mma: two groups a segment, wider shared expert
    (7, 3, 192, 64, 128, 8, 32, "BF16", 8),    # decode on gemv_mma, 8 bits, two groups a segment
    (6, 2, 128, 128, 64, 8, 64, "BF16", 8),    # decode on gemv_mma, 8 bits, narrower shared expert
    (12, 10, 64, 32, 32, 4, 32, "BF16", 8),    # top_k > 8: prefill combines on the scalar kernel, not moe_combine4
]


def path_of(T, bits, sdt):
    """moe.cu's use_moe_decode: the decode chain for T <= 16 over 4/8-bit BF16-scaled experts."""
    return "moe_decode" if T <= 16 and bits in (4, 8) and sdt == "BF16" else "moe"


@pytest.mark.parametrize("E,top_k,H,I,Is,bits,group,sdt,rbits", CASES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 11, 19, 99])
def test_moe_small(E, top_k, H, I, Is, bits, group, sdt, rbits, T, gpu_tol):
    rng = np.random.default_rng(E * 100 + T)
    cpu, gpu = moe_weights(rng, E, H, I, Is, bits, group, sdt, rbits)
    h = rng.standard_normal((T, H)).astype(np.float32)
    moe_vs_cpu(cpu, gpu, h, top_k, 0.05, path_of(T, bits, sdt), gpu_tol)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 16, 146, 300])  # 146, 300: the 8-bit router on the wgmma GEMM
def test_moe_real_dims(T, gpu_tol):
    rng = np.random.default_rng(256 + T)
    cpu, gpu = moe_weights(rng, 256, 2048, 512, 512, 4, 64, "BF16", 8)
    h = rng.standard_normal((T, 2048)).astype(np.float32)
    moe_vs_cpu(cpu, gpu, h, 8, 0.25, path_of(T, 4, "BF16"), gpu_tol)


# moe.cu's use_moe_small: T in (16, MOE_SMALL_MAX_TOKENS = 352] with the real dims runs the routed gate/up
# products on kernels/moe_small.cuh, and the down products up to MOE_SMALL_DOWN_MAX_TOKENS = 512 (T = 400:
# gate/up on the wgmma GEMM, down on moe_small); small=False keeps them on the wgmma GEMM.
@pytest.fixture(scope="module")
def real_moe():
    rng = np.random.default_rng(4096)
    return moe_weights(rng, 256, 2048, 512, 512, 4, 64, "BF16", 8)


@pytest.mark.parametrize("T", [17, 64, 146, 300, 400])
def test_moe_small_real_dims(real_moe, T, gpu_tol):
    # the few-rows kernels against the CPU and against the wgmma path (the same bf16 operands, another
    # summation order: close, not equal, which also shows that the new path ran); deterministic
    cpu, gpu = real_moe
    rng = np.random.default_rng(3000 + T)
    h = rng.standard_normal((T, 2048)).astype(np.float32)
    out = moe_vs_cpu(cpu, gpu, h, 8, 0.25, "moe", gpu_tol)
    old = ops.moe("cuda", *gpu, h, 8, small=False)
    check(out, old, "moe", gpu_tol)
    assert not np.array_equal(out, old)
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, 8))


@pytest.mark.parametrize("T,same", [(146, 100), (300, 40), (64, 64)])
def test_moe_small_skewed(real_moe, T, same, gpu_tol):
    # `same` identical tokens: their 8 experts get >= `same` rows each (100 rows: 7 passes of 16 rows, 40 rows
    # at T = 300: 2 passes of 32), most other experts none (T = 64: only 8 experts have rows at all)
    cpu, gpu = real_moe
    rng = np.random.default_rng(5000 + T)
    h = rng.standard_normal((T, 2048)).astype(np.float32)
    logits = np.sort(ops.linear(cpu[0], 0, h), axis=1)[:, ::-1]
    h[:same] = h[np.argmax(logits[:, 7] - logits[:, 8])].copy()  # the clearest top-8 margin: the rows stay checkable
    out = moe_vs_cpu(cpu, gpu, h, 8, 0.25, "moe", gpu_tol)
    check(out, ops.moe("cuda", *gpu, h, 8, small=False), "moe", gpu_tol)


@pytest.mark.parametrize("T", [146, 300, 512])
def test_moe_small_xb_room(real_moe, T, gpu_tol):
    # without moe_xb_elems' room the gated kernel stores F32 rows and the down kernel converts them with the
    # rounding of the bf16 hand-over: the same bits; T = 512 (the top of the down product's range, 24-row
    # passes; gate/up on the wgmma GEMM there) also
    # against the wgmma path. One block short of the room: no hand-over, and the same split-K choices (the
    # router's split depends on the workspace's room, and the bf16 rounding of the activations turns its
    # ~1e-7 into ~1e-4); at the least room the splits may differ: within tolerance.
    _, gpu = real_moe
    h = np.random.default_rng(6000 + T).standard_normal((T, 2048)).astype(np.float32)
    least = T * max(2048, 8 * 512, 512)
    room = least + T * 8 * 512 + T * 512  # ops::moe_xb_elems (every block a multiple of 64 elements here)
    out = ops.moe("cuda", *gpu, h, 8)
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, 8, xb_elems=room - 64))
    check(out, ops.moe("cuda", *gpu, h, 8, xb_elems=least), "moe", gpu_tol)
    check(out, ops.moe("cuda", *gpu, h, 8, small=False), "moe", gpu_tol)


@pytest.mark.parametrize("case,T", [
    ((256, 8, 2048, 512, 512, 4, 64), 16),    # the decode chain's last T
    ((256, 8, 2048, 512, 512, 4, 64), 513),   # past MOE_SMALL_MAX_TOKENS
    ((256, 8, 2048, 512, 512, 8, 64), 146),   # 8-bit experts
    ((128, 8, 2048, 512, 512, 4, 64), 146),   # other expert count
    ((256, 4, 2048, 512, 512, 4, 64), 146),   # other top-k
    ((8, 2, 256, 128, 128, 4, 64), 146),      # other dims
])
def test_moe_small_other_configs_keep_wgmma(case, T):
    # outside use_moe_small the small flag changes nothing: today's path, bit for bit
    E, top_k, H, I, Is, bits, group = case
    rng = np.random.default_rng(E + T + bits)
    _, gpu = moe_weights(rng, E, H, I, Is, bits, group, "BF16", 8)
    h = rng.standard_normal((T, H)).astype(np.float32)
    assert np.array_equal(ops.moe("cuda", *gpu, h, top_k), ops.moe("cuda", *gpu, h, top_k, small=False))


# A prompt's down products on the wgmma GEMM write bf16 rows for the combine (MoeScratch::down_bf16,
# docs/numerics.md): each of a token's K + 1 weighted expert rows rounded once (2^-9 relative), summed in fp32
# in the same order. The real dims take it from T = 513 (moe_small's down range ends at 512; 128-row tiles
# from T = 2048), the other dims wherever both down products run on the wgmma GEMM.
@pytest.mark.parametrize("case,T,cpu_ref", [
    ((256, 8, 2048, 512, 512, 4, 64), 513, True),
    ((256, 8, 2048, 512, 512, 4, 64), 600, True),
    ((256, 8, 2048, 512, 512, 4, 64), 4096, False),  # 128-row tiles; the shared down product on 256-row tiles
    ((256, 8, 2048, 512, 512, 8, 64), 146, True),    # 8-bit experts (not moe_small's)
    ((64, 4, 1024, 256, 512, 4, 64), 300, True),     # the shared down product: split-K with F32 rows, whole with bf16
    ((8, 2, 256, 128, 128, 4, 64), 146, True),       # one column tile
    ((8, 2, 320, 128, 128, 4, 64), 146, True),       # a part column tile: the pair stores' column bound
])
def test_moe_down_bf16(case, T, cpu_ref, gpu_tol):
    E, top_k, H, I, Is, bits, group = case
    rng = np.random.default_rng(8000 + E + T + bits)
    cpu, gpu = moe_weights(rng, E, H, I, Is, bits, group, "BF16", 8)
    h = rng.standard_normal((T, H)).astype(np.float32)
    on = ops.moe("cuda", *gpu, h, top_k)
    off = ops.moe("cuda", *gpu, h, top_k, down_bf16=False)
    assert np.all(np.isfinite(on))
    assert not np.array_equal(on, off), "the bf16 rows were not taken"
    err = np.abs(on - off).max() / np.abs(off).max()
    assert err < 1e-2, f"bf16 down rows: max |on - off| / max |off| = {err:.3g}"
    assert np.array_equal(on, ops.moe("cuda", *gpu, h, top_k))  # deterministic
    if cpu_ref:
        moe_vs_cpu(cpu, gpu, h, top_k, 0.25 if E == 256 else 0.05, "moe", gpu_tol)


@pytest.mark.parametrize("case,T", [
    ((256, 8, 2048, 512, 512, 4, 64, "BF16", 8), 16),   # the decode chain: no down rows
    ((256, 8, 2048, 512, 512, 4, 64, "BF16", 8), 400),  # the routed down product on moe_small
    ((12, 10, 128, 64, 64, 4, 32, "BF16", 8), 99),      # top_k > 8: moe_combine_kernel reads F32 rows only
    ((7, 3, 64, 32, 64, 4, 32, "F32", 4), 99),          # F32 scales: the down products off the wgmma GEMM
])
def test_moe_down_bf16_elsewhere_f32(case, T):
    # where either down product or the combine does not take bf16 rows, down_bf16 changes nothing, bit for bit
    E, top_k, H, I, Is, bits, group, sdt, rbits = case
    rng = np.random.default_rng(8100 + E + T)
    _, gpu = moe_weights(rng, E, H, I, Is, bits, group, sdt, rbits)
    h = rng.standard_normal((T, H)).astype(np.float32)
    assert np.array_equal(ops.moe("cuda", *gpu, h, top_k), ops.moe("cuda", *gpu, h, top_k, down_bf16=False))


@pytest.mark.parametrize("T", [513, 1100])
def test_moe_add_rms_norm_xb_down_bf16(real_moe, T, gpu_tol):
    # the combine that takes the norm reads the same bf16 rows (moe_then_norm checks it against moe, then
    # add_rms_norm_xb, bit for bit); against its F32-row form within the bf16 rounding
    _, gpu = real_moe
    rng = np.random.default_rng(8200 + T)
    h, _ = post_norm_h(rng, T, 2048)
    x = (rng.standard_normal((T, 2048)) * 2).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, 2048).astype(np.float32)
    x_on, y_on, _, tmp = ops.moe_add_rms_norm_xb("cuda", *gpu, h, x, nw, 1e-6, 8)
    x_off, y_off, _, _ = ops.moe_add_rms_norm_xb("cuda", *gpu, h, x, nw, 1e-6, 8, down_bf16=False)
    assert np.isnan(tmp).all()  # the combine took the norm
    assert not np.array_equal(x_on, x_off)
    check(x_on - x, x_off - x, "moe", gpu_tol)  # the MoE output added
    check(y_on, y_off, "moe", gpu_tol)


@pytest.mark.parametrize("E,top_k,group", [(16, 8, 64), (40, 4, 32), (129, 8, 128), (256, 8, 64), (256, 1, 64)])
def test_moe_decode_router(E, top_k, group, gpu_tol):
    # One token, 8-bit router over H = 2048: the fused router kernel (kernels/moe_router.cuh), a cluster of
    # ceil(E/16) CTAs (1, 3, 9, 16). Its logits equal the router GEMV's bit for bit and its top-k is moe_topk's.
    # Up to 16 tokens (a short prompt) run it too, a cluster per token with the one-token bits, so every token
    # of a 16-token call routes as it does alone, even at near-ties: only the expert products' summation order
    # may differ (a changed expert or weight shows at 1e-2 or more).
    rng = np.random.default_rng(1000 + E + top_k)
    cpu, gpu = moe_weights(rng, E, 2048, 128, 128, 4, group, "BF16", 8)
    h = rng.standard_normal((16, 2048)).astype(np.float32)
    ref = ops.moe("cpu", *cpu, h, top_k)
    ok = stable_rows(cpu[0], h, top_k, 0.05)
    assert ok.any(), "no token has a clear top-k margin: pick another seed"
    many = ops.moe("cuda", *gpu, h, top_k)
    for t in range(len(h)):
        one = ops.moe("cuda", *gpu, h[t:t + 1], top_k)
        check(one, many[t:t + 1], "moe_decode", gpu_tol)
        assert np.array_equal(one, ops.moe("cuda", *gpu, h[t:t + 1], top_k))
        if ok[t]:
            check(one, ref[t:t + 1], "moe_decode", gpu_tol)


@pytest.mark.parametrize("E,top_k,bits,group", [(16, 8, 4, 64), (40, 4, 8, 32), (129, 8, 4, 128), (256, 8, 4, 64),
                                                 (256, 1, 8, 64)])
def test_moe_decode_router_normed(E, top_k, bits, group):
    # One token, the MoE block normalising its own input (ops.moe_rms_normed_add): the fused router's NORM_IN
    # instance in clusters of 1, 3, 9 and 16 CTAs (its staging warp sums the squares in rms_norm's order) and
    # moe_up's (one and two weight groups a segment). The router's logits, the shared expert gate and the
    # experts' inputs are the h that rms_norm writes, so the output equals rms_norm then moe_add bit for bit,
    # and the residual row's scale (x is uneven, far from unit rms) exercises the norm.
    rng = np.random.default_rng(2000 + E + top_k)
    _, gpu = moe_weights(rng, E, 2048, 128, 128, bits, group, "BF16", 8)
    for t in range(3):
        res = (rng.standard_normal((1, 2048)) * rng.uniform(0.01, 30.0, 2048)).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, 2048).astype(np.float32)
        got, fused = ops.moe_rms_normed_add("cuda", *gpu, res, nw, 1e-6, top_k)
        assert fused
        assert np.array_equal(got, ops.moe_add("cuda", *gpu, ops.rms_norm("cuda", res, nw, 1e-6), res, top_k))


@pytest.mark.parametrize("T", [19, 300])
def test_moe_prefill_router_on_wgmma(T, gpu_tol):
    # 4-bit router and shared-expert gate (one output row): prefill runs them on the wgmma GEMM, which
    # converts h into the bf16 workspace before the expert GEMMs convert it again; a shared expert
    # wider than the routed ones: the down products convert two activations of different widths
    rng = np.random.default_rng(700 + T)
    cpu, gpu = moe_weights(rng, 8, 256, 128, 192, 4, 64, "BF16", 4)
    h = rng.standard_normal((T, 256)).astype(np.float32)
    moe_vs_cpu(cpu, gpu, h, 2, 0.05, path_of(T, 4, "BF16"), gpu_tol)


@pytest.mark.parametrize("T", [40, 300])
def test_moe_8bit_on_wgmma(T, gpu_tol):
    # 8-bit experts, router and shared expert (quantize=8) on the wgmma GEMM's BITS = 8 instances: at T = 300
    # (T * top_k >= 64 rows an expert) the routed products run over 128-row tile maps (linear_wide_tiles),
    # at T = 40 over 64-row ones; gate and up as two products (no 8-bit GATED instance), the shared expert as
    # dense products; against the CPU on the tokens with a clear top-k margin
    rng = np.random.default_rng(800 + T)
    cpu, gpu = moe_weights(rng, 4, 256, 128, 128, 8, 64, "BF16", 8)
    h = rng.standard_normal((T, 256)).astype(np.float32)
    moe_vs_cpu(cpu, gpu, h, 2, 0.05, path_of(T, 8, "BF16"), gpu_tol)


@pytest.mark.parametrize("group", [64, 32])
def test_moe_prefill_wide_tiles(group, gpu_tol):
    # 400 tokens x top-4 over 8 experts: ~200 rows per expert, so moe.cu builds 128-row expert tiles
    # (full and partial ones) for the wgmma kernel; group 32 has no 128-row kernel and keeps 64-row tiles
    rng = np.random.default_rng(31 + group)
    cpu, gpu = moe_weights(rng, 8, 256, 192, 128, 4, group, "BF16", 8)
    h = rng.standard_normal((400, 256)).astype(np.float32)
    out = moe_vs_cpu(cpu, gpu, h, 4, 0.05, "moe", gpu_tol)
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, 4))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("T", [300, 330, 384, 150, 280, 288, 289])
def test_moe_prefill_tail_tiles(T, bits, gpu_tol):
    # top_k = E = 8: every expert takes all T rows, so every expert's remainder is known. T = 300: 2 x 128 + 44
    # (the last 44 rows on the tail map's 64-row tiles, moe_scatter_kernel), 330: 2 x 128 + 74 (a partial
    # 128-row tile), 384: 3 x 128 (no remainder, the tail map empty). 4 bits: the gathered GATED gate/up and
    # the plain down at BM 128, then BM 64; 8 bits: gate and up as two products, each over both maps.
    # The down product's merge map (remainders of at most 32 rows join the last full tile on the BM = 160
    # kernel): T = 150 (128 + 22: the expert's only tile, 150 rows), 280 (128 + a merged 152), 288 (128 + a
    # full merged 160), 289 (2 x 128 + 33: no merge).
    rng = np.random.default_rng(T + bits)
    cpu, gpu = moe_weights(rng, 8, 256, 128, 128, bits, 64, "BF16", 8)
    h = rng.standard_normal((T, 256)).astype(np.float32)
    out = moe_vs_cpu(cpu, gpu, h, 8, 0.05, "moe", gpu_tol)
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, 8))


@pytest.mark.parametrize("T", [4300, 4096])
def test_moe_prefill_gated_dense_wide(T, gpu_tol):
    # The gate/up pairs run as one gated wgmma product (linear.cu, use_gated_wgmma): 4300 tokens and a
    # 512-wide shared expert give its dense 128-row instance (34 row tiles x 4 column tiles of 128
    # outputs >= 132 SMs), 4096 tokens too (32 x 4 = 128 tiles: one round of the SMs against two of 64-row
    # tiles, dense_wide); the routed experts (~1075 rows each) its gathered 128-row one. Partial
    # column tiles (I = 192, Is = 64), 64-row tiles and the two-product fallback (group 32, T <= 64
    # shared products) are in the cases above.
    rng = np.random.default_rng(T)
    cpu, gpu = moe_weights(rng, 8, 256, 128, 512, 4, 64, "BF16", 8)
    h = rng.standard_normal((T, 256)).astype(np.float32)
    out = moe_vs_cpu(cpu, gpu, h, 2, 0.05, "moe", gpu_tol)
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, 2))


@pytest.mark.parametrize("E, top_k", [(3, 2), (2, 2)])
def test_moe_prefill_many_chunks(E, top_k, gpu_tol):
    # 1100 tokens: five chunks of the routing tables (256 tokens a CTA), more chunks than experts, the last
    # one partial; top_k = E: every expert takes every token
    rng = np.random.default_rng(40 + E)
    cpu, gpu = moe_weights(rng, E, 64, 32, 32, 4, 32, "BF16", 8)
    h = rng.standard_normal((1100, 64)).astype(np.float32)
    out = moe_vs_cpu(cpu, gpu, h, top_k, 0.05, "moe", gpu_tol)
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, top_k))


@pytest.mark.parametrize("T", [1, 3])
def test_moe_decode_shared_wider(T, gpu_tol):
    # shared expert wider than the routed ones (the down kernel's act rows differ in length), 8-bit
    rng = np.random.default_rng(900 + T)
    cpu, gpu = moe_weights(rng, 9, 256, 64, 160, 8, 32, "BF16", 8)
    h = rng.standard_normal((T, 256)).astype(np.float32)
    moe_vs_cpu(cpu, gpu, h, 4, 0.05, "moe_decode", gpu_tol)


@pytest.mark.parametrize("I", [64, 128])  # fp32 decode GEMVs, then gemv_mma
@pytest.mark.parametrize("T", [1, 4, 99])
def test_moe_deterministic(T, I):
    rng = np.random.default_rng(5)
    _, gpu = moe_weights(rng, 7, 128, I, 64 if I == 64 else 128, 4, 64, "BF16", 8)
    h = rng.standard_normal((T, 128)).astype(np.float32)
    assert np.array_equal(ops.moe("cuda", *gpu, h, 3), ops.moe("cuda", *gpu, h, 3))


@pytest.mark.parametrize("E,top_k,H,I,Is,group,T", [
    (8, 2, 256, 128, 512, 64, 4300),  # both pairs hand over: GATED dense 128-row shared, gathered 128-row routed
    (8, 4, 256, 192, 128, 64, 400),   # 128-row expert tiles, partial column tiles of the routed act (I = 192)
    (8, 2, 256, 128, 192, 64, 300),   # 64-row tiles; shared expert wider than the routed ones
    (8, 2, 256, 128, 128, 64, 40),    # routed pair only: the shared gate/up (T <= 64) is two products
    (8, 2, 256, 128, 128, 32, 300),   # group 32: no GATED instance, no hand-over (both sizes convert)
    (256, 8, 2048, 512, 512, 64, 4096),  # the model's dims at a 4K prefill
])
def test_moe_prefill_xb_hand_over(E, top_k, H, I, Is, group, T):
    # moe.cu's hand_over_xb: with ops::moe_xb_elems' room the GATED gate/up products store the activation
    # rows as the down products' bf16 X; with only the least workspace CUDA accepts (T * max(H, K*I, Is))
    # the down products convert the F32 rows (wgx_bf16_kernel). The same bits either way.
    rng = np.random.default_rng(E + T + I)
    _, gpu = moe_weights(rng, E, H, I, Is, 4, group, "BF16", 8)
    h = rng.standard_normal((T, H)).astype(np.float32)
    least = T * max(H, top_k * I, Is)
    out = ops.moe("cuda", *gpu, h, top_k)
    assert np.isfinite(out).all()
    assert np.array_equal(out, ops.moe("cuda", *gpu, h, top_k, xb_elems=least))


def post_norm_h(rng, T, H):
    """A prompt's post-attention norm (engine.cpp): add_rms_norm_xb's h [T, H] and its bf16 X (uint16)."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    _, h, xb = ops.add_rms_norm_xb("cuda", x, res, nw, 1e-6)
    return h, xb


def check_h_as_xb(gpu, h, xb, top_k):
    """moe over h handed over as its bf16 X: with h's F32 rows (MoeInput::F32_AND_XB) and, where
    moe_xb_only_supported, alone (MoeInput::XB: h's rows NaN, so a read would show), the bits of moe converting h
    itself; where not supported, XB is refused. Returns whether it was."""
    ref = ops.moe("cuda", *gpu, h, top_k)
    assert np.isfinite(ref).all()
    assert np.array_equal(ops.moe("cuda", *gpu, h, top_k, h_xb=xb), ref)
    supported = ops.moe_xb_only_supported("cuda", *gpu, len(h), top_k)
    if supported:
        assert np.array_equal(ops.moe("cuda", *gpu, h, top_k, h_xb=xb, h_f32=False), ref)
    else:
        with pytest.raises(Exception, match="moe_xb_only_supported"):
            ops.moe("cuda", *gpu, h, top_k, h_xb=xb, h_f32=False)
    return supported


@pytest.mark.parametrize("T", [16, 17, 32, 33, 146, 300, 513, 1100])
def test_moe_h_as_xb_real_dims(real_moe, T):
    # the model's dims: the decode chain up to 16 rows, the 8-bit router on the GEMV up to 32 (it reads h's
    # rows), from 33 on the wgmma GEMM with the shared expert, the routed gate/up on moe_small up to 352 rows
    _, gpu = real_moe
    h, xb = post_norm_h(np.random.default_rng(7000 + T), T, 2048)
    assert check_h_as_xb(gpu, h, xb, 8) == (T > 32)


@pytest.mark.parametrize("E,top_k,H,I,Is,bits,group,sdt,rbits,T,supported", [
    (8, 2, 256, 128, 192, 4, 64, "BF16", 4, 12, False),   # the decode chain reads h's rows
    (8, 2, 256, 128, 192, 4, 64, "BF16", 4, 19, True),    # 4-bit router on the wgmma GEMM from 9 rows
    (8, 2, 256, 128, 128, 4, 32, "BF16", 8, 300, True),   # group 32: gate and up as two wgmma products
    (8, 2, 256, 128, 128, 8, 64, "BF16", 8, 300, True),   # 8-bit experts
    (7, 3, 64, 32, 64, 4, 32, "F32", 4, 99, False),       # F32 scales: generic kernels read h's rows
])
def test_moe_h_as_xb_configs(E, top_k, H, I, Is, bits, group, sdt, rbits, T, supported):
    rng = np.random.default_rng(7100 + E + T)
    _, gpu = moe_weights(rng, E, H, I, Is, bits, group, sdt, rbits)
    h, xb = post_norm_h(rng, T, H)
    assert check_h_as_xb(gpu, h, xb, top_k) == supported


def moe_then_norm(cpu, gpu, h, h_xb, top_k, margin, rng, gpu_tol, fused):
    """ops.moe_add_rms_norm_xb (the MoE block joining the residual stream x, then the next layer's input norm as
    its bf16 X, engine.cpp) against moe then add_rms_norm_xb on the GPU, bit for bit: x, y written into h's buffer
    as the engine does, the Xb; without y the same x and Xb with h left as it was; with h given only as its bf16
    X where moe_xb_only_supported (h's rows NaN) the same. Against the CPU's moe then add_rms_norm on the tokens
    with a clear top-k margin. fused: the combine took the norm (tmp, NaN before, never written)."""
    T, H = h.shape
    x = (rng.standard_normal((T, H)) * 2).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    mix = ops.moe("cuda", *gpu, h, top_k)
    x_ref, y_ref, xb_ref = ops.add_rms_norm_xb("cuda", x, mix, nw, 1e-6)
    x1, h1, xb1, tmp = ops.moe_add_rms_norm_xb("cuda", *gpu, h, x, nw, 1e-6, top_k)
    assert np.array_equal(x1, x_ref) and np.array_equal(h1, y_ref) and np.array_equal(xb1, xb_ref)
    assert np.isnan(tmp).all() == fused
    x2, h2, xb2, _ = ops.moe_add_rms_norm_xb("cuda", *gpu, h, x, nw, 1e-6, top_k, write_y=False)
    assert np.array_equal(x2, x_ref) and np.array_equal(xb2, xb_ref) and np.array_equal(h2, h)
    if ops.moe_xb_only_supported("cuda", *gpu, T, top_k):
        x3, h3, xb3, _ = ops.moe_add_rms_norm_xb("cuda", *gpu, h, x, nw, 1e-6, top_k, write_y=False, h_xb=h_xb,
                                                 h_f32=False)
        assert np.array_equal(x3, x_ref) and np.array_equal(xb3, xb_ref) and np.isnan(h3).all()
    ok = stable_rows(cpu[0], h, top_k, margin)
    assert ok.any(), "no token has a clear top-k margin: pick another seed"
    xc, yc = ops.add_rms_norm("cpu", x, ops.moe("cpu", *cpu, h, top_k), nw, 1e-6)
    check(x1[ok], xc[ok], "moe", gpu_tol)
    check(from_xb(xb1)[ok], yc[ok], "moe", gpu_tol)


@pytest.mark.parametrize("T", [17, 33, 146, 513])
def test_moe_add_rms_norm_xb_real_dims(real_moe, T, gpu_tol):
    # the model's dims: past the decode chain the combine takes the norm (moe_small's products up to 352 rows,
    # the wgmma GEMM's from 353; h as its bf16 X alone from 33 rows)
    cpu, gpu = real_moe
    rng = np.random.default_rng(7200 + T)
    h, h_xb = post_norm_h(rng, T, 2048)
    moe_then_norm(cpu, gpu, h, h_xb, 8, 0.25, rng, gpu_tol, fused=True)


@pytest.mark.parametrize("E,top_k,H,I,Is,bits,group,sdt,rbits,T,fused", [
    (8, 2, 256, 128, 192, 4, 64, "BF16", 4, 12, False),  # the decode chain: moe, then add_rms_norm_xb
    (8, 2, 256, 128, 192, 4, 64, "BF16", 4, 19, True),   # H = 256: 64 threads a row, one float4 each
    (8, 4, 1024, 128, 128, 4, 64, "BF16", 8, 99, True),  # H = 1024: 128 threads, two float4s each
    (7, 3, 64, 32, 64, 4, 32, "F32", 4, 99, True),       # generic expert kernels; H = 64: 16 of 32 threads busy
    (12, 10, 64, 32, 32, 4, 32, "BF16", 8, 99, False),   # top_k 10 > 8: the scalar combine, then the norm
])
def test_moe_add_rms_norm_xb_configs(E, top_k, H, I, Is, bits, group, sdt, rbits, T, fused, gpu_tol):
    rng = np.random.default_rng(7300 + E + T)
    cpu, gpu = moe_weights(rng, E, H, I, Is, bits, group, sdt, rbits)
    h, h_xb = post_norm_h(rng, T, H)
    moe_then_norm(cpu, gpu, h, h_xb, top_k, 0.05, rng, gpu_tol, fused)
