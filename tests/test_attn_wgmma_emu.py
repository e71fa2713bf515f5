"""The wgmma prefill attention's data layout on the CPU (tests/emu/attn_wgmma_emu.cu): its CTA order, TMA
SWIZZLE_128B boxes of Q, K and V (rows past the tensor zero, the V tile past pos0 + T zeroed over NaN cache
rows), the K-major descriptors of S = Q K^T and the MN-major (transposed) V descriptor of O += P V read as
the PTX ISA's 128B-swizzle layouts, the accumulator and P A-fragment positions, the causal mask and the
skipped tiles, with the kernel's own per-thread online softmax, against an fp64 attention; and the
kernel's pipeline protocol (mbarriers, TMA landings) under random schedules: no deadlock, the right tile
in every read, no overwrite of a stage being read, balanced barriers. Needs nvcc (host execution only; no
GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_attn_wgmma_emulator(tmp_path):
    assert run_emulator(tmp_path, "attn_wgmma_emu", "-gencode=arch=compute_90a,code=sm_90a").count("ok  ") == 6
