"""Pipelined decoding (docs/generation.md, "Pipelined decoding") on the tiny model, CPU backend.

generate.py launches the step that feeds a token before it looks at the token and takes the step
back (decode_discard) when the token ends generation. The reference is the same loop run through
SyncCore, which turns those calls into the synchronous order (a step runs only when it is sampled,
so nothing is ever taken back): tokens, text, logprobs, finish reasons and the session's state after
the request must be identical, bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

import lily
from lily import LilyError
from lily.checkpoint.tiny import tiny_checkpoint
from checks import nan_norm_checkpoint
from pipeline_cases import PROMPT, assert_same_result, assert_same_session, both, pair


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.Model.load(tiny_checkpoint(), device="cpu", max_context=256)


@pytest.fixture(scope="module")
def greedy(model) -> list[int]:
    return model.generate(PROMPT, max_tokens=12, session=model.new_session()).token_ids


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=12),                                                  # greedy, ends at max_tokens
    dict(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7),   # seeded sampling
    dict(max_tokens=9, temperature=1.2, seed=3, logprobs=4, repetition_penalty=1.3, presence_penalty=0.5),
    dict(max_tokens=1),                                                   # nothing launched ahead
])
def test_pipelined_equals_synchronous(model, kwargs):
    r, _, _ = both(model, **kwargs)
    assert r.finish_reason == "length" and len(r.token_ids) == kwargs["max_tokens"]


def test_stop_token_id_discards_the_step_ahead(model, greedy):
    stop = greedy[4]
    r, piped, _ = both(model, max_tokens=12, stop_token_ids=[stop])
    first = greedy.index(stop)
    assert r.finish_reason == "stop" and r.stop_reason == stop and r.token_ids == greedy[:first]
    # Every returned token was fed (the stop token was sampled after the last one); both() then
    # prefilled two more.
    assert piped.tokens[3:] == tuple(greedy[:first]) + (11, 1814)


def test_stop_string_discards_the_step_ahead(model):
    text = model.generate(PROMPT, max_tokens=12, session=model.new_session()).text
    stop = text[len(text) // 2:][:2]
    assert stop.strip()
    r, _, _ = both(model, max_tokens=12, stop=[stop])
    assert r.finish_reason == "stop" and r.stop_reason == stop and len(r.token_ids) < 12


def test_context_end(model):
    r, piped, _ = both(model, max_context=7, max_tokens=None)
    # 3 prompt tokens; four fit in the context, the fifth is sampled but not fed.
    assert r.finish_reason == "length" and len(r.token_ids) == 5 and piped.position == 7


def test_grammar_constraint(model):
    for kwargs in (dict(choice=["alpha", "beta gamma", "delta"], seed=1),
                   dict(regex=r"[0-9]{3}-[a-z]{2}", temperature=1.0, seed=5),
                   dict(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/\n', temperature=1.0, seed=4)):
        r, _, _ = both(model, "Text:", max_tokens=16, logprobs=2, **kwargs)
        assert r.finish_reason in ("stop", "length")


def test_closed_stream_discards_the_step_ahead(model, greedy):
    for n in (1, 2, 5):
        piped, sync = pair(model)
        for s in (piped, sync):
            stream = model.generate(PROMPT, max_tokens=12, stream=True, session=s)
            events = [next(stream) for _ in range(n)]
            assert [e.token_id for e in events] == greedy[:n]
            stream.close()
            assert stream.result().finish_reason == "cancelled" and stream.result().token_ids == greedy[:n]
        assert_same_session(piped, sync)


def test_multi_turn_reuse_stays_exact(model):
    piped, sync = pair(model)
    messages = [{"role": "user", "content": "Hi"}]
    for turn in range(3):
        r = model.chat(messages, max_tokens=6, temperature=0.8, seed=turn, session=piped)
        q = model.chat(messages, max_tokens=6, temperature=0.8, seed=turn, session=sync)
        assert_same_result(r, q)
        assert r.usage.cached_tokens == q.usage.cached_tokens
        assert [s.tokens for s in piped.prefix_snapshots] == [s.tokens for s in sync.prefix_snapshots]
        messages += [r.message, {"role": "user", "content": f"Again {turn}"}]
    # The next turn on a fresh session computes what the reused one did.
    fresh = model.chat(messages, max_tokens=6, temperature=0.8, seed=9, session=model.new_session())
    assert model.chat(messages, max_tokens=6, temperature=0.8, seed=9, session=piped).token_ids == fresh.token_ids


def test_busy_rules_while_a_step_runs_ahead(model, greedy):
    s = model.new_session()
    stream = model.generate(PROMPT, max_tokens=8, stream=True, session=s)
    assert next(stream).token_id == greedy[0]
    assert s._core.launched  # the step feeding greedy[0] runs ahead
    for call in (s.snapshot, s.reset, lambda: s.restore(None), lambda: s.prefill([1])):
        with pytest.raises(LilyError, match="busy"):
            call()
    stream.close()
    assert not s._core.launched and s.position == 3  # the prompt; greedy[0] sampled, not fed
    assert model.generate(PROMPT, max_tokens=2, session=s).token_ids == greedy[:2]


# --- the core's primitives ----------------------------------------------------------------------------

def test_discard_then_the_same_step_again(model):
    ids = model.tokenizer.encode(PROMPT)
    a, b = model.new_session(), model.new_session()
    a.prefill(ids)
    b.prefill(ids)
    before, copy = a.state(), a._core.state_copy
    a._core.decode_launch(77)
    assert a._core.launched and a.position == 4 and a._core.state_copy != copy
    a._core.decode_discard()
    assert not a._core.launched and a.position == 3 and a._core.state_copy == copy
    after = a.state()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    np.testing.assert_array_equal(a._core.decode_step(77), b._core.decode_step(77))
    with pytest.raises(LilyError, match="decode_discard needs a launched step"):
        a._core.decode_discard()


def test_discard_gives_the_sampled_token_back(model):
    ids = np.asarray(model.tokenizer.encode(PROMPT), np.int32)
    kw = dict(temperature=1.0, top_p=0.9, seed=11, prompt_ids=ids)
    a, b = model.new_session()._core, model.new_session()._core
    a.set_sampler(**kw)
    b.set_sampler(**kw)
    assert a.prefill_sample(ids) == b.prefill_sample(ids)
    a.decode_launch(-1)
    a.decode_discard()  # has_token again: the sampled id can still be fed, and the sampler did not move
    seq_a = [a.decode_sample(-1) for _ in range(4)]
    seq_b = [b.decode_sample(-1) for _ in range(4)]
    assert seq_a == seq_b


def test_pipelined_primitives_equal_decode_sample(model):
    ids = np.asarray(model.tokenizer.encode(PROMPT), np.int32)
    kw = dict(temperature=0.7, seed=2, num_logprobs=3, prompt_ids=ids)
    a, b = model.new_session()._core, model.new_session()._core
    a.set_sampler(**kw)
    b.set_sampler(**kw)
    toks_a, toks_b = [a.prefill_sample(ids)], [b.prefill_sample(ids)]
    a.decode_launch(-1)
    for _ in range(6):
        a.sample_launch()
        a.decode_launch(-1)  # before the id is known
        toks_a.append(a.sampled())
        toks_b.append(b.decode_sample(-1))
        for x, y in zip(a.last_logprobs(), b.last_logprobs()):
            np.testing.assert_array_equal(x, y)
    assert toks_a == toks_b
    a.decode_discard()
    assert a.position == b.position
    with pytest.raises(LilyError, match="sampled\\(\\) needs a sample_launch first"):
        a.sampled()
    with pytest.raises(LilyError, match="sample_next needs a decode_launch first"):
        a.sample_launch()


def test_nan_sample_with_a_step_launched_on_it(tmp_path):
    """A NaN sample raises from the step launched on its id (the CPU knows the id at once), leaving the
    session after the step that was sampled."""
    ckpt = nan_norm_checkpoint(tmp_path / "nan")
    with lily.Model.load(ckpt, device="cpu", max_context=64, check_weights=False) as m:
        core = m.new_session()._core
        core.set_sampler()
        core.prefill(np.array([1, 2, 3], np.int32))
        core.decode_launch(5)
        core.sample_launch()
        with pytest.raises(LilyError, match="logits contain NaN"):
            core.decode_launch(-1)
        assert core.position == 4 and not core.launched
        with pytest.raises(LilyError, match="needs a sampled token"):
            core.decode_launch(-1)
