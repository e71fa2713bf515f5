"""The fused CUDA GDN decode layer (gdn_in_proj_mixer: the stacked in_proj GEMV and gdn_decode_mixer of one
token in one kernel, a cluster of 16 CTAs a key head) against the two CUDA ops it replaces (linear or
linear_rms_normed, then gdn_decode_mixer) at the model's real dims, over consecutive tokens with the conv and
recurrent states carried: bit for bit (the same staged input, the same per-row sum order, the mixer's own
device functions). Elsewhere (other dims) the op runs those ops itself."""
from __future__ import annotations

import numpy as np
import pytest

from gdn_decode_cases import gdn_token_inputs, layer_rows, run_layer, run_layer_parts
from lily import _core
from test_linear import random_words_matrix

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops

REAL = (16, 32, 128, 128, 4, 2048)  # Hk, Hv, Dk, Dv, conv kernel, hidden
STEPS = 4


def case(seed, Hk, Hv, Dk, Dv, K, H):
    rng = np.random.default_rng(seed)
    x = gdn_token_inputs(rng, Hk, Hv, Dk, Dv, K, STEPS)
    w = ops.QMatrix("cuda", **random_words_matrix(rng, layer_rows(Hk, Hv, Dk, Dv), H))
    res = (rng.standard_normal((STEPS, 1, H)) * 3.0).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    return x, w, res, nw


@pytest.mark.parametrize("normed", [True, False])
def test_fused_layer_equals_the_two_ops(normed):
    Hk, Hv, Dk, Dv, K, H = REAL
    x, w, xin, nw = case(11 + normed, *REAL)
    in_norm = nw if normed else None
    y, cs, st, fused = run_layer(w, x, xin, in_norm, Hk, Dk)
    assert all(fused)
    assert np.isfinite(y).all() and np.isfinite(st).all()
    want = run_layer_parts("cuda", w, x, xin, in_norm, Hk, Dk)
    for name, got, ref in zip(("y", "conv_state", "state"), (y, cs, st), want):
        np.testing.assert_array_equal(got, ref, err_msg=name)


def test_fused_layer_strong_decay_and_large_inputs():
    """Decays near zero (S nearly resets) and an input row with a few huge entries (e_u of their blocks
    far from the others'): still the two ops' bits."""
    Hk, Hv, Dk, Dv, K, H = REAL
    x, w, xin, nw = case(5, *REAL)
    x["A_log"] = (x["A_log"] + 1.5).astype(np.float32)
    x["dt_bias"] = (x["dt_bias"] + 12.0).astype(np.float32)
    xin[:, :, ::97] *= 1e4
    y, cs, st, fused = run_layer(w, x, xin, nw, Hk, Dk)
    assert all(fused)
    want = run_layer_parts("cuda", w, x, xin, nw, Hk, Dk)
    for name, got, ref in zip(("y", "conv_state", "state"), (y, cs, st), want):
        np.testing.assert_array_equal(got, ref, err_msg=name)


@pytest.mark.parametrize("normed", [True, False])
def test_out_of_place_is_bit_identical_to_in_place(normed):
    """The decode step's ping-pong: every element of the new conv and recurrent state (NaN before the call)
    written with the in-place run's bits, the input state left as it was (checked in run_layer)."""
    Hk, Hv, Dk, Dv, K, H = REAL
    x, w, xin, nw = case(21, *REAL)
    in_norm = nw if normed else None
    a = run_layer(w, x, xin, in_norm, Hk, Dk, out_of_place=True)
    b = run_layer(w, x, xin, in_norm, Hk, Dk)
    for name, got, ref in zip(("y", "conv_state", "state"), a[:3], b[:3]):
        np.testing.assert_array_equal(got, ref, err_msg=name)


def test_other_dims_run_the_two_ops():
    """The tiny model's GDN dims (Dk = Dv = 32): not the fused kernel's; the op runs its parts."""
    dims = (2, 4, 32, 32, 4, 512)
    x, w, xin, nw = case(3, *dims)
    y, cs, st, fused = run_layer(w, x, xin, nw, 2, 32)
    assert not any(fused)
    want = run_layer_parts("cuda", w, x, xin, nw, 2, 32)
    for name, got, ref in zip(("y", "conv_state", "state"), (y, cs, st), want):
        np.testing.assert_array_equal(got, ref, err_msg=name)
