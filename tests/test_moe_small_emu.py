"""moe_small_kernel's fragments on the CPU (tests/emu/moe_small_emu.cu): the exact-q A registers (128 + q)
from a lane's weight loads and the B registers from the staged Xb rows, assembled by the PTX layout of
mma.m16n8k16, the block sums and the per-block scale/bias epilogue, against a scalar reference product; the
staging slot permutation and conflict-free shared loads. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_small_emulator(tmp_path):
    assert run_emulator(tmp_path, "moe_small_emu", "-arch=sm_90a").count("ok  ") == 9
