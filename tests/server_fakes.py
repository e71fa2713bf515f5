"""Scripted generation sources for server tests: no model runs, timings are set by the test."""
from __future__ import annotations

import time

from lily import Generation, GenerationEvent, GenerationStream


class Slow:
    """A scripted engine: ``n`` pieces, ``delay`` seconds apart."""

    def __init__(self, n=3, delay=0.0):
        self.n, self.delay = n, delay

    def __call__(self, job):
        result = Generation(text="", thinking=job.prompt.thinking)
        result.usage.prompt_tokens = len(job.prompt.ids)
        n, delay = self.n, self.delay

        def events():
            result.finish_reason = "cancelled"
            for i in range(n):
                if job.cancelled:
                    return
                time.sleep(delay)
                result.token_ids.append(i)
                result.usage.completion_tokens += 1
                yield GenerationEvent("x", i, None, "length" if i == n - 1 else None)
            result.finish_reason = "length"
            result.text = "x" * n

        return GenerationStream(events(), result)
