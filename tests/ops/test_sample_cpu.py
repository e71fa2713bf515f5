"""The CPU reference sampler (csrc/cpu/sample.cpp) against the properties of docs/sampling.md."""
from __future__ import annotations

import numpy as np
import pytest

import lily
from lily import _core

ops = _core.ops


def draw(logits, step=0, counts=None, seen=None, **params):
    """One draw on the CPU: (token, counts, seen, logprob ids, logprob values)."""
    V = logits.size
    counts = np.zeros(V, np.int32) if counts is None else counts
    seen = np.zeros(V, np.int32) if seen is None else seen
    return ops.sample("cpu", np.ascontiguousarray(logits, np.float32), counts, seen, step, **params)


def tokens(logits, n, **params):
    return np.array([draw(logits, step, **params)[0] for step in range(n)])


def normal_logits(rng, V, scale=2.0):
    return (rng.standard_normal(V) * scale).astype(np.float32)


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], np.float32)
    assert draw(logits)[0] == 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_top_k_one_is_greedy(temperature):
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = normal_logits(rng, 257)
        greedy = draw(logits)[0]
        assert (tokens(logits, 5, temperature=temperature, top_k=1, seed=7) == greedy).all()


def test_distribution_matches_softmax():
    rng = np.random.default_rng(2)
    logits = normal_logits(rng, 12, 1.0)
    T, n = 0.8, 30000
    got = np.bincount(tokens(logits, n, temperature=T, seed=11), minlength=12) / n
    p = np.exp((logits - logits.max()) / T)
    p /= p.sum()
    # binomial std <= 0.5/sqrt(n) = 0.0029; 5 sigma
    assert np.abs(got - p).max() < 0.015, (got, p)


def test_seeds_and_steps_reproduce_and_vary():
    logits = normal_logits(np.random.default_rng(3), 1000, 0.5)
    a, b = tokens(logits, 50, temperature=1.0, seed=5), tokens(logits, 50, temperature=1.0, seed=5)
    assert (a == b).all()
    assert len(set(a.tolist())) > 10
    assert (a != tokens(logits, 50, temperature=1.0, seed=6)).any()


def test_top_k_keeps_ties_and_nothing_else():
    logits = np.array([1.0, 2.0, 2.0, 2.0, 0.0, 1.5], np.float32)
    got = set(tokens(logits, 400, temperature=1.0, top_k=2, seed=1).tolist())
    assert got == {1, 2, 3}  # the 2nd largest value is tied three ways: all kept


def test_top_p_keeps_the_smallest_head_reaching_the_mass():
    p = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = np.log(p)
    assert set(tokens(logits, 400, temperature=1.0, top_p=0.75, seed=2).tolist()) == {1, 3}
    assert set(tokens(logits, 400, temperature=1.0, top_p=0.85, seed=2).tolist()) == {1, 2, 3}
    assert set(tokens(logits, 400, temperature=1.0, top_p=0.4, seed=2).tolist()) == {1}


def test_min_p_keeps_ids_above_a_fraction_of_the_max():
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3], np.float32))
    # p / p_max = 0.1, 1, 0.3, 0.6
    assert set(tokens(logits, 400, temperature=1.0, min_p=0.4, seed=3).tolist()) == {1, 3}
    assert set(tokens(logits, 400, temperature=1.0, min_p=0.2, seed=3).tolist()) == {1, 2, 3}


def test_filters_never_choose_excluded_ids():
    rng = np.random.default_rng(4)
    for _ in range(10):
        logits = normal_logits(rng, 500)
        order = np.argsort(-logits, kind="stable")
        allowed_k = set(order[:20].tolist())
        assert set(tokens(logits, 100, temperature=1.5, top_k=20, seed=4).tolist()) <= allowed_k
        e = np.exp(logits.astype(np.float64) - logits.max())
        allowed_min_p = set(np.nonzero(e >= 0.1 + 1e-6)[0].tolist())
        assert set(tokens(logits, 100, temperature=1.0, min_p=0.1, seed=4).tolist()) <= allowed_min_p
        cum = np.cumsum(e[order]) / e.sum()
        head = int(np.searchsorted(cum, 0.5)) + 1  # the smallest head with mass >= 0.5
        assert set(tokens(logits, 100, temperature=1.0, top_p=0.5, seed=4).tolist()) <= set(order[:head].tolist())


def test_penalties_move_the_argmax():
    logits = np.array([0.0, 0.1, 0.2, 2.0, 0.3, 1.5], np.float32)
    counts = np.zeros(6, np.int32)
    seen = np.zeros(6, np.int32)
    counts[3] = 2
    assert draw(logits, counts=counts.copy())[0] == 3
    assert draw(logits, counts=counts.copy(), presence_penalty=0.6)[0] == 5
    assert draw(logits, counts=counts.copy(), presence_penalty=0.4)[0] == 3
    assert draw(logits, counts=counts.copy(), frequency_penalty=0.3)[0] == 5   # 2 * 0.3 > 0.5
    assert draw(logits, counts=counts.copy(), frequency_penalty=0.2)[0] == 3   # 2 * 0.2 < 0.5
    seen[3] = 1
    assert draw(logits, seen=seen.copy(), repetition_penalty=1.5)[0] == 5      # 2.0 / 1.5 < 1.5
    assert draw(logits, seen=seen.copy(), repetition_penalty=1.2)[0] == 3      # 2.0 / 1.2 > 1.5
    negative = np.array([-3.0, -1.0, -1.1], np.float32)
    seen = np.array([0, 1, 0], np.int32)
    assert draw(negative, seen=seen.copy(), repetition_penalty=1.2)[0] == 2    # -1.2 < -1.1


def test_state_update():
    logits = np.array([0.0, 3.0, 1.0], np.float32)
    counts = np.array([0, 4, 1], np.int32)
    tok, c, s, _, _ = draw(logits, counts=counts)
    assert tok == 1 and c.tolist() == [0, 5, 1] and s.tolist() == [0, 1, 0]


def test_logprobs_are_log_softmax_of_raw_logits():
    rng = np.random.default_rng(5)
    logits = normal_logits(rng, 300)
    counts = rng.integers(0, 3, 300).astype(np.int32)
    tok, _, _, ids, vals = draw(logits, counts=counts, temperature=0.9, presence_penalty=1.0, seed=9, num_logprobs=5)
    l64 = logits.astype(np.float64)
    lp = l64 - (l64.max() + np.log(np.exp(l64 - l64.max()).sum()))
    assert ids[0] == tok and abs(vals[0] - lp[tok]) < 1e-5
    top = np.argsort(-logits, kind="stable")[:5]
    assert ids[1:6].tolist() == top.tolist()
    np.testing.assert_allclose(vals[1:6], lp[top], atol=1e-5)
    assert (ids[6:] == -1).all() and np.isneginf(vals[6:]).all()
    _, _, _, ids0, vals0 = draw(logits, num_logprobs=0)
    assert ids0[0] == int(np.argmax(logits)) and (ids0[1:] == -1).all()


def test_logprobs_ties_prefer_lower_id_and_small_vocab():
    logits = np.array([1.0, 2.0, 2.0, 0.5], np.float32)
    _, _, _, ids, vals = draw(logits, num_logprobs=20)
    assert ids[1:5].tolist() == [1, 2, 0, 3] and (ids[5:] == -1).all()


@pytest.mark.parametrize("params, name", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "penalt"),
    (dict(frequency_penalty=float("inf")), "penalt"),
    (dict(num_logprobs=21), "logprobs"),
    (dict(num_logprobs=-2), "logprobs"),
])
def test_invalid_params_raise_naming_the_parameter(params, name):
    with pytest.raises(lily.LilyError, match=name):
        draw(np.zeros(8, np.float32) + 1.0, **params)


NAN_CASES = [dict(), dict(temperature=1.0), dict(temperature=0.6, top_k=20, top_p=0.95),
             dict(temperature=0.7, min_p=0.1, top_p=0.8), dict(temperature=1.0, top_k=3, num_logprobs=5),
             dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, top_p=0.9)]


@pytest.mark.parametrize("params", NAN_CASES)
@pytest.mark.parametrize("where", ["one", "all"])
def test_nan_logits_choose_no_token_and_leave_the_state(params, where):
    # Issue 14 row 1: NaN logits with top_k/min_p and top_p < 1 read past an empty candidate list
    # (SIGSEGV). Now the sampler writes token -1 and leaves counts/seen untouched; the session raises.
    rng = np.random.default_rng(3)
    logits = normal_logits(rng, 4099)
    if where == "one":
        logits[17] = np.nan
    else:
        logits[:] = np.nan
    counts, seen = np.ones(4099, np.int32), np.zeros(4099, np.int32)
    token, c, s, _, _ = draw(logits, counts=counts.copy(), seen=seen.copy(), seed=5, **params)
    assert token == -1
    assert (c == counts).all() and (s == seen).all()


@pytest.mark.parametrize("params", NAN_CASES)
def test_inf_logits_still_choose_a_valid_token(params):
    rng = np.random.default_rng(4)
    logits = normal_logits(rng, 1031)
    logits[5] = np.inf
    logits[9] = -np.inf
    token = draw(logits, seed=1, **params)[0]
    assert token == 5
    logits[:] = -np.inf
    assert 0 <= draw(logits, seed=1, **params)[0] < 1031
