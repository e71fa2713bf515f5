"""The Xb hand-over's layout and rounding on the CPU (tests/emu/xb_layout_emu.cu): the stores of the GATED
epilogue's bf16 output and of gated_rms_norm_xb, with the kernel headers' own position and rounding
helpers, against wgx_bf16_kernel's conversion of the same F32 rows and an independent round to nearest
even. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_xb_layout_emulator(tmp_path):
    assert run_emulator(tmp_path, "xb_layout_emu", "-arch=sm_90a").count("ok  ") == 7
