"""The dense BF16 wgmma GEMM's data layout on the CPU (tests/emu/wgmma_dense_emu.cu): its work units, TMA
SWIZZLE_128B boxes with zero fill past M, N and K, the wgmma descriptors of both operands (the kernel's
wg_desc, wgd_a_offset and + 2 per k16 step) read as the PTX ISA's K-major 128B-swizzle layout, and the
epilogue's accumulator positions, against an fp64 product. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_wgmma_dense_emulator(tmp_path):
    exe = tmp_path / "wgmma_dense_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"),
                    "-o", str(exe), str(ROOT / "tests/emu/wgmma_dense_emu.cu")], check=True, capture_output=True,
                   timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 4
