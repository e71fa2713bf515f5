"""The dense BF16 wgmma GEMM's data layout on the CPU (tests/emu/wgmma_dense_emu.cu): its work units, TMA
SWIZZLE_128B boxes with zero fill past M, N and K, the wgmma descriptors of both operands (the kernel's
wg_desc, wgd_a_offset and + 2 per k16 step) read as the PTX ISA's K-major 128B-swizzle layout, and the
epilogue's accumulator positions, against an fp64 product. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_dense_emulator(tmp_path):
    assert run_emulator(tmp_path, "wgmma_dense_emu", "-arch=sm_90a").count("ok  ") == 4
