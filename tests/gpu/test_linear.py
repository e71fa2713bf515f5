"""CUDA linear and embedding against the fp32 CPU reference, every weight variant, odd and real shapes."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core
from lily.checkpoint import quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops


def _store(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in storage form: F32 as is, F16/BF16 as raw uint16 bits (BF16 truncated)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "F32":
        return a
    if dtype == "F16":
        return a.astype(np.float16).view(np.uint16)
    return (a.view(np.uint32) >> 16).astype(np.uint16)


def random_matrix(rng, stack, rows, cols, bits=0, group=0, dtype="F32"):
    """Storage arrays of a random matrix stack: dense `dtype` values, or affine (bits, group) with
    `dtype` scales. Values ~ U(-0.5, 0.5) like real weights after MLX quantization."""
    if bits == 0:
        return dict(weight=_store(rng.uniform(-0.5, 0.5, (stack, rows, cols)), dtype), dtype=dtype, num_stack=stack,
                    rows=rows, cols=cols)
    words = quant.pack(rng.integers(0, 2**bits, (stack, rows, cols)), bits)
    g = cols // group
    scales = rng.uniform(0.5, 1.5, (stack, rows, g)) / (2**bits - 1)
    biases = rng.uniform(-0.6, -0.4, (stack, rows, g))
    return dict(weight=np.ascontiguousarray(words), dtype="U32", num_stack=stack, rows=rows, cols=cols, bits=bits,
                group_size=group, scales=_store(scales, dtype), biases=_store(biases, dtype), scale_dtype=dtype)


def random_words_matrix(rng, rows, cols, bits=4, group=64):
    """A large affine matrix from random U32 words (fast to make at lm_head size)."""
    words = rng.integers(0, 2**32, (1, rows, cols * bits // 32), dtype=np.uint32)
    g = cols // group
    scales = rng.uniform(0.5, 1.5, (1, rows, g)).astype(np.float32) / (2**bits - 1)
    biases = rng.uniform(-0.6, -0.4, (1, rows, g)).astype(np.float32)
    return dict(weight=words, dtype="U32", num_stack=1, rows=rows, cols=cols, bits=bits, group_size=group,
                scales=_store(scales, "BF16"), biases=_store(biases, "BF16"), scale_dtype="BF16")


def both(m: dict):
    return ops.QMatrix("cpu", **m), ops.QMatrix("cuda", **m)


def gemv_mma_tokens(m: dict, T: int) -> bool:
    """Whether T tokens of m take the multi-token integer GEMV (linear.cu's gemv_mma_tokens_matrix): T = 2..16,
    4-bit (any rows) or 8-bit from 1024 rows, T x rows x cols <= 2^28 (gemv_plan.h's mma_tokens_shape), BF16
    scales, a group of a whole or half a 64-byte row segment, whole segments, one token's staged x within 96 KB."""
    bits, group, cols = m.get("bits", 0), m.get("group_size", 0), m["cols"]
    if bits not in (4, 8) or m.get("scale_dtype") != "BF16" or (bits == 8 and m["rows"] < 1024):
        return False
    if not 2 <= T <= 16 or T * m["rows"] * cols > 1 << 28:
        return False
    vals = 512 // bits
    if group & (group - 1) or not (group >= vals or 2 * group == vals) or cols % vals:
        return False
    return cols // 8 * 24 + cols // min(group, vals) * 8 <= 96 * 1024


DS_MAX_TOKENS = 32  # kernels/dense_small.cuh


def dense_small(m: dict, T: int) -> bool:
    """Whether T tokens of m take the dense short-prompt kernel (linear.cu's dense_small_matrix): T = 2..32,
    4-bit with BF16 scales, a power-of-two group >= 32, rows a multiple of 32 up to 16384 (not the vocabulary
    head), whole 128-value segments, and a K split (dense_small.cuh's ds_splits: up to 8 parts of whole
    segments and groups) whose staged X (8 rows a started n8 tile, 2 Kp + 64 bytes a row) and partials
    (8 rows a tile x 132 floats) fit 110 KB."""
    rows, cols, group = m["rows"], m["cols"], m.get("group_size", 0)
    if not (2 <= T <= DS_MAX_TOKENS and m.get("bits", 0) == 4 and m.get("scale_dtype") == "BF16"):
        return False
    if group < 32 or group & (group - 1) or rows % 32 or rows > 16384 or cols % 128:
        return False
    ks = 1
    while 2 * ks <= 8 and cols % (2 * ks * 128) == 0 and (cols // (2 * ks)) % group == 0:
        ks *= 2
    nt = (T + 7) // 8
    return nt * 8 * (2 * cols // ks + 64) + nt * 8 * 132 * 4 <= 110 * 1024


def path_of(m: dict, T: int) -> str:
    """Which CUDA kernel runs (linear.cu's predicates) and so which tolerance applies."""
    fast = m.get("bits", 0) in (4, 8) and m.get("scale_dtype") == "BF16"
    if m.get("bits", 0) == 0 and m["dtype"] == "BF16" and T > 8 and m["cols"] % 8 == 0:
        # dense BF16 weights: from 128 rows the dense wgmma GEMM (use_dense_wgmma), else the mma.sync GEMM
        return "linear_wgmma" if T >= 128 else "linear_gemm"
    if not fast:
        return "linear_generic"
    if dense_small(m, T):
        return "linear_dense_small"
    if gemv_mma_tokens(m, T):
        return "linear_gemv"  # the multi-token integer GEMV (use_gemv_mma_tokens)
    nt = 1 if T <= 1 else 2 if T <= 2 else 4 if T <= 4 else 8
    staged = nt * m["cols"] * (4 + m["bits"] / 32)  # x and one sum per 16-byte chunk, per CTA
    if T <= 8 and staged <= 96 * 1024:
        return "linear_gemv"
    group = m["group_size"]
    # use_wgmma_gemm: 4-bit, or 8-bit above 32 rows (below, the blocked GEMV and the mma.sync GEMM keep them)
    wgmma = (m["bits"] == 4 or T > 32) and m["cols"] % 64 == 0 and (group == 32 or group % 64 == 0)
    if not wgmma and T <= 32 and staged <= 96 * 1024:  # the GEMV in blocks of 8 rows
        return "linear_gemv"
    return "linear_wgmma" if wgmma else "linear_gemm"


def check(out, ref, key, tol):
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert np.all(np.isfinite(out))
    assert err <= tol[key], f"{key}: relative error {err:.3g} > {tol[key]:.3g} (max abs {np.abs(out - ref).max():.3g})"


VARIANTS = [(0, 0, "F32"), (0, 0, "F16"), (0, 0, "BF16")] + [
    (bits, group, sdt) for bits in (2, 4, 8) for group in (32, 64, 128) for sdt in ("F32", "F16", "BF16")
]


@pytest.mark.parametrize("bits,group,sdt", VARIANTS)
@pytest.mark.parametrize("T", [1, 3, 8, 9, 19, 99, 300])
def test_linear_variants(bits, group, sdt, T, gpu_tol):
    rng = np.random.default_rng(1000 + T)
    rows, cols = (19, 5) if bits == 0 else (67, 3 * 128)
    if bits == 0 and T >= 99:
        rows, cols = 131, 77
    m = random_matrix(rng, 2, rows, cols, bits, group, sdt)
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for e in (0, 1):
        check(ops.linear(wg, e, x), ops.linear(wc, e, x), path_of(m, T), gpu_tol)


# Dense BF16 weights (the vision tower's) from T = 9 on take the tensor-core GEMM with the weights as stored:
# odd row counts, a K with a partial k-tile (4304 % 64 = 16), the tower's shapes, and both stack entries.
@pytest.mark.parametrize("T, rows, cols", [(8, 19, 8), (9, 19, 8), (65, 131, 72), (300, 3456, 1152),
                                           (257, 1152, 4304), (100, 2048, 4608), (70, 1152, 1536), (1, 64, 64)])
def test_linear_dense_bf16(T, rows, cols, gpu_tol):
    rng = np.random.default_rng(T + rows + cols)
    m = random_matrix(rng, 2, rows, cols, 0, 0, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for e in (0, 1):
        check(ops.linear(wg, e, x), ops.linear(wc, e, x), path_of(m, T), gpu_tol)


# Dense BF16 from 128 rows on the dense wgmma GEMM (kernels/linear_wgmma_dense.cuh): the vision tower's
# products (qkv 3456x1152: a half-empty last column tile, 128-row tiles; proj 1152x1152: 64-row tiles; fc1
# 4304x1152; fc2 1152x4304: K = 67 x 64 + 16, zero-filled by TMA; the merger's 4608x4608 and 2048x4608;
# the patch embedding's K = 1536), odd row counts, a K with an 8-wide tail, and stack entry 1.
DENSE_WGMMA_SHAPES = [(128, 64, 64), (129, 40, 72), (1031, 3456, 1152), (1024, 1152, 1152), (1000, 4304, 1152),
                      (777, 1152, 4304), (1024, 4608, 4608), (1023, 2048, 4608), (300, 1152, 1536)]


@pytest.mark.parametrize("T, rows, cols", DENSE_WGMMA_SHAPES)
def test_linear_dense_wgmma(T, rows, cols, gpu_tol):
    rng = np.random.default_rng(T * 7 + rows + cols)
    stack = 2 if rows * cols <= 1 << 20 else 1
    m = random_matrix(rng, stack, rows, cols, 0, 0, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for e in range(stack):
        got = ops.linear(wg, e, x)
        check(got, ops.linear(wc, e, x), "linear_wgmma", gpu_tol)
        # against the mma.sync GEMM (127 rows: below the wgmma GEMM's 128): rows are independent, both round
        # the operands to bf16 alike (nearest even), so only the fp32 summation order differs
        old = ops.linear(wg, e, x[:127])
        err = np.linalg.norm(got[:127] - old) / np.linalg.norm(old)
        assert err <= 1e-4, f"dense wgmma vs mma.sync GEMM: relative {err:.3g}"


# linear_bias: the bias in the dense wgmma GEMM's epilogue (T >= 128) is one fp32 add after the sum, the
# same bits as linear then add_bias on the GPU; below 128 rows it is those two ops.
@pytest.mark.parametrize("T, rows, cols", [(9, 19, 8), (127, 1152, 1152), (128, 64, 64), (1031, 3456, 1152),
                                           (777, 1152, 4304)])
def test_linear_bias_dense(T, rows, cols, gpu_tol):
    rng = np.random.default_rng(T + rows)
    m = random_matrix(rng, 1, rows, cols, 0, 0, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    b = rng.standard_normal(rows).astype(np.float32)
    got = ops.linear_bias(wg, x, b)
    np.testing.assert_array_equal(got, ops.add_bias("cuda", ops.linear(wg, 0, x), b))
    check(got, ops.linear_bias(wc, x, b), path_of(m, T), gpu_tol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 65, 130])
def test_linear_fast_partial_tiles(bits, T, gpu_tol):
    # rows not a multiple of any tile; cols = 96 leaves a half k-tile (K % 64 == 32)
    rng = np.random.default_rng(7 + T)
    m = random_matrix(rng, 3, 133, 96, bits, 32, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, 96)).astype(np.float32)
    check(ops.linear(wg, 2, x), ops.linear(wc, 2, x), path_of(m, T), gpu_tol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols", [(133, 3072), (61, 9216), (257, 4128), (5, 64)])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 8])
def test_linear_gemv_row_slots(bits, rows, cols, T, gpu_tol):
    # GEMV slots of 2..256 threads per row: idle threads (3072 cols), two chunk steps per thread
    # (9216 cols at 4 bits, 4128 at 8 bits), a row count that leaves most of a pass empty
    rng = np.random.default_rng(rows * 31 + cols + T)
    m = random_matrix(rng, 2, rows, cols, bits, 64 if cols % 64 == 0 else 32, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    check(ops.linear(wg, 1, x), ops.linear(wc, 1, x), path_of(m, T), gpu_tol)


@pytest.mark.parametrize("rows,cols,group,T", [
    (4000, 1024, 64, 1100),  # 128-row tiles (>= one CTA per SM), partial row and column tiles
    (4096, 2048, 128, 2048),  # 128-row tiles, full; one group over two k-tiles
    (4000, 1024, 32, 1100),  # group 32: two groups per k-tile (64-row tiles)
    (300, 128, 64, 17), (300, 128, 64, 65), (300, 128, 64, 300),  # 64-row tiles, two k-tiles, partial tiles
    (40, 256, 32, 77),  # fewer outputs than the 256-row weight box of the TMA loads, group 32
    (1, 128, 64, 20),  # one output (the shared-expert gate's shape), fewer rows than one tile
    (12352, 2048, 64, 146), (8192, 2048, 64, 300),  # 128-row tiles short of one CTA an SM (dense_wide: fewer rounds)
    (4000, 1024, 64, 2100),  # 256-row tiles of 128 outputs (dense_tall), partial row and column tiles
])
def test_linear_wgmma_tiles(rows, cols, group, T, gpu_tol):
    rng = np.random.default_rng(rows + cols + group + T)
    m = random_matrix(rng, 2, rows, cols, 4, group, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    assert path_of(m, T) == "linear_wgmma"
    for e in (0, 1):
        check(ops.linear(wg, e, x), ops.linear(wc, e, x), "linear_wgmma", gpu_tol)


# A matrix's rows stacked with other rows keep their bits (engine.cpp's project: GDN's b and a, 32 rows each,
# run as one 64-row product of a view of the stacked in_proj): each output of the wgmma GEMM is the same
# operands in the same k order whatever rows share its weight tile. T = 700 and 4096: prompts past the
# stacked-projection bound (512), 64-row tiles.
@pytest.mark.parametrize("T", [700, 4096])
def test_linear_wgmma_row_blocks_bitwise(T):
    rng = np.random.default_rng(64 + T)
    m = random_matrix(rng, 1, 64, 2048, 4, 64, "BF16")
    x = rng.standard_normal((T, 2048)).astype(np.float32)
    halves = [dict(m, rows=32, weight=np.ascontiguousarray(m["weight"][:, r:r + 32]),
                   scales=np.ascontiguousarray(m["scales"][:, r:r + 32]),
                   biases=np.ascontiguousarray(m["biases"][:, r:r + 32])) for r in (0, 32)]
    assert path_of(m, T) == path_of(halves[0], T) == "linear_wgmma"
    y = ops.linear(ops.QMatrix("cuda", **m), 0, x)
    for r, h in zip((0, 32), halves):
        assert np.array_equal(ops.linear(ops.QMatrix("cuda", **h), 0, x), y[:, r:r + 32])


# 8-bit weights on the wgmma GEMM (BITS = 8: 64-byte W rows, bytes made bf16 through fp32 2^23): the router and
# shared-expert gate (256 and 1 outputs over 2048) and both stacked (257: a partial second column tile), at the
# prompt sizes that profile them (146, 4096), split-K (33..64 rows), 64- and 128-row tiles (2048 outputs at 4096
# rows fill the SMs), groups of 32 (two a k-tile), 64 and 128 (one over two k-tiles), both stack entries (the
# W map's expert coordinate); and the 32-row boundary, at and below which the blocked GEMV keeps them.
@pytest.mark.parametrize("rows,cols,group,T", [
    (256, 2048, 64, 146), (1, 2048, 64, 146), (257, 2048, 64, 146), (257, 2048, 64, 4096),
    (256, 2048, 64, 33), (257, 2048, 32, 64), (257, 2048, 128, 65), (2048, 2048, 64, 4096),
    (300, 512, 32, 300), (40, 256, 128, 77), (257, 2048, 64, 32),
])
def test_linear_wgmma_8bit(rows, cols, group, T, gpu_tol):
    rng = np.random.default_rng(8 * rows + cols + group + T)
    m = random_matrix(rng, 2, rows, cols, 8, group, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    assert path_of(m, T) == ("linear_wgmma" if T > 32 else "linear_gemv")
    for e in (0, 1):
        out = ops.linear(wg, e, x)
        check(out, ops.linear(wc, e, x), path_of(m, T), gpu_tol)
        assert np.array_equal(out, ops.linear(wg, e, x))  # deterministic (split-K reduces in split order)


REAL = [(4, 64, 2048, 8192), (4, 64, 8192, 2048), (8, 64, 256, 2048), (8, 64, 1, 2048), (4, 64, 2048, 4096),
        (4, 64, 512, 2048), (4, 64, 2048, 512)]


@pytest.mark.parametrize("bits,group,rows,cols", REAL)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 37, 300])
def test_linear_real_dims(bits, group, rows, cols, T, gpu_tol):
    rng = np.random.default_rng(rows + cols + T)
    m = random_matrix(rng, 1, rows, cols, bits, group, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    check(ops.linear(wg, 0, x), ops.linear(wc, 0, x), path_of(m, T), gpu_tol)


@pytest.mark.parametrize("T", [1, 2, 37])
def test_linear_lm_head(T, gpu_tol):
    rng = np.random.default_rng(248320 + T)
    m = random_words_matrix(rng, 248320, 2048)
    wc, wg = both(m)
    x = rng.standard_normal((T, 2048)).astype(np.float32)
    check(ops.linear(wg, 0, x), ops.linear(wc, 0, x), path_of(m, T), gpu_tol)


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
@pytest.mark.parametrize("rows,segs", [(1, 1), (1024, 3), (1031, 5), (1057, 17), (2000, 40), (1000, 2), (3000, 1)])
def test_linear_gemv_mma_shapes(bits, group, rows, segs, gpu_tol):
    # one token on the integer tensor-core GEMV: rows that leave tiles partial, segment counts (64-byte
    # row pieces) that leave K-parts uneven or empty, every group size that fits a segment or half of one
    cols = segs * 512 // bits
    if cols % group:
        pytest.skip("group does not divide the row")
    rng = np.random.default_rng(rows * 7 + segs + bits + group)
    m = random_matrix(rng, 2, rows, cols, bits, group, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((1, cols)).astype(np.float32) * np.exp2(rng.integers(-6, 7, (1, cols)))
    for e in (0, 1):
        check(ops.linear(wg, e, x), ops.linear(wc, e, x), "linear_gemv", gpu_tol)


# Short prompts on the multi-token integer GEMV (kernels/gemv_mma_tokens.cuh): each token's row must equal
# its one-token product bit for bit (>= 1024 rows: one token takes the integer GEMV too). Group sizes of
# a whole or half a segment, odd T, T past one launch (9..16: two launches; K = 8192 at 4 bits: at most 6
# tokens a launch, so 8 = 4 + 4 and 16 = 5 + 5 + 6), rows that leave a tile partial, K-parts uneven or
# empty, both stack entries.
TOKEN_SHAPES = [(1031, 5), (1057, 17), (2000, 40), (1100, 64)]


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128), (8, 32), (8, 64), (8, 128)])
@pytest.mark.parametrize("rows,segs", TOKEN_SHAPES)
@pytest.mark.parametrize("T", [2, 3, 5, 8, 11, 16])
def test_linear_gemv_mma_tokens_bitwise(bits, group, rows, segs, T, gpu_tol):
    cols = segs * 512 // bits
    if cols % group:
        pytest.skip("group does not divide the row")
    rng = np.random.default_rng(rows * 13 + segs + bits + group + T)
    m = random_matrix(rng, 2, rows, cols, bits, group, "BF16")
    assert gemv_mma_tokens(m, T) and path_of(m, T) == "linear_gemv"
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32) * np.exp2(rng.integers(-6, 7, (T, cols)))
    for e in (0, 1):
        y = ops.linear(wg, e, x)
        for t in range(T):
            one = ops.linear(wg, e, x[t:t + 1])
            assert np.array_equal(y[t:t + 1], one), f"token {t} of {T} (entry {e}) differs from its one-token product"
        check(y, ops.linear(wc, e, x), "linear_gemv", gpu_tol)


# 4-bit matrices with fewer rows than one token's integer GEMV takes (one row, a partial tile, rows that are
# not whole 32-row warp tiles: the dense short-prompt kernel leaves them here) and a group of 32 (a half
# segment): the multi-token GEMV against the CPU, deterministic.
@pytest.mark.parametrize("rows,cols,group", [(1, 256, 64), (37, 384, 64), (600, 2048, 64), (1040, 2048, 64),
                                             (4112, 2048, 64)])
@pytest.mark.parametrize("T", [2, 4, 9, 11, 16])
def test_linear_gemv_mma_tokens_small(rows, cols, group, T, gpu_tol):
    rng = np.random.default_rng(rows + cols + T)
    m = random_matrix(rng, 1, rows, cols, 4, group, "BF16")
    assert not dense_small(m, T) and path_of(m, T) == "linear_gemv"
    wc, wg = both(m)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    y = ops.linear(wg, 0, x)
    check(y, ops.linear(wc, 0, x), "linear_gemv", gpu_tol)
    assert np.array_equal(y, ops.linear(wg, 0, x))


@pytest.mark.parametrize("rows, T, taken", [(8192, 16, True), (8192, 9, True), (16400, 9, False), (16400, 16, False)])
def test_linear_tokens_work_cap(rows, T, taken, gpu_tol):
    # Past 2^28 multiply-adds (T x rows x cols; the 248,320-row lm_head's blocks of 16 rows, and any T of
    # it) a short prompt keeps the wgmma GEMM (gemv_plan.h's mma_tokens_shape; above 16384 rows the dense
    # short-prompt kernel does not take it either): linear_xb_supported, which refuses the multi-token GEMV's
    # and the dense short-prompt kernel's products, says which kernel runs.
    rng = np.random.default_rng(rows + T)
    m = random_matrix(rng, 1, rows, 2048, 4, 64, "BF16")
    assert (gemv_mma_tokens(m, T) or dense_small(m, T)) == taken
    wc, wg = both(m)
    assert ops.linear_xb_supported(wg, T) == (not taken)
    x = rng.standard_normal((T, 2048)).astype(np.float32)
    check(ops.linear(wg, 0, x), ops.linear(wc, 0, x), path_of(m, T), gpu_tol)


@pytest.mark.parametrize("T", [2, 7, 11, 17, 32])
def test_linear_add_tokens(T):
    # linear_add of a short prompt: the dense short-prompt kernel adds into res in its epilogue, the same
    # fp32 add as linear then add
    rng = np.random.default_rng(50 + T)
    m = random_matrix(rng, 1, 2048, 4096, 4, 64, "BF16")
    w = ops.QMatrix("cuda", **m)
    x = rng.standard_normal((T, 4096)).astype(np.float32)
    res = rng.standard_normal((T, 2048)).astype(np.float32)
    assert np.array_equal(ops.linear_add(w, x, res), res + ops.linear(w, 0, x))


# Short prompts' dense 4-bit products with the tokens as the MMA's N (kernels/dense_small.cuh): the model's
# dense shapes (in_proj_qkv / q 8192 x 2048, the stacked in_proj 12352 x 2048, in_proj_z 4096 x 2048,
# out_proj / o_proj 2048 x 4096, k / v and the shared expert's gate / up 512 x 2048, its down 2048 x 512,
# GDN's in_proj_b / in_proj_a 32 x 2048) and K = 8192 at T = 2..32 (one to four n8 tiles, partial ones;
# K split 1..8 ways over a cluster), groups 32 / 64 / 128, both stack entries: against the CPU (bf16
# operands, as the wgmma GEMM) and deterministic (the K-parts summed in rank order).
DS_SHAPES = [(8192, 2048), (12352, 2048), (4096, 2048), (2048, 4096), (512, 2048), (2048, 512), (32, 2048),
             (2048, 8192)]


@pytest.mark.parametrize("rows,cols", DS_SHAPES)
@pytest.mark.parametrize("T", [2, 3, 8, 11, 16, 17, 32])
def test_linear_dense_small(rows, cols, T, gpu_tol):
    rng = np.random.default_rng(rows * 3 + cols + T)
    stack = 2 if rows * cols <= 1 << 22 else 1
    m = random_matrix(rng, stack, rows, cols, 4, 64, "BF16")
    assert dense_small(m, T) and path_of(m, T) == "linear_dense_small"
    wc, wg = both(m)
    assert not ops.linear_xb_supported(wg, T)  # GDN's out_proj then reads F32 rows (linear_xb refuses)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for e in range(stack):
        y = ops.linear(wg, e, x)
        check(y, ops.linear(wc, e, x), "linear_dense_small", gpu_tol)
        assert np.array_equal(y, ops.linear(wg, e, x))


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("T", [5, 24])
def test_linear_dense_small_groups(group, T, gpu_tol):
    rng = np.random.default_rng(group + T)
    m = random_matrix(rng, 2, 1024, 1024, 4, group, "BF16")
    assert dense_small(m, T)
    wc, wg = both(m)
    x = rng.standard_normal((T, 1024)).astype(np.float32) * np.exp2(rng.integers(-6, 7, (T, 1024)))
    for e in (0, 1):
        check(ops.linear(wg, e, x), ops.linear(wc, e, x), "linear_dense_small", gpu_tol)


# The routing's boundaries: T = 1 (the one-token integer GEMV), 33 (the wgmma GEMM), rows that are not whole
# 32-row warp tiles (2..16: the multi-token GEMV bit for bit, 17..32: the wgmma GEMM), 8-bit weights (their
# paths), and the 248,320-row head (dense_small refuses it: its blocks keep the fp32 GEMV / wgmma GEMM).
@pytest.mark.parametrize("bits,rows,T,path", [
    (4, 2048, 1, "linear_gemv"), (4, 2048, 2, "linear_dense_small"), (4, 2048, 32, "linear_dense_small"),
    (4, 2048, 33, "linear_wgmma"), (4, 2064, 2, "linear_gemv"), (4, 2064, 16, "linear_gemv"),
    (4, 2064, 17, "linear_wgmma"), (8, 2048, 2, "linear_gemv"), (8, 2048, 20, "linear_gemv"),
    (8, 2048, 33, "linear_wgmma"),
])
def test_linear_dense_small_boundaries(bits, rows, T, path, gpu_tol):
    rng = np.random.default_rng(bits * rows + T)
    m = random_matrix(rng, 1, rows, 2048, bits, 64, "BF16")
    assert path_of(m, T) == path
    wc, wg = both(m)
    x = rng.standard_normal((T, 2048)).astype(np.float32)
    y = ops.linear(wg, 0, x)
    check(y, ops.linear(wc, 0, x), path, gpu_tol)
    if path == "linear_gemv" and T > 1 and bits == 4:  # the multi-token GEMV: each row its one-token product
        assert np.array_equal(y[:1], ops.linear(wg, 0, x[:1]))
    assert ops.linear_xb_supported(wg, T) == (path == "linear_wgmma")


def test_linear_dense_small_lm_head(gpu_tol):
    rng = np.random.default_rng(248320 + 16)
    m = random_words_matrix(rng, 248320, 2048)
    assert not dense_small(m, 16)
    wg = ops.QMatrix("cuda", **m)
    assert ops.linear_xb_supported(wg, 16)  # the wgmma GEMM, as before


def test_linear_dense_small_nonfinite():
    # NaN / Inf in one token reach that token's outputs only (the padding rows of its n8 tile are zeros)
    rng = np.random.default_rng(22)
    m = random_matrix(rng, 1, 2048, 2048, 4, 64, "BF16")
    wg = ops.QMatrix("cuda", **m)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((11, 2048)).astype(np.float32)
        x[3, 700] = bad
        y = ops.linear(wg, 0, x)
        assert not np.isfinite(y[3]).any()
        assert np.isfinite(np.delete(y, 3, axis=0)).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_gemv_nonfinite(bits):
    # NaN and Inf in x reach every output, as in the fp32 product (the tensor-core GEMV scales x per block)
    rng = np.random.default_rng(bits)
    m = random_matrix(rng, 1, 40, 1024, bits, 64, "BF16")
    wc, wg = both(m)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((1, 1024)).astype(np.float32)
        x[0, 300] = bad
        ref, out = ops.linear(wc, 0, x), ops.linear(wg, 0, x)
        assert not np.isfinite(ref).any()
        assert not np.isfinite(out).any()


def test_linear_gemv_mma_tokens_nonfinite():
    # NaN / Inf in one token of a short prompt reach that token's outputs only
    rng = np.random.default_rng(21)
    m = random_matrix(rng, 1, 1040, 1024, 4, 64, "BF16")
    wg = ops.QMatrix("cuda", **m)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((5, 1024)).astype(np.float32)
        x[3, 700] = bad
        y = ops.linear(wg, 0, x)
        assert not np.isfinite(y[3]).any()
        assert np.isfinite(np.delete(y, 3, axis=0)).all()


def test_linear_deterministic():
    rng = np.random.default_rng(3)
    for T in (1, 4, 37, 146, 300, 520):  # 37-300: split-K (units per tile reduced in split order); 520: unsplit
        m = random_matrix(rng, 1, 300, 512, 4, 64, "BF16")
        wg = ops.QMatrix("cuda", **m)
        x = rng.standard_normal((T, 512)).astype(np.float32)
        assert np.array_equal(ops.linear(wg, 0, x), ops.linear(wg, 0, x))


@pytest.mark.parametrize("T", [65, 146, 300, 512])
@pytest.mark.parametrize("N,K", [(2048, 4096), (2048, 512), (300, 2048)])
def test_linear_split_k_several_row_tiles(T, N, K, gpu_tol):
    # Medium prompts: dense products with fewer tiles than half the SMs split K over several 64-row tiles
    # (linear.cu with_split_k, T <= 512): the out_proj / o_proj shape, the shared expert's down product
    # (K = 512: two splits) and a partial column tile; against the CPU
    rng = np.random.default_rng(T + N + K)
    m = random_matrix(rng, 1, N, K, 4, 64, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, K)).astype(np.float32)
    check(ops.linear(wg, 0, x), ops.linear(wc, 0, x), "linear_wgmma", gpu_tol)


@pytest.mark.parametrize("N,K,bits,group,T", [
    (64, 2048, 4, 64, 4096),    # GDN's b|a at 4K: 64 tiles of 64 rows, split 2
    (64, 2048, 4, 32, 4096),    # 32-wide groups: the 64-row split instance
    (257, 2048, 8, 64, 4096),   # the router and shared-expert gate: 64-row tiles too many, 32 x 2 of 128 rows split
    (300, 2048, 4, 64, 4096),   # a part column tile on the 128-row split
    (2048, 512, 4, 64, 1000),   # 8 x 8 tiles of 128 rows, K = 512: two splits
    (64, 2048, 4, 64, 9000),    # 141 tiles of 64 rows, 71 of 128: unsplit
])
def test_linear_split_k_long_prompts(N, K, bits, group, T, gpu_tol):
    # Long prompts: dense products with fewer tiles than half the SMs split K too (linear.cu with_split_k, on
    # 64- or 128-row tiles); against the CPU, and deterministic (the partials summed in split order)
    rng = np.random.default_rng(T + N + K + bits + group)
    m = random_matrix(rng, 1, N, K, bits, group, "BF16")
    wc, wg = both(m)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out = ops.linear(wg, 0, x)
    check(out, ops.linear(wc, 0, x), "linear_wgmma", gpu_tol)
    assert np.array_equal(out, ops.linear(wg, 0, x))


@pytest.mark.parametrize("bits,group,sdt", [(0, 0, "F32"), (0, 0, "BF16"), (4, 64, "BF16"), (8, 32, "F16"), (2, 128, "F32")])
def test_embedding(bits, group, sdt, gpu_tol):
    rng = np.random.default_rng(11)
    V, H = 1000, 256
    m = random_matrix(rng, 1, V, H, bits, group, sdt)
    wc, wg = both(m)
    ids = rng.integers(0, V, 19).astype(np.int32)
    ids[:2] = [0, V - 1]
    check(ops.embedding(wg, ids), ops.embedding(wc, ids), "embedding", gpu_tol)


def test_embedding_clamps_ids():
    rng = np.random.default_rng(12)
    m = random_matrix(rng, 1, 50, 64, 4, 64, "BF16")
    wc, wg = both(m)
    out = ops.embedding(wg, np.array([-3, 50, 1000], dtype=np.int32))
    ref = ops.embedding(wc, np.array([0, 49, 49], dtype=np.int32))
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("T,heads,D,out,group,bits", [
    (4096, 32, 128, 2048, 64, 4),  # GDN out_proj at a 4K prefill: 128-row tiles
    (300, 32, 128, 2048, 64, 4),   # 64-row tiles, a partial last tile
    (40, 32, 128, 2048, 64, 4),    # T <= 64: split-K, its partials after X in the workspace
    (33, 4, 128, 320, 32, 4),      # the fewest rows the GEMM takes at 4 bits (T <= 32: dense_small); group 32,
                                   # a partial column tile
    (100, 4, 24, 256, 32, 4),      # K = 96, no multiple of 64: no wgmma GEMM, linear_xb refuses
    (300, 32, 128, 2048, 64, 8),   # 8-bit weights read the same Xb
    (40, 32, 128, 2048, 32, 8),    # 8-bit, split-K, group 32
    (300, 8, 256, 512, 64, 4),     # D = 256: two float4s a lane in the warp-row Xb path
    (130, 8, 200, 256, 64, 4),     # D = 200: the second float4s of lanes 18-31 past the row
])
def test_gated_rms_norm_linear_xb(T, heads, D, out, group, bits):
    # The GDN hand-over (engine.cpp gdn_layer): gated_rms_norm_xb writes out_proj's bf16 X into the linear
    # workspace and linear_xb reads it; the same bits as gated_rms_norm's F32 rows converted by linear.
    K = heads * D
    rng = np.random.default_rng(T + K + bits)
    m = random_matrix(rng, 1, out, K, bits, group, "BF16")
    w = ops.QMatrix("cuda", **m)
    x = rng.standard_normal((T * heads, D)).astype(np.float32)
    z = rng.standard_normal((T * heads, D)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, D).astype(np.float32)
    if K % 64:
        assert not ops.linear_xb_supported(w, T)
        with pytest.raises(Exception, match="linear_xb"):
            ops.gated_rms_norm_linear_xb(w, x, z, nw, 1e-6)
        return
    assert ops.linear_xb_supported(w, T) and not ops.linear_xb_supported(w, 8)
    ref = ops.linear(w, 0, ops.gated_rms_norm("cuda", x, z, nw, 1e-6).reshape(T, K))
    got = ops.gated_rms_norm_linear_xb(w, x, z, nw, 1e-6)
    assert np.isfinite(got).all()
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("T, out, group, bits", [(4096, 256, 64, 4), (300, 257, 64, 8), (40, 512, 64, 4),
                                                 (146, 1024, 32, 4)])
def test_add_rms_norm_linear_xb(T, out, group, bits):
    # A prompt's input and post-attention norms (engine.cpp): add_rms_norm_xb also writes the next products'
    # bf16 X, which linear_xb (and the MoE) read: x and h the same bits as add_rms_norm's, the product the
    # same as linear converting h itself.
    H = 2048
    rng = np.random.default_rng(T + out + bits)
    m = random_matrix(rng, 1, out, H, bits, group, "BF16")
    w = ops.QMatrix("cuda", **m)
    x = rng.standard_normal((T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    assert ops.linear_xb_supported(w, T)
    x2, h, got = ops.add_rms_norm_linear_xb(w, x, res, nw, 1e-6)
    x_ref, h_ref = ops.add_rms_norm("cuda", x, res, nw, 1e-6)
    assert np.array_equal(x2, x_ref) and np.array_equal(h, h_ref)
    assert np.isfinite(got).all()
    assert np.array_equal(got, ops.linear(w, 0, h_ref))


@pytest.mark.parametrize("T, pos0, out, bits", [(130, 0, 2048, 4), (40, 300, 512, 8), (300, 7, 256, 4)])
def test_gated_attention_linear_xb(T, pos0, out, bits):
    # A prompt's o_proj (engine.cpp attention_layer): gated_attention writes the gated o as linear's bf16 X
    # and linear_xb reads it; the product and the caches the same bits as the op sequence then linear.
    nH, nKV, D, rd, theta, eps = 16, 2, 256, 64, 1e7, 1e-6
    assert ops.gated_attention_xb_supported("cuda", T, nH, nKV, D)
    assert not ops.gated_attention_xb_supported("cuda", 4, nH, nKV, D)  # the split-KV attention's T
    assert not ops.gated_attention_xb_supported("cpu", T, nH, nKV, D)
    rng = np.random.default_rng(T + pos0 + bits)
    w = ops.QMatrix("cuda", **random_matrix(rng, 1, out, nH * D, bits, 64, "BF16"))
    assert ops.linear_xb_supported(w, T)
    p = rng.standard_normal((T, nH * 2 * D)).astype(np.float32)
    k = (2 * rng.standard_normal((T, nKV * D))).astype(np.float32)
    v = rng.standard_normal((T, nKV * D)).astype(np.float32)
    qn = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    kn = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    cache = lambda: rng.standard_normal((pos0 + T + 8, nKV * D)).astype(np.float32)
    kc, vc = cache(), cache()
    y, kc2, vc2 = ops.gated_attention_linear_xb(w, p, k, v, qn, kn, eps, rd, theta, kc, vc, nH, nKV, pos0)
    q_, g_, o, kc_ref, vc_ref = ops.gated_attention("cuda", p, k, v, qn, kn, eps, rd, theta, kc, vc, nH, nKV, pos0)
    assert np.isfinite(y).all()
    assert np.array_equal(y, ops.linear(w, 0, o))
    assert np.array_equal(kc2, kc_ref) and np.array_equal(vc2, vc_ref)
