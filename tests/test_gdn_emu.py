"""The chunked GDN prefill kernels (csrc/cuda/kernels/gdn_chunk.cuh) on the CPU: benchmarks/gdn_emu.cpp runs
their source with every thread a fiber, cp.async, ldmatrix, cvt.rn.bf16x2 and mma.sync m16n8k16 emulated from
the PTX ISA, and compares o and the final state with an fp64 recurrence (each case "ok" within 1.5e-5; the
3xBF16 products measure 6-8e-6). Needs a C++20 compiler only (no GPU, no nvcc)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_gdn_emulator(tmp_path):
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "gdn_emu"
    subprocess.run(["g++", "-O2", "-std=c++20", "-I", str(root / "csrc"), "-o", str(exe),
                    str(root / "benchmarks/gdn_emu.cpp")], check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(exe), "quick"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok\n") == 6, r.stdout  # five cases with eager copies, one with deferred ones
