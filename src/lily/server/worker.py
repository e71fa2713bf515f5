"""The generation worker: one thread runs one request at a time on one session, from a bounded FIFO queue.

The HTTP layer parses and tokenizes a request (in a thread of the event loop's pool), then
``submit``s a ``Job``; when the queue is full, ``submit`` raises ``QueueFull`` (the server answers
429). The worker thread runs jobs in the order they were accepted and sends each job's events to the job's own queue, which the handler
turns into a response (``notify``, when set, is called from the worker thread after each item: the
HTTP layer's event loop wakes on it). A handler whose client went away calls ``job.cancel()``: a waiting job is
skipped, a running one stops at its next token, and the worker moves on. Every accepted job gets
exactly one final item (``done``, ``cancelled`` or ``error``).

Before a request runs, the session is brought to the longest prefix of its prompt that it holds
(its own tokens, when the prompt continues them) or that the prefix cache has a snapshot of; then
the rest of the prompt is prefilled in one pass and generation follows (``lily.Model.generate`` on
the session, which resumes from the session's tokens). The snapshots at the prompt's message
boundaries that the cache lacks are made after the request (``Deferred``), off its time to first
token: the worker restores the request's starting state, prefills up to each boundary exactly as an
eager split would (so the snapshots are the same bytes), keeps them, and puts the session back at
the request's end, all before it takes the next job. That prefills the boundaries' tokens twice, so
only up to ``DEFER_MAX_TOKENS`` of them are deferred (a chat turn: the one-pass saving, ~4-8 ms on
the H200, is a large part of its TTFT); a longer prompt splits at its boundaries and snapshots there
before generating, as does a request that resumed from the session's own tokens (no saved starting
state). Nothing else differs from a cold run, so the output is the same.
"""
from __future__ import annotations

import collections
import itertools
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..constraints import Constraint
from ..errors import LilyError
from ..generate import Generation, GenerationStream
from ..sampling import SamplingParams
from .cache import PrefixCache, SnapshotLike
from ..multimodal import image_spans, safe_cut, same_images, split_at
from .metrics import Metrics
from .prompt import Prompt

DEFAULT_MAX_QUEUE = 64
DEFAULT_CACHE_MIB = 4096


SHUTDOWN_REASON = "the server is shutting down"


class QueueFull(Exception):
    """The waiting queue is full; retry later."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class Job:
    """One accepted request. The handler reads ``next_item()``: ("event", GenerationEvent) per token,
    then one of ("done", Generation), ("cancelled", Generation | None), ("error", exception)."""

    def __init__(self, request_id: str, prompt: Prompt, params: SamplingParams, constraint: Constraint | None = None):
        self.id, self.prompt, self.params = request_id, prompt, params
        self.constraint = constraint  # structured output; it applies after </think> when the prompt opens one
        self.seq: int | None = None
        self.started = False  # the worker has reached the job's first engine step (mark_started)
        self.accepted = time.perf_counter()  # for the time to first token (metrics)
        self.first_token: float | None = None
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._cancel_lock = threading.Lock()
        self.cancel_reason: str | None = None  # why it was cancelled (the first cancel's reason)
        self.notify: Callable[[], None] | None = None  # called after each put (from the worker thread)

    def cancel(self, reason: str = "cancelled") -> None:
        with self._cancel_lock:
            if not self._cancel.is_set():
                self.cancel_reason = reason
                self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def mark_started(self) -> None:
        """Called by the worker just before the job's first engine step (which runs without the GIL):
        wakes the handler, which writes a stream's headers then (see app._JobResponse)."""
        self.started = True
        notify = self.notify
        if notify is not None:
            notify()

    @property
    def pending(self) -> bool:
        """Whether an item waits to be read."""
        return not self._items.empty()

    def put(self, kind: str, payload=None) -> None:
        self._items.put((kind, payload))
        notify = self.notify
        if notify is not None:
            notify()

    def poll(self):
        """The next item, or None when there is none yet (never blocks)."""
        try:
            return self._items.get_nowait()
        except queue.Empty:
            return None

    def next_item(self, timeout: float):
        """The next item, or None after ``timeout`` seconds without one."""
        try:
            return self._items.get(timeout=timeout)
        except queue.Empty:
            return None


@dataclass(frozen=True)
class Deferred:
    """Boundary snapshots to make once a request is over: from ``start`` (the cache's snapshot the
    request resumed from; None: an empty session), prefill ``ids`` from ``pos`` to each of ``cuts`` in
    turn, snapshotting at each one the cache lacks (``images`` / ``spans``: the prompt's images)."""
    start: SnapshotLike | None
    pos: int
    cuts: tuple[int, ...]
    ids: list[int]
    images: list
    spans: tuple


# The most prompt tokens (from the resumed state to the last boundary) whose boundary snapshots are made after the
# request: beyond, the second prefill would cost more GPU time than the one-pass TTFT saving (a 7,000-token
# prompt: ~200 ms against ~6 ms on the H200, docs/server.md).
DEFER_MAX_TOKENS = 512

# A generation source for tests: job -> GenerationStream, used instead of the model.
Source = Callable[[Job], GenerationStream]


class Worker:
    """Owns the model's serving session, the prefix cache, the queue and the worker thread."""

    def __init__(self, model, *, max_queue: int = DEFAULT_MAX_QUEUE, cache_bytes: int = DEFAULT_CACHE_MIB << 20,
                 max_context: int | None = None, source: Source | None = None, history: int = 4096):
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.model = model
        self.session = model.new_session(max_context)
        self.cache = PrefixCache(cache_bytes)
        self.defer_max_tokens = DEFER_MAX_TOKENS  # boundary tokens whose snapshots may wait for the reply
        self.source = source
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._submit_lock = threading.Lock()
        self._seq = itertools.count()
        self._closed = False
        self.running: Job | None = None
        # Finished jobs, oldest first: seq, id, token counts, finish reason (for /health and tests).
        self.records: collections.deque = collections.deque(maxlen=history)
        self.metrics = Metrics()  # histograms for a /metrics route (lily.server.metrics)
        # Called with one line per cancelled request (id, tokens so far, reason): the server's request
        # log (lily serve --log-requests); None: not logged.
        self.log: Callable[[str], None] | None = None
        self.totals = collections.Counter(dict.fromkeys(
            ("requests", "done", "cancelled", "error", "prompt_tokens", "cached_tokens", "completion_tokens"), 0))
        self._thread = threading.Thread(target=self._work, name="lily-worker", daemon=True)
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self.session.max_context

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        """Accept ``job`` at the back of the queue; QueueFull when it is full."""
        with self._submit_lock:  # seq order == queue order
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            job.seq = next(self._seq)  # before the put: the worker may take the job at once
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise QueueFull(f"{self.max_queue} requests are already waiting") from None

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop: waiting jobs and the running one end as cancelled; the thread exits."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            pending = []
            while True:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            running = self.running
            self._queue.put(None)
        if running is not None:
            running.cancel(SHUTDOWN_REASON)
        for job in pending:
            job.cancel(SHUTDOWN_REASON)
            self._log_cancelled(job, None)
            job.put("cancelled", None)
        self._thread.join(timeout)

    # --- the worker thread ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.running = job
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - reported to the one request; the worker goes on
                if not isinstance(e, LilyError):
                    traceback.print_exc(file=sys.stderr)
                self._recover()
                self._record(job, None, "error")
                job.put("error", e)
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        if job.cancelled:
            self._record(job, None, "cancelled")
            job.put("cancelled", None)
            return
        deferred = None
        if self.source is not None:
            stream, cached, setup = self.source(job), 0, 0.0
        else:
            stream, cached, setup, deferred = self._start(job)
        job.mark_started()
        try:
            while not job.cancelled:  # checked before every token, the first one included
                event = next(stream, None)
                if event is None:
                    break
                if job.first_token is None:
                    job.first_token = time.perf_counter()
                job.put("event", event)
        finally:
            stream.close()
        result: Generation = stream.result()
        result.usage.cached_tokens = cached
        result.usage.prefill_seconds += setup
        kind = "cancelled" if job.cancelled else "done"
        self._record(job, result, kind)
        job.put(kind, result)
        if deferred is not None:  # after the reply, before the next job
            self._snapshot_boundaries(deferred)

    def _start(self, job: Job) -> tuple[GenerationStream, int, float, Deferred | None]:
        """Resume the session for the job's prompt; the stream of the rest, the number of prompt tokens
        reused, the seconds spent here, and the boundary snapshots to make after the request (None:
        none, or made here already: a prompt continuing the session's own tokens)."""
        t0 = time.perf_counter()
        session, ids, images = self.session, job.prompt.ids, list(job.prompt.images)
        spans = tuple(image_spans(ids, images, self.model.config.image_token_id)) if images else ()
        cached, start = self._resume(ids, spans, job.prompt.array)
        cuts, pos = [], cached
        for b in job.prompt.boundaries:
            b = safe_cut(spans, b)
            if pos < b < len(ids):
                cuts.append(b)
                pos = b
        deferred = None
        if cuts and self.cache.budget_bytes and any(self._lacks(job.prompt.array[:b], spans) for b in cuts):
            if (cached == 0 or start is not None) and cuts[-1] - cached <= self.defer_max_tokens:
                deferred = Deferred(start, cached, tuple(cuts), ids, images, spans)
            else:  # a long prompt, or no saved copy of the starting state to go back to: split it now
                self._prefill_boundaries(cached, cuts, ids, images, spans)
        constraint = job.constraint.with_think(job.prompt.thinking) if job.constraint is not None else None
        # The int32 array, not the list: the engine call converts no list (docs/server.md, the host's share).
        stream = self.model.generate(job.prompt.array, job.params, stream=True, session=session,
                                     constraint=constraint, images=images or None)
        return stream, cached, time.perf_counter() - t0, deferred

    def _lacks(self, prefix: np.ndarray, spans) -> bool:
        """Whether the cache has no snapshot of ``prefix`` with the prompt's images in it."""
        kept = self.cache.get(prefix)
        return kept is None or getattr(kept, "images", ()) != tuple(s for s in spans if s[0] < len(prefix))

    def _prefill_boundaries(self, pos: int, cuts, ids: list[int], images: list, spans) -> None:
        """Prefill ``ids`` from the session's position ``pos`` to each of ``cuts`` in turn (one call
        each), keeping a snapshot at each one the cache lacks (one per token prefix: the latest images
        behind it)."""
        session = self.session
        for b in cuts:
            session.prefill(ids[pos:b], images=split_at(spans, images, pos, b))
            pos = b
            if self.cache.budget_bytes:
                kept = self.cache.get(ids[:b])
                if kept is None or getattr(kept, "images", ()) != session.image_spans:
                    self._keep_snapshot()

    def _snapshot_boundaries(self, d: Deferred) -> None:
        """Make a finished request's boundary snapshots (``d``), then put the session back where the
        request left it (its own tokens stay reusable; when that copy cannot be made, e.g. out of
        device memory, the session stays at the last boundary instead). Runs on the worker thread
        between jobs, so no request sees the session meanwhile, and the cache gets only complete
        snapshots. A failure leaves the cache without them: a later request prefills more, never
        reuses a wrong state."""
        if self._closed:
            return
        session = self.session
        end = None
        if self._next_continues(session.tokens):
            try:
                end = session.snapshot()
            except Exception as e:  # noqa: BLE001 - the boundaries matter more than the end state
                print(f"lily serve: the session's end state was not kept ({type(e).__name__}: {e})", file=sys.stderr)
        try:
            if d.start is None:
                session.reset()
            else:
                session.restore(d.start)
            self._prefill_boundaries(d.pos, d.cuts, d.ids, d.images, d.spans)
        except Exception as e:  # noqa: BLE001 - reuse is an optimisation, never a reason to fail
            print(f"lily serve: boundary snapshots failed ({type(e).__name__}: {e})", file=sys.stderr)
            if end is None:  # the session's state is unknown: the next request starts from an empty one
                self._recover()
                return
        if end is None:
            return
        try:
            session.restore(end)
        except Exception:  # noqa: BLE001 - then the next request starts from an empty session
            self._recover()

    def _next_continues(self, held: tuple[int, ...]) -> bool:
        """Whether the session's end state (its tokens ``held``) may still be resumed from: true unless
        the next job is already waiting and its prompt does not continue ``held`` (that job restores
        or resets the session first, so copying the end state and putting it back, two copies of the
        whole state, would be thrown away: docs/server.md)."""
        with self._queue.mutex:
            job = self._queue.queue[0] if self._queue.queue else None
        if job is None or job.cancelled:  # nothing waiting (or it will be skipped): keep the end state
            return True
        ids = job.prompt.ids
        return len(held) < len(ids) and tuple(ids[:len(held)]) == held

    def _keep_snapshot(self) -> None:
        """Add the session's state to the prefix cache; a failed copy (e.g. out of device memory)
        empties the cache instead of failing the request."""
        try:
            self.cache.add(self.session.snapshot())
        except Exception as e:  # noqa: BLE001 - reuse is an optimisation, never a reason to fail
            self.cache.clear()
            print(f"lily serve: prefix snapshot failed ({type(e).__name__}: {e}); cache cleared", file=sys.stderr)

    def _resume(self, ids: list[int], spans=(), array: np.ndarray | None = None) -> tuple[int, SnapshotLike | None]:
        """Bring the session to the longest reusable prefix of ``ids`` (whose images are ``spans``:
        a prefix is reused only with the same images behind its image tokens; ``array``: ids as an
        int32 array, when there is one); its length, and the cache's snapshot restored (None: the
        session's own tokens, or an empty session)."""
        session = self.session
        held = session.tokens
        own = len(held) if len(held) < len(ids) and tuple(ids[:len(held)]) == held \
            and same_images(session.image_spans, spans, len(held)) else -1
        snap = self.cache.longest_prefix(ids, longer_than=max(own, 0), array=array,
                                         accept=lambda s: same_images(getattr(s, "images", ()), spans, len(s.tokens)))
        if snap is not None:
            session.restore(snap)
            return len(snap.tokens), snap
        if own >= 0:
            return own, None
        session.reset()
        return 0, None

    def _recover(self) -> None:
        try:
            self.session._release()  # an exception inside generation leaves no stream to close
            self.session.reset()
        except Exception:  # noqa: BLE001
            pass

    def _record(self, job: Job, result: Generation | None, kind: str) -> None:
        usage = result.usage if result is not None else None
        row = {"seq": job.seq, "id": job.id, "outcome": kind, "prompt_tokens": len(job.prompt.ids),
               "cached_tokens": usage.cached_tokens if usage else 0,
               "completion_tokens": usage.completion_tokens if usage else 0,
               "finish_reason": result.finish_reason if result is not None else None}
        self.records.append(row)
        if kind == "cancelled":
            self._log_cancelled(job, result)
        self.totals["requests"] += 1
        self.totals[kind] += 1
        if result is not None:
            self.metrics.observe(None if job.first_token is None else job.first_token - job.accepted,
                                 usage.decode_tokens_per_second)
        if usage is not None:
            self.totals["prompt_tokens"] += usage.prompt_tokens
            self.totals["cached_tokens"] += usage.cached_tokens
            self.totals["completion_tokens"] += usage.completion_tokens

    def stats(self) -> dict:
        running = self.running
        return {"queued": self.queued, "max_queue": self.max_queue, "running": running is not None,
                "max_context": self.max_context, "prefix_cache": self.cache.stats(), "totals": dict(self.totals)}

    def _log_cancelled(self, job: Job, result: Generation | None) -> None:
        """The request log's line for a cancelled job: its id, the tokens generated so far, why."""
        log = self.log
        if log is None:
            return
        if result is None:
            when = "before it started"
        else:
            usage = result.usage
            when = (f"after {usage.completion_tokens} completion token{'' if usage.completion_tokens == 1 else 's'} "
                    f"(prompt {usage.prompt_tokens or len(job.prompt.ids)}, cached {usage.cached_tokens})")
        try:
            log(f"request {job.id} cancelled {when}: {job.cancel_reason or 'cancelled'}")
        except Exception:  # noqa: BLE001 - a log line never fails a request
            pass
