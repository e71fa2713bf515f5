"""Images -> the vision tower's input: decode, resize, normalise, patchify (numpy + Pillow, no torch).

What Hugging Face's Qwen2-VL image processor (the one Qwen3.5/3.6 uses, PIL backend) does, step by step:
1. decode (PNG, JPEG, WebP, ... whatever Pillow reads) and convert to RGB, compositing transparency
   onto white;
2. resize with bicubic resampling to (h, w), both multiples of f = patch_size * merge_size, close to the
   original aspect ratio, with min_pixels <= h w <= max_pixels (``smart_resize``);
3. scale to [0, 1] and normalise per channel: (x - mean) / std;
4. cut into p x p patches listed in merge-block order (m x m blocks row-major, the patches of a block
   row-major), each patch the values [C, tp, p, p] flattened, its one frame repeated tp times.
The result is ``pixels`` [gh gw, C tp p p] float32 and the grid (1, gh, gw) in patches; the image
becomes gh gw / m^2 ``<|image_pad|>`` tokens. The bounds come from the checkpoint's
preprocessor_config.json (``ImageProcessorConfig``) and can be overridden per call.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .errors import LilyError

# Pillow refuses to decode images above this many pixels (a decompression bomb guard); far above any
# image the resize keeps, since max_pixels bounds what reaches the model.
MAX_DECODED_PIXELS = 100_000_000
MAX_ASPECT_RATIO = 200  # as transformers' smart_resize


class ImageError(LilyError):
    """An image lily cannot read or use: corrupt or unsupported bytes, an extreme shape, a bad argument."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json's values (Qwen3.6's by default)."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536        # size.shortest_edge: the fewest pixels an image is resized to
    max_pixels: int = 16777216     # size.longest_edge: the most
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> "ImageProcessorConfig":
        """This config with the user's pixel bounds, checked."""
        lo = self.min_pixels if min_pixels is None else min_pixels
        hi = self.max_pixels if max_pixels is None else max_pixels
        for name, v in (("min_pixels", lo), ("max_pixels", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ImageError(f"{name} must be a positive integer, got {v!r}")
        if lo > hi:
            raise ImageError(f"min_pixels ({lo}) exceeds max_pixels ({hi})")
        return replace(self, min_pixels=lo, max_pixels=hi)


def load_processor_config(model_dir: str | os.PathLike) -> ImageProcessorConfig:
    """The checkpoint's preprocessor_config.json, or Qwen3.6's values when the file is absent."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return ImageProcessorConfig()
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ImageError(f"{path}: unreadable JSON ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise ImageError(f"{path}: expected a JSON object")
    base = ImageProcessorConfig()
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    try:
        cfg = ImageProcessorConfig(
            patch_size=int(raw.get("patch_size", base.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", base.merge_size)),
            min_pixels=int(raw.get("min_pixels", size.get("shortest_edge", base.min_pixels))),
            max_pixels=int(raw.get("max_pixels", size.get("longest_edge", base.max_pixels))),
            image_mean=tuple(float(v) for v in raw.get("image_mean", base.image_mean)),
            image_std=tuple(float(v) for v in raw.get("image_std", base.image_std)),
        )
    except (TypeError, ValueError) as e:
        raise ImageError(f"{path}: {e}") from None
    if min(cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) <= 0 or len(cfg.image_mean) != 3 \
            or len(cfg.image_std) != 3 or 0 in cfg.image_std:
        raise ImageError(f"{path}: patch sizes must be positive and image_mean / image_std hold 3 values (std != 0)")
    return cfg.with_pixels()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size an image is resized to: both sides multiples of ``factor``, the pixel count within
    [min_pixels, max_pixels] (one factor x factor block at least), the aspect ratio kept as closely as
    possible."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image of {width}x{height} pixels: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_pil(image):
    """A PIL image from a path, bytes, a PIL image or a numpy array [H, W] / [H, W, 3|4] (uint8, or
    floats in [0, 1]), converted to RGB (transparency composited onto white)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, np.ndarray):
        a = image
        if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3, 4)) or a.size == 0:
            raise ImageError(f"an image array must be [H, W] or [H, W, 1|3|4], got shape {list(a.shape)}")
        if np.issubdtype(a.dtype, np.floating):
            if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
                raise ImageError("a float image array must hold values in [0, 1]")
            a = np.round(a * 255)
        elif a.dtype != np.uint8:
            raise ImageError(f"an image array must be uint8 or float, got {a.dtype}")
        a = np.ascontiguousarray(a.astype(np.uint8))
        img = Image.fromarray(a[:, :, 0] if a.ndim == 3 and a.shape[2] == 1 else a)
    else:
        if isinstance(image, (str, os.PathLike)):
            try:
                data = Path(image).read_bytes()
            except OSError as e:
                raise ImageError(f"cannot read image {str(image)!r}: {e.strerror or e}") from None
        elif isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
        else:
            raise ImageError(f"an image is a path, bytes, a PIL image or a numpy array, got {type(image).__name__}")
        # Pillow refuses above 2 x MAX_IMAGE_PIXELS (and only warns above MAX_IMAGE_PIXELS), so the size
        # its header declares is checked here too, before any pixel is decoded.
        Image.MAX_IMAGE_PIXELS = MAX_DECODED_PIXELS
        too_large = f"image too large to decode (over {MAX_DECODED_PIXELS} pixels)"
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_DECODED_PIXELS:
                raise ImageError(f"{too_large}: its header says {img.width}x{img.height}")
            img.load()
        except Image.DecompressionBombError:
            raise ImageError(too_large) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"cannot decode the image ({type(e).__name__}: {str(e)[:200]}); lily reads PNG, "
                             f"JPEG, WebP and the other formats Pillow decodes") from None
    if getattr(img, "n_frames", 1) > 1:
        img.seek(0)  # an animated image: its first frame (video input is not supported)
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


@dataclass(frozen=True)
class PreparedImage:
    """One image as the vision tower reads it."""
    pixels: np.ndarray           # [gh gw, C tp p p] float32, patches in merge-block order
    grid: tuple[int, int, int]   # (t, gh, gw) in patches, t = 1
    merge_size: int
    digest: str                  # the image's identity for prefix reuse (image_digest: the resized image, grid, cfg)

    @property
    def num_tokens(self) -> int:
        """The image's <|image_pad|> tokens: one per merge block."""
        return self.grid[1] * self.grid[2] // self.merge_size ** 2


def patchify(image: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """[H, W, C] uint8 -> [gh gw, C tp p p] float32 normalised ((v / 255 - mean) / std per channel, in
    float32 as the processor: the same value bit for bit), in merge-block order, the frame repeated tp
    times. The reordering moves the uint8 bytes (a quarter of the float32 ones), the arithmetic runs
    once per pixel on the reordered frame, and each of the tp copies is one strided copy of it."""
    H, W, C = image.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = H // p, W // p
    x = image.reshape(gh // m, m, p, gw // m, m, p, C).transpose(0, 3, 1, 4, 6, 2, 5)  # (bh, bw, mh, mw, C, p, p)
    x = np.ascontiguousarray(x).reshape(gh * gw, C, 1, p * p)
    frame = np.multiply(x, np.float32(1 / 255), dtype=np.float32)
    np.subtract(frame, np.asarray(cfg.image_mean, np.float32)[:, None, None], out=frame)
    np.divide(frame, np.asarray(cfg.image_std, np.float32)[:, None, None], out=frame)
    out = np.empty((gh * gw, C, tp, p * p), np.float32)
    out[...] = frame
    return out.reshape(gh * gw, C * tp * p * p)


def image_digest(resized: np.ndarray, grid: tuple[int, int, int], cfg: ImageProcessorConfig) -> str:
    """sha256 of what determines the prepared pixels: the resized uint8 image [h, w, 3], the grid and the
    processor's patch sizes and normalisation (hashing these 3 bytes per pixel instead of the 2 x 4 x 3
    bytes of the float32 patches; the same image at the same bounds gets the same digest)."""
    head = np.asarray([*grid, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size], np.int64).tobytes()
    norm = np.asarray([*cfg.image_mean, *cfg.image_std], np.float32).tobytes()
    h = hashlib.sha256(b"lily-image-v2" + head + norm)
    h.update(memoryview(np.ascontiguousarray(resized)).cast("B"))
    return h.hexdigest()


def prepare_image(image, cfg: ImageProcessorConfig) -> PreparedImage:
    """Decode, resize, normalise and patchify one image (the module docstring's steps)."""
    from PIL import Image

    img = to_pil(image)
    width, height = img.size
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(img.resize((w, h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)
    grid = (1, h // cfg.patch_size, w // cfg.patch_size)
    return PreparedImage(patchify(resized, cfg), grid, cfg.merge_size, image_digest(resized, grid, cfg))


@dataclass(frozen=True)
class PromptLayout:
    """Where a prompt's images go and every token's multimodal RoPE position (docs/model.md section 8.5)."""
    rows: np.ndarray       # [n] int32: the prompt indices of the image tokens, in order
    positions: np.ndarray  # [T, 3] int32: each token's (t, h, w) rope position
    rope_delta: int        # after the prompt: the token at index p has rope position p + rope_delta


def prompt_layout(ids: np.ndarray, images: list[PreparedImage], image_token_id: int, start: int,
                  rope_start: int) -> PromptLayout:
    """The image rows and (t, h, w) positions of prompt ``ids`` [T] that continues a session at index
    ``start`` whose next rope position is ``rope_start``. Each maximal run of ``image_token_id`` is the
    next image, with exactly its num_tokens tokens. Text tokens count on by one (t = h = w); image i's
    tokens, its merged grid (gh', gw') = (gh/m, gw/m) row-major, get (c, c + row, c + col) with c the
    position where the image starts, and the text after it continues from c + max(gh', gw')."""
    ids = np.asarray(ids)
    is_image = ids == image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = list(zip(edges[::2], edges[1::2]))
    if len(runs) != len(images):
        raise ImageError(f"the prompt has {len(runs)} runs of image tokens but {len(images)} images were given")
    positions = np.empty((ids.size, 3), np.int64)
    at, pos = 0, rope_start
    for (a, b), image in zip(runs, images):
        if b - a != image.num_tokens:
            raise ImageError(f"an image of {image.grid[1]}x{image.grid[2]} patches needs {image.num_tokens} image "
                             f"tokens, the prompt has a run of {b - a}")
        positions[at:a] = (pos + np.arange(a - at))[:, None]
        pos += a - at
        gh, gw = image.grid[1] // image.merge_size, image.grid[2] // image.merge_size
        rows, cols = np.divmod(np.arange(gh * gw), gw)
        positions[a:b] = np.stack([np.full(gh * gw, pos), pos + rows, pos + cols], axis=1)
        pos += max(gh, gw)
        at = b
    positions[at:] = (pos + np.arange(ids.size - at))[:, None]
    pos += ids.size - at
    return PromptLayout(np.flatnonzero(is_image).astype(np.int32), positions.astype(np.int32),
                        pos - (start + ids.size))
