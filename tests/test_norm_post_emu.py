"""The MoE block's normed input (ops.moe_rms_normed_add: moe_router.cuh's staging warp, router_inv_rms, and
moe_up's mma_stage_normed_x) sums the squares of the residual row in the RMSNorm kernels' order, so the
router and moe_up stage the h that out_proj's norm tail wrote, bit for bit (tests/emu/norm_post_emu.cu, on
the CPU; a control order differs). Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_normed_input_sums_in_the_norms_order(tmp_path):
    exe = tmp_path / "norm_post_emu"
    # sm_90a: the router's header brings kernels that use Hopper instructions (compiled, never run)
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-Xcompiler",
                    "-ffp-contract=off", "-I", str(ROOT / "csrc"), "-o", str(exe),
                    str(ROOT / "tests/emu/norm_post_emu.cu")], check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 4
