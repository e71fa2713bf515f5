"""Image input through the Python API, the CLI and the server, on the tiny synthetic checkpoint with its
tiny vision tower (random weights: the text is gibberish; what is compared is the tokens and logprobs).

The reference is Session.prefill(ids, images=...) with the prompt's pads expanded by hand, then greedy
decode steps; prefix reuse must never resume a state computed from other images behind the same ids."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

import lily
from lily.checkpoint import synthetic
from lily.errors import LilyError
from lily.images import ImageError

IMG = 248056
STEPS = 6


def picture(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png(a) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def data_url(a) -> str:
    return "data:image/png;base64," + base64.b64encode(png(a)).decode()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = synthetic.make_checkpoint(tmp_path_factory.mktemp("vision"), "tiny", layout="hf", vision=True)
    # Small images stay small: 32 x 32 pixels at least (one merge block) instead of 256 x 256.
    (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 1024, "max_pixels": 65536}))
    return path


@pytest.fixture(scope="module")
def model(ckpt):
    return lily.Model.load(ckpt, device="cpu", max_context=512, prefill_chunk=16)


A, B, C = picture(64, 96, 1), picture(64, 96, 2), picture(100, 40, 3)  # A and B: same size, other pixels


def user(*images, text="Describe."):
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def reference(model, messages, images, steps=STEPS):
    """Greedy ids and first-token log-probabilities from Session.prefill with images."""
    tok = model.tokenizer
    plain = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
             for m in messages]
    ids = tok.encode(tok.apply_chat_template(plain, add_generation_prompt=True))
    prepared = model.prepare_images(images)
    expanded = []
    it = iter(prepared)
    for t in ids:
        expanded += [IMG] * next(it).num_tokens if t == IMG else [t]
    s = model.new_session()
    logits = s.prefill(expanded, images=prepared)
    out, first = [], logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = s.decode_step(out[-1])
    return expanded, out, first


@pytest.mark.parametrize("images", [(A,), (A, C)], ids=["one", "two"])
def test_chat_equals_session_prefill(model, images):
    msgs = user(*images)
    ids, want, first = reference(model, msgs, list(images))
    s = model.new_session()
    g = s.chat(msgs, temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    assert g.token_ids == want
    assert s.tokens[:len(ids)] == tuple(ids)
    assert g.logprobs[0].logprob == pytest.approx(float(first[want[0]]), abs=1e-4)
    assert g.usage.prompt_tokens == len(ids)


def test_stream_equals_non_stream(model):
    msgs = user(A, C)
    full = model.new_session().chat(msgs, temperature=0, max_tokens=STEPS, ignore_eos=True)
    stream = model.new_session().chat(msgs, temperature=0, max_tokens=STEPS, ignore_eos=True, stream=True)
    events = list(stream)
    assert [e.token_id for e in events if e.token_id is not None] == full.token_ids
    assert stream.result().text == full.text


def test_image_url_parts_and_sources_agree(model, tmp_path):
    """path, bytes, PIL image, numpy array, data: URL and file:// URL: the same image, the same answer."""
    from PIL import Image

    f = tmp_path / "a.png"
    f.write_bytes(png(A))
    parts = [{"type": "image", "image": A}, {"type": "image", "image": str(f)}, {"type": "image", "image": png(A)},
             {"type": "image", "image": Image.fromarray(A)}, {"type": "image_url", "image_url": {"url": data_url(A)}},
             {"type": "image_url", "image_url": {"url": f.as_uri()}}]
    answers = {tuple(model.new_session().chat([{"role": "user", "content": [p, {"type": "text", "text": "Hi"}]}],
                                              temperature=0, max_tokens=3, ignore_eos=True).token_ids) for p in parts}
    assert len(answers) == 1


def test_token_prompt_with_images_argument(model):
    msgs = user(A)
    ids, want, _ = reference(model, msgs, [A])
    one_pad = [t for i, t in enumerate(ids) if t != IMG or ids[i - 1] != IMG]  # the template's single pad
    for prompt in (ids, one_pad):
        g = model.new_session().generate(prompt, images=[A], max_tokens=STEPS, ignore_eos=True)
        assert g.token_ids == want


def test_prefix_reuse_is_keyed_by_image_content(model):
    """A second turn about the same image resumes; the same ids for another image of the same size do not."""
    s = model.new_session()
    first = s.chat(user(A), temperature=0, max_tokens=4, ignore_eos=True)
    (_, image_end, _), = s.image_spans
    follow = user(A) + [first.message, {"role": "user", "content": "And?"}]
    again = s.chat(follow, temperature=0, max_tokens=4, ignore_eos=True)
    assert again.usage.cached_tokens > image_end  # resumed after the image
    assert again.token_ids == model.new_session().chat(follow, temperature=0, max_tokens=4, ignore_eos=True).token_ids
    other = s.chat(user(B), temperature=0, max_tokens=4, ignore_eos=True)  # same ids as user(A)
    assert other.usage.cached_tokens < image_end - 1  # not past the image
    assert other.token_ids == model.new_session().chat(user(B), temperature=0, max_tokens=4, ignore_eos=True).token_ids


def test_snapshot_file_keeps_image_spans(model, tmp_path):
    s = model.new_session()
    s.chat(user(A), temperature=0, max_tokens=2)
    snap = s.snapshot()
    assert snap.images and snap.images == s.image_spans
    loaded = model.load_snapshot(snap.save(tmp_path / "a.snap"))
    assert loaded.images == snap.images


@pytest.mark.parametrize("content, words", [
    ([{"type": "video", "video": "x.mp4"}], "video and audio input are not supported"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64"),
    ([{"type": "image_url", "image_url": {"url": "data:,abc"}}], "must be base64"),
    ([{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}], "unsupported image URL scheme"),
    ([{"type": "image_url", "image_url": {}}], "image_url.url' is required"),
    ([{"type": "image", "image": b"not an image"}], "cannot decode the image"),
    ([{"type": "image", "image": "/no/such/file.png"}], "cannot read image"),
    ([{"type": "image", "image": np.zeros((1, 3000, 3), np.uint8)}], "aspect ratio"),
])
def test_bad_images_are_named(model, content, words):
    with pytest.raises(LilyError, match=words):
        model.chat([{"role": "user", "content": content}], max_tokens=1)
    assert model.chat(user(A), max_tokens=1).usage.completion_tokens == 1  # the model still serves


def test_images_argument_mismatch(model):
    with pytest.raises(ImageError, match="1 image placeholder"):
        model.generate([1, IMG, 2], images=[A, C], max_tokens=1)
    with pytest.raises(ImageError, match="needs .* image tokens"):
        model.generate([1, IMG, IMG, 2], images=[A], max_tokens=1)
    with pytest.raises(LilyError, match="go in their content"):
        model.chat(user(A), images=[A], max_tokens=1)


def test_text_only_checkpoint_refuses_images():
    from lily.checkpoint.tiny import tiny_checkpoint

    m = lily.Model.load(tiny_checkpoint(), device="cpu", max_context=256)
    with pytest.raises(LilyError, match="has no vision tower"):
        m.chat(user(A), max_tokens=1)


def lily_cli(*args, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "lily.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=120)


def test_cli_generate_and_chat_with_images(model, ckpt, tmp_path):
    a, c = tmp_path / "a.png", tmp_path / "c.png"
    a.write_bytes(png(A))
    c.write_bytes(png(C))
    r = lily_cli("generate", "-m", str(ckpt), "--device", "cpu", "-q", "--chat", "--greedy", "-n", "4",
                 "--ignore-eos", "--image", str(a), "--image", str(c), "Describe.")
    assert r.returncode == 0, r.stderr
    want = model.new_session().chat(user(A, C), temperature=0, max_tokens=4, ignore_eos=True)
    assert r.stdout == want.text + "\n"
    r = lily_cli("generate", "-m", str(ckpt), "--image", str(a), "Describe.")
    assert r.returncode != 0 and "--image applies to a --chat prompt" in r.stderr
    r = lily_cli("chat", "-m", str(ckpt), "--device", "cpu", "-v", "-n", "2", "-t", "0",
                 stdin=f"/image {tmp_path / 'missing.png'}\n/image {a}\nDescribe.\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "no such file" in r.stderr and "a.png attached" in r.stderr and "prompt tokens" in r.stderr
