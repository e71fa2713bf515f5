"""moe_small_kernel's fragments on the CPU (tests/emu/moe_small_emu.cu): the A registers dequantized from a
lane's 16-byte weight loads and the B registers from the staged Xb rows, assembled by the PTX layout of
mma.m16n8k16, against a scalar reference product; the staging slot permutation and conflict-free shared
loads; the ring's copies and reads against direct loads. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_small_emulator(tmp_path):
    assert run_emulator(tmp_path, "moe_small_emu", "-arch=sm_90a").count("ok  ") == 14
