"""The fused GDN decode layer's row mapping (kernels/gdn_in_proj_mixer.cuh): every in_proj row computed once
by its key head's cluster, handed over via DSMEM to exactly the CTAs whose mixer reads it, at the offset
where it reads the row the unfused mixer reads; the L2 prefetch names the rows computed
(tests/emu/gdn_rows_emu.cu, on the CPU, for every K split). Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_gdn_fused_row_mapping(tmp_path):
    out = run_emulator(tmp_path, "gdn_rows_emu", "-arch=sm_90a")
    assert out.count("ok  ks") == 4
