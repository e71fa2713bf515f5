"""The CPU gdn_decode_mixer (the GDN decode token's conv1d_silu -> gated_delta_rule -> gated_rms_norm
in one op, the reference of the fused CUDA kernel) against the three ops run in sequence."""
from __future__ import annotations

import numpy as np
import pytest

from gdn_decode_cases import gdn_token_inputs, layer_rows, run_fused, run_layer, run_layer_parts, run_three_ops
from lily import _core

ops = _core.ops


# (Hk, Hv, Dk, Dv, K): the tiny test model, odd widths, GQA groups 1..4, other conv sizes, real widths
SHAPES = [(2, 4, 32, 32, 4), (1, 1, 16, 16, 4), (3, 3, 20, 19, 3), (1, 4, 8, 12, 2), (2, 2, 64, 72, 5),
          (16, 32, 128, 128, 4)]


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, K", SHAPES)
def test_gdn_decode_mixer_is_the_three_ops(Hk, Hv, Dk, Dv, K):
    x = gdn_token_inputs(np.random.default_rng(Hk * 1000 + Hv * 100 + Dk + Dv + K), Hk, Hv, Dk, Dv, K, steps=4)
    fused, three = run_fused("cpu", x, Hk, Dk), run_three_ops("cpu", x, Hk, Dk)
    for name, got, ref in zip(("y", "conv_state", "state"), fused, three):
        np.testing.assert_array_equal(got, ref, err_msg=name)
    assert np.isfinite(fused[0]).all() and np.abs(fused[0]).max() > 0


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, K", SHAPES[:4])
def test_out_of_place_equals_in_place(Hk, Hv, Dk, Dv, K):
    """The decode step's ping-pong: the new state in other buffers (NaN before the op, so a missed
    element shows), the same bits as in place, the inputs untouched (checked inside run_*)."""
    x = gdn_token_inputs(np.random.default_rng(Hk + Hv + Dk + Dv + K), Hk, Hv, Dk, Dv, K, steps=3)
    for run in (run_fused, run_three_ops):
        for name, got, ref in zip(("y", "conv_state", "state"), run("cpu", x, Hk, Dk, out_of_place=True),
                                  run("cpu", x, Hk, Dk)):
            np.testing.assert_array_equal(got, ref, err_msg=f"{run.__name__}: {name}")


def test_gdn_decode_mixer_supported_on_cpu():
    assert ops.gdn_decode_mixer_supported("cpu", 16, 32, 128, 128, 4)
    assert ops.gdn_decode_mixer_supported("cpu", 1, 3, 20, 19, 7)


def test_gdn_decode_mixer_names_a_bad_shape():
    x = gdn_token_inputs(np.random.default_rng(0), 2, 4, 8, 8, 4, steps=1)
    args = lambda **kw: [kw.get(k, x[k][0] if k in ("qkv", "a", "b", "z") else x[k]) for k in
                         ("qkv", "conv_weight", "conv_state", "a", "b", "A_log", "dt_bias", "state", "z",
                          "norm_weight")]
    with pytest.raises(Exception, match="gdn_decode_mixer.*qkv"):
        ops.gdn_decode_mixer("cpu", *args(qkv=np.zeros((2, x["qkv"].shape[2]), np.float32)), 1e-6, 2, 8)
    with pytest.raises(Exception, match="gdn_decode_mixer.*norm_weight"):
        ops.gdn_decode_mixer("cpu", *args(norm_weight=np.ones(7, np.float32)), 1e-6, 2, 8)
    with pytest.raises(Exception, match="gdn_decode_mixer.*key heads"):
        ops.gdn_decode_mixer("cpu", *args(), 1e-6, 3, 8)


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("Hk, Hv, Dk, Dv, K, H", [(2, 4, 32, 32, 4, 64), (1, 2, 16, 12, 3, 40)])
def test_gdn_in_proj_mixer_is_linear_then_the_mixer(Hk, Hv, Dk, Dv, K, H, normed):
    """On the CPU gdn_in_proj_mixer is its ops (linear or linear_rms_normed, then gdn_decode_mixer), bit for bit."""
    rng = np.random.default_rng(Hk + Dv + H + normed)
    x = gdn_token_inputs(rng, Hk, Hv, Dk, Dv, K, 3)
    R = layer_rows(Hk, Hv, Dk, Dv)
    w = ops.QMatrix("cpu", rng.uniform(-0.5, 0.5, (1, R, H)).astype(np.float32), "F32", 1, R, H)
    xin = rng.standard_normal((3, 1, H)).astype(np.float32)
    in_norm = rng.uniform(0.5, 1.5, H).astype(np.float32) if normed else None
    y, cs, st, fused = run_layer(w, x, xin, in_norm, Hk, Dk)
    assert not any(fused)  # one kernel only on CUDA
    for name, got, want in zip(("y", "conv_state", "state"), (y, cs, st),
                               run_layer_parts("cpu", w, x, xin, in_norm, Hk, Dk)):
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_gdn_in_proj_mixer_names_a_bad_matrix():
    rng = np.random.default_rng(3)
    x = gdn_token_inputs(rng, 1, 1, 8, 8, 4, 1)
    R = layer_rows(1, 1, 8, 8) - 1
    w = ops.QMatrix("cpu", np.zeros((1, R, 16), np.float32), "F32", 1, R, 16)
    with pytest.raises(Exception, match="gdn_in_proj_mixer.*rows"):
        run_layer(w, x, np.ones((1, 1, 16), np.float32), None, 1, 8)
