"""Chat about images (on CUDA when lily has it, else the CPU): image parts in the messages, a follow-up
turn that reuses the image's prefix, and the same request through `lily serve` with a data: URL (docs/vision.md).

    python examples/vision.py [CHECKPOINT] [IMAGE]   # default: a tiny random model with a vision tower
"""
import base64
import io
import sys
import tempfile

import numpy as np

import lily
from lily.checkpoint import synthetic

if len(sys.argv) > 1:
    path = sys.argv[1]
else:  # random weights: the text is gibberish, but every step runs
    path = synthetic.make_checkpoint(tempfile.mkdtemp(), "tiny", layout="hf", vision=True)
if len(sys.argv) > 2:
    image = sys.argv[2]                                  # a path; bytes, PIL images and arrays work too
else:
    y, x = np.mgrid[0:96, 0:128]
    image = np.stack([x * 2, y * 2, np.full_like(x, 128)], axis=-1).astype(np.uint8)  # a colour gradient

model = lily.Model.load(path)                           # "auto": CUDA when available, else the CPU
chat = model.new_session()
params = model.default_sampling(max_tokens=256 if len(sys.argv) > 1 else 16)

messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "What is in this picture?"}]}]
r = chat.chat(messages, params, enable_thinking=False)
print("answer:", repr(r.content), "\n", r.usage)

messages += [r.message, {"role": "user", "content": "Describe its colours."}]
stream = chat.chat(messages, params, stream=True, enable_thinking=False)
for event in stream:
    print(event.text, end="", flush=True)
r = stream.result()
print("\n", r.usage, f"(reused {r.usage.cached_tokens} of {r.usage.prompt_tokens} prompt tokens: the image is not "
      f"encoded again)")

# The server takes OpenAI image_url parts with data: URLs (base64).
from pathlib import Path  # noqa: E402

from openai import OpenAI  # noqa: E402
from PIL import Image  # noqa: E402

from lily.server import Server  # noqa: E402

if isinstance(image, str):
    data = Path(image).read_bytes()
else:
    Image.fromarray(image).save(buf := io.BytesIO(), format="PNG")
    data = buf.getvalue()
url = "data:image/png;base64," + base64.b64encode(data).decode()
with Server(model, port=0) as server:
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model=server.model_name, max_tokens=params.max_tokens,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "What is in this picture?"}]}])
    print("server:", repr(reply.choices[0].message.content))
