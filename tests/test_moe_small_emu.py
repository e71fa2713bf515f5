"""moe_small_kernel's fragments on the CPU (tests/emu/moe_small_emu.cu): the A registers dequantized from a
lane's 16-byte weight loads and the B registers from the staged Xb rows, assembled by the PTX layout of
mma.m16n8k16, against a scalar reference product; the staging slot permutation and conflict-free shared
loads; the persistent form's work-item walk. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_small_emulator(tmp_path):
    exe = tmp_path / "moe_small_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"),
                    "-o", str(exe), str(ROOT / "tests/emu/moe_small_emu.cu")], check=True, capture_output=True,
                   timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 9
