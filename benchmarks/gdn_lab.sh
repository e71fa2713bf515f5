#!/usr/bin/env bash
# Chunked GDN prefill lab (benchmarks/gdn_lab.cu): builds it (~30 s) and runs it (~5-10 s) on the H200.
# Prints markdown tables and "gdn_lab: all checks ok" or "gdn_lab: FAIL" (exit 1); with OUT set it also
# writes $OUT/gdn_lab.md. Flags as CMakeLists.txt's CUDA ones. No GPU needed for the host emulation of the
# same kernels: g++ -O2 -std=c++20 -I csrc -o "${TMPDIR:-/tmp}/gdn_emu" benchmarks/gdn_emu.cpp && "${TMPDIR:-/tmp}/gdn_emu"
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills -I csrc \
  -o "${TMPDIR:-/tmp}/gdn_lab" benchmarks/gdn_lab.cu
"${TMPDIR:-/tmp}/gdn_lab"
