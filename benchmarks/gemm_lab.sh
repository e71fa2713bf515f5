#!/usr/bin/env bash
# Prefill GEMM lab (benchmarks/gemm_lab.cu): old mma.sync GEMM vs the wgmma GEMM, timed and self-checked.
# Builds it (~1 min on 2 cores, less on the H200's 16) and runs it (< 30 s) on the H200. Exit status 1 on
# any FAIL or CUDA error. With OUT set it also writes $OUT/gemm_lab.md. Flags as CMakeLists.txt's CUDA ones.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills \
  -I csrc -o "${TMPDIR:-/tmp}/gemm_lab" benchmarks/gemm_lab.cu
if [ -n "${OUT:-}" ]; then
  "${TMPDIR:-/tmp}/gemm_lab" | tee "$OUT/gemm_lab.md"
else
  "${TMPDIR:-/tmp}/gemm_lab"
fi
