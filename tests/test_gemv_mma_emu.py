"""The integer tensor-core GEMV's fragment logic on the CPU (tests/emu/gemv_mma_emu.cu): the kernel's own
block scaling, digit split, A/B fragment mapping and column epilogue against fp64, with mma.sync emulated
from the PTX fragment tables; and the multi-token kernel's staged layout (kernels/gemv_mma_tokens.cuh):
each of T tokens read through it gives its one-token tile bit for bit; and which short prompts take that kernel
(gemv_plan.h's mma_tokens_shape: the model's layer matrices, not its lm_head). Needs nvcc (host compilation only;
no GPU)."""
from __future__ import annotations

import shutil

import pytest
from checks import run_emulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_gemv_mma_fragment_emulator(tmp_path):
    assert run_emulator(tmp_path, "gemv_mma_emu").count("ok  ") == 18 + 12 + 1
