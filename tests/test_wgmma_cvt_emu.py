"""The converter warpgroup's layout for the quantized prefill GEMM on the CPU (tests/emu/wgmma_cvt_emu.cu): the
headers' wgc_convert (kernels/linear_wgmma_cvt.cuh) run by all 128 converter threads into an emulated bf16 A
stage, every element the SS wgmma would read through its A descriptor (K-major SWIZZLE_128B) bit for bit
against the register the RS path's wg_dequant_half fills (and a scalar round(s*q + b)); every A stage byte
written once a k-tile, the converter's 16-byte loads and stores bank-conflict-free. BM 64, 128, 256; plain and
GATED; groups of 32 (GS32), 64, 128; 4- and 8-bit. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_cvt_emulator(tmp_path):
    assert run_emulator(tmp_path, "wgmma_cvt_emu", "-arch=sm_90a").count("ok  ") == 24


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_cvt_kernel_compiles(tmp_path):
    """The converter-fed kernel compiles for sm_90a: 8 instances (dense 4/8-bit with and without 32-wide groups;
    gathered, GATED, gathered GATED 4-bit; gathered 8-bit), 128 registers at launch, no spills."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(["nvcc", "-O3", "-arch=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-v",
                        "-I", str(root / "csrc"), "-cubin", "-o", str(tmp_path / "cvt.cubin"),
                        str(root / "tests/emu/wgmma_cvt_kernel.cu")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("Used 128 registers") == 8, r.stderr
    assert r.stderr.count("0 bytes spill stores, 0 bytes spill loads") == 8, r.stderr
