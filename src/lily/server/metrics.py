"""Server counters and histograms in the Prometheus text format, for a ``/metrics`` endpoint.

The worker thread calls ``Metrics.observe`` once per finished request (``worker.Worker._record``);
``render(engine)`` writes the exposition text: requests by outcome, prompt / cached / completion
tokens, the queue, and histograms of the time to first token (from acceptance to the first
generated token, queueing included) and of the decode speed. The HTTP route itself belongs to
``app.py`` (not wired yet: the transport is being moved to uvicorn/Starlette).
"""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 150, 200, 300, 500, 1000)


class Histogram:
    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds):
        self.bounds, self.counts, self.total, self.count = tuple(bounds), [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Totals and histograms of finished requests (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tps = Histogram(TPS_BUCKETS)

    def observe(self, ttft: float | None, tokens_per_second: float | None) -> None:
        with self._lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            if tokens_per_second:
                self.tps.observe(tokens_per_second)

    def render(self, engine) -> str:
        """The Prometheus text exposition (format 0.0.4) of ``engine``'s state and these histograms."""
        totals = dict(engine.totals)
        lines = ["# HELP lily_requests_total Finished requests by outcome.", "# TYPE lily_requests_total counter"]
        lines += [f'lily_requests_total{{outcome="{k}"}} {totals.get(k, 0)}' for k in ("done", "cancelled", "error")]
        for kind in ("prompt", "cached", "completion"):
            name = f"lily_{kind}_tokens_total"
            lines += [f"# TYPE {name} counter", f"{name} {totals.get(kind + '_tokens', 0)}"]
        lines += ["# HELP lily_queue_waiting Requests waiting for the engine.", "# TYPE lily_queue_waiting gauge",
                  f"lily_queue_waiting {engine.queued}", "# TYPE lily_queue_running gauge",
                  f"lily_queue_running {int(engine.running is not None)}"]
        with self._lock:
            lines += ["# HELP lily_time_to_first_token_seconds From acceptance to the first generated token.",
                      "# TYPE lily_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("lily_time_to_first_token_seconds")
            lines += ["# HELP lily_decode_tokens_per_second Decode speed of each request.",
                      "# TYPE lily_decode_tokens_per_second histogram"]
            lines += self.tps.lines("lily_decode_tokens_per_second")
        return "\n".join(lines) + "\n"
