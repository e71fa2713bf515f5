"""dense_small_kernel on the CPU (tests/emu/dense_small_emu.cu): whole products through the kernel's K-part
addresses, staged X, fragments, partials and rank-ordered reduction against a scalar reference; conflict-free
partial stores; the split plan of the model's dense shapes. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_dense_small_emulator(tmp_path):
    exe = tmp_path / "dense_small_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"),
                    "-o", str(exe), str(ROOT / "tests/emu/dense_small_emu.cu")], check=True, capture_output=True,
                   timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 9
