"""A NumPy twin of the CUDA vision tower's numerics, run on the CPU (no GPU): the tower of
docs/model.md section 8 with its products' operands rounded to bf16 (the dense BF16 GEMM) and its attention
rounding q, k, v and p to bf16 over 64-row key tiles with an online softmax (kernels/vision_attention.cuh),
every other op fp32 (lily's own CPU ops). With no rounding the twin must equal the CPU backend; with the
roundings its distance from the CPU backend is the error the GPU tests should see, and it must sit well
inside their tolerances (tests/gpu/conftest.py), so that a GPU failure means a bug, not a tight bound."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import lily
from checks import rel_err
from lily import _core
from lily.checkpoint import safetensors_io as sio
from lily.checkpoint import synthetic

ops = _core.ops
_spec = importlib.util.spec_from_file_location("gpu_conftest", Path(__file__).parent / "gpu" / "conftest.py")
_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpu)
GPU_TOL = _gpu.GPU_TOL
REAL_TOWER = {"depth": 3, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
              "num_position_embeddings": 2304}


def bf16(x):
    """Round float32 to the nearest bfloat16 (ties to even), as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def linear(x, w, b, rounded):
    """x W^T + b: fp32 operands, or bf16 ones as the tensor cores take them (fp64 sums stand in for fp32
    accumulation, whose error is far below bf16's)."""
    if rounded:
        x, w = bf16(x), bf16(w)
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32) + b


def attention(qkv, starts, nH, rounded, tile=64):
    """Per image and head: softmax(q k^T / sqrt(D)) v. Rounded: q, k, v to bf16, the scores' exponentials to
    bf16 for the PV product with the running max and sum of a 64-key online softmax, as the kernel."""
    N, W = qkv.shape[0], qkv.shape[1] // 3
    D = W // nH
    o = np.zeros((N, W), np.float32)
    scale = np.float32(1.4426950408889634 / np.sqrt(D))
    for a, e in zip(starts[:-1], starts[1:]):
        for h in range(nH):
            q, k, v = (qkv[a:e, i * W + h * D:i * W + (h + 1) * D] for i in range(3))
            if not rounded:
                s = q.astype(np.float64) @ k.astype(np.float64).T / np.sqrt(D)
                p = np.exp(s - s.max(1, keepdims=True))
                o[a:e, h * D:(h + 1) * D] = (p / p.sum(1, keepdims=True)) @ v
                continue
            q, k, v = bf16(q), bf16(k), bf16(v)
            m = np.full((e - a, 1), -np.inf, np.float32)
            acc, l = np.zeros((e - a, D), np.float32), np.zeros((e - a, 1), np.float32)
            for t0 in range(0, e - a, tile):
                s = (q @ k[t0:t0 + tile].T).astype(np.float32) * scale
                m_new = np.maximum(m, s.max(1, keepdims=True))
                alpha = np.exp2(m - m_new)
                p = np.exp2(s - m_new).astype(np.float32)
                l = l * alpha + p.sum(1, keepdims=True)
                acc = acc * alpha + bf16(p) @ v[t0:t0 + tile]
                m = m_new
            o[a:e, h * D:(h + 1) * D] = acc / l
    return o


def patch_positions(gh, gw, m):
    return np.array([(br * m + r, bc * m + c) for br in range(gh // m) for bc in range(gw // m)
                     for r in range(m) for c in range(m)], np.int32)


def tower(path, v, pixels, grids, rounded):
    """Engine::encode_images (engine/vision.cpp) step by step, products and attention as above."""
    t = {}
    for shard in sio.find_shards(path):
        f = sio.SafetensorsFile(shard)
        for name in f.names():
            if name.startswith("model.visual."):
                raw = np.asarray(f.get(name))
                t[name[len("model.visual."):]] = (raw.astype(np.uint32) << 16).view(np.float32)
    W, m = v.hidden_size, v.spatial_merge_size
    pos = np.concatenate([patch_positions(gh, gw, m) for _, gh, gw in grids])
    starts = np.cumsum([0] + [gh * gw for _, gh, gw in grids])
    x = linear(pixels, t["patch_embed.proj.weight"].reshape(W, -1), t["patch_embed.proj.bias"], rounded)
    for i, (_, gh, gw) in enumerate(grids):
        a, e = starts[i], starts[i + 1]
        x[a:e] = ops.vision_position_embedding("cpu", t["pos_embed.weight"], pos[a:e], gh, gw, x[a:e])
    for b in range(v.depth):
        p = f"blocks.{b}."
        h = ops.layer_norm("cpu", x, t[p + "norm1.weight"], t[p + "norm1.bias"], 1e-6)
        qkv = ops.vision_rope("cpu", linear(h, t[p + "attn.qkv.weight"], t[p + "attn.qkv.bias"], rounded), pos,
                              v.num_heads, v.rope_theta)
        x = x + linear(attention(qkv, starts, v.num_heads, rounded), t[p + "attn.proj.weight"], t[p + "attn.proj.bias"],
                       rounded)
        h = ops.layer_norm("cpu", x, t[p + "norm2.weight"], t[p + "norm2.bias"], 1e-6)
        h = ops.gelu("cpu", linear(h, t[p + "mlp.linear_fc1.weight"], t[p + "mlp.linear_fc1.bias"], rounded), True)
        x = x + linear(h, t[p + "mlp.linear_fc2.weight"], t[p + "mlp.linear_fc2.bias"], rounded)
    y = ops.layer_norm("cpu", x, t["merger.norm.weight"], t["merger.norm.bias"], 1e-6).reshape(-1, m * m * W)
    y = ops.gelu("cpu", linear(y, t["merger.linear_fc1.weight"], t["merger.linear_fc1.bias"], rounded), False)
    return linear(y, t["merger.linear_fc2.weight"], t["merger.linear_fc2.bias"], rounded)


@pytest.mark.parametrize("starts, nH, D", [([0, 256], 16, 72), ([0, 100, 164, 420], 4, 72), ([0, 70], 2, 128)])
def test_attention_twin_predicts_the_gpu_error(starts, nH, D):
    rng = np.random.default_rng(starts[-1] + nH + D)  # the inputs of tests/gpu/test_vision.py
    qkv = rng.standard_normal((starts[-1], 3 * nH * D)).astype(np.float32)
    ref = ops.vision_attention("cpu", qkv, np.array(starts, np.int32), nH)
    assert rel_err(attention(qkv, starts, nH, False), ref) < 1e-5
    err = rel_err(attention(qkv, starts, nH, True), ref)
    print(f"vision_attention {starts} x {nH} heads of {D}: bf16 twin rel err {err:.3g}")
    assert err < GPU_TOL["vision_attention"] / 3


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_tower_twin_predicts_the_gpu_error(which, tmp_path):
    path = synthetic.make_checkpoint(tmp_path, "tiny", with_tokenizer=False,
                                     vision=True if which == "tiny" else REAL_TOWER)
    model = lily.Model.load(path, device="cpu")
    rng = np.random.default_rng(2)
    pics = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((64, 96), (128, 64))]
    images = model.prepare_images(pics, min_pixels=64 * 64)
    grids = [im.grid for im in images]
    pixels = np.concatenate([im.pixels for im in images])
    ref = model.encode_images(images)
    assert rel_err(tower(path, model.config.vision, pixels, grids, False), ref) < 1e-4
    err = rel_err(tower(path, model.config.vision, pixels, grids, True), ref)
    print(f"{which} tower: bf16 twin rel err {err:.3g}")
    assert err < GPU_TOL["vision_tower"] / 3
