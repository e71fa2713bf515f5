"""A host model (NumPy, no GPU) of the CUDA sampler's top_k select (csrc/cuda/kernels/sample.cuh, draw, and
sample_cluster.cuh, select_fine / radix_select): the 12-bit first level counted in the argmax pass, the coarse
8-bit bin picked from the 256 sums of 16 fine bins, the fine bin among those 16, the hand-over to the candidate list
when at most SAMPLE_CANDIDATES ids are at or above the fine bin's lower edge, otherwise the 8-bit levels resumed at
bits 12-19, 4-11 and 0-7 (the last overlapping 4 bits already fixed), and rank 0's exact threshold on the list.
Checks that the kept set (before min_p / top_p) equals a direct sort's `z >= k-th largest z` on realistic and
adversarial scores, and that the candidate path is taken exactly when the kept set fits (as before the change).
`python tests/test_sample_select_model.py` prints the passes and candidate counts of the old (8-bit levels) and
new select on each case."""
from __future__ import annotations

import numpy as np
import pytest

REAL_V = 248320
CANDIDATES = 1024  # SAMPLE_CANDIDATES
FINE_BITS = 12


def score_key(z):
    """float_key(z + 0.f): order-preserving f32 -> u32, -0 counted as +0."""
    u = (z.astype(np.float32) + np.float32(0.0)).view(np.uint32)
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def key_float(k):
    k = np.uint32(k)
    u = (k & np.uint32(0x7FFFFFFF)) if k & np.uint32(0x80000000) else ~k
    return np.array([u], np.uint32).view(np.float32)[0]


def pick(hist, above, need):
    """pick_bin: the highest bin where the count from the top reaches need; returns (bin, count above it)."""
    acc = above
    for b in range(hist.size - 1, -1, -1):
        if acc + int(hist[b]) >= need:
            return b, acc
        acc += int(hist[b])
    return 0, acc - int(hist[0])  # no crossing (NaN only): the lowest bin


def radix_levels(keys, need, prefix, mask, above, shifts):
    """radix_select's 8-bit levels from a given state; returns (prefix, mask, levels run, stopped)."""
    levels = 0
    for shift in shifts:
        sel = (keys & np.uint32(mask)) == np.uint32(prefix)
        hist = np.bincount((keys[sel] >> np.uint32(shift)) & 255, minlength=256)
        b, above = pick(hist, above, need)
        prefix |= b << shift
        mask |= 255 << shift
        levels += 1
        if shift > 0 and above + int(hist[b]) <= CANDIDATES:
            return prefix, mask & 0xFFFFFFFF, levels, True
    return prefix, 0xFFFFFFFF, levels, False


def select_old(keys, k):
    """Before: 8-bit levels at shifts 24, 16, 8, 0 (each a pass)."""
    return radix_levels(keys, k, 0, 0, 0, (24, 16, 8, 0))


def select_new(keys, k):
    """After: the 12-bit level from the argmax pass's histogram (no pass of its own), then 8-bit levels at 12, 4, 0."""
    fine = np.bincount(keys >> np.uint32(32 - FINE_BITS), minlength=1 << FINE_BITS)
    coarse = fine.reshape(256, 16).sum(axis=1)  # each CTA's 8-bit histogram, summed from its fine bins
    cb, above = pick(coarse, 0, k)
    fb, above = pick(fine[16 * cb:16 * cb + 16], above, k)
    prefix, mask = (16 * cb + fb) << 20, 0xFFF00000
    at_or_above = above + int(fine[16 * cb + fb])
    if at_or_above <= CANDIDATES:
        return prefix, mask, 0, True
    return radix_levels(keys, k, prefix, mask, above, (12, 4, 0))


def kept_by_sampler(z, k, select):
    """draw(): the select, the compaction, then rank 0's exact threshold on the list (candidate path) or the full
    passes' z_min. Returns (kept mask, candidate path?, list size, passes over the logits after the argmax pass)."""
    keys = score_key(z)
    prefix, mask, levels, stopped = select(keys, k)
    if stopped:  # compact_kept: a superset of top_k's ids
        cand = (keys & np.uint32(mask)) >= np.uint32(prefix)
        n = int(cand.sum())
        assert k <= n <= CANDIDATES
        ck = np.sort(keys[cand])[::-1]  # bitonic_sort_desc
        t = key_float(ck[min(k, n) - 1])
        return cand & (z >= t), True, n, levels + 1
    t = key_float(prefix)  # exact: the k-th largest key
    z_min = np.float32(-np.inf) if np.isnan(t) else t
    kept = z >= z_min
    n = int(kept.sum())
    return kept, n <= CANDIDATES, n, levels + 1


def kept_by_sort(z, k):
    """cpu/sample.cpp step 5."""
    t = np.sort(z)[::-1][k - 1]
    return z >= t


def cases():
    """(name, scores z / T as f32) on V = 248320: realistic, then adversarial."""
    rng = np.random.default_rng(12)
    V = REAL_V
    out = []
    for std in (2.0, 3.0, 4.0, 5.7):
        z = (rng.standard_normal(V) * std - 2.0).astype(np.float32)
        z[rng.choice(V, 5, replace=False)] = z.max() + rng.uniform(1, 6, 5).astype(np.float32)
        out.append((f"gauss std {std} + 5 large", z))
    for T in (0.7, 1.0):  # tests/gpu/test_sample.py's peaked logits at temperature T
        z = (rng.standard_normal(V) - 8.0).astype(np.float32)
        head = rng.choice(V, 64, replace=False)
        z[head] = (rng.standard_normal(64) * 2.0 + 4.0).astype(np.float32)
        out.append((f"peaked / {T}", (z / np.float32(T)).astype(np.float32)))
    z = (rng.standard_normal(V) * 0.3 + 30.0).astype(np.float32)  # a narrow band far from 0: the fallback
    out.append(("narrow band 30 +- 0.3", z))
    z = (rng.standard_normal(V) * 3.0).astype(np.float32)
    z[rng.choice(V, 1000, replace=False)] = z.max() + 1.0
    out.append(("1000 tied above", z))
    z = (rng.standard_normal(V) * 3.0).astype(np.float32)
    z[rng.choice(V, 1100, replace=False)] = z.max() + 1.0
    out.append(("1100 tied above", z))
    for spread in (1, 5000, 200000):  # test_top_k_select_stops_at_any_level
        z = (rng.standard_normal(V) - 8.0).astype(np.float32)
        z[rng.choice(V, spread, replace=False)] = rng.uniform(2.0, 4.0, spread).astype(np.float32)
        out.append((f"spread {spread} in [2, 4)", z))
    out.append(("all equal", np.full(V, 1.5, np.float32)))
    out.append(("all zero, half -0", np.where(np.arange(V) % 2 == 0, np.float32(-0.0), np.float32(0.0))))
    z = (rng.standard_normal(V) * 3.0).astype(np.float32)
    z[::2] = -np.inf
    out.append(("half -inf", z.copy()))
    z[1::2][30:] = -np.inf
    out.append(("30 finite, rest -inf", z.copy()))
    out.append(("all -inf", np.full(V, -np.inf, np.float32)))
    z = (rng.standard_normal(V) * 3.0).astype(np.float32)
    z[rng.choice(V, 3, replace=False)] = np.inf
    out.append(("3 +inf", z))
    z = (rng.integers(-4, 5, V)).astype(np.float32)  # 9 values, ~27K ids each
    out.append(("integers -4..4", z))
    z = (rng.standard_normal(V) * 1e-39).astype(np.float32)  # subnormals around +-0
    out.append(("subnormal", z))
    z = (rng.standard_normal(V) * 3.0).astype(np.float32)  # ties exactly at the k-th value
    top = np.sort(z)[::-1]
    for kk in (20, 40, 100):
        z[rng.choice(np.flatnonzero(z < top[kk + 50]), 7, replace=False)] = top[kk - 1]
    out.append(("7 ties at the k-th", z))
    return out


CASES = cases()


@pytest.mark.parametrize("name,z", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("k", [1, 20, 40, 100, 2000])
def test_kept_set_equals_a_sort(name, z, k):
    want = kept_by_sort(z, k)
    new, new_cand, _, _ = kept_by_sampler(z, k, select_new)
    old, old_cand, _, _ = kept_by_sampler(z, k, select_old)
    assert (new == want).all() and (old == want).all()
    assert new_cand == old_cand == (int(want.sum()) <= CANDIDATES)  # the same path as before the change


def test_realistic_logits_stop_at_the_fine_level():
    """Model-like scores (test_sample.py's peaked logits, Gaussians with a few large ones) hand over after the
    12-bit level: the argmax pass and the compaction are the only passes."""
    for name, z in CASES[:6]:
        for k in (20, 40, 100):
            _, cand, n, passes = kept_by_sampler(z, k, select_new)
            assert cand and passes == 1 and n <= 4 * k + 64, (name, k, n, passes)


if __name__ == "__main__":
    print(f"{'case':28} {'k':>5} | {'old: passes':>11} {'list':>6} | {'new: passes':>11} {'list':>6} | kept path")
    for name, z in CASES:
        for k in (20, 40, 100):
            want = kept_by_sort(z, k)
            rows = [kept_by_sampler(z, k, s) for s in (select_old, select_new)]
            assert all((r[0] == want).all() for r in rows)
            (_, _, n0, p0), (_, c1, n1, p1) = rows
            print(f"{name:28} {k:5} | {p0:11} {n0:6} | {p1:11} {n1:6} | {int(want.sum()):6} "
                  f"{'candidates' if c1 else 'full passes'}")
