"""Sampling parameters, their validation, and the stop-string matcher.

The sampler itself runs in the core, next to the logits (``docs/sampling.md`` has the algorithm:
penalties, temperature, top_k, min_p, top_p, then a seeded inverse-CDF draw). Python decides when to
stop: stop token ids, stop strings and ``max_tokens``.
"""
from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from .errors import LilyError

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_TOP_K = 2**31 - 1  # the core's top_k is an int32
# The core computes in float32: these bounds keep every value finite and non-zero there.
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature: 0 = greedy (argmax), else logits / temperature. top_k: keep the k most likely ids
    (0 or -1 = off, as vLLM; -1 is stored as 0). top_p: keep the smallest set of most likely ids whose mass reaches top_p (1 = off).
    min_p: keep ids with p >= min_p * p_max (0 = off). presence_penalty / frequency_penalty:
    subtracted from the logit of every id generated so far (once / per occurrence).
    repetition_penalty: ids in the prompt or the output get positive logits divided and negative
    ones multiplied by it (1 = off). seed: the random stream (None: a fresh random seed per request);
    the same seed, prompt and parameters give the same tokens.
    max_tokens: the most tokens to generate (None: the model's default_max_tokens, i.e.
    generation_config.json's max_new_tokens or 32768, capped by the context).
    stop: strings that end generation; the matched string and anything after it are not returned.
    stop_token_ids: ids that end generation, in addition to the checkpoint's (generation_config's
    eos ids) unless ignore_eos. The stop token is not part of the output.
    logprobs: False/None = off; True or 0 = the chosen token's logprob; n (1..20) = also the n most
    likely alternatives. Logprobs are those of the raw model distribution (before penalties).
    skip_special_tokens: leave tokens flagged special out of the text (think and tool tags stay).
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | bool | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        # Normalise containers so that a params object is hashable and safe to share.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop) if isinstance(stop, Iterable) else stop)
        ids = self.stop_token_ids
        object.__setattr__(self, "stop_token_ids",
                           () if ids is None else tuple(ids) if isinstance(ids, Iterable) else ids)
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's and the server's "off"
            object.__setattr__(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        """Raise LilyError naming the first parameter that is out of range."""
        _real("temperature", self.temperature, lo=0.0, hi=1e6)
        _integer("top_k", self.top_k, lo=0, hi=MAX_TOP_K)
        _real("top_p", self.top_p, lo=MIN_TOP_P, hi=1.0)
        _real("min_p", self.min_p, lo=0.0, hi=1.0)
        _real("presence_penalty", self.presence_penalty, lo=-1e6, hi=1e6)
        _real("frequency_penalty", self.frequency_penalty, lo=-1e6, hi=1e6)
        _real("repetition_penalty", self.repetition_penalty, lo=MIN_REPETITION_PENALTY, hi=MAX_REPETITION_PENALTY)
        if self.seed is not None:
            _integer("seed", self.seed, lo=0, hi=MAX_SEED)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, lo=1)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise LilyError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple):
            raise LilyError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for i in self.stop_token_ids:
            _integer("stop_token_ids entry", i, lo=0)
        if self.logprobs not in (None, False, True):
            _integer("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int:
        """The core's num_logprobs: -1 (off), 0 (chosen token only) or the number of alternatives."""
        if self.logprobs is None or self.logprobs is False:
            return -1
        return 0 if self.logprobs is True else int(self.logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """These params with a concrete seed (a fresh random one when seed is None)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))

    @classmethod
    def from_generation_config(cls, config: dict, **overrides) -> "SamplingParams":
        """The checkpoint's recommended sampling (generation_config.json: do_sample, temperature,
        top_k, top_p, min_p, repetition_penalty), then ``overrides``."""
        kw = {}
        if config.get("do_sample", False):
            for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
                if config.get(name) is not None:
                    kw[name] = config[name]
        return cls(**{**kw, **overrides})


def _real(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LilyError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise LilyError(f"{name} must be {bound}" + (f" and <= {hi}" if hi is not None else "") + f", got {value!r}")
    if hi is not None and value > hi:
        raise LilyError(f"{name} must be <= {hi}, got {value!r}")


def _integer(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LilyError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise LilyError(f"{name} must be {rng}, got {value!r}")


class StopMatcher:
    """Finds stop strings in streamed text, also across token boundaries.

    ``feed(delta)`` returns ``(text, stop)``: the text that is safe to show now, and the stop string
    that ended generation (None while none has). Text that might be the start of a stop string is
    held back until the next delta decides; ``flush()`` releases it at the end. A matched stop
    string and everything after it are never returned. With several stops, the one that starts
    first wins (the longest on a tie).
    """

    __slots__ = ("stops", "_held", "_max")

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(sorted(stops, key=len, reverse=True))
        self._held = ""
        self._max = max(map(len, self.stops), default=0)

    def feed(self, delta: str) -> tuple[str, str | None]:
        text = self._held + delta
        best, best_at = None, len(text)
        for s in self.stops:
            at = text.find(s)
            if 0 <= at < best_at:
                best, best_at = s, at
        if best is not None:
            self._held = ""
            return text[:best_at], best
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        # No table of prefixes (quadratic in a stop's length): each stop's first character locates
        # the candidate suffixes, longest first, and one startswith (in C) tests each.
        tail = text[len(text) - min(len(text), self._max - 1):]
        best = 0
        for s in self.stops:
            at = tail.find(s[0], 0, len(tail) - best)
            while at >= 0:
                n = len(tail) - at
                if n < len(s) and s.startswith(tail[at:]):
                    best = n
                    break
                at = tail.find(s[0], at + 1, len(tail) - best)
        return best

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text
