"""The MoE tile maps on the CPU (tests/emu/moe_tiles_emu.cu): moe_scatter_kernel's map of 128-row tiles
with 64-row tails (and the maps without tails), built with the kernel header's moe_tile_counts and
moe_write_tiles and read back with find_tile: every grouped row in exactly one tile of its expert, tails of
at most 64 rows, the same tile starts as the map without tails, counts within moe.cu's bounds. Needs nvcc
(host compilation only; no GPU)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_moe_tiles_emulator(tmp_path):
    exe = tmp_path / "moe_tiles_emu"
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"),
                    "-o", str(exe), str(ROOT / "tests/emu/moe_tiles_emu.cu")], check=True, capture_output=True,
                   timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "all passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 5
