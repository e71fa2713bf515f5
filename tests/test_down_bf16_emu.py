"""A prompt's MoE down rows as bf16 on the CPU (tests/emu/down_bf16_emu.cu): the wgmma GEMM's y16 epilogue
stores (LinearArgs::y16's pair order) and the combines' 16-byte reads, with the kernel headers' own position
helpers, for every consumer thread of every tile at BM 64, 128, 160 and 256: every column written once, with the
bits of wg_bf16, and read back once where the combine takes it. Needs nvcc (host compilation only; no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_down_bf16_emulator(tmp_path):
    assert run_emulator(tmp_path, "down_bf16_emu", "-arch=sm_90a").count("ok  ") == 11
