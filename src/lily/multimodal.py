"""Images in prompts: message content parts -> image sources, image URLs under a policy, the chat
template's one ``<|image_pad|>`` per image expanded to the image's tokens, and image spans.

Content parts (OpenAI and Hugging Face styles): ``{"type": "text", "text": ...}``,
``{"type": "image", "image": path | bytes | PIL.Image | numpy array | URL}`` and
``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": URL``). URLs: ``data:`` (base64),
``http(s)://`` and ``file://``, each allowed or refused by a ``URLPolicy`` (the Python API allows them all;
the server only ``data:`` unless its operator allows more). Video and audio parts are refused.

A prompt's images are identified by their spans ``(start, end, digest)``: the prompt indices of each
image's tokens and its content digest (``PreparedImage.digest``). Two states computed the same prefix
exactly when their ids and their spans within it agree (``same_images``); prefix reuse checks that.
"""
from __future__ import annotations

import base64
import binascii
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .images import ImageError, PreparedImage

DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # an encoded image (a data: URL's payload, a download, a file)
DEFAULT_FETCH_SECONDS = 10.0

Span = tuple[int, int, str]  # (first token index, end index, image digest)


@dataclass(frozen=True)
class URLPolicy:
    """Which image URLs may be read: ``data:`` always; ``http(s)://`` when ``allow_http`` (at most
    ``max_bytes``, within ``timeout`` seconds); ``file://`` (and, for ``image`` parts, plain paths) anywhere
    when ``allow_files``, else only under ``allowed_dir`` (None: refused)."""
    allow_http: bool = False
    allow_files: bool = False
    allowed_dir: Path | None = None
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout: float = DEFAULT_FETCH_SECONDS


PYTHON_API_POLICY = URLPolicy(allow_http=True, allow_files=True)  # the Python user reads what they like


def is_video_part(part) -> bool:
    return isinstance(part, Mapping) and (part.get("type") in ("video", "video_url", "input_audio", "audio")
                                          or "video" in part or "video_url" in part)


def is_image_part(part) -> bool:
    return isinstance(part, Mapping) and (part.get("type") in ("image", "image_url")
                                          or (part.get("type") is None and ("image" in part or "image_url" in part)))


def has_image_parts(messages: Sequence[Mapping]) -> bool:
    """Whether any message's content holds an image part."""
    return any(isinstance(m, Mapping) and isinstance(m.get("content"), (list, tuple))
               and any(is_image_part(p) for p in m["content"]) for m in messages)


def extract_images(messages: Sequence[Mapping], policy: URLPolicy = PYTHON_API_POLICY) -> tuple[list, list]:
    """``messages`` with each image part replaced by ``{"type": "image"}`` (what the chat template
    renders as one ``<|image_pad|>``), and the images' sources in prompt order (URLs already read into
    bytes under ``policy``). ImageError names a bad part; video and audio parts are refused."""
    out, sources = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (str, bytes, Mapping)) or not isinstance(content, Sequence):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if is_video_part(part):
                raise ImageError(f"'{where}': video and audio input are not supported (images only)")
            if is_image_part(part):
                sources.append(image_source(part, where, policy))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, sources


def image_source(part: Mapping, where: str, policy: URLPolicy):
    """An image part's image: the object given, or a URL's bytes."""
    if part.get("type") == "image_url" or "image_url" in part:
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, Mapping) else ref
        if not isinstance(url, str) or not url:
            raise ImageError(f"'{where}.image_url.url' is required (a data:, http(s):// or file:// URL)")
        return read_url(url, policy, where)
    if "image" not in part or part["image"] is None:
        raise ImageError(f"'{where}.image' is required (a path, bytes, a PIL image, a numpy array or a URL)")
    image = part["image"]
    if isinstance(image, str) and (image.startswith(("data:", "http://", "https://", "file:"))):
        return read_url(image, policy, where)
    if isinstance(image, (str, Path)) and not policy.allow_files:
        return read_file(Path(image), policy, where)
    return image


def read_url(url: str, policy: URLPolicy, where: str = "image") -> bytes:
    """The encoded image at ``url`` under ``policy``; ImageError names a refused or unreadable URL."""
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return read_data_url(url, policy.max_bytes, where)
    if scheme in ("http", "https"):
        if not policy.allow_http:
            raise ImageError(f"'{where}': fetching http(s) image URLs is off (the server's --allow-image-urls turns "
                             f"it on); send the image as a data: URL (base64)")
        return fetch(url, policy, where)
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ImageError(f"'{where}': a file:// URL must name a local file, got host {parsed.netloc!r}")
        return read_file(Path(urllib.request.url2pathname(parsed.path)), policy, where)
    raise ImageError(f"'{where}': unsupported image URL scheme {scheme[:20]!r}; use a data: URL (base64)")


def read_data_url(url: str, max_bytes: int, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise ImageError(f"'{where}': a data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"'{where}': the image has more than {max_bytes} bytes")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"'{where}': the data: URL is not valid base64 ({e})") from None


def read_file(path: Path, policy: URLPolicy, where: str) -> bytes:
    if not policy.allow_files:
        if policy.allowed_dir is None:
            raise ImageError(f"'{where}': local image files are refused (the server's --allow-image-dir DIR allows "
                             f"files under DIR); send the image as a data: URL (base64)")
        root = policy.allowed_dir.resolve()
        if not path.is_absolute():
            path = root / path
        if not path.resolve().is_relative_to(root):
            raise ImageError(f"'{where}': {path} is outside the allowed image directory {root}")
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise ImageError(f"'{where}': {path} has {size} bytes; the limit is {policy.max_bytes}")
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"'{where}': cannot read {path}: {e.strerror or e}") from None


def fetch(url: str, policy: URLPolicy, where: str) -> bytes:
    """GET ``url``: at most ``policy.max_bytes``, the body within ``policy.timeout`` seconds of the request
    (checked after each read; ``read1`` returns what one socket read brought, so a server that trickles
    bytes cannot keep one call waiting past it; each socket wait is itself at most ``policy.timeout``)."""
    deadline = time.monotonic() + policy.timeout
    try:
        with urllib.request.urlopen(url, timeout=policy.timeout) as r:  # noqa: S310 - http(s) only, checked above
            chunks, size = [], 0
            while True:
                chunk = r.read1(1 << 16)
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > policy.max_bytes:
                    raise ImageError(f"'{where}': the image at {url[:200]} has more than {policy.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ImageError(f"'{where}': fetching {url[:200]} took more than {policy.timeout:g} s")
                chunks.append(chunk)
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001 - urllib's many errors: one clear message
        raise ImageError(f"'{where}': cannot fetch {url[:200]} ({type(e).__name__}: {str(e)[:200]})") from None


def image_runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of ``image_token_id`` in ``ids``."""
    is_image = np.asarray(ids, dtype=np.int64) == image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def expand_image_pads(ids: Sequence[int], images: Sequence[PreparedImage], image_token_id: int,
                      cuts: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """``ids`` with each run of image tokens that is one token long (the chat template's placeholder)
    grown to its image's ``num_tokens``, and ``cuts`` (prompt lengths) moved with it; a run already of
    the image's length stays. A cut inside a run is dropped. ImageError when runs and images disagree."""
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(images):
        raise ImageError(f"the prompt has {len(runs)} image placeholder(s) (<|image_pad|>) but {len(images)} "
                         f"image(s) were given")
    out, at, moved = [], 0, {c: c for c in cuts}
    for (a, b), image in zip(runs, images):
        n = image.num_tokens
        if b - a not in (1, n):
            raise ImageError(f"an image of {image.grid[1]}x{image.grid[2]} patches needs {n} image tokens (or one "
                             f"placeholder), the prompt has a run of {b - a}")
        out += list(ids[at:a]) + [image_token_id] * n
        at = b
        for c in cuts:
            if c >= b:
                moved[c] += n - (b - a)
            elif c > a:
                moved.pop(c, None)
    out += list(ids[at:])
    return out, sorted(moved.values())


def image_spans(ids: Sequence[int], images: Sequence[PreparedImage], image_token_id: int) -> tuple[Span, ...]:
    """(start, end, digest) of each image in prompt ``ids`` (runs already expanded)."""
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(images):
        raise ImageError(f"the prompt has {len(runs)} run(s) of image tokens but {len(images)} image(s) were given")
    return tuple((a, b, im.digest) for (a, b), im in zip(runs, images))


def same_images(held: tuple[Span, ...] | None, spans: Sequence[Span], n: int) -> bool:
    """Whether a state whose image spans are ``held`` computed the first ``n`` tokens of a prompt whose
    image spans are ``spans`` (their ids being equal): the same images at the same places, none cut
    at ``n``. ``held`` None: unknown images (a state whose image tokens lily cannot identify)."""
    if held is None:
        return False
    mine = tuple(s for s in spans if s[0] < n)
    return all(b <= n for _, b, _ in mine) and mine == tuple(s for s in held if s[0] < n)


def split_at(spans: Sequence[Span], images: Sequence[PreparedImage], start: int, end: int) -> list[PreparedImage]:
    """The images whose spans lie in [start, end)."""
    return [im for (a, b, _), im in zip(spans, images) if start <= a and b <= end]


def safe_cut(spans: Sequence[Span], cut: int) -> int:
    """``cut`` moved back to the start of an image span it would split."""
    for a, b, _ in spans:
        if a < cut < b:
            return a
    return cut
