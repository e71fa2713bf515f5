"""One GDN layer's decode tokens for the gdn_decode_mixer tests (tests/ops CPU, tests/gpu CUDA): inputs,
the fused op and the three ops it replaces, run token by token with the states carried."""
from __future__ import annotations

import numpy as np

from lily import _core

ops = _core.ops


def gdn_token_inputs(rng, Hk, Hv, Dk, Dv, K, steps):
    """`steps` decode tokens of one GDN layer: per-token qkv, a, b, z and the layer's weights/states."""
    C = 2 * Hk * Dk + Hv * Dv
    f = np.float32
    return dict(
        qkv=rng.standard_normal((steps, 1, C)).astype(f),
        a=rng.standard_normal((steps, 1, Hv)).astype(f),
        b=rng.standard_normal((steps, 1, Hv)).astype(f),
        z=rng.standard_normal((steps, 1, Hv * Dv)).astype(f),
        conv_weight=(rng.standard_normal((C, K)) / np.sqrt(K)).astype(f),
        conv_state=rng.standard_normal((K - 1, C)).astype(f),
        A_log=np.log(rng.uniform(1.0, 16.0, Hv)).astype(f),
        dt_bias=rng.standard_normal(Hv).astype(f),
        state=(rng.standard_normal((Hv, Dk, Dv)) * 0.1).astype(f),
        norm_weight=rng.normal(1.0, 0.1, Dv).astype(f),
    )


def unchanged(before, after):
    """The input state an out-of-place call returned as it left it: the same bits it was given."""
    np.testing.assert_array_equal(after, before, err_msg="an out-of-place op wrote its input state")
    return None


def run_fused(device, x, Hk, Dk, eps=1e-6, out_of_place=False):
    """Every token through gdn_decode_mixer, states carried: (y [steps, Hv*Dv], conv_state, state).
    out_of_place: each token writes new state buffers (the decode step's ping-pong), the inputs unchanged."""
    conv_state, state, ys = x["conv_state"], x["state"], []
    for t in range(x["qkv"].shape[0]):
        out = ops.gdn_decode_mixer(device, x["qkv"][t], x["conv_weight"], conv_state, x["a"][t], x["b"][t],
                                   x["A_log"], x["dt_bias"], state, x["z"][t], x["norm_weight"], eps, Hk, Dk,
                                   out_of_place)
        if out_of_place:
            unchanged(conv_state, out[3]), unchanged(state, out[4])
        y, conv_state, state = out[:3]
        ys.append(y[0])
    return np.stack(ys), conv_state, state


def run_three_ops(device, x, Hk, Dk, eps=1e-6, out_of_place=False):
    """The same tokens through conv1d_silu, gated_delta_rule and gated_rms_norm (the unfused engine)."""
    Hv, Dv = x["state"].shape[0], x["state"].shape[2]
    conv_state, state, ys = x["conv_state"], x["state"], []
    for t in range(x["qkv"].shape[0]):
        c = ops.conv1d_silu(device, x["qkv"][t], x["conv_weight"], conv_state, out_of_place)
        g = ops.gated_delta_rule(device, c[0], x["a"][t], x["b"][t], x["A_log"], x["dt_bias"], state, Hk, Dk,
                                 out_of_place)
        if out_of_place:
            unchanged(conv_state, c[2]), unchanged(state, g[2])
        (u, conv_state), (o, state) = c[:2], g[:2]
        y = ops.gated_rms_norm(device, o.reshape(Hv, Dv), x["z"][t].reshape(Hv, Dv), x["norm_weight"], eps)
        ys.append(y.reshape(-1))
    return np.stack(ys), conv_state, state


def layer_rows(Hk, Hv, Dk, Dv):
    """Rows of the stacked in_proj [q | k | v | z | b | a] (gdn_in_proj_mixer)."""
    return 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv


def run_layer(w, x, xin, in_norm, Hk, Dk, eps=1e-6, out_of_place=False):
    """Every token's input row xin[t] [1, H] (h, or with in_norm the residual row) through gdn_in_proj_mixer
    with the stacked in_proj w, states carried: (y [steps, Hv*Dv], conv_state, state, one_kernel of each)."""
    conv_state, state, ys, fused = x["conv_state"], x["state"], [], []
    for t in range(xin.shape[0]):
        out = ops.gdn_in_proj_mixer(w, xin[t], in_norm, 1e-6, x["conv_weight"], conv_state, x["A_log"],
                                    x["dt_bias"], state, x["norm_weight"], eps, Hk, Dk, out_of_place)
        if out_of_place:
            unchanged(conv_state, out[4]), unchanged(state, out[5])
        y, conv_state, state = out[:3]
        ys.append(y[0]), fused.append(out[3])
    return np.stack(ys), conv_state, state, fused


def run_layer_parts(device, w, x, xin, in_norm, Hk, Dk, eps=1e-6):
    """The same tokens through the ops gdn_in_proj_mixer stands for: linear (linear_rms_normed with in_norm)
    into the stacked row, split into qkv | z | b | a, then gdn_decode_mixer."""
    Hv, Dv = x["state"].shape[0], x["state"].shape[2]
    C, Vd = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    conv_state, state, ys = x["conv_state"], x["state"], []
    for t in range(xin.shape[0]):
        proj = ops.linear(w, 0, xin[t]) if in_norm is None else ops.linear_rms_normed(w, xin[t], in_norm, 1e-6)[0]
        qkv, z, b, a = proj[:, :C], proj[:, C:C + Vd], proj[:, C + Vd:C + Vd + Hv], proj[:, C + Vd + Hv:]
        y, conv_state, state = ops.gdn_decode_mixer(device, np.ascontiguousarray(qkv), x["conv_weight"], conv_state,
                                                    np.ascontiguousarray(a), np.ascontiguousarray(b), x["A_log"],
                                                    x["dt_bias"], state, np.ascontiguousarray(z), x["norm_weight"],
                                                    eps, Hk, Dk)
        ys.append(y[0])
    return np.stack(ys), conv_state, state
