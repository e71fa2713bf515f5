"""The prefill GEMM's tile shapes on the CPU (tests/emu/wgmma_tiles_emu.cu): the gated product's
interleaved rows (every consumer thread's stage rows, scale rows and outputs against the producer's two
W boxes; gate and up of each output in one thread; every output of the tile stored once, BM 64 and 128),
the shared-memory budget, and the MoE tile spans (each expert's rows covered once, the wgmma N of each
tile a multiple of 32 within its tile rows). Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_tiles_emulator(tmp_path):
    assert run_emulator(tmp_path, "wgmma_tiles_emu", "-arch=sm_90a").count("ok  ") == 6
