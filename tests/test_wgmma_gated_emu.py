"""The gated prefill GEMM's row mapping on the CPU (tests/emu/wgmma_gated_emu.cu): every consumer thread's
stage rows, scale rows and outputs (the kernel header's wg_row_base, wg_row_step, wg_out_step) against the
producer's two W boxes; gate and up of each output in one thread (slice rows 0-7 gate, 8-15 up) and every
output of the tile stored once, BM 64, 128 and 256 (one m64 block a consumer warpgroup: 64 gate + 64 up
rows a stage); the shared-memory budget. Needs nvcc (host compilation
only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_gated_emulator(tmp_path):
    assert run_emulator(tmp_path, "wgmma_gated_emu", "-arch=sm_90a").count("ok  ") == 6
