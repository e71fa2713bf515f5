"""The server's boundary snapshots are made after the request (lily.server.worker.Deferred), off its
time to first token: the same bytes as the eager split made, reused by the next turn, never seen half
made, and the session left where the request ended. The first three failed before the change (the
snapshot was taken before the first token); the last two guard a cancelled request and a prompt that
continues the session's own tokens (no saved starting state: still split before the first token).
The ninth session's: the end-state copy skipped for a waiting job of another conversation (kept for one
that continues the session), and the engine given the prompt as one int32 array."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import lily
from lily.checkpoint.tiny import tiny_checkpoint
from lily.server.prompt import Prompt, chat_prompt
from lily.server.worker import Job, Worker

CONTEXT = 256
FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
SECOND = FIRST + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me more"}]
PARAMS = lily.SamplingParams(max_tokens=4, temperature=0.8, seed=7, logprobs=2)


@pytest.fixture(scope="module")
def model() -> lily.Model:
    return lily.Model.load(tiny_checkpoint(), device="cpu", max_context=CONTEXT)


@pytest.fixture
def worker(model):
    w = Worker(model, max_context=CONTEXT)
    yield w
    w.close()


def prompt_of(model, messages) -> Prompt:
    return chat_prompt(model.tokenizer, messages, None, {})


def finish(job: Job):
    """The job's final (kind, payload)."""
    while (item := job.next_item(60)) is not None and item[0] == "event":
        pass
    assert item is not None, "no final item"
    return item


def wait_idle(worker: Worker, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while worker.running is not None or worker.queued:
        assert time.monotonic() < end, "the worker stayed busy"
        time.sleep(0.005)


def eager_snapshot(model, ids: list[int], b: int, start=None):
    """What the old path kept at boundary ``b``: from ``start`` (None: empty), one prefill call to b."""
    s = model.new_session(CONTEXT)
    pos = 0
    if start is not None:
        s.restore(start)
        pos = len(start.tokens)
    s.prefill(ids[pos:b])
    return s.snapshot()


def same_bytes(a, b, tmp_path) -> bool:
    return a.save(tmp_path / "a.snap").read_bytes() == b.save(tmp_path / "b.snap").read_bytes()


def test_snapshot_comes_after_the_first_token_and_equals_the_eager_one(model, worker, tmp_path):
    prompt = prompt_of(model, FIRST)
    ids, b = prompt.ids, prompt.boundaries[-1]
    job = Job("a", prompt, PARAMS)
    seen = []  # at each item the worker puts: (whether the snapshot exists, the session's tokens)
    job.notify = lambda: seen.append((tuple(ids[:b]) in worker.cache, worker.session.tokens))
    end_state = {}
    put = job.put

    def put_and_record(kind, payload=None):
        if kind == "done":
            end_state.update(worker.session.state())
        put(kind, payload)

    job.put = put_and_record
    worker.submit(job)
    kind, result = finish(job)
    wait_idle(worker)
    assert kind == "done" and result.usage.cached_tokens == 0
    assert seen[0][0] is False  # not made before the first token
    kept = worker.cache.get(ids[:b])
    assert kept is not None and kept.tokens == tuple(ids[:b])
    assert same_bytes(kept, eager_snapshot(model, ids, b), tmp_path)
    # the session is back where the request ended: its own tokens stay reusable
    assert worker.session.tokens == seen[-1][1] == tuple(ids) + tuple(result.token_ids[:-1])
    state = worker.session.state()
    assert state.keys() == end_state.keys()
    assert all(np.array_equal(state[k], end_state[k]) for k in state)


def test_a_request_waiting_on_the_deferred_job_reuses_it_and_equals_a_cold_run(model, worker, tmp_path):
    first, second = prompt_of(model, FIRST), prompt_of(model, SECOND)
    b1 = first.boundaries[-1]
    assert second.ids[:b1] == first.ids[:b1] and second.boundaries[-1] > b1
    started, release = held_deferred(worker)
    a = Job("a", first, PARAMS)
    worker.submit(a)
    assert started.wait(60)
    assert finish(a)[0] == "done"  # request a is answered while its snapshot is pending
    b = Job("b", second, PARAMS)
    worker.submit(b)
    time.sleep(0.1)
    assert b.poll() is None and tuple(first.ids[:b1]) not in worker.cache  # b waits; nothing half made
    release.set()
    kind, result = finish(b)
    wait_idle(worker)
    assert kind == "done" and result.usage.cached_tokens == b1  # resumed from a's deferred snapshot
    cold = model.generate(second.ids, PARAMS)
    assert result.token_ids == cold.token_ids and result.text == cold.text
    assert [lp.logprob for lp in result.logprobs] == [lp.logprob for lp in cold.logprobs]
    # b's own boundary snapshot continues a's, as the eager path made it
    b2 = second.boundaries[-1]
    assert same_bytes(worker.cache.get(second.ids[:b2]),
                      eager_snapshot(model, second.ids, b2, worker.cache.get(first.ids[:b1])), tmp_path)


def test_a_cancelled_request_still_leaves_its_snapshot(model, worker, tmp_path):
    prompt = prompt_of(model, FIRST)
    b = prompt.boundaries[-1]
    job = Job("a", prompt, lily.SamplingParams(max_tokens=50, temperature=0))
    job.notify = lambda: job.cancel("client went away")
    worker.submit(job)
    kind, _ = finish(job)
    wait_idle(worker)
    assert kind == "cancelled"
    assert same_bytes(worker.cache.get(prompt.ids[:b]), eager_snapshot(model, prompt.ids, b), tmp_path)


def test_without_a_copy_of_the_end_state_the_boundary_is_still_kept(model, worker, tmp_path):
    prompt = prompt_of(model, FIRST)
    b = prompt.boundaries[-1]
    session, calls = worker.session, []
    snapshot = session.snapshot

    def first_fails():  # the copy of the request's end state fails; the boundary's is made
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("out of device memory (test)")
        return snapshot()

    session.snapshot = first_fails
    job = Job("a", prompt, PARAMS)
    worker.submit(job)
    kind, _ = finish(job)
    wait_idle(worker)
    del session.snapshot
    assert kind == "done" and len(calls) == 2
    assert same_bytes(worker.cache.get(prompt.ids[:b]), eager_snapshot(model, prompt.ids, b), tmp_path)
    assert session.tokens == tuple(prompt.ids[:b])  # left at the boundary, consistently
    second = prompt_of(model, SECOND)
    kind, result = finish_job(worker, Job("b", second, PARAMS))
    assert kind == "done" and result.usage.cached_tokens == b
    assert result.token_ids == model.generate(second.ids, PARAMS).token_ids


def finish_job(worker: Worker, job: Job):
    worker.submit(job)
    return finish(job)


def test_a_failed_deferred_snapshot_leaves_no_entry_and_the_session_at_its_end(model, worker):
    prompt = prompt_of(model, FIRST)
    b = prompt.boundaries[-1]
    session, calls = worker.session, []
    snapshot = session.snapshot

    def second_fails():  # the first copy is of the request's end; the second, at the boundary, fails
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("out of device memory (test)")
        return snapshot()

    session.snapshot = second_fails
    job = Job("a", prompt, PARAMS)
    worker.submit(job)
    kind, result = finish(job)
    wait_idle(worker)
    del session.snapshot
    assert kind == "done" and len(calls) == 2
    assert tuple(prompt.ids[:b]) not in worker.cache and len(worker.cache) == 0
    assert session.tokens == tuple(prompt.ids) + tuple(result.token_ids[:-1])
    again = Job("b", prompt, PARAMS)  # nothing to reuse: a cold run, the same output
    worker.submit(again)
    kind, result2 = finish(again)
    assert kind == "done" and result2.usage.cached_tokens == 0 and result2.token_ids == result.token_ids


def test_a_prompt_continuing_the_session_splits_at_its_boundary_before_generating(model, worker, tmp_path):
    a = Job("a", Prompt(list(range(5, 25))), PARAMS)  # a completion prompt: no boundaries
    worker.submit(a)
    finish(a)
    wait_idle(worker)
    held = list(worker.session.tokens)
    ids = held + list(range(30, 40))
    cut = len(held) + 4
    job = Job("b", Prompt(ids, (cut,)), PARAMS)
    seen = []
    job.notify = lambda: seen.append(tuple(ids[:cut]) in worker.cache)
    worker.submit(job)
    kind, result = finish(job)
    wait_idle(worker)
    # no saved copy of the session's state to go back to: the snapshot is made before the first token
    assert kind == "done" and result.usage.cached_tokens == len(held) and seen[0] is True
    start = eager_snapshot(model, held, len(held))
    assert same_bytes(worker.cache.get(ids[:cut]), eager_snapshot(model, ids, cut, start), tmp_path)


def test_a_long_prompt_snapshots_before_its_first_token(model, worker):
    # Past DEFER_MAX_TOKENS boundary tokens the second prefill would cost more than the one-pass saving: the
    # prompt is split and the boundary snapshot exists by the first item (the eager path), and no deferred
    # work follows the reply (the session holds the request's own tokens).
    worker.defer_max_tokens = 0
    prompt = prompt_of(model, FIRST)
    ids, b = prompt.ids, prompt.boundaries[-1]
    job = Job("long", prompt, PARAMS)
    seen = []
    job.notify = lambda: seen.append(tuple(ids[:b]) in worker.cache)
    worker.submit(job)
    kind, _ = finish(job)
    wait_idle(worker)
    assert kind == "done" and seen and seen[0]
    assert worker.session.tokens[:len(ids)] == tuple(ids)


def count_calls(monkeypatch, session, names=("snapshot", "restore")) -> dict:
    calls = {n: 0 for n in names}
    for n in names:
        real = getattr(session, n)

        def counted(*a, _real=real, _n=n, **k):
            calls[_n] += 1
            return _real(*a, **k)

        monkeypatch.setattr(session, n, counted)
    return calls


def held_deferred(worker):
    """Hold the worker's deferred work until release is set (so that a second job can queue behind it)."""
    started, release = threading.Event(), threading.Event()
    deferred = worker._snapshot_boundaries

    def held(d):
        started.set()
        assert release.wait(60)
        deferred(d)

    worker._snapshot_boundaries = held
    return started, release


def test_a_waiting_job_of_another_conversation_skips_the_end_state_copy(model, worker, tmp_path, monkeypatch):
    """The end state is copied and put back only for a prompt that may continue it: with another
    conversation already waiting (it restores or resets the session first), the deferred work makes the
    boundary snapshot alone: one copy and one restore fewer, the same snapshot, the same output."""
    first = prompt_of(model, FIRST)
    other = prompt_of(model, [{"role": "user", "content": "Something else entirely"}])
    b = first.boundaries[-1]
    started, release = held_deferred(worker)
    a = Job("a", first, PARAMS)
    worker.submit(a)
    assert started.wait(60) and finish(a)[0] == "done"
    calls = count_calls(monkeypatch, worker.session)
    c = Job("c", other, PARAMS)
    worker.submit(c)  # waits behind a's deferred work
    release.set()
    kind, result = finish(c)
    wait_idle(worker)
    assert kind == "done"
    # a's deferred work: restore/reset + one snapshot (the boundary); no copy of a's end, no restore of it.
    # c: reset (no snapshot restored) and its own deferred boundary snapshot, whose end copy is kept
    # (nothing waits behind c): snapshots = a's boundary + c's end + c's boundary, restores = c's end.
    assert calls == {"snapshot": 3, "restore": 1}
    assert same_bytes(worker.cache.get(first.ids[:b]), eager_snapshot(model, first.ids, b), tmp_path)
    cold = model.generate(other.ids, PARAMS)
    assert result.token_ids == cold.token_ids and result.text == cold.text


def test_a_waiting_job_that_continues_the_session_keeps_the_end_state(model, worker, monkeypatch):
    """A waiting prompt that continues the finished request's tokens (prompt + output) still resumes from
    them: the end state is copied and put back as before."""
    first = prompt_of(model, FIRST)
    started, release = held_deferred(worker)
    a = Job("a", first, PARAMS)
    worker.submit(a)
    assert started.wait(60)
    kind, result = finish(a)
    assert kind == "done"
    held = first.ids + result.token_ids[:-1]  # the last sampled token is not fed (the session's own tokens)
    assert worker.session.tokens == tuple(held)
    calls = count_calls(monkeypatch, worker.session)
    cont = Prompt(held + [model.tokenizer.encode(" more")[0]])
    c = Job("c", cont, PARAMS)
    worker.submit(c)
    release.set()
    kind, result_c = finish(c)
    wait_idle(worker)
    assert kind == "done" and result_c.usage.cached_tokens == len(held)  # resumed from the session's own tokens
    # a's deferred work: its end copied, reset, the boundary snapshot, its end put back; c resumes from the
    # session's own tokens and splits at no boundary of its own (a completion-style prompt has none)
    assert calls == {"snapshot": 2, "restore": 1}
    cold = model.generate(cont.ids, PARAMS)
    assert result_c.token_ids == cold.token_ids


def test_the_engine_gets_the_prompt_as_one_int32_array(model, worker, monkeypatch):
    """The worker converts the prompt's id list once (Prompt.array) and hands that array to the engine
    call and the prefix lookup; a 7,000-id list costs ~0.15 ms a conversion on the host."""
    seen = []
    real = model.generate

    def spy(prompt, *a, **k):
        seen.append(prompt)
        return real(prompt, *a, **k)

    monkeypatch.setattr(model, "generate", spy)
    prompt = prompt_of(model, FIRST)
    kind, result = finish_job(worker, Job("a", prompt, PARAMS))
    assert kind == "done" and len(seen) == 1
    assert isinstance(seen[0], np.ndarray) and seen[0].dtype == np.int32 and seen[0] is prompt.array
    assert seen[0].tolist() == prompt.ids
    monkeypatch.undo()
    assert result.token_ids == model.generate(prompt.ids, PARAMS).token_ids
