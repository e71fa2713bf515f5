#!/usr/bin/env bash
# Decode chain lab (benchmarks/chain_lab.cu): builds it (~15 s) and runs it (a few seconds) on the H200.
# Prints a markdown table; with OUT set it also writes $OUT/chain_lab.md.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills -I csrc \
  -o "${TMPDIR:-/tmp}/chain_lab" benchmarks/chain_lab.cu
if [[ -n ${OUT:-} ]]; then "${TMPDIR:-/tmp}/chain_lab" | tee "$OUT/chain_lab.md"; else "${TMPDIR:-/tmp}/chain_lab"; fi
