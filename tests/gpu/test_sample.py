"""The CUDA sampler against the CPU reference sampler (docs/sampling.md): greedy bit-equal, seeded
draws equal wherever no decision lies within rounding of a boundary, logprobs to 1e-5."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops
REAL_V = 248320
MARGIN = 1e-4  # relative distance from a boundary below which CPU and GPU may legitimately differ


def run(device, logits, counts, seen, step=0, **params):
    return ops.sample(device, logits, counts.copy(), seen.copy(), step, **params)


def peaked(rng, V):
    """Logits shaped like a language model's: a head of up to 64 likely ids over a long flat tail."""
    logits = (rng.standard_normal(V) - 8.0).astype(np.float32)
    head = rng.choice(V, min(64, V), replace=False)
    logits[head] = (rng.standard_normal(head.size) * 2.0 + 4.0).astype(np.float32)
    return logits


def inputs(rng, V, penalised=False, scale=3.0):
    logits = (rng.standard_normal(V) * scale).astype(np.float32)
    counts = rng.integers(0, 3, V).astype(np.int32) if penalised else np.zeros(V, np.int32)
    seen = rng.integers(0, 2, V).astype(np.int32) if penalised else np.zeros(V, np.int32)
    return logits, counts, seen


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


def uniform01(seed, step):
    mask = (1 << 64) - 1
    x = (seed + (step + 1) * 0x9E3779B97F4A7C15) & mask
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return (x >> 40) / float(1 << 24)


def boundary_margin(logits, counts, seen, step, temperature, top_k=0, top_p=1.0, min_p=0.0, seed=0,
                    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, **_):
    """The canonical algorithm in float64: how far (relative to the rounding the f32 sums may carry)
    the min_p threshold, the top_p crossing and the inverse-CDF target lie from a decision boundary.
    Below 1, CPU and GPU may legitimately choose differently."""
    z = logits.astype(np.float64)
    if repetition_penalty != 1.0:
        z = np.where(seen > 0, np.where(z > 0, z / repetition_penalty, z * repetition_penalty), z)
    z = z - (presence_penalty * (counts > 0) + frequency_penalty * counts)
    z = z / temperature
    keep = np.ones(z.size, bool)
    if 0 < top_k < z.size:
        keep = z >= np.sort(z)[::-1][top_k - 1]
    e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    # An f32 sum errs by at most min(half an ulp of the total, the term) per added term, on each side.
    def rounding(kept):
        x = e[kept] / e[kept].sum()
        return MARGIN + 2 * np.minimum(6e-8, x).sum()

    margins = [np.inf]
    if min_p > 0:  # e itself differs by an ulp or two (expf)
        margins.append(np.abs(e[keep] - min_p).min() / (1e-5 * min_p))
        keep &= e >= min_p
    if top_p < 1:
        desc = np.sort(e[keep])[::-1]
        cum = np.cumsum(desc)
        i = int(np.searchsorted(cum, top_p * cum[-1]))
        near = [cum[i]] + ([cum[i - 1]] if i > 0 else [])
        margins.append(np.abs(np.array(near) - top_p * cum[-1]).min() / cum[-1] / rounding(keep))
        keep &= e >= desc[i]
    cum = np.cumsum(e[keep])
    target = uniform01(seed, step) * cum[-1]
    i = int(np.searchsorted(cum, target, side="right"))
    near = [cum[min(i, cum.size - 1)]] + ([cum[i - 1]] if i > 0 else [])
    margins.append(np.abs(np.array(near) - target).min() / cum[-1] / rounding(keep))
    return min(margins)


@pytest.mark.parametrize("V", [1, 5, 99, 1000, 4097, 31041, REAL_V])
@pytest.mark.parametrize("penalised", [False, True])
def test_greedy_bit_equal(V, penalised):
    rng = np.random.default_rng(V + penalised)
    for trial in range(3):
        logits, counts, seen = inputs(rng, V, penalised)
        params = PENALTIES if penalised else {}
        cpu, gpu = run("cpu", logits, counts, seen, **params), run("cuda", logits, counts, seen, **params)
        assert gpu[0] == cpu[0], f"trial {trial}: token {gpu[0]} != {cpu[0]}"
        np.testing.assert_array_equal(gpu[1], cpu[1])
        np.testing.assert_array_equal(gpu[2], cpu[2])


def test_greedy_ties_take_the_lowest_id():
    logits = np.zeros(REAL_V, np.float32)
    logits[[200000, 70001, 3001, 248319]] = 5.0
    z = np.zeros(REAL_V, np.int32)
    assert run("cuda", logits, z, z)[0] == 3001


SAMPLING = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=0.6, top_k=20, top_p=0.95),
    dict(temperature=1.3, top_k=100),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=50, top_p=0.8, min_p=0.02, **PENALTIES),
    dict(temperature=1.0, top_p=0.5, **PENALTIES),
    dict(temperature=0.9, top_k=2000, top_p=0.9),  # more kept ids than the candidate path takes: the full passes
]


@pytest.mark.parametrize("V", [7, 1000, 40000, REAL_V])
@pytest.mark.parametrize("params", SAMPLING, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_seeded_draws_equal(V, params):
    if V > 1000 and not ({"top_k", "top_p", "min_p"} & params.keys()):
        pytest.skip("a draw over the whole vocabulary sits within f32 summation error of a boundary")
    rng = np.random.default_rng(V)
    checked, seeds = 0, range(24 if V < REAL_V else 8)
    for seed in seeds:
        _, counts, seen = inputs(rng, V, penalised=True)
        logits = peaked(rng, V)  # fresh inputs per seed
        step = seed * 7 + 3
        p = dict(params, seed=seed)
        if boundary_margin(logits, counts, seen, step, **p) < 1.0:
            continue
        checked += 1
        cpu, gpu = run("cpu", logits, counts, seen, step, **p), run("cuda", logits, counts, seen, step, **p)
        assert gpu[0] == cpu[0], f"seed {seed}: token {gpu[0]} != {cpu[0]}"
        np.testing.assert_array_equal(gpu[1], cpu[1])
        np.testing.assert_array_equal(gpu[2], cpu[2])
    assert checked >= len(seeds) // 2, f"only {checked} of {len(seeds)} seeds away from a boundary"


@pytest.mark.parametrize("ties", [1000, 1100])
def test_top_k_ties_on_both_paths(ties):
    """top_k keeps every id tied with its threshold: 1,000 tied ids go through the candidate path (at most
    SAMPLE_CANDIDATES = 1024 kept ids), 1,100 through the full passes; equal e make every sum exact, so both
    choose the CPU's token, always one of the tied ids."""
    rng = np.random.default_rng(ties)
    logits, counts, seen = inputs(rng, REAL_V)
    tied = rng.choice(REAL_V, ties, replace=False)
    logits[tied] = logits.max() + 1.0
    for seed in range(6):
        p = dict(temperature=0.8, top_k=20, top_p=0.9, seed=seed)
        cpu, gpu = run("cpu", logits, counts, seen, seed, **p), run("cuda", logits, counts, seen, seed, **p)
        assert gpu[0] == cpu[0] and gpu[0] in tied, f"seed {seed}: token {gpu[0]} (cpu {cpu[0]})"


@pytest.mark.parametrize("spread", [1, 5000, 200000])
def test_top_k_select_stops_at_any_level(spread):
    """top_k's radix select hands over to the candidate list after the first level at which the ids at or above
    its prefix fit (SAMPLE_CANDIDATES): `spread` ids share the top key bits (scores in [2, 4)), so the hand-over
    comes after a deeper level the more share it (the 12-bit first level, counted in the argmax pass: 1: 65 ids at
    or above its prefix; 5,000: 674; 200,000: more than 1,024, so the 8-bit level at bits 12-19 follows: 94
    there; tests/test_sample_select_model.py; the exact select is test_top_k_ties_on_both_paths's 1,100 ties);
    the draws equal the CPU's away from boundaries (top_p 0.93: with 20 near-equal kept e, 0.9 falls on a
    partial sum)."""
    rng = np.random.default_rng(spread)
    _, counts, seen = inputs(rng, REAL_V)
    logits = (rng.standard_normal(REAL_V) - 8.0).astype(np.float32)
    ids = rng.choice(REAL_V, spread, replace=False)
    logits[ids] = rng.uniform(2.0, 4.0, spread).astype(np.float32)
    checked = 0
    for seed in range(8):
        p = dict(temperature=1.0, top_k=20, top_p=0.93, seed=seed)
        if boundary_margin(logits, counts, seen, seed, **p) < 1.0:
            continue
        checked += 1
        cpu, gpu = run("cpu", logits, counts, seen, seed, **p), run("cuda", logits, counts, seen, seed, **p)
        assert gpu[0] == cpu[0], f"seed {seed}: token {gpu[0]} != {cpu[0]}"
    assert checked >= 4


@pytest.mark.parametrize("V", [99, REAL_V])
def test_top_k_one_is_greedy(V):
    rng = np.random.default_rng(V)
    logits, counts, seen = inputs(rng, V)
    greedy = run("cuda", logits, counts, seen)[0]
    for seed in range(5):
        assert run("cuda", logits, counts, seen, seed, temperature=1.5, top_k=1, seed=seed)[0] == greedy


@pytest.mark.parametrize("V", [3, 1000, REAL_V])
@pytest.mark.parametrize("n", [0, 5, 20])
def test_logprobs(V, n, gpu_tol):
    rng = np.random.default_rng(V * 31 + n)
    logits, counts, seen = inputs(rng, V, penalised=True)
    for params in (dict(), dict(temperature=0.9, top_p=0.9, seed=4, **PENALTIES)):
        cpu = run("cpu", logits, counts, seen, 1, num_logprobs=n, **params)
        gpu = run("cuda", logits, counts, seen, 1, num_logprobs=n, **params)
        if gpu[0] != cpu[0]:
            continue  # a boundary draw; the token comparison is the other tests' job
        np.testing.assert_array_equal(gpu[3], cpu[3])
        used = cpu[3] >= 0
        assert np.abs(gpu[4][used] - cpu[4][used]).max() <= gpu_tol["sample_logprobs"]
        assert np.isneginf(gpu[4][~used]).all()


def test_repeatable_and_never_masked():
    rng = np.random.default_rng(9)
    logits, counts, seen = inputs(rng, REAL_V)
    logits[::2] = -np.inf  # masked ids must never be drawn
    for p in (dict(temperature=1.2, top_p=0.99, seed=17), dict(temperature=1.2, top_k=5, top_p=0.99, seed=17)):
        draws = [run("cuda", logits, counts, seen, step, **p)[0] for step in range(20)]
        assert all(d % 2 == 1 for d in draws)
        assert draws == [run("cuda", logits, counts, seen, step, **p)[0] for step in range(20)]
    # top_k past the finite ids: its threshold is -inf, every id is kept (the full passes), masked ones never drawn
    logits[1::2][20:] = -np.inf
    p = dict(temperature=1.0, top_k=40, seed=3)
    assert all(run("cuda", logits, counts, seen, step, **p)[0] % 2 == 1 for step in range(10))


@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0), dict(temperature=0.6, top_k=20, top_p=0.95),
                                    dict(temperature=0.7, min_p=0.1, top_p=0.8),
                                    dict(temperature=1.0, top_k=3, num_logprobs=5)])
@pytest.mark.parametrize("where", ["one", "all"])
def test_nan_logits_choose_no_token_like_the_cpu(params, where):
    # Issue 14 row 1: both samplers write token -1 for NaN logits and leave counts/seen untouched.
    rng = np.random.default_rng(3)
    logits, counts, seen = inputs(rng, REAL_V)
    counts[:] = 1
    if where == "one":
        logits[REAL_V - 3] = np.nan
    else:
        logits[:] = np.nan
    for device in ("cpu", "cuda"):
        token, c, s, _, _ = run(device, logits, counts, seen, seed=5, **params)
        assert token == -1, device
        assert (c == counts).all() and (s == seen).all(), device
    logits[:] = -np.inf  # all -inf is still a valid (if degenerate) distribution
    assert 0 <= run("cuda", logits, counts, seen, seed=5, **params)[0] < REAL_V
