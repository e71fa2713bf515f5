"""The Xb hand-over's layout and rounding on the CPU (tests/emu/xb_layout_emu.cu): the stores of the GATED
epilogue's bf16 output and of gated_rms_norm_xb, with the kernel headers' own position and rounding
helpers, against wgx_bf16_kernel's conversion of the same F32 rows and an independent round to nearest
even. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_xb_layout_emulator(tmp_path):
    exe = tmp_path / "xb_layout_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"),
                    "-o", str(exe), str(ROOT / "tests/emu/xb_layout_emu.cu")], check=True, capture_output=True,
                   timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 7
