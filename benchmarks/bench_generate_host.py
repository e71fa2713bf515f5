"""Host (Python) overhead per generated token of Model.generate, without the forward pass.

The session's core is replaced by a stub whose calls return at once (its samples cycle through the
ids of a multilingual text, so the detokenizer does real work), so what is timed is exactly the Python
side of a decode step: the core calls' bookkeeping (the pipelined loop's sample_launch, decode_launch
and sampled), stop ids, detokenization, stop strings, logprob conversion, events. The real core's own
binding cost is timed separately on the tiny checkpoint (``last_logprobs``, which does no model work).

    python benchmarks/bench_generate_host.py [--tokens 20000]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import lily
from lily.checkpoint.tiny import tiny_checkpoint

TEXT = ("The quick brown fox jumps over the lazy dog. 你好，世界！日本語のテキスト。 Emoji: 😀 👍🏽 🇯🇵. "
        "مرحبا بالعالم! Русский текст. def f(x):\n    return x * 2\n")


class StubCore:
    """Stands in for lily._core.Session: sampling returns the next id of a fixed cycle at once."""

    def __init__(self, ids: list[int], max_context: int):
        self.ids, self.i, self.position, self.max_context = ids, 0, 0, max_context
        self.lp = (np.arange(21, dtype=np.int32), np.full(21, -1.5, np.float32))

    def set_sampler(self, **kwargs):
        pass

    def _next(self) -> int:
        self.i += 1
        return self.ids[self.i % len(self.ids)]

    def prefill_sample(self, ids, mask=None, *images):
        self.position += len(ids)
        return self._next()

    def decode_sample(self, token=-1):
        self.position += 1
        return self._next()

    # The pipelined loop's calls (generate.py): launch a step, sample it, read the id, take a step back.
    launched = False

    def decode_launch(self, token=-1):
        self.position += 1
        self.launched = True

    def sample_launch(self, mask=None):
        self.launched = False

    def sampled(self):
        return self._next()

    def decode_discard(self):
        self.position -= 1
        self.launched = False

    def last_logprobs(self):
        return self.lp

    def reset(self):
        self.position = 0


def per_token_us(model, ids, n, **kwargs) -> float:
    session = model.new_session(max_context=n + 64)
    session._core = StubCore(ids, n + 64)
    start = time.perf_counter()
    for _ in model.generate("Hello", max_tokens=n, stream=True, session=session, ignore_eos=True, **kwargs):
        pass
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20000)
    args = p.parse_args()
    model = lily.Model.load(tiny_checkpoint(), device="cpu")
    ids = model.tokenizer.encode(TEXT)
    stub = StubCore(ids, 1 << 30)
    start = time.perf_counter()
    for _ in range(args.tokens):
        stub.decode_sample(-1)
    stub_us = (time.perf_counter() - start) / args.tokens * 1e6
    print(f"stub call itself: {stub_us:.2f} us/token (included below)")
    cases = {"stream, greedy": {}, "stream, 2 stop strings": {"stop": ["</answer>", "\n\n\n"]},
             "stream, logprobs=5": {"logprobs": 5},
             "stream, stop strings + logprobs=5": {"stop": ["</answer>", "\n\n\n"], "logprobs": 5}}
    for name, kwargs in cases.items():
        best = min(per_token_us(model, ids, args.tokens, **kwargs) for _ in range(3))
        print(f"{name:36s} {best:6.2f} us/token")
    session = model.new_session()
    model.generate("Hello", max_tokens=1, logprobs=5, session=session)
    start = time.perf_counter()
    for _ in range(args.tokens):
        session._core.last_logprobs()
    print(f"{'real core: last_logprobs() call':36s} {(time.perf_counter() - start) / args.tokens * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
