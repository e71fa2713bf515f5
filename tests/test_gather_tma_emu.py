"""The gathered MoE product's row-TMA producer on the CPU (tests/emu/gather_tma_emu.cu): with a model of TMA's
SWIZZLE_128B (chunk bits 4-6 XOR address bits 7-9), a box {64, 1} per gathered row at row r of a 1024-aligned
stage lands where the dense box {64, BM} and wg_swz put row r, every stage's Xb base is 1024-aligned, the
producer threads' row loads (row r = tid) leave the bytes the retired cp.async producer left for every row the
epilogue stores (BM 64 and 128, several x_rows patterns, tile rows 1..BM), each warp's expect_tx matches its own
loads' bytes (BM/32 arrivals), and stale (NaN) rows past the tile's end reach no stored column. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_gather_tma_emulator(tmp_path):
    assert run_emulator(tmp_path, "gather_tma_emu", "-arch=sm_90a").count("ok  ") == 3
