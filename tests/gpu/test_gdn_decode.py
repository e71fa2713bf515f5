"""The fused CUDA GDN decode kernel (gdn_decode_mixer: conv1d_silu -> gated_delta_rule ->
gated_rms_norm of one token in one launch) against the CPU op, and against the three CUDA ops it
replaces, over several consecutive tokens with the conv and recurrent states carried."""
from __future__ import annotations

import numpy as np
import pytest

from checks import assert_rel_close, rel_err
from gdn_decode_cases import gdn_token_inputs, run_fused, run_three_ops
from lily import _core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _core.backend_available("cuda"), reason="no CUDA backend on this machine"),
]
ops = _core.ops


def strong(x):
    """Per-token decays exp(-exp(A_log) softplus(a + dt_bias)) of ~e^-10 .. e^-100: S nearly resets."""
    x = dict(x)
    x["a"] = (x["a"] + 12.0).astype(np.float32)
    x["A_log"] = (x["A_log"] + 1.5).astype(np.float32)
    return x


# (Hk, Hv, Dk, Dv, K): real widths (cluster 2 x 4); the tiny model (2 x 1); one head; Dv = 72 (3 slices,
# the last partial, float4 norm); Dv = 19 (scalar norm, odd C); GQA 4 x 2 slices = 8; Dv = 256
# (8 slices, group 1); Dk = 256; conv kernels 2 and 3
SHAPES = [(16, 32, 128, 128, 4), (2, 4, 32, 32, 4), (1, 1, 16, 16, 4), (1, 2, 64, 72, 3), (3, 3, 32, 19, 4),
          (1, 4, 64, 40, 4), (2, 2, 128, 256, 4), (1, 1, 256, 64, 2)]
STEPS = 6


@pytest.mark.parametrize("decay", ["usual", "strong"])
@pytest.mark.parametrize("Hk, Hv, Dk, Dv, K", SHAPES)
def test_gdn_decode_mixer_matches_cpu(Hk, Hv, Dk, Dv, K, decay, gpu_tol):
    assert ops.gdn_decode_mixer_supported("cuda", Hk, Hv, Dk, Dv, K)
    x = gdn_token_inputs(np.random.default_rng(Hk * 977 + Hv * 31 + Dk * 7 + Dv + K), Hk, Hv, Dk, Dv, K, STEPS)
    if decay == "strong":
        x = strong(x)
    y_cpu, cs_cpu, s_cpu = run_fused("cpu", x, Hk, Dk)
    y_gpu, cs_gpu, s_gpu = run_fused("cuda", x, Hk, Dk)
    assert np.isfinite(y_gpu).all() and np.isfinite(s_gpu).all()
    tol = gpu_tol["gated_delta_rule"]
    for t in range(STEPS):
        assert_rel_close(f"y token {t}", y_gpu[t], y_cpu[t], tol)
    assert_rel_close("state", s_gpu, s_cpu, tol)
    np.testing.assert_array_equal(cs_gpu, cs_cpu)  # the conv state is a copy of inputs


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, K", SHAPES)
def test_gdn_decode_mixer_equals_cuda_ops(Hk, Hv, Dk, Dv, K, gpu_tol):
    """Fused kernel vs conv1d_silu + gated_delta_kernel + gated_rms_norm on the GPU: the same operations in
    the same order (norm sums included), so expected bit-identical; the tolerance leaves room for the
    compiler contracting a multiply-add differently in the two kernels."""
    x = gdn_token_inputs(np.random.default_rng(7 + Dv + Hv), Hk, Hv, Dk, Dv, K, STEPS)
    fused, three = run_fused("cuda", x, Hk, Dk), run_three_ops("cuda", x, Hk, Dk)
    tol = gpu_tol["gdn_decode_fused_vs_ops"]
    for name, got, ref in zip(("y", "conv_state", "state"), fused, three):
        exact = np.array_equal(got, ref)
        print(f"{name}: {'bit-identical' if exact else f'rel err {rel_err(got, ref):.3g}'}")
        assert_rel_close(name, got, ref, tol)
    np.testing.assert_array_equal(fused[1], three[1])


@pytest.mark.parametrize("Hk, Hv, Dk, Dv, K", SHAPES)
def test_out_of_place_is_bit_identical_to_in_place(Hk, Hv, Dk, Dv, K):
    """The decode step's ping-pong (the new conv and recurrent state in the other copy): the fused kernel
    and the three kernels write every element of the output buffers (NaN before the call) with the bits
    of the in-place run, and leave the input state untouched (checked in run_*)."""
    x = gdn_token_inputs(np.random.default_rng(11 + Dv + Hv), Hk, Hv, Dk, Dv, K, STEPS)
    for run in (run_fused, run_three_ops):
        for name, got, ref in zip(("y", "conv_state", "state"), run("cuda", x, Hk, Dk, out_of_place=True),
                                  run("cuda", x, Hk, Dk)):
            np.testing.assert_array_equal(got, ref, err_msg=f"{run.__name__}: {name}")


def test_gdn_decode_mixer_supported_on_cuda():
    assert ops.gdn_decode_mixer_supported("cuda", 16, 32, 128, 128, 4)  # Qwen3.6: clusters of 2 x 4
    assert ops.gdn_decode_mixer_supported("cuda", 2, 4, 32, 32, 4)  # the tiny model
    assert not ops.gdn_decode_mixer_supported("cuda", 1, 4, 128, 128, 4)  # 16 CTAs per key head
    assert not ops.gdn_decode_mixer_supported("cuda", 2, 4, 20, 32, 4)  # no fast-path Dk
    assert not ops.gdn_decode_mixer_supported("cuda", 2, 4, 32, 32, 5)  # conv kernel 5
    x = gdn_token_inputs(np.random.default_rng(1), 1, 4, 128, 128, 4, 1)
    with pytest.raises(Exception, match="gdn_decode_mixer"):
        run_fused("cuda", x, 1, 128)
