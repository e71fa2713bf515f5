"""Prompts with images on the CPU backend equal transformers' Qwen3_5MoeForConditionalGeneration (fp32,
eager) on a tiny random multimodal config: the multimodal RoPE positions, and the logits of prompts with
one and with two images of different sizes (prefill across chunk boundaries + 8 cached decode steps), from
the float checkpoint and quantized at load (against transformers holding the dequantized text weights)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import lily
from checks import TOL, assert_logits_close
from hf_reference import (MM_TOKEN_IDS, build_multimodal_model, mlx_to_torch_state, multimodal_reference_logits,
                          save_multimodal)
from lily import _core
from lily.images import ImageError, prompt_layout

IMG, START, END = MM_TOKEN_IDS["image_token_id"], MM_TOKEN_IDS["vision_start_token_id"], MM_TOKEN_IDS["vision_end_token_id"]
DECODE = [7, 99, 250, 3, 12, 45, 180, 64]


def picture(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    model = build_multimodal_model(seed=4)
    path = save_multimodal(model, tmp_path_factory.mktemp("mm"))
    m = lily.Model.load(path, device="cpu", prefill_chunk=16)
    images = m.prepare_images([picture(48, 64, 1), picture(90, 40, 2)])
    assert [im.grid for im in images] == [(1, 6, 8), (1, 12, 4)]
    return dict(model=model, lily=m, images=images, path=path)


def prompt_with(images, text=((5, 17), (40, 41), (50, 51, 52))):
    ids = list(text[0])
    for im, after in zip(images, text[1:]):
        ids += [START] + [IMG] * im.num_tokens + [END] + list(after)
    return ids


def test_positions_equal_transformers_get_rope_index(mm):
    ids = prompt_with(mm["images"])
    t = torch.tensor([ids])
    ref, delta = mm["model"].model.get_rope_index(t, (t == IMG).int(), torch.tensor([im.grid for im in mm["images"]]))
    layout = prompt_layout(np.array(ids), mm["images"], IMG, 0, 0)
    np.testing.assert_array_equal(layout.positions, ref[:, 0].T.numpy())
    assert layout.rope_delta == int(delta) < 0
    assert layout.rows.tolist() == [i for i, x in enumerate(ids) if x == IMG]


def test_mrope_with_equal_positions_is_rope():
    x = np.random.default_rng(0).standard_normal((9, 4 * 32)).astype(np.float32)
    p = np.arange(3, 12, dtype=np.int32)
    got = _core.ops.mrope("cpu", x, 4, 16, 1e7, [11, 11, 10], np.repeat(p[:, None], 3, 1))
    np.testing.assert_array_equal(got, _core.ops.rope("cpu", x, 4, 16, 1e7, 3))


@pytest.mark.parametrize("n", [1, 2])
def test_logits_equal_transformers(mm, n):
    images = mm["images"][:n]
    ids = prompt_with(images)
    pixels = np.concatenate([im.pixels for im in images])
    ref = multimodal_reference_logits(mm["model"], ids, pixels, [list(im.grid) for im in images], DECODE)
    s = mm["lily"].new_session()
    rows = [s.prefill(ids, images=images)] + [s.decode_step(t) for t in DECODE]
    assert s._core.rope_delta < 0
    assert_logits_close(np.stack(rows), ref, TOL["cpu_vs_hf_fp32"])


def test_logits_quantized_at_load_equal_transformers(mm, tmp_path):
    """Model.load(float checkpoint, quantize=4): the text matrices 4-bit, the tower float. The reference holds
    the weights that quantization gives (`lily convert`'s output is the same tensors: test_convert.py),
    dequantized, and the original tower."""
    from lily.checkpoint.convert import convert_hf_to_mlx

    mlx = convert_hf_to_mlx(mm["path"], tmp_path / "mlx")
    ref_model = copy.deepcopy(mm["model"])
    missing, unexpected = ref_model.load_state_dict(mlx_to_torch_state(mlx, "model.language_model."), strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("inv_freq")], (missing, unexpected)
    q = lily.Model.load(mm["path"], device="cpu", quantize=4, prefill_chunk=16)
    assert any("affine 4-bit" in line for line in q._engine.weight_signature().splitlines())
    for n in (1, 2):
        images = mm["images"][:n]
        ids = prompt_with(images)
        pixels = np.concatenate([im.pixels for im in images])
        grids = [list(im.grid) for im in images]
        ref = multimodal_reference_logits(ref_model, ids, pixels, grids, DECODE)
        float_ref = multimodal_reference_logits(mm["model"], ids, pixels, grids, DECODE)
        # really 4-bit: the float model's logits would fail the comparison below by a margin
        assert np.abs(ref - float_ref).max() > 3 * TOL["cpu_vs_hf_fp32"] * np.abs(ref).max()
        s = q.new_session()
        rows = [s.prefill(ids, images=images)] + [s.decode_step(t) for t in DECODE]
        assert_logits_close(np.stack(rows), ref, TOL["cpu_vs_hf_fp32"])


def test_a_snapshot_keeps_the_rope_offset(mm, tmp_path):
    ids = prompt_with(mm["images"][:1])
    s = mm["lily"].new_session()
    s.prefill(ids, images=mm["images"][:1])
    snap = s.snapshot()
    a = s.decode_step(9)
    snap.save(tmp_path / "s.lily")
    for restored in (snap, mm["lily"].load_snapshot(tmp_path / "s.lily")):
        other = mm["lily"].new_session()
        other.restore(restored)
        np.testing.assert_array_equal(other.decode_step(9), a)


def test_image_token_runs_must_match_the_images(mm):
    s = mm["lily"].new_session()
    with pytest.raises(ImageError, match="2 runs of image tokens but 1 images"):
        s.prefill(prompt_with(mm["images"]), images=mm["images"][:1])
    bad = [START] + [IMG] * 5 + [END]
    with pytest.raises(ImageError, match="needs 12 image tokens, the prompt has a run of 5"):
        s.prefill(bad, images=mm["images"][:1])
    assert s.position == 0


def test_generate_never_reuses_a_prefix_that_held_images(mm):
    """Until prefixes carry the images' content, a session that prefilled images is not resumed from its
    tokens: the same ids with other images must not reuse the first images' state."""
    ids = prompt_with(mm["images"][:1])
    s = mm["lily"].new_session()
    s.prefill(ids, images=mm["images"][:1])
    out = mm["lily"].generate(ids + [60], session=s, max_tokens=2, temperature=0)
    assert out.usage.cached_tokens == 0
    s = mm["lily"].new_session()  # nor from a prefix snapshot that holds images
    s.prefill(ids, images=mm["images"][:1])
    s.remember_prefix(s.snapshot())
    s.prefill([5])
    assert mm["lily"].generate(ids + [61], session=s, max_tokens=2, temperature=0).usage.cached_tokens == 0
