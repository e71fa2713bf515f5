#!/usr/bin/env bash
# Dense BF16 GEMM lab (benchmarks/dense_lab.cu): the vision tower's products on the mma.sync GEMM and on the
# dense wgmma GEMM, timed and self-checked on the H200. Builds it (~1 min on 2 cores), runs it with a time
# limit; exit status 1 on any FAIL, CUDA error or time-out. DENSE_LAB_T sets the rows (default 4096 = 1 MP).
# With OUT set it also writes $OUT/dense_lab.md. Flags as CMakeLists.txt's CUDA ones.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${TMPDIR:-/tmp}/dense_lab"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills \
  -I csrc -o "$BIN" benchmarks/dense_lab.cu || exit 1
if [ -n "${OUT:-}" ]; then
  timeout 300 "$BIN" 2>&1 | tee "$OUT/dense_lab.md"
  exit "${PIPESTATUS[0]}"
fi
timeout 300 "$BIN"
