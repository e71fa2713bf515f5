"""Prefix snapshots of session state, kept for reuse across requests: an LRU under a byte budget.

The recurrent state of a Gated DeltaNet layer cannot be rolled back, so a request whose prompt
diverges from what the session holds can only resume from a saved copy of the state taken at a
prefix of its prompt. The server keeps such copies (``lily.Snapshot``, keyed by the token ids they
hold) at message boundaries; a request restores the longest one that is a prefix of its prompt.
Where the boundaries are is decided in ``prompt.py``.

A lookup costs one pass over the prompt plus one step per entry, not a comparison of the prompt
with every entry: each entry keeps a hash of its tokens, and the prompt's prefix hashes (all of
them, one numpy pass) pick the candidates; only the longest matching one is compared in full, as
arrays (each entry keeps its tokens as one, made when it is added): no Python object per token is
touched on a request's way to the engine.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol, Sequence

import numpy as np

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: every power is a distinct odd number mod 2^64
_powers = np.ones(1, dtype=np.uint64)


def prefix_hashes(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """[len(ids) + 1] uint64: element n is a polynomial hash of ``ids[:n]`` (sum of (id + 1) * M^j,
    mod 2^64), so equal prefixes have equal hashes (unequal ones rarely do)."""
    global _powers
    n, powers = len(ids), _powers
    if len(powers) < n:  # M^0 .. M^(n-1), grown by doubling and kept
        p = np.full(max(n, 2 * len(powers)), _MULTIPLIER, dtype=np.uint64)
        p[0] = 1
        _powers = powers = np.cumprod(p, out=p)  # wraps mod 2^64, as meant
    out = np.zeros(n + 1, dtype=np.uint64)
    if n:
        terms = np.asarray(ids).astype(np.uint64) + np.uint64(1)  # ids >= 0: the same value for any int dtype
        np.cumsum(terms * powers[:n], out=out[1:])
    return out


class SnapshotLike(Protocol):
    tokens: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...


class PrefixCache:
    """Snapshots keyed by their token prefix, least recently used dropped first, so that the total
    ``nbytes`` stays within ``budget_bytes`` (and the count within ``max_entries``). A snapshot larger
    than the whole budget is not kept; ``budget_bytes=0`` keeps nothing."""

    def __init__(self, budget_bytes: int, max_entries: int = 256):
        if budget_bytes < 0 or max_entries < 0:
            raise ValueError("budget_bytes and max_entries must be >= 0")
        self.budget_bytes, self.max_entries = int(budget_bytes), int(max_entries)
        self._entries: OrderedDict[tuple[int, ...], SnapshotLike] = OrderedDict()
        self._hashes: dict[tuple[int, ...], int] = {}  # prefix_hashes(key)[-1] of each entry
        self._arrays: dict[tuple[int, ...], np.ndarray] = {}  # each entry's tokens as an integer array
        self._nbytes = 0
        self._lock = threading.Lock()  # the worker thread writes; /health reads
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    def get(self, tokens: Sequence[int] | np.ndarray) -> SnapshotLike | None:
        """The entry of exactly these tokens (not marked as used), or None. An integer array is compared
        with the entries' arrays of its length (~10 us for 7,000 ids) instead of being made a tuple and
        hashed (~75 us)."""
        with self._lock:
            if not isinstance(tokens, np.ndarray):
                return self._entries.get(tuple(tokens))
            n = len(tokens)
            for key, array in self._arrays.items():
                if len(array) == n and np.array_equal(array, tokens):
                    return self._entries[key]
            return None

    def longest_prefix(self, ids: Sequence[int], longer_than: int = 0, accept=None, *,
                       array: np.ndarray | None = None) -> SnapshotLike | None:
        """The snapshot of the longest proper prefix of ``ids`` (at least one id is left to run) with
        more than ``longer_than`` tokens and, when given, ``accept(snapshot)`` true (e.g. the same
        images behind its image tokens), marked as recently used; None when there is none.
        ``array``: the same ids as an integer array, when the caller has one (the hashes and the
        comparison use it; without it the ids are converted once)."""
        if array is None:
            array = np.asarray(ids, dtype=np.int64)
        size = len(array)
        best: tuple[int, ...] | None = None
        with self._lock:
            fits = [(len(k), h, k) for k, h in self._hashes.items() if longer_than < len(k) < size]
            if fits:
                longest = max(f[0] for f in fits)  # no hash beyond the longest candidate is needed
                hashes = prefix_hashes(array[:longest])
                for n, h, key in sorted(fits, key=lambda f: f[0], reverse=True):
                    # the hash picks, the comparison (of arrays: ~5 us for 7,000 ids, not ~0.1 ms) decides
                    if int(hashes[n]) == h and np.array_equal(array[:n], self._arrays[key]) \
                            and (accept is None or accept(self._entries[key])):
                        best = key
                        break
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(best)
            return self._entries[best]

    def add(self, snapshot: SnapshotLike) -> bool:
        """Keep ``snapshot`` (replacing one of the same tokens); returns whether it was kept."""
        key = tuple(snapshot.tokens)
        size = int(snapshot.nbytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= int(old.nbytes)
                del self._hashes[key], self._arrays[key]
            if size > self.budget_bytes or self.max_entries == 0:
                return False
            self._entries[key] = snapshot
            array = np.asarray(key, dtype=np.int64)
            if array.size and 0 <= array.min() and array.max() < 2**31:
                array = array.astype(np.int32)  # token ids: half the memory
            self._hashes[key], self._arrays[key] = int(prefix_hashes(array)[-1]), array
            self._nbytes += size
            while self._nbytes > self.budget_bytes or len(self._entries) > self.max_entries:
                dropped_key, dropped = self._entries.popitem(last=False)
                del self._hashes[dropped_key], self._arrays[dropped_key]
                self._nbytes -= int(dropped.nbytes)
                self.evictions += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hashes.clear()
            self._arrays.clear()
            self._nbytes = 0

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self._nbytes, "budget_bytes": self.budget_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
