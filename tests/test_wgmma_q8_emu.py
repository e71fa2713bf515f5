"""The 8-bit weights on the prefill wgmma GEMM on the CPU (tests/emu/wgmma_q8_emu.cu): the kernel's byte -> bf16
conversion (wg_q8_pair) over every byte pair, and its 8-bit stage layout (W box {16 words, 256 rows} into
64-byte rows), each consumer thread's A fragments (wg_dequant_half's 8-bit mapping) bit for bit against a
scalar dequantisation, and an emulated wgmma over 4 k-tiles against an fp64 product, BM 64, 128 and 256 (its
tiles of 128 weight rows, one m64 block a warpgroup), groups of 64 and 32. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_q8_emulator(tmp_path):
    assert run_emulator(tmp_path, "wgmma_q8_emu", "-arch=sm_90a").count("ok  ") == 7
