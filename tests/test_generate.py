"""Model.generate / Model.chat on the tiny synthetic checkpoint (random weights, real tokenizer)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import lily
from lily import Generation, LilyError, SamplingParams
from lily.checkpoint.tiny import tiny_checkpoint

PROMPT = "Hello, world"  # [9419, 11, 1814]


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.Model.load(tiny_checkpoint(), device="cpu")


@pytest.fixture(scope="module")
def greedy(model) -> list[int]:
    """Eight greedy tokens after PROMPT, by argmax over the logits of prefill / decode_step."""
    s = model.new_session()
    logits, out = s.prefill(model.tokenizer.encode(PROMPT)), []
    for _ in range(8):
        out.append(int(np.argmax(logits)))
        logits = s.decode_step(out[-1])
    return out


def test_greedy_is_the_argmax_chain(model, greedy):
    r = model.generate(PROMPT, max_tokens=8, session=model.new_session())
    assert r.token_ids == greedy
    assert r.finish_reason == "length" and r.stop_reason is None
    assert r.text == model.tokenizer.decode(greedy)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (3, 8, 0)
    # Text, id lists and arrays are the same prompt.
    assert model.generate([9419, 11, 1814], max_tokens=3).token_ids == greedy[:3]
    assert model.generate(np.array([9419, 11, 1814], np.int64), max_tokens=3).token_ids == greedy[:3]


def test_stream_equals_blocking(model):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=10, logprobs=2)
    blocking = model.generate(PROMPT, params)
    stream = model.generate(PROMPT, params, stream=True)
    events = list(stream)
    assert "".join(e.text for e in events) == blocking.text
    assert [e.token_id for e in events] == blocking.token_ids
    assert [e.finish_reason for e in events] == [None] * 9 + ["length"]
    assert [e.logprobs for e in events] == blocking.logprobs
    assert stream.result().token_ids == blocking.token_ids and stream.result().text == blocking.text


# --- sampling through the model ----------------------------------------------------------------------

def uniform01(seed: int, step: int) -> float:
    m = (1 << 64) - 1
    x = (seed + (step + 1) * 0x9E3779B97F4A7C15) & m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return (x >> 40) * 2.0**-24


def reference_sample(logits, p: SamplingParams, step: int, counts: np.ndarray, seen: np.ndarray) -> int:
    """docs/sampling.md, written out in numpy."""
    z = logits.astype(np.float32).copy()
    if p.repetition_penalty != 1:
        s = seen > 0
        z[s] = np.where(z[s] > 0, z[s] / np.float32(p.repetition_penalty), z[s] * np.float32(p.repetition_penalty))
    c = counts > 0
    z[c] -= np.float32(p.frequency_penalty) * counts[c] + np.float32(p.presence_penalty)
    if p.temperature == 0:
        return int(np.argmax(z))
    z /= np.float32(p.temperature)
    keep = np.ones(z.size, bool)
    if 0 < p.top_k < z.size:
        keep = z >= np.sort(z)[-p.top_k]
    e = np.where(keep, np.exp(z - z[keep].max()), 0).astype(np.float32)
    if p.min_p > 0:
        keep &= e >= p.min_p
    if p.top_p < 1:
        vals = np.sort(e[keep])[::-1]
        mass = np.cumsum(vals)
        tau = vals[np.argmax(mass >= p.top_p * vals.sum())]
        keep &= e >= tau
    e = np.where(keep, e, 0)
    cdf = np.cumsum(e)
    hit = np.flatnonzero(cdf > uniform01(p.seed, step) * cdf[-1])
    return int(hit[0]) if hit.size else int(np.flatnonzero(keep)[-1])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05, seed=3),
    SamplingParams(temperature=2.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, seed=4),
])
def test_first_two_tokens_follow_the_reference_sampler(model, params):
    ids = model.tokenizer.encode(PROMPT)
    t0, t1 = model.generate(ids, params, max_tokens=2, session=model.new_session()).token_ids
    s = model.new_session()
    V = model.config.vocab_size
    counts, seen = np.zeros(V, np.int32), np.zeros(V, np.int32)
    seen[ids] = 1  # the prompt counts for the repetition penalty
    assert t0 == reference_sample(s.prefill(ids), params, 0, counts, seen)
    counts[t0], seen[t0] = 1, 1
    assert t1 == reference_sample(s.decode_step(t0), params, 1, counts, seen)


def test_top_k_1_is_greedy_and_seeds_reproduce(model, greedy):
    assert model.generate(PROMPT, temperature=1.5, top_k=1, seed=9, max_tokens=6).token_ids == greedy[:6]
    hot = SamplingParams(temperature=1.5, max_tokens=6)
    a = model.generate(PROMPT, hot, seed=11).token_ids
    assert model.generate(PROMPT, hot, seed=11).token_ids == a
    assert len({tuple(model.generate(PROMPT, hot, seed=s, max_tokens=2).token_ids) for s in (1, 2, 3)}) > 1


def test_logprobs_are_the_model_distribution(model, greedy):
    logits = model.new_session().prefill(model.tokenizer.encode(PROMPT)).astype(np.float64)
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    r = model.generate(PROMPT, max_tokens=2, logprobs=5)
    first = r.logprobs[0]
    assert first.token_id == greedy[0] and first.top[0][0] == greedy[0]
    # The core's log-sum-exp over 248320 logits vs float64 here (3e-4 seen with an f32 sum).
    assert abs(first.logprob - ref[greedy[0]]) < 1e-3
    assert [i for i, _ in first.top] == list(np.argsort(-ref, kind="stable")[:5])
    assert np.allclose([v for _, v in first.top], np.sort(ref)[::-1][:5], atol=1e-3)
    assert len(r.logprobs) == 2 and model.generate(PROMPT, max_tokens=1, logprobs=True).logprobs[0].top == []


# --- stopping --------------------------------------------------------------------------------------

def test_stop_token_id(model, greedy):
    s = model.new_session()
    r = model.generate(PROMPT, max_tokens=8, stop_token_ids=[greedy[3]], session=s)
    assert r.token_ids == greedy[:3] and r.finish_reason == "stop" and r.stop_reason == greedy[3]
    # The stop token was sampled but never fed.
    assert s.tokens == (9419, 11, 1814, *greedy[:3])
    assert model.stop_token_ids() == {248046, 248044}


def test_stop_string_across_token_boundaries(model, greedy):
    pieces = [model.tokenizer.decode([t]) for t in greedy]
    i = next(k for k in range(1, 7) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    before = "".join(pieces[:i + 1])[:-2]
    assert stop not in before
    r = model.generate(PROMPT, max_tokens=8, stop=["never-there", stop])
    assert r.text == before and r.finish_reason == "stop" and r.stop_reason == stop
    assert r.token_ids == greedy[:i + 2]  # up to the token that completed the stop string
    events = list(model.generate(PROMPT, max_tokens=8, stop=stop, stream=True))
    assert "".join(e.text for e in events) == before and all(stop not in e.text for e in events)
    assert events[-1].finish_reason == "stop"


def test_context_end_finishes_with_length(model, greedy):
    s = model.new_session(max_context=6)
    r = model.generate(PROMPT, session=s)
    # 3 prompt tokens; three generated ones fit in the context, the fourth is sampled but not fed.
    assert r.token_ids == greedy[:4] and r.finish_reason == "length" and s.position == 6


# --- sessions and reuse ----------------------------------------------------------------------------

def test_session_continues_and_reuses_snapshots(model, greedy):
    s = model.new_session()
    ids = model.tokenizer.encode(PROMPT)
    s.prefill(ids)
    r = model.generate(ids + greedy[:2], max_tokens=2, session=s)
    assert r.usage.cached_tokens == 3 and r.token_ids == greedy[2:4]
    # Batch: the second prompt shares 3 tokens with the first and resumes from a snapshot there.
    prompts = [ids + greedy[:2], ids + [greedy[0], 11]]
    batch = model.generate(prompts, max_tokens=3, session=s)
    fresh = [model.generate(p, max_tokens=3, session=model.new_session()) for p in prompts]
    assert [b.token_ids for b in batch] == [f.token_ids for f in fresh]
    assert batch[1].usage.cached_tokens == 4
    assert list(model.generate(prompts, max_tokens=1, stream=True))[1].token_ids == fresh[1].token_ids[:1]
    # A prompt that extends the previous one reuses all of it but the token sampled from.
    extended = model.generate([ids, ids + greedy[:1]], max_tokens=2, session=model.new_session())
    assert [r.usage.cached_tokens for r in extended] == [0, 2] and extended[1].token_ids == greedy[1:3]


def test_chat_turns_resume_from_the_message_boundary(model):
    tok, s = model.tokenizer, model.new_session()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    first = model.chat(messages, max_tokens=4, temperature=0, session=s)
    assert first.thinking and first.usage.prompt_tokens == len(tok.encode_chat(messages))
    messages += [first.message, {"role": "user", "content": "Again"}]
    second = model.chat(messages, max_tokens=4, temperature=0, session=s)
    boundary = len(tok.encode_chat(messages[:2], add_generation_prompt=False))
    assert second.usage.cached_tokens == boundary
    # Resuming gives exactly what a fresh session computes.
    assert second.token_ids == model.chat(messages, max_tokens=4, temperature=0, session=model.new_session()).token_ids
    off = model.chat(messages[:2], max_tokens=2, temperature=0, enable_thinking=False, session=s)
    assert not off.thinking and off.content == off.text and "reasoning_content" not in off.message


def test_reasoning_split():
    g = Generation(text="plan\n</think>\n\nanswer", thinking=True)
    assert (g.reasoning, g.content) == ("plan", "answer")
    assert g.message == {"role": "assistant", "content": "answer", "reasoning_content": "plan"}
    assert Generation(text="still thinking", thinking=True).content == ""


def test_busy_session_and_cancel(model, greedy):
    s = model.new_session()
    stream = model.generate(PROMPT, max_tokens=8, session=s, stream=True)
    assert next(stream).token_id == greedy[0]
    with pytest.raises(LilyError, match="busy"):
        model.generate(PROMPT, max_tokens=1, session=s)
    with pytest.raises(LilyError, match="busy"):
        s.prefill([1])
    stream.close()
    assert stream.result().finish_reason == "cancelled" and stream.result().token_ids == greedy[:1]
    assert model.generate(PROMPT, max_tokens=1, session=s).token_ids == greedy[:1]


def test_sessions_in_threads(model, greedy):
    prompts = [PROMPT, "Another conversation"]
    expected = [model.generate(p, max_tokens=4, session=model.new_session()).token_ids for p in prompts]
    got = [None, None]

    def work(i):
        got[i] = model.generate(prompts[i], max_tokens=4, session=model.new_session()).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


# --- errors and reprs ------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda m: m.generate(PROMPT, max_tokens=0), "max_tokens"),
    (lambda m: m.generate(PROMPT, temprature=0.5), "unknown generation argument.*temprature"),
    (lambda m: m.generate(PROMPT, params={"temperature": 1})[0], "lily.SamplingParams"),
    (lambda m: m.generate(""), "prompt is empty"),
    (lambda m: m.generate([1, 248320]), "outside the vocabulary"),
    (lambda m: m.generate(3.5), "prompt must be"),
    (lambda m: m.generate(PROMPT, session=m.new_session(max_context=3)), "max_context is 3"),
    (lambda m: m.generate(PROMPT, session="default"), "session must be a Session"),
    (lambda m: m.generate([PROMPT, PROMPT], session=m.new_session(max_context=3)), "max_context"),
    (lambda m: m.chat("hi"), "list of messages"),
])
def test_bad_requests_are_clear_errors(model, call, match):
    with pytest.raises(LilyError, match=match):
        call(model)


def test_reprs(model):
    r = model.generate(PROMPT, max_tokens=2)
    assert repr(r).startswith("Generation(text=") and "finish_reason='length'" in repr(r)
    assert "prompt=3" in repr(r.usage) and "tok/s" in repr(r.usage)
    stream = model.generate(PROMPT, max_tokens=1, stream=True, session=model.new_session())
    assert "running" in repr(stream)
    stream.result()
    assert "done" in repr(stream)
    assert repr(model.session).startswith("Session(position=") and "MiB" in repr(model.session.snapshot())
