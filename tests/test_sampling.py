"""SamplingParams validation, the stop-string matcher, and what each sampling parameter does to the
distribution the core draws from (on small logits, thousands of seeded draws)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from lily import LilyError, SamplingParams
from lily import _core
from lily.sampling import StopMatcher

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], dtype=np.float32)  # V = 6
DRAWS = 4000


def draw(params: SamplingParams, logits=LOGITS, counts=None, seen=None) -> np.ndarray:
    """Empirical distribution of the core sampler's first draw over DRAWS seeds."""
    V = logits.size
    counts = np.zeros(V, np.int32) if counts is None else counts
    seen = np.zeros(V, np.int32) if seen is None else seen
    hist = np.zeros(V)
    for seed in range(DRAWS):
        tok = _core.ops.sample("cpu", logits, counts, seen, 0, params.temperature, params.top_k, params.top_p,
                               params.min_p, params.presence_penalty, params.frequency_penalty,
                               params.repetition_penalty, seed, -1)[0]
        hist[tok] += 1
    return hist / DRAWS


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def assert_close(freq, p):
    # 4000 draws: the standard error of a frequency is <= 0.008; 0.035 is > 4 sigma.
    assert np.abs(freq - p).max() < 0.035, (freq.round(3), np.round(p, 3))


def test_temperature_scales_the_softmax():
    assert_close(draw(SamplingParams(temperature=1.0)), softmax(LOGITS))
    assert_close(draw(SamplingParams(temperature=0.5)), softmax(LOGITS / 0.5))
    assert_close(draw(SamplingParams(temperature=3.0)), softmax(LOGITS / 3.0))


def test_greedy_and_its_limits():
    greedy = np.eye(6)[0]
    assert (draw(SamplingParams(temperature=0.0)) == greedy).all()
    assert (draw(SamplingParams(temperature=1.0, top_k=1)) == greedy).all()
    assert (draw(SamplingParams(temperature=1.0, min_p=1.0)) == greedy).all()
    assert (draw(SamplingParams(temperature=1.0, top_p=1e-6)) == greedy).all()


def test_top_k_keeps_the_k_most_likely():
    p = softmax(LOGITS)
    p[[2, 3, 4]] = 0  # the three least likely of six
    assert_close(draw(SamplingParams(temperature=1.0, top_k=3)), p / p.sum())


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    p = softmax(LOGITS)  # sorted: id 0 (0.42), 5 (0.25), 1 (0.15), 2 (0.09), ...
    keep = np.zeros(6, bool)
    keep[[0, 5, 1]] = True  # 0.42 + 0.25 < 0.7 <= 0.42 + 0.25 + 0.15
    q = np.where(keep, p, 0)
    assert_close(draw(SamplingParams(temperature=1.0, top_p=0.7)), q / q.sum())


def test_min_p_drops_unlikely_ids():
    p = softmax(LOGITS)
    q = np.where(p >= 0.3 * p.max(), p, 0)
    assert (q > 0).sum() == 3  # ids 0, 5, 1
    assert_close(draw(SamplingParams(temperature=1.0, min_p=0.3)), q / q.sum())


def test_presence_and_frequency_penalties_lower_generated_ids():
    counts = np.array([2, 0, 0, 0, 0, 1], np.int32)
    z = LOGITS - 0.5 * (counts > 0) - 0.25 * counts
    got = draw(SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25), counts=counts)
    assert_close(got, softmax(z))
    assert draw(SamplingParams(presence_penalty=10.0), counts=counts)[1] == 1.0  # greedy avoids ids 0 and 5


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    seen = np.array([1, 0, 0, 0, 1, 0], np.int32)
    z = LOGITS.copy()
    z[0] /= 2.0
    z[4] *= 2.0
    assert_close(draw(SamplingParams(temperature=1.0, repetition_penalty=2.0), seen=seen), softmax(z))


def test_seed_and_step_fix_the_draw():
    args = ("cpu", LOGITS, np.zeros(6, np.int32), np.zeros(6, np.int32))
    same = {_core.ops.sample(*args, 0, 1.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 42, -1)[0] for _ in range(5)}
    assert len(same) == 1
    by_step = {_core.ops.sample(*args, step, 1.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 42, -1)[0] for step in range(40)}
    assert len(by_step) > 2


# --- SamplingParams ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": float("nan")}, "presence_penalty"), ({"frequency_penalty": None}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"seed": 1.0}, "seed"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"stop": [""]}, "stop"), ({"stop": ["a", 3]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
])
def test_invalid_parameters_name_themselves(kwargs, name):
    with pytest.raises(LilyError, match=name):
        SamplingParams(**kwargs)


def test_params_normalise_and_derive():
    p = SamplingParams(stop="###", stop_token_ids=[7, 8], logprobs=True, top_k=np.int64(5), temperature=np.float32(0.5))
    assert p.stop == ("###",) and p.stop_token_ids == (7, 8) and p.num_logprobs == 0
    assert SamplingParams().num_logprobs == -1 and SamplingParams(logprobs=5).num_logprobs == 5
    assert SamplingParams().is_greedy and not p.is_greedy
    assert SamplingParams(seed=3).with_seed().seed == 3
    assert SamplingParams().with_seed().seed is not None
    hash(p)  # frozen and normalised: usable as a key


def test_from_generation_config():
    cfg = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95, "eos_token_id": [248046, 248044]}
    p = SamplingParams.from_generation_config(cfg, max_tokens=10)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, 20, 0.95, 10)
    assert SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.7}).is_greedy


# --- stop strings ----------------------------------------------------------------------------------

def run_matcher(stops, pieces):
    m = StopMatcher(stops)
    out, hit = [], None
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit is not None:
            return "".join(out), hit
    out.append(m.flush())
    return "".join(out), None


def test_stop_string_across_pieces():
    assert run_matcher(["STOP"], ["abc S", "T", "OP tail"]) == ("abc ", "STOP")
    assert run_matcher(["STOP"], ["abc ST", "OX"]) == ("abc STOX", None)  # a false start is released
    assert run_matcher(["ab", "b"], ["xab"]) == ("x", "ab")  # the earliest match wins
    assert run_matcher(["abc", "ab"], ["zabc"]) == ("z", "abc")  # same start: the longest


def test_held_text_is_only_a_possible_stop_prefix():
    m = StopMatcher(["</answer>"])
    assert m.feed("final </ans") == ("final ", None)
    assert m.flush() == "</ans"


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_match_a_plain_search(seed):
    rng = random.Random(seed)
    alphabet = "ab<>/ \n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 10)))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    first = min(((text.find(s), -len(s), s) for s in stops if s in text), default=None)
    expected = (text[:first[0]], first[2]) if first else (text, None)
    assert run_matcher(stops, pieces) == expected
