"""The server's deferred boundary snapshots on a CUDA session (lily.server.worker.Deferred): the
snapshot made after the request holds the same state, bit for bit, as a fresh session prefilled to
the boundary in one call (what the eager split stored); the session is back at the request's end;
the next turn resumes from the snapshot. tests/test_server_deferred.py has the CPU versions."""
from __future__ import annotations

import time

import numpy as np
import pytest

import lily
from lily.checkpoint.tiny import tiny_checkpoint
from lily.server.prompt import chat_prompt
from lily.server.worker import Job, Worker

pytestmark = pytest.mark.gpu

FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
SECOND = FIRST + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me more"}]


def run(worker: Worker, job: Job):
    worker.submit(job)
    while (item := job.next_item(120)) is not None and item[0] == "event":
        pass
    assert item is not None and item[0] == "done", item
    end = time.monotonic() + 120
    while worker.running is not None or worker.queued:  # the snapshots after the request
        assert time.monotonic() < end
        time.sleep(0.005)
    return item[1]


def states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_cuda_deferred_snapshot_equals_the_eager_one_and_is_reused():
    m = lily.Model.load(tiny_checkpoint(), device="cuda", max_context=1024)
    worker = Worker(m, max_context=1024)
    try:
        params = lily.SamplingParams(max_tokens=4, temperature=0)
        first = chat_prompt(m.tokenizer, FIRST, None, {})
        b1 = first.boundaries[-1]
        job = Job("a", first, params)
        at_end = {}
        put = job.put

        def put_and_record(kind, payload=None):
            if kind == "done":
                at_end.update(worker.session.state())
            put(kind, payload)

        job.put = put_and_record
        result = run(worker, job)
        kept = worker.cache.get(first.ids[:b1])
        assert kept is not None and result.usage.cached_tokens == 0
        eager = m.new_session(1024)
        eager.prefill(first.ids[:b1])
        check = m.new_session(1024)
        check.restore(kept)
        states_equal(check.state(), eager.state())
        states_equal(worker.session.state(), at_end)  # back where the request ended
        second = chat_prompt(m.tokenizer, SECOND, None, {})
        result2 = run(worker, Job("b", second, params))
        assert result2.usage.cached_tokens == b1 and result2.finish_reason in ("stop", "length")
        b2 = second.boundaries[-1]
        eager.prefill(second.ids[b1:b2])  # the eager path: from b1's state, one call to b2
        check.restore(worker.cache.get(second.ids[:b2]))
        states_equal(check.state(), eager.state())
    finally:
        worker.close()
