"""Images on the CUDA backend (issue 17, phase 2) against the fp32 CPU backend: every vision op (odd sizes,
several images), the whole tower (tiny, and real width: 1152 wide, 16 heads of 72, a few blocks), and prompts
with one and two images end to end (prefill + cached decode steps through the captured graph). Text-only
prompts keep their exact bits: a checkpoint's text output does not depend on its tower, on a session's
earlier images, or on the graph."""
from __future__ import annotations

import numpy as np
import pytest

import lily
from checks import rel_err
from lily import _core
from lily.checkpoint import synthetic
from lily.errors import LilyError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops

IMG, START, END = 248056, 248053, 248054  # synthetic checkpoints' image pad, vision start and end ids
REAL_TOWER = {"depth": 3, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
              "num_position_embeddings": 2304}


def check(got, ref, tol, what=""):
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol:.3g} (max abs {np.abs(got - ref).max():.3g})"
    return err


def both(fn, *args, **kw):
    return fn("cuda", *args, **kw), fn("cpu", *args, **kw)


# ---- the ops


@pytest.mark.parametrize("R, D", [(1, 1152), (19, 1152), (300, 64), (5, 77), (3, 4304), (2, 4608)])
def test_layer_norm(R, D, gpu_tol):
    rng = np.random.default_rng(R * 31 + D)
    x = (rng.standard_normal((R, D)) * 3 + 2).astype(np.float32)  # an offset mean: the variance's two passes
    w, b = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    check(*both(ops.layer_norm, x, w, b, 1e-6), gpu_tol["layer_norm"])


@pytest.mark.parametrize("R, C", [(1, 1152), (7, 3456), (33, 5), (4, 4304)])
def test_add_bias_is_exact(R, C):
    rng = np.random.default_rng(R + C)
    x, b = rng.standard_normal((R, C)).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    np.testing.assert_array_equal(*both(ops.add_bias, x, b))


@pytest.mark.parametrize("tanh_approx", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (19, 4304), (257, 4608)])
def test_gelu(shape, tanh_approx, gpu_tol):
    x = (np.random.default_rng(shape[0]).standard_normal(shape) * 4).astype(np.float32)
    check(*both(ops.gelu, x, tanh_approx), gpu_tol["gelu"])


def dense_bf16(rng, rows, cols):
    """A dense BF16 matrix (weights ~ U(-1, 1) / sqrt(cols): pre-activations of order one) on both backends."""
    w = (rng.uniform(-1, 1, (1, rows, cols)) / np.sqrt(cols)).astype(np.float32)
    m = dict(weight=(w.view(np.uint32) >> 16).astype(np.uint16), dtype="BF16", num_stack=1, rows=rows, cols=cols)
    return ops.QMatrix("cpu", **m), ops.QMatrix("cuda", **m)


# linear_bias_gelu: the GELU in the dense wgmma GEMM's epilogue (T >= 128) gives the bits of linear_bias then
# gelu on the GPU (kernels/gelu.cuh: one function, no FMA contraction); below 128 rows it is those two ops.
@pytest.mark.parametrize("T, rows, cols", [(9, 19, 8), (127, 4304, 1152), (128, 64, 64), (1031, 4304, 1152),
                                           (1024, 4608, 4608)])
def test_linear_bias_gelu_is_linear_bias_then_gelu(T, rows, cols, gpu_tol):
    rng = np.random.default_rng(T + rows)
    wc, wg = dense_bf16(rng, rows, cols)
    x = (rng.standard_normal((T, cols)) * 3).astype(np.float32)
    b = rng.standard_normal(rows).astype(np.float32)
    got = ops.linear_bias_gelu(wg, x, b)
    np.testing.assert_array_equal(got, ops.gelu("cuda", ops.linear_bias(wg, x, b), True))
    check(got, ops.linear_bias_gelu(wc, x, b), gpu_tol["linear_wgmma"], "linear_bias_gelu vs the CPU")


def norm_params(rng, T, W):
    x = (rng.standard_normal((T, W)) * 3 + 1).astype(np.float32)
    return x, (1 + 0.3 * rng.standard_normal(W)).astype(np.float32), rng.standard_normal(W).astype(np.float32)


# The tower's block inputs handed over as bf16 (engine/vision.cpp): layer_norm_xb writes the products' X,
# fc1's epilogue writes gelu's output as fc2's X, and the products read them without a conversion. Bit for
# bit the unfused ops on the GPU (layer_norm, linear_bias, gelu, linear_bias), at the tower's shapes (hidden
# 1152, qkv 3456, intermediate 4304 = 67 x 64 + 16: a zero-filled k tail in fc2), 0.25 MP and 1 MP row
# counts, an odd one and the least the dense GEMM takes.
@pytest.mark.parametrize("T", [128, 1024, 1031, 4096])
def test_mlp_bf16_hand_over_is_bitwise_the_unfused_ops(T):
    rng = np.random.default_rng(T)
    W, I = 1152, 4304
    _, fc1 = dense_bf16(rng, I, W)
    _, fc2 = dense_bf16(rng, W, I)
    x, nw, nb = norm_params(rng, T, W)
    b1, b2 = rng.standard_normal(I).astype(np.float32), rng.standard_normal(W).astype(np.float32)
    assert ops.linear_bias_xb_supported(fc1, T) and ops.linear_bias_xb_supported(fc2, T)
    got = ops.layer_norm_mlp_xb(x, nw, nb, 1e-6, fc1, b1, fc2, b2)
    h = ops.layer_norm("cuda", x, nw, nb, 1e-6)
    ref = ops.linear_bias(fc2, ops.gelu("cuda", ops.linear_bias(fc1, h, b1), True), b2)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("T", [128, 1031, 4096])
def test_qkv_bf16_hand_over_is_bitwise_the_unfused_ops(T):
    rng = np.random.default_rng(T + 1)
    W = 1152
    _, qkv = dense_bf16(rng, 3 * W, W)
    x, nw, nb = norm_params(rng, T, W)
    b = rng.standard_normal(3 * W).astype(np.float32)
    got = ops.layer_norm_linear_bias_xb(qkv, x, nw, nb, 1e-6, b)
    np.testing.assert_array_equal(got, ops.linear_bias(qkv, ops.layer_norm("cuda", x, nw, nb, 1e-6), b))


def test_bf16_hand_over_needs_the_dense_wgmma_gemm():
    rng = np.random.default_rng(0)
    wc, wg = dense_bf16(rng, 64, 64)
    assert not ops.linear_bias_xb_supported(wg, 127) and ops.linear_bias_xb_supported(wg, 128)
    assert not ops.linear_bias_xb_supported(wc, 1024)
    x, nw, nb = norm_params(rng, 127, 64)
    z = np.zeros(64, np.float32)
    with pytest.raises(LilyError, match="linear_bias_gelu_xb: 127 rows .* do not run on the dense wgmma GEMM"):
        ops.layer_norm_mlp_xb(x, nw, nb, 1e-6, wg, z, wg, z)
    with pytest.raises(LilyError, match="linear_bias_xb: 127 rows .* take no bf16 X"):
        ops.layer_norm_linear_bias_xb(wg, x, nw, nb, 1e-6, z)


def merge_order(gh, gw, m=2):
    """(row, col) of the patches of a gh x gw grid in merge-block order (engine/vision.cpp)."""
    return np.array([(br * m + r, bc * m + c) for br in range(gh // m) for bc in range(gw // m)
                     for r in range(m) for c in range(m)], np.int32)


@pytest.mark.parametrize("side, gh, gw", [(8, 2, 2), (8, 4, 6), (48, 64, 64), (48, 2, 90), (48, 36, 12)])
def test_vision_position_embedding(side, gh, gw, gpu_tol):
    rng = np.random.default_rng(side + gh * 7 + gw)
    W = 64 if side == 8 else 1152
    table = rng.standard_normal((side * side, W)).astype(np.float32)
    pos = merge_order(gh, gw)
    y = rng.standard_normal((len(pos), W)).astype(np.float32)
    check(*both(ops.vision_position_embedding, table, pos, gh, gw, y), gpu_tol["elementwise"])


def test_vision_position_embedding_refuses_a_position_outside_the_grid():
    pos = np.array([[0, 0], [2, 0]], np.int32)
    with pytest.raises(LilyError, match=r"pos\[1\] = \(2, 0\) is outside the 2 x 2 grid"):
        ops.vision_position_embedding("cuda", np.ones((4, 8), np.float32), pos, 2, 2, np.zeros((2, 8), np.float32))


@pytest.mark.parametrize("N, nH, D", [(1, 4, 16), (19, 4, 16), (256, 16, 72), (1024, 16, 72), (7, 3, 40)])
def test_vision_rope(N, nH, D, gpu_tol):
    rng = np.random.default_rng(N + nH + D)
    qkv = rng.standard_normal((N, 3 * nH * D)).astype(np.float32)
    pos = rng.integers(0, 128, (N, 2)).astype(np.int32)
    check(*both(ops.vision_rope, qkv, pos, nH, 1e4), gpu_tol["rope"])


@pytest.mark.parametrize("T, nH, D, rd, theta", [(1, 16, 256, 64, 1e7), (300, 2, 256, 64, 1e7), (9, 4, 64, 16, 1e7),
                                                 (5, 3, 24, 10, 1e4)])
def test_mrope(T, nH, D, rd, theta, gpu_tol):
    rng = np.random.default_rng(T + nH + D)
    x = rng.standard_normal((T, nH * D)).astype(np.float32)
    pos = rng.integers(0, 100000, (T, 3)).astype(np.int32)
    check(*both(ops.mrope, x, nH, rd, theta, [11, 11, 10], pos), gpu_tol["rope"])


def test_mrope_with_equal_positions_is_rope_bit_for_bit():
    x = np.random.default_rng(0).standard_normal((70, 16 * 256)).astype(np.float32)
    p = np.arange(4000, 4070, dtype=np.int32)
    got = ops.mrope("cuda", x, 16, 64, 1e7, [11, 11, 10], np.repeat(p[:, None], 3, 1))
    np.testing.assert_array_equal(got, ops.rope("cuda", x, 16, 64, 1e7, 4000))


# (image starts, heads, head size): one image, several of odd sizes (partial 64-row tiles, a single
# patch), the real head size 72 and other padded sizes up to 128
ATTENTION_CASES = [([0, 64], 4, 16), ([0, 1], 2, 16), ([0, 100, 164, 420], 4, 72), ([0, 256], 16, 72),
                   ([0, 19, 30], 3, 40), ([0, 1024, 1280], 16, 72), ([0, 70], 2, 128), ([0, 33], 2, 8),
                   ([0, 65, 66, 200], 2, 96)]


@pytest.mark.parametrize("starts, nH, D", ATTENTION_CASES)
def test_vision_attention(starts, nH, D, gpu_tol):
    rng = np.random.default_rng(starts[-1] + nH + D)
    qkv = rng.standard_normal((starts[-1], 3 * nH * D)).astype(np.float32)
    check(*both(ops.vision_attention, qkv, np.array(starts, np.int32), nH), gpu_tol["vision_attention"])


def test_vision_attention_keeps_images_apart():
    """Changing one image's keys and values leaves the other image's outputs as they were, bit for bit."""
    rng = np.random.default_rng(1)
    starts, nH, D = np.array([0, 80, 200], np.int32), 4, 72
    qkv = rng.standard_normal((200, 3 * nH * D)).astype(np.float32)
    a = ops.vision_attention("cuda", qkv, starts, nH)
    qkv[80:, nH * D:] = rng.standard_normal((120, 2 * nH * D))
    b = ops.vision_attention("cuda", qkv, starts, nH)
    np.testing.assert_array_equal(a[:80], b[:80])
    assert not np.array_equal(a[80:], b[80:])


def test_vision_attention_names_what_it_cannot_run():
    qkv = np.zeros((4, 3 * 2 * 136), np.float32)
    with pytest.raises(LilyError, match="vision_attention: head size 136 exceeds the CUDA kernel's 128"):
        ops.vision_attention("cuda", qkv, np.array([0, 4], np.int32), 2)
    with pytest.raises(LilyError, match="starts must increase"):
        ops.vision_attention("cuda", np.zeros((4, 48), np.float32), np.array([0, 2, 2, 4], np.int32), 2)


# ---- the tower


def pictures(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]


@pytest.fixture(scope="module")
def tiny_mm(tmp_path_factory):
    """The tiny text model (MLX 4-bit) with the tiny tower (bf16: 64 wide, 4 heads of 16, 2 blocks)."""
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("tiny_mm"), "tiny", with_tokenizer=False, vision=True)


@pytest.fixture(scope="module")
def real_tower(tmp_path_factory):
    """The tiny text model with a real-width tower of 3 blocks (1152 wide, 16 heads of 72, MLP 4304)."""
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("real_tower"), "tiny", with_tokenizer=False,
                                     vision=REAL_TOWER)


@pytest.mark.parametrize("which", ["tiny_mm", "real_tower"])
@pytest.mark.parametrize("shapes", [[(64, 64)], [(256, 320), (96, 480)]])
def test_tower_matches_cpu(which, shapes, request, gpu_tol):
    path = request.getfixturevalue(which)
    cpu, gpu = lily.Model.load(path, device="cpu"), lily.Model.load(path, device="cuda")
    images = cpu.prepare_images(pictures(shapes, len(shapes)), min_pixels=64 * 64)
    got, ref = gpu.encode_images(images), cpu.encode_images(images)
    err = check(got, ref, gpu_tol["vision_tower"], which)
    print(f"{which} {shapes}: tower rel err {err:.3g}")
    np.testing.assert_array_equal(got, gpu.encode_images(images))  # deterministic


# ---- end to end

DECODE = [7, 99, 250, 3, 12, 45, 180, 64, 5, 1000]


def prompt_with(images, text=((5, 17), (40, 41), (50, 51, 52))):
    ids = list(text[0])
    for im, after in zip(images, text[1:]):
        ids += [START] + [IMG] * im.num_tokens + [END] + list(after)
    return ids


def run(model, ids, images, use_graph=True):
    s = model.new_session(use_graph=use_graph)
    rows = list(s.prefill(ids, all_logits=True, images=images)) + [s.decode_step(t) for t in DECODE]
    return np.stack(rows), s


@pytest.mark.parametrize("n", [1, 2])
def test_prompt_with_images_matches_cpu(tiny_mm, n, gpu_tol):
    cpu = lily.Model.load(tiny_mm, device="cpu", prefill_chunk=16)
    gpu = lily.Model.load(tiny_mm, device="cuda", prefill_chunk=16)  # chunks across image boundaries
    images = cpu.prepare_images(pictures([(64, 96), (160, 64)][:n], 7), min_pixels=64 * 64)
    ids = prompt_with(images)
    ref, s_cpu = run(cpu, ids, images)
    got, s_gpu = run(gpu, ids, images)
    assert s_gpu._core.rope_delta == s_cpu._core.rope_delta < 0
    T = len(ids)
    err_p = float(np.abs(got[:T] - ref[:T]).max() / np.abs(ref[:T]).max())
    err_d = float(np.abs(got[T:] - ref[T:]).max() / np.abs(ref[T:]).max())
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    print(f"{n} image(s): prefill err {err_p:.3g}, decode err {err_d:.3g}, top-1 agreement {agree:.3f}")
    assert err_p < gpu_tol["engine_logits"] and err_d < gpu_tol["engine_logits"]
    assert agree >= gpu_tol["engine_top1"]
    assert s_gpu._core.decode_graph_nodes > 0


def test_decode_after_images_graph_equals_eager(tiny_mm):
    """The rope offset reaches the fused decode kernel as an argument: the captured graph replays the eager
    steps bit for bit, and a session whose offset changes captures a new graph."""
    m = lily.Model.load(tiny_mm, device="cuda")
    images = m.prepare_images(pictures([(64, 96)], 3), min_pixels=64 * 64)
    ids = prompt_with(images)
    graph, s = run(m, ids, images, use_graph=True)
    eager, _ = run(m, ids, images, use_graph=False)
    np.testing.assert_array_equal(graph, eager)
    text = [11, 12, 13, 14]
    s.reset()  # offset 0 again: text after a reset equals text in a fresh session
    fresh = m.new_session()
    np.testing.assert_array_equal(s.prefill(text), fresh.prefill(text))
    for t in DECODE:
        np.testing.assert_array_equal(s.decode_step(t), fresh.decode_step(t))


def test_text_is_independent_of_the_tower(tiny_mm, tmp_path):
    """The same text weights with and without a vision tower give the same bits for a text prompt, with the
    same decode graph."""
    plain = synthetic.make_checkpoint(tmp_path / "plain", "tiny", with_tokenizer=False)
    ids = list(range(100, 160))
    outs = []
    for path in (plain, tiny_mm):
        m = lily.Model.load(path, device="cuda")
        rows, s = run(m, ids, [])
        outs.append((rows, s._core.decode_graph_nodes))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1] > 0


def test_chat_with_an_image_on_cuda(tmp_path):
    """The API path: a chat message with an image part is read and answered on CUDA (the logits themselves are
    compared above)."""
    path = synthetic.make_checkpoint(tmp_path / "mm", "tiny", vision=True)
    msgs = [{"role": "user", "content": [{"type": "image", "image": pictures([(64, 64)], 5)[0]},
                                         {"type": "text", "text": "What is this?"}]}]
    outs = [lily.Model.load(path, device=d).chat(msgs, max_tokens=4, temperature=0, ignore_eos=True)
            for d in ("cpu", "cuda")]
    assert outs[0].usage.prompt_tokens == outs[1].usage.prompt_tokens > 4
    assert len(outs[1].token_ids) == 4
