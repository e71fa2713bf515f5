#!/usr/bin/env bash
# Decode-GEMV lab (benchmarks/gemv_lab.cu): builds it (~15 s) and runs it (~5-10 s) on the H200.
# Prints a markdown table; with OUT set it also writes $OUT/gemv_lab.md. Flags as CMakeLists.txt's CUDA ones.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills -I csrc \
  -o "${TMPDIR:-/tmp}/gemv_lab" benchmarks/gemv_lab.cu
"${TMPDIR:-/tmp}/gemv_lab"
