#!/usr/bin/env bash
# GDN decode layer lab (benchmarks/gdn_fused_lab.cu): in_proj GEMV + gdn_decode_mixer as two kernels against
# gdn_in_proj_mixer_kernel, 30 layers in a CUDA graph with PDL, bit-for-bit check first. Builds it (~1 min)
# and runs it (~10 s); with OUT set also writes $OUT/gdn_fused_lab.md.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -I csrc -o "${TMPDIR:-/tmp}/gdn_fused_lab" \
  benchmarks/gdn_fused_lab.cu
if [[ -n ${OUT:-} ]]; then
  "${TMPDIR:-/tmp}/gdn_fused_lab" | tee "$OUT/gdn_fused_lab.md"
else
  "${TMPDIR:-/tmp}/gdn_fused_lab"
fi
