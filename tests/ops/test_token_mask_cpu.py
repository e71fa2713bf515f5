"""ops.apply_token_mask on the CPU (constrained decoding, docs/generation.md): a numpy reference of
the bit layout, and the sampler never choosing a masked id, greedy or seeded."""
from __future__ import annotations

import numpy as np
import pytest

from lily import LilyError, _core

ops = _core.ops


def reference(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """logits with -inf where bit v % 32 of word v // 32 is clear."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:logits.size].astype(bool)
    return np.where(bits, logits, -np.inf).astype(np.float32)


def random_mask(rng, V: int, density: float) -> np.ndarray:
    allowed = rng.random(V) < density
    allowed[rng.integers(V)] = True  # at least one id
    return mask_of(allowed)


def mask_of(allowed: np.ndarray) -> np.ndarray:
    words = (allowed.size + 31) // 32
    bits = np.zeros(words * 32, np.uint8)
    bits[:allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 1000, 4099])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_matches_reference(V, density):
    rng = np.random.default_rng(V)
    logits = rng.standard_normal(V).astype(np.float32)
    mask = random_mask(rng, V, density)
    got = ops.apply_token_mask("cpu", logits, mask)
    np.testing.assert_array_equal(got, reference(logits, mask))


def test_extra_words_and_high_bits_are_ignored():
    logits = np.arange(40, dtype=np.float32)
    mask = np.array([-1, 0xFF, -1, -1], np.int32)  # 2 words needed; the others and bits >= 40 are unused
    got = ops.apply_token_mask("cpu", logits, mask)
    assert np.isfinite(got).sum() == 40


def test_short_mask_is_refused_by_name():
    with pytest.raises(LilyError, match="apply_token_mask: mask has 1 words; 40 logits need at least 2"):
        ops.apply_token_mask("cpu", np.zeros(40, np.float32), np.zeros(1, np.int32))


@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                    dict(temperature=1.3, top_p=0.9, min_p=0.01),
                                    dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5)])
def test_sampler_never_draws_a_masked_id(params):
    rng = np.random.default_rng(7)
    V = 2000
    for step in range(40):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        allowed = rng.random(V) < 0.02
        allowed[rng.integers(V)] = True
        masked = ops.apply_token_mask("cpu", logits, mask_of(allowed))
        counts = np.zeros(V, np.int32)
        seen = rng.integers(0, 2, V).astype(np.int32)
        token = ops.sample("cpu", masked, counts, seen, step, seed=3, **params)[0]
        assert allowed[token], (step, token)
        if not params:  # greedy: the best allowed id
            assert token == np.flatnonzero(allowed)[np.argmax(logits[allowed])]


def test_logprobs_of_a_masked_draw_are_the_masked_distribution():
    rng = np.random.default_rng(8)
    V = 300
    logits = rng.standard_normal(V).astype(np.float32)
    allowed = np.zeros(V, bool)
    allowed[[3, 77, 150]] = True
    masked = ops.apply_token_mask("cpu", logits, mask_of(allowed))
    token, _, _, ids, values = ops.sample("cpu", masked, np.zeros(V, np.int32), np.zeros(V, np.int32), 0,
                                          num_logprobs=5)
    p = np.exp(logits[allowed].astype(np.float64))
    assert np.isclose(np.exp(values[:4]).sum() - np.exp(values[0]), 1.0, atol=1e-5)  # top 3 = all the mass
    assert set(ids[1:4].tolist()) == {3, 77, 150} and np.isneginf(values[4:6]).all()
    assert np.isclose(values[0], np.log(p.max() / p.sum()), atol=1e-5)
