"""The MoE block's normed input (ops.moe_rms_normed_add: moe_router.cuh's staging warp, router_inv_rms, and
moe_up's mma_stage_normed_x) sums the squares of the residual row in the RMSNorm kernels' order, so the
router and moe_up stage the h that out_proj's norm tail wrote, bit for bit (tests/emu/norm_post_emu.cu, on
the CPU; a control order differs). Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_normed_input_sums_in_the_norms_order(tmp_path):
    # sm_90a: the router's header brings kernels that use Hopper instructions (compiled, never run)
    assert run_emulator(tmp_path, "norm_post_emu", "-arch=sm_90a", "-Xcompiler", "-ffp-contract=off").count("ok  ") == 4
