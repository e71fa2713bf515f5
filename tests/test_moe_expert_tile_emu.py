"""The one-tile-per-expert MoE GEMM's layout on the CPU (tests/emu/moe_expert_tile_emu.cu; the kernel is
gemm_lab's "expert" group, benchmarks/gemm_lab_expert.cuh): every consumer thread's stage rows, scale rows
and outputs (plain and GATED) against the producer's W boxes, the A fragment registers against wgmma's,
every output of the 128 x TN tile stored once from its own accumulator (TN 160 and 256), the
shared-memory budget. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_expert_tile_emulator(tmp_path):
    assert run_emulator(tmp_path, "moe_expert_tile_emu", "-arch=sm_90a").count("ok  ") == 8
