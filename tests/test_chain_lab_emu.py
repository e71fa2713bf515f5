"""The decode chain lab's consumer math on the CPU (tests/emu/chain_lab_emu.cu): the persistent kernel's
math policies of benchmarks/chain_lab_math.cuh (PsDigits<2>, PsDigits<4>: the integer digits with several
segments a step; PsBf3: x as three bf16 terms on mma m16n8k16) run for the 32 lanes of a warp with mma.sync
emulated from the PTX fragment tables, against fp64; PsBf3's staged reads are bank-conflict-free; and the
timeline's reduction (benchmarks/chain_lab_timeline.h) recovers known intervals from synthetic stamps; part 3's
index logic (benchmarks/chain_lab_phase.cuh): the flat dealing of a CTA's segments over its 8 warps, and the
producers' staging of y (every 64-row block once, by its last contributor, bytes equal to staging y whole).
Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_chain_lab_math_emulator(tmp_path):
    exe = tmp_path / "chain_lab_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++20", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"), "-o", str(exe),
                    str(ROOT / "tests/emu/chain_lab_emu.cu")], check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 3 * 6 + 4
