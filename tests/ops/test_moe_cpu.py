"""The CPU moe op against an fp64 numpy reference written from its contract (ops.h; docs/model.md
section 2.4):

  out[t] = sum_{e in top-k} w_e * down_e(silu(gate_e h) * up_e h) + sigmoid(shared_expert_gate h) * shared(h)

with w = softmax(router h) over all experts, kept for the top k and renormalised to sum 1.
"""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core

ops = _core.ops


def silu(u):
    return u / (1 + np.exp(-u))


def moe_ref(W, h, top_k):
    """W: fp64 arrays router [E, H], gate/up [E, I, H], down [E, H, I], sgate/sup [Is, H],
    sdown [H, Is], shared_expert_gate [1, H]."""
    h = h.astype(np.float64)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        r = W["router"] @ h[t]
        p = np.exp(r - r.max())
        p /= p.sum()                                   # softmax over all experts
        top = np.argsort(-p)[:top_k]
        w = p[top] / p[top].sum()                      # renormalised over the chosen k
        for we, e in zip(w, top):
            out[t] += we * (W["down"][e] @ (silu(W["gate"][e] @ h[t]) * (W["up"][e] @ h[t])))
        shared = W["sdown"] @ (silu(W["sgate"] @ h[t]) * (W["sup"] @ h[t]))
        out[t] += 1 / (1 + np.exp(-(W["shared_expert_gate"] @ h[t])[0])) * shared  # a scalar gate per token
    return out


def routing_margin(router, h, top_k):
    """Smallest gap between the k-th and (k+1)-th router logit over the tokens (fp64)."""
    r = -np.sort(-(h.astype(np.float64) @ router.T), axis=1)
    return float(np.min(r[:, top_k - 1] - r[:, top_k]))


@pytest.mark.parametrize("T, E, top_k, H, I, Is", [(1, 4, 1, 16, 8, 8), (3, 8, 2, 16, 8, 12), (5, 6, 3, 32, 16, 8)])
def test_moe_matches_reference(T, E, top_k, H, I, Is):
    rng = np.random.default_rng(T * 100 + E * 10 + top_k)
    shapes = dict(router=(1, E, H), gate=(E, I, H), up=(E, I, H), down=(E, H, I), sgate=(1, Is, H), sup=(1, Is, H),
                  sdown=(1, H, Is), shared_expert_gate=(1, 1, H))
    W = {name: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) for name, s in shapes.items()}
    h = rng.standard_normal((T, H)).astype(np.float32)
    # fp32 and fp64 pick the same experts only if no two router logits nearly tie at the cut.
    assert routing_margin(W["router"][0], h, top_k) > 1e-3
    q = {name: ops.QMatrix("cpu", w, "F32", *w.shape) for name, w in W.items()}
    got = ops.moe("cpu", q["router"], q["gate"], q["up"], q["down"], q["sgate"], q["sup"], q["sdown"],
                  q["shared_expert_gate"], h, top_k)
    ref = moe_ref({name: (w[0] if w.shape[0] == 1 else w).astype(np.float64) for name, w in W.items()}, h, top_k)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
