"""Pipelined decoding against the synchronous order, shared by tests/test_pipeline.py (CPU) and
tests/gpu/test_pipeline_cuda.py: SyncCore runs generate.py's pipelined calls in the order of the
one-step-at-a-time loop, and the helpers compare two sessions' results and state bit for bit."""
from __future__ import annotations

import numpy as np

PROMPT = "Hello, world"  # 3 tokens with the built-in tokenizer


class SyncCore:
    """A session core under generate.py's pipelined calls, in the synchronous loop's order: a
    decode_launch only marks the step, sample_launch runs it and samples it at once (decode_sample's
    order), decode_discard forgets the mark. Everything else goes to the real core."""

    def __init__(self, core):
        self._real = core
        self.launched = False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def decode_launch(self, token=-1):
        assert token == -1 and not self.launched
        self.launched = True

    def sample_launch(self, mask=None):
        assert self.launched
        self.launched = False
        self._real.decode_launch(-1)
        self._real.sample_launch(mask)

    def decode_discard(self):
        assert self.launched
        self.launched = False


def pair(model, max_context: int = 256):
    """Two fresh sessions: the pipelined one, and one whose core runs in the synchronous order."""
    piped, sync = model.new_session(max_context=max_context), model.new_session(max_context=max_context)
    sync._core = SyncCore(sync._core)
    return piped, sync


def assert_same_session(a, b):
    """Bit-identical state, tokens and position, and the same logits for what comes next."""
    assert a.tokens == b.tokens and a.position == b.position == len(a.tokens)
    assert not a._core.launched and not b._core.launched
    assert a._core.state_copy == b._core._real.state_copy
    sa, sb = a.state(), b.state()
    assert sa.keys() == sb.keys()
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    if a.position + 2 <= a.max_context:
        np.testing.assert_array_equal(a.prefill([11, 1814]), b.prefill([11, 1814]))


def assert_same_result(r, q):
    assert (r.token_ids, r.text, r.finish_reason, r.stop_reason) == (q.token_ids, q.text, q.finish_reason,
                                                                     q.stop_reason)
    assert r.logprobs == q.logprobs
    assert r.usage.completion_tokens == q.usage.completion_tokens


def both(model, prompt=PROMPT, max_context=256, **kwargs):
    piped, sync = pair(model, max_context)
    r = model.generate(prompt, session=piped, **kwargs)
    q = model.generate(prompt, session=sync, **kwargs)
    assert_same_result(r, q)
    assert_same_session(piped, sync)
    return r, piped, sync
