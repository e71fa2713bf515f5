"""The GEMV's normed input (gemv_mma.cuh, mma_stage_normed_x) sums the squares of x in the RMSNorm kernels'
order for every D it takes, so it stages their h bit for bit (tests/emu/norm_in_emu.cu, on the CPU; a
control D with another order differs). Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_normed_input_sums_in_the_norms_order(tmp_path):
    assert run_emulator(tmp_path, "norm_in_emu", "-Xcompiler", "-ffp-contract=off").count("ok  ") == 17
