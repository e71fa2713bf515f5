"""Image input through the Python API, the CLI and the server, on the tiny synthetic checkpoint with its
tiny vision tower (random weights: the text is gibberish; what is compared is the tokens and logprobs).

The reference is Session.prefill(ids, images=...) with the prompt's pads expanded by hand, then greedy
decode steps; prefix reuse must never resume a state computed from other images behind the same ids."""
from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest

import lily
from checks import png_header_only
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
    """path, bytes, PIL image, numpy array, data: URL, file:// URL, PreparedImage: the same image and answer."""
    from PIL import Image

    f = tmp_path / "a.png"
    f.write_bytes(png(A))
    parts = [{"type": "image", "image": A}, {"type": "image", "image": str(f)}, {"type": "image", "image": png(A)},
             {"type": "image", "image": Image.fromarray(A)}, {"type": "image_url", "image_url": {"url": data_url(A)}},
             {"type": "image_url", "image_url": {"url": f.as_uri()}},
             {"type": "image", "image": model.prepare_images([A])[0]}]
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
    ([{"type": "image", "image": png_header_only(20000, 20000)}], "too large to decode"),
    ([{"type": "image", "image": b"<svg xmlns='http://www.w3.org/2000/svg'/>"}], "cannot decode the image"),
    ([{"type": "image", "image": np.full((256, 256, 3), 200, np.uint8)}] * 9,  # 9 x 64 tokens: over 512
     r"-token prompt exceeds the session's max_context of 512|the session's max_context is 512"),
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
    r = lily_cli("generate", "-m", str(ckpt), "--device", "cpu", "-q", "--chat", "--greedy", "-n", "4", "--ignore-eos",
                 "--image", str(a), "--image-max-pixels", "1024", "Describe.")
    assert r.returncode == 0, r.stderr
    small = model.prepare_images([A], max_pixels=1024)
    assert r.stdout == model.new_session().chat(user(*small), temperature=0, max_tokens=4, ignore_eos=True).text + "\n"
    r = lily_cli("generate", "-m", str(ckpt), "--chat", "--image-max-pixels", "1024", "Describe.")
    assert r.returncode != 0 and "apply to --image" in r.stderr
    r = lily_cli("chat", "-m", str(ckpt), "--device", "cpu", "-v", "-n", "2", "-t", "0",
                 stdin=f"/image {tmp_path / 'missing.png'}\n/image {a}\nDescribe.\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "no such file" in r.stderr and "a.png attached" in r.stderr and "prompt tokens" in r.stderr


def test_vision_example_runs():
    """examples/vision.py (the name issue 17 and docs/vision.md give) on its tiny random model: an answer,
    a follow-up turn that reuses the image's prefix, and the same question through the server."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "vision.py"
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reused = re.search(r"reused (\d+) of (\d+) prompt tokens", r.stdout)
    assert reused and 0 < int(reused[1]) < int(reused[2]), r.stdout
    assert "answer:" in r.stdout and "server:" in r.stdout, r.stdout


# --- the server --------------------------------------------------------------------------------------

def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*parts, text="Describe."):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    import openai

    from lily.multimodal import URLPolicy
    from lily.server import Server

    folder = tmp_path_factory.mktemp("allowed")
    with Server(model, port=0, model_name="vision", image_policy=URLPolicy(allowed_dir=folder)) as s:
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60), folder


def test_server_data_url_equals_the_api(model, served):
    _, client, _ = served
    kw = dict(model="vision", temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(messages=ask(image_part(data_url(A)), image_part(data_url(C))), **kw)
    want = model.new_session().chat(user(A, C), temperature=0, max_tokens=5, ignore_eos=True)
    msg = r.choices[0].message
    assert (msg.content or "", getattr(msg, "reasoning_content", None) or "") == (want.content, want.reasoning)
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    chunks = client.chat.completions.create(messages=ask(image_part(data_url(A)), image_part(data_url(C))),
                                            stream=True, **kw)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == want.content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want.reasoning


def test_server_prefix_reuse_is_keyed_by_image_content(model, served):
    _, client, _ = served
    kw = dict(model="vision", temperature=0, max_tokens=3)
    first = client.chat.completions.create(messages=ask(image_part(data_url(A)), text="One"), **kw)
    turn = ask(image_part(data_url(A)), text="One") + [{"role": "assistant", "content": "x"},
                                                       {"role": "user", "content": "Two"}]
    again = client.chat.completions.create(messages=turn, **kw)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 6
    # The same ids with another image: nothing past the image is reused, and the answer is B's.
    turn_b = ask(image_part(data_url(B)), text="One") + turn[1:]
    other = client.chat.completions.create(messages=turn_b, **kw)
    assert other.usage.prompt_tokens == again.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens < 8
    b_msgs = user(B, text="One") + turn[1:]
    want = model.new_session().chat(b_msgs, temperature=0, max_tokens=3)
    assert (other.choices[0].message.content or "") == want.content


def test_server_refusals_are_400s_and_it_keeps_serving(served, tmp_path):
    import openai

    s, client, folder = served
    (folder / "a.png").write_bytes(png(A))
    outside = tmp_path / "b.png"
    outside.write_bytes(png(B))
    bad = [
        ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "video and audio input"),
        ([image_part("https://example.com/cat.png")], "--allow-image-urls"),
        ([image_part(outside.as_uri())], "outside the allowed image directory"),
        ([image_part("data:image/png;base64,%%%")], "not valid base64"),
        ([image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())], "cannot decode the image"),
        ([image_part("gopher://x")], "unsupported image URL scheme"),
        ([image_part("data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>")
                     .decode())], "cannot decode the image"),  # a format Pillow does not read
        ([image_part("data:image/png;base64," + base64.b64encode(png_header_only(20000, 20000)).decode())],
         "too large to decode"),  # 20000 x 20000: refused from its header, never decoded
    ]
    for parts, words in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="vision", messages=ask(*parts), max_tokens=1)
        assert words in str(e.value), (words, str(e.value))
    big = data_url(np.full((256, 256, 3), 200, np.uint8))  # 64 tokens each: 9 exceed the context of 512
    with pytest.raises(openai.BadRequestError, match="context") as e:
        client.chat.completions.create(model="vision", messages=ask(*[image_part(big)] * 9), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    ok = client.chat.completions.create(model="vision", messages=ask(image_part((folder / "a.png").as_uri())),
                                        max_tokens=1)
    assert ok.choices[0].finish_reason in ("length", "stop")
    # A 1 x 1 image is valid: resized up to min_pixels (32 x 32 here: one merged token), as transformers does.
    one_pixel = image_part(data_url(np.zeros((1, 1, 3), np.uint8)))
    dot = client.chat.completions.create(model="vision", messages=ask(one_pixel), max_tokens=1)
    text = client.chat.completions.create(model="vision", messages=ask(), max_tokens=1)
    assert dot.usage.prompt_tokens - text.usage.prompt_tokens == 3  # vision_start, one image pad, vision_end
    assert s.worker.stats()["totals"]["error"] == 0


def test_server_image_pixel_bounds_per_request(model, served):
    import openai

    _, client, _ = served
    big = data_url(np.full((256, 256, 3), 90, np.uint8))  # 64 tokens at the checkpoint's max_pixels 65536
    kw = dict(model="vision", messages=ask(image_part(big)), max_tokens=1)
    full = client.chat.completions.create(**kw)
    small = client.chat.completions.create(**kw, extra_body={"mm_processor_kwargs": {"max_pixels": 64 * 64}})
    # 256 x 256 -> 64 x 64 pixels: 4 merged tokens instead of 64
    assert full.usage.prompt_tokens - small.usage.prompt_tokens == 60
    want = model.new_session().chat(user(model.prepare_images([np.full((256, 256, 3), 90, np.uint8)],
                                                              max_pixels=64 * 64)[0]), max_tokens=1)
    assert small.usage.prompt_tokens == want.usage.prompt_tokens
    for body, words in (({"min_pixels": 8192, "max_pixels": 4096}, "min_pixels (8192) exceeds max_pixels (4096)"),
                        ({"max_pixels": 0}, "mm_processor_kwargs.max_pixels"),
                        ({"max_pixel": 4096}, "max_pixel")):
        with pytest.raises(openai.BadRequestError, match=re.escape(words)) as e:
            client.chat.completions.create(**kw, extra_body={"mm_processor_kwargs": body})
        assert e.value.status_code == 400


def test_server_without_a_vision_tower():
    from types import SimpleNamespace

    from lily.multimodal import URLPolicy
    from lily.server.app import _read_images
    from lily.server.errors import APIError

    msgs = ask(image_part(data_url(A)))
    for device in ("cpu", "cuda"):  # both backends read images; a checkpoint without a tower never does
        s = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vision=None), device=device),
                            model_name="m", image_policy=URLPolicy())
        with pytest.raises(APIError, match="the model 'm' has no vision tower") as e:
            _read_images(s, msgs, (None, None))
        assert e.value.status == 400
    assert _read_images(s, [{"role": "user", "content": "text"}], (None, None)) == (
        [{"role": "user", "content": "text"}], [])


def test_text_only_server_answers_images_with_400():
    import openai

    from lily.checkpoint.tiny import tiny_checkpoint
    from lily.server import Server

    m = lily.Model.load(tiny_checkpoint(), device="cpu", max_context=256)
    with Server(m, port=0, model_name="text") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="the model 'text' has no vision tower"):
            client.chat.completions.create(model="text", messages=ask(image_part(data_url(A))), max_tokens=1)
        assert client.chat.completions.create(model="text", messages=USER_TEXT, max_tokens=1).choices


USER_TEXT = [{"role": "user", "content": "Hi"}]


def test_http_fetch_when_allowed_with_limits(tmp_path):
    import functools
    import http.server
    import threading

    from lily.multimodal import URLPolicy, read_url

    (tmp_path / "a.png").write_bytes(png(A))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}/a.png"
    try:
        with pytest.raises(ImageError, match="--allow-image-urls"):
            read_url(url, URLPolicy())
        assert read_url(url, URLPolicy(allow_http=True)) == png(A)
        with pytest.raises(ImageError, match="more than 100 bytes"):
            read_url(url, URLPolicy(allow_http=True, max_bytes=100))
        with pytest.raises(ImageError, match="cannot fetch"):
            read_url(url + ".missing", URLPolicy(allow_http=True))
        with pytest.raises(ImageError, match="more than 100 bytes"):
            read_url(data_url(A), URLPolicy(max_bytes=100))
    finally:
        httpd.shutdown()


def test_http_fetch_time_limit_holds_against_a_trickle():
    import http.server
    import threading
    import time

    from lily.multimodal import URLPolicy, read_url

    class Trickle(http.server.BaseHTTPRequestHandler):  # 1000 bytes, one every 50 ms: 50 s in all
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ImageError, match="took more than 0.5 s"):
            read_url(f"http://127.0.0.1:{httpd.server_port}/a.png", URLPolicy(allow_http=True, timeout=0.5))
        assert time.monotonic() - t0 < 5  # each read returns what arrived; before, one read waited for 64 KiB
    finally:
        httpd.shutdown()


def test_file_urls_need_an_allowed_dir(tmp_path):
    from lily.multimodal import PYTHON_API_POLICY, URLPolicy, extract_images, read_url

    (tmp_path / "a.png").write_bytes(png(A))
    url = (tmp_path / "a.png").as_uri()
    for policy in (URLPolicy(), URLPolicy(allow_http=True)):  # the server's default, and with http allowed
        with pytest.raises(ImageError, match="local image files are refused .*--allow-image-dir"):
            read_url(url, policy)
        with pytest.raises(ImageError, match="local image files are refused"):  # a plain path in an image part
            extract_images([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")}]}],
                           policy)
    assert read_url(url, URLPolicy(allowed_dir=tmp_path)) == png(A)
    with pytest.raises(ImageError, match="outside the allowed image directory"):
        read_url((tmp_path / ".." / "x.png").as_uri(), URLPolicy(allowed_dir=tmp_path))
    with pytest.raises(ImageError, match="must name a local file"):
        read_url("file://example.com/a.png", URLPolicy(allowed_dir=tmp_path))
    assert read_url(url, PYTHON_API_POLICY) == png(A)  # the Python API's caller reads what they like


def test_serve_image_flags(tmp_path):
    import argparse

    from lily.server.cli import image_policy

    def flags(**kw):
        return argparse.Namespace(**{"allow_image_urls": False, "allow_image_dir": None, "image_max_mib": 20.0,
                                     "image_fetch_timeout": 10.0, **kw})

    assert image_policy(flags()).allow_http is False and image_policy(flags()).allowed_dir is None
    p = image_policy(flags(allow_image_urls=True, allow_image_dir=tmp_path, image_max_mib=0.5, image_fetch_timeout=2))
    assert (p.allow_http, p.allowed_dir, p.max_bytes, p.timeout) == (True, tmp_path, 1 << 19, 2)
    with pytest.raises(LilyError, match="not a directory"):
        image_policy(flags(allow_image_dir=tmp_path / "missing"))
    with pytest.raises(LilyError, match="must be positive"):
        image_policy(flags(image_max_mib=0))


def test_serve_image_pixel_flags(model):
    import argparse

    from lily.checkpoint.tiny import tiny_checkpoint
    from lily.server.cli import image_pixels

    def flags(lo=None, hi=None):
        return argparse.Namespace(image_min_pixels=lo, image_max_pixels=hi)

    assert image_pixels(flags(), model) == (None, None)
    assert image_pixels(flags(hi=4096), model) == (None, 4096)
    with pytest.raises(LilyError, match="exceeds max_pixels"):
        image_pixels(flags(lo=8192, hi=4096), model)
    with pytest.raises(LilyError, match="must be a positive integer"):
        image_pixels(flags(hi=-1), model)
    with pytest.raises(LilyError, match="has no vision tower"):
        image_pixels(flags(hi=4096), lily.Model.load(tiny_checkpoint(), device="cpu", max_context=64))
