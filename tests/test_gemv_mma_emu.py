"""The integer tensor-core GEMV's fragment logic on the CPU (tests/emu/gemv_mma_emu.cu): the kernel's own
block scaling, digit split, A/B fragment mapping and column epilogue against fp64, with mma.sync emulated
from the PTX fragment tables; and the multi-token kernel's staged layout (kernels/gemv_mma_tokens.cuh):
each of T tokens read through it gives its one-token tile bit for bit; and which short prompts take that kernel
(gemv_plan.h's mma_tokens_shape: the model's layer matrices, not its lm_head). Needs nvcc (host compilation only;
no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_gemv_mma_fragment_emulator(tmp_path):
    exe = tmp_path / "gemv_mma_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"), "-o", str(exe),
                    str(ROOT / "tests/emu/gemv_mma_emu.cu")], check=True, capture_output=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 18 + 12 + 1
