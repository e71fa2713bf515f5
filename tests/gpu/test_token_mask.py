"""The CUDA token mask (kernels/token_mask.cuh) against the CPU op, and the CUDA sampler on masked
logits: only allowed ids, greedy equal to the CPU's choice."""
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


def mask_of(allowed: np.ndarray) -> np.ndarray:
    words = (allowed.size + 31) // 32
    bits = np.zeros(words * 32, np.uint8)
    bits[:allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("V", [1, 33, 1000, 4099, REAL_V])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.5, 1.0])
def test_cuda_equals_cpu(V, density):
    rng = np.random.default_rng(V)
    logits = rng.standard_normal(V).astype(np.float32)
    allowed = rng.random(V) < density
    mask = mask_of(allowed)
    np.testing.assert_array_equal(ops.apply_token_mask("cuda", logits, mask), ops.apply_token_mask("cpu", logits, mask))


@pytest.mark.parametrize("params", [dict(), dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.95)])
def test_cuda_sampler_draws_only_allowed_ids(params):
    rng = np.random.default_rng(5)
    for step in range(20):
        logits = (rng.standard_normal(REAL_V) * 3).astype(np.float32)
        allowed = np.zeros(REAL_V, bool)
        allowed[rng.choice(REAL_V, 1 + step, replace=False)] = True
        masked = ops.apply_token_mask("cuda", logits, mask_of(allowed))
        zeros = np.zeros(REAL_V, np.int32)
        token = ops.sample("cuda", masked, zeros, zeros.copy(), step, seed=9, **params)[0]
        assert allowed[token], (step, token)
        if not params:
            assert token == ops.sample("cpu", masked, zeros, zeros.copy(), step)[0]
