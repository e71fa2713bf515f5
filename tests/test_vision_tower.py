"""The vision tower on the CPU against transformers' Qwen3_5MoeForConditionalGeneration (fp32, eager) on a
tiny random multimodal config with odd sizes (docs/model.md section 8): loading (float and quantize-at-load,
where the tower stays float), the tower's merged tokens for two images of different sizes, and checkpoints
without a tower (text-only, a clear error for images)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import lily
from hf_reference import build_multimodal_model, save_multimodal
from lily.checkpoint import safetensors_io as sio
from lily.errors import LilyError

GRIDS = [[1, 4, 6], [1, 6, 2]]  # two images of 4x6 and 6x2 patches (6 and 3 merged tokens)


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    model = build_multimodal_model(seed=3)
    path = save_multimodal(model, tmp_path_factory.mktemp("mm"))
    v = model.config.vision_config
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = np.random.default_rng(5).standard_normal((n, 3 * v.temporal_patch_size * v.patch_size ** 2))
    pixels = pixels.astype(np.float32)
    with torch.no_grad():
        ref = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    return dict(model=model, path=path, pixels=pixels, ref=ref)


def lazy_tensors(path) -> dict:
    return {name: f.lazy(name) for shard in sio.find_shards(path) for f in [sio.SafetensorsFile(shard)]
            for name in f.names()}


def encode(m, pixels):
    return m._engine.encode_images(pixels, np.array(GRIDS, np.int32))


def test_the_checkpoint_has_a_vision_tower(mm):
    m = lily.Model.load(mm["path"], device="cpu")
    v = m.config.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.num_position_embeddings, v.rope_theta) == (2, 48, 3, 49, 10000.0)
    assert any(line.startswith("visual.blocks.1.attn.qkv ") for line in m._engine.weight_signature().splitlines())


def test_merged_tokens_equal_transformers(mm):
    m = lily.Model.load(mm["path"], device="cpu")
    got = encode(m, mm["pixels"])
    assert got.shape == mm["ref"].shape == (9, 64)
    np.testing.assert_allclose(got, mm["ref"], rtol=1e-4, atol=1e-4)


def test_quantize_at_load_keeps_the_tower_float(mm):
    m = lily.Model.load(mm["path"], device="cpu", quantize=4)
    signature = m._engine.weight_signature().splitlines()
    visual = [line for line in signature if line.startswith("visual.") and "affine" in line]
    assert not visual and any("affine 4-bit" in line for line in signature)
    np.testing.assert_allclose(encode(m, mm["pixels"]), mm["ref"], rtol=1e-4, atol=1e-4)


def test_without_vision_tensors_the_checkpoint_loads_text_only(mm, tmp_path):
    """An mlx-lm conversion keeps vision_config but drops the tower: it loads as a text model, and an
    image is refused naming why."""
    for f in mm["path"].iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp_path / f.name)
    tensors = {name: t for name, t in lazy_tensors(mm["path"]).items() if not name.startswith("model.visual.")}
    sio.save_sharded(tmp_path, tensors)
    assert "vision_config" in json.loads((tmp_path / "config.json").read_text())
    m = lily.Model.load(tmp_path, device="cpu")
    assert m.config.vision is None
    assert not any(line.startswith("visual.") for line in m._engine.weight_signature().splitlines())
    with pytest.raises(LilyError, match="this checkpoint has no vision tower"):
        encode(m, mm["pixels"])


def test_an_incomplete_tower_is_refused(mm, tmp_path):
    for f in mm["path"].iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp_path / f.name)
    tensors = {name: t for name, t in lazy_tensors(mm["path"]).items()
               if name != "model.visual.blocks.1.mlp.linear_fc2.bias"}
    sio.save_sharded(tmp_path, tensors)
    with pytest.raises(LilyError, match="missing tensor 'model.visual.blocks.1.mlp.linear_fc2.bias'"):
        lily.Model.load(tmp_path, device="cpu")


def test_encode_images_checks_the_grids(mm):
    m = lily.Model.load(mm["path"], device="cpu")
    with pytest.raises(LilyError, match="grids hold 36 patches but pixels has 30 rows"):
        encode(m, mm["pixels"][:30])
    with pytest.raises(LilyError, match="not one frame of whole 2 x 2 merge blocks"):
        m._engine.encode_images(mm["pixels"][:15], np.array([[1, 3, 5]], np.int32))
