"""The GEMV's normed input (gemv_mma.cuh, mma_stage_normed_x) sums the squares of x in the RMSNorm kernels'
order for every D it takes, so it stages their h bit for bit (tests/emu/norm_in_emu.cu, on the CPU; a
control D with another order differs). Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_normed_input_sums_in_the_norms_order(tmp_path):
    exe = tmp_path / "norm_in_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-ffp-contract=off", "-I",
                    str(ROOT / "csrc"), "-o", str(exe), str(ROOT / "tests/emu/norm_in_emu.cu")], check=True,
                   capture_output=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 17
