"""lily.images (numpy + Pillow) equals transformers' Qwen2-VL image processor (PIL backend, the one
Qwen3.5/3.6 uses) on PNG, JPEG and WebP files, grey, palette and transparent images, arrays, and
overridden pixel bounds; bad input raises ImageError naming the problem."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from checks import png_header_only
from lily.images import ImageError, ImageProcessorConfig, load_processor_config, prepare_image, smart_resize

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

CFG = ImageProcessorConfig(min_pixels=32 * 32, max_pixels=256 * 256)


def reference(image, cfg=CFG):
    proc = Qwen2VLImageProcessorPil(patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
                                    merge_size=cfg.merge_size, image_mean=list(cfg.image_mean),
                                    image_std=list(cfg.image_std),
                                    size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels})
    out = proc(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def photo(w, h, mode="RGB", seed=0):
    """A smooth random image (so JPEG / WebP compress it like a photo)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 4), dtype=np.uint8)
    return Image.fromarray(small, "RGBA").resize((w, h), Image.Resampling.BILINEAR).convert(mode)


def encoded(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,mode,size", [
    ("PNG", "RGB", (200, 120)), ("PNG", "RGBA", (97, 61)), ("PNG", "L", (40, 300)), ("PNG", "P", (64, 64)),
    ("JPEG", "RGB", (333, 257)), ("WEBP", "RGB", (150, 150)), ("PNG", "RGB", (1200, 700)),  # above max_pixels
])
def test_equal_to_transformers(fmt, mode, size):
    data = encoded(photo(*size, mode=mode), fmt)
    got = prepare_image(data, CFG)
    ref_pixels, ref_grid = reference(Image.open(io.BytesIO(data)))
    assert got.grid == ref_grid
    assert got.pixels.shape == ref_pixels.shape and got.pixels.dtype == np.float32
    np.testing.assert_allclose(got.pixels, ref_pixels, rtol=0, atol=1e-6)


def test_inputs_of_every_kind_agree(tmp_path):
    img = photo(90, 70)
    (tmp_path / "a.png").write_bytes(encoded(img, "PNG"))
    a = np.asarray(img)
    digests = {prepare_image(x, CFG).digest for x in
               (tmp_path / "a.png", str(tmp_path / "a.png"), encoded(img, "PNG"), img, a, a / 255.0)}
    assert len(digests) == 1
    assert prepare_image(photo(90, 70, seed=1), CFG).digest not in digests


@pytest.mark.parametrize("cfg", [CFG, ImageProcessorConfig(min_pixels=32 * 32, max_pixels=300 * 200,
                                                        image_mean=(0.48145466, 0.4578275, 0.40821073),
                                                        image_std=(0.26862954, 0.26130258, 0.27577711))])
def test_pixels_are_the_normalised_frame_bit_for_bit(cfg):
    # prepare_image reorders the uint8 pixels first and normalises after: the same float32 operations on
    # each value as normalising the [H, W, C] image and then cutting it into patches (what it did before)
    got = prepare_image(photo(333, 201, seed=2), cfg)
    h, w = got.grid[1] * cfg.patch_size, got.grid[2] * cfg.patch_size
    resized = np.asarray(photo(333, 201, seed=2).resize((w, h), Image.Resampling.BICUBIC), np.uint8)
    x = (resized.astype(np.float32) * np.float32(1 / 255) - np.asarray(cfg.image_mean, np.float32)) \
        / np.asarray(cfg.image_std, np.float32)
    p, m, tp, (gh, gw) = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size, got.grid[1:]
    x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    ref = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p)).reshape(gh * gw, -1)
    assert got.pixels.flags.c_contiguous and got.pixels.dtype == np.float32
    np.testing.assert_array_equal(got.pixels.view(np.uint32), np.ascontiguousarray(ref).view(np.uint32))


def test_digest_names_the_image_and_its_preparation():
    img = photo(192, 128)  # whole 32-pixel blocks within the bounds: not resized, so one changed value stays
    a = prepare_image(img, CFG)
    assert a.digest == prepare_image(np.asarray(img), CFG).digest
    assert a.digest != prepare_image(img, CFG.with_pixels(max_pixels=64 * 64)).digest  # other bounds: other pixels
    other_norm = ImageProcessorConfig(min_pixels=CFG.min_pixels, max_pixels=CFG.max_pixels, image_std=(0.25,) * 3)
    assert a.digest != prepare_image(img, other_norm).digest
    flipped = np.asarray(img).copy()
    flipped[0, 0, 0] ^= 1  # one value of one pixel
    assert a.digest != prepare_image(flipped, CFG).digest


def test_pixel_bounds_and_the_resize_rule():
    cfg = CFG.with_pixels(min_pixels=64 * 64, max_pixels=64 * 64)
    got = prepare_image(photo(500, 100), cfg)
    ref_pixels, ref_grid = reference(photo(500, 100), cfg)
    assert got.grid == ref_grid and got.grid[1] * got.grid[2] * 16 * 16 <= 64 * 64
    np.testing.assert_allclose(got.pixels, ref_pixels, atol=1e-6)
    assert got.num_tokens == got.grid[1] * got.grid[2] // 4
    for h, w in [(1, 1), (31, 33), (1000, 30), (3000, 4000)]:
        rh, rw = smart_resize(h, w, 32, CFG.min_pixels, CFG.max_pixels)
        assert rh % 32 == 0 and rw % 32 == 0 and CFG.min_pixels <= rh * rw <= CFG.max_pixels
    with pytest.raises(ImageError, match="min_pixels .* exceeds max_pixels"):
        CFG.with_pixels(min_pixels=10_000, max_pixels=100)


def test_a_one_pixel_image_is_resized_up():
    got = prepare_image(np.full((1, 1, 3), 200, np.uint8), CFG)
    ref_pixels, ref_grid = reference(Image.fromarray(np.full((1, 1, 3), 200, np.uint8)))
    assert got.grid == ref_grid
    np.testing.assert_allclose(got.pixels, ref_pixels, atol=1e-6)


@pytest.mark.parametrize("data,match", [
    (b"not an image at all", "cannot decode the image"),
    (encoded(photo(50, 50), "PNG")[:60], "cannot decode the image"),
    (png_header_only(20000, 20000), "too large to decode"),  # Pillow's own guard (over 2 x 100 MP)
    (png_header_only(12000, 12000), "too large to decode .*: its header says 12000x12000"),  # 144 MP: lily's check
    (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "cannot decode the image"),
])
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow warns from 100 MP; lily refuses
def test_bad_bytes_are_refused(data, match):
    with pytest.raises(ImageError, match=match):
        prepare_image(data, CFG)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ImageError, match="cannot read image"):
        prepare_image(tmp_path / "missing.png", CFG)
    with pytest.raises(ImageError, match=r"must be \[H, W\]"):
        prepare_image(np.zeros((2, 2, 2, 2), np.uint8), CFG)
    with pytest.raises(ImageError, match="values in"):
        prepare_image(np.full((4, 4, 3), 2.0), CFG)
    with pytest.raises(ImageError, match="aspect ratio"):
        prepare_image(np.zeros((1, 300, 3), np.uint8), CFG)
    with pytest.raises(ImageError, match="a path, bytes"):
        prepare_image(42, CFG)


def test_processor_config_file(tmp_path):
    assert load_processor_config(tmp_path) == ImageProcessorConfig()
    (tmp_path / "preprocessor_config.json").write_text(
        '{"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2, "size": {"shortest_edge": 256, '
        '"longest_edge": 9216}, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.4]}')
    cfg = load_processor_config(tmp_path)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (8, 256, 9216, (0.5, 0.4, 0.3))
    got = prepare_image(photo(77, 50), cfg)
    ref_pixels, ref_grid = reference(photo(77, 50), cfg)
    assert got.grid == ref_grid and got.pixels.shape[1] == 3 * 2 * 8 * 8
    np.testing.assert_allclose(got.pixels, ref_pixels, atol=1e-6)
    (tmp_path / "preprocessor_config.json").write_text("[1, 2]")
    with pytest.raises(ImageError, match="expected a JSON object"):
        load_processor_config(tmp_path)
