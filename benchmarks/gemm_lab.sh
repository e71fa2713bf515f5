#!/usr/bin/env bash
# Prefill GEMM lab (benchmarks/gemm_lab.cu): the mma.sync GEMM, the retired wgmma GEMM, the library's
# TMA GEMM, the few-rows MoE expert kernels (small) and, when asked (GEMM_LAB_GROUPS=expert), the
# one-tile-per-expert MoE variant (expert), timed and self-checked. Builds it (~15 s on 2 cores) and runs it on the H200, one process per kernel group
# (a crash or hang in one variant is reported and the others still run; each group has a time limit).
# Exit status 1 on any FAIL, CUDA error or time-out. With OUT set it also writes $OUT/gemm_lab.md.
# Flags as CMakeLists.txt's CUDA ones. GEMM_LAB_GROUPS overrides the groups ("old,wgmma tma").
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${TMPDIR:-/tmp}/gemm_lab"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills \
  -I csrc -o "$BIN" benchmarks/gemm_lab.cu || exit 1
GROUPS_="${GEMM_LAB_GROUPS:-old,wgmma tma small}"
run_all() {
  local status=0 first=1 g
  for g in $GROUPS_; do
    local args=(${g//,/ })
    [ $first = 1 ] || args=(-n "${args[@]}")
    first=0
    timeout 60 "$BIN" "${args[@]}"
    local rc=$?
    if [ $rc != 0 ]; then
      [ $rc = 124 ] && echo "gemm_lab: group '$g' timed out after 60 s (hang?)" || echo "gemm_lab: group '$g' exit status $rc"
      status=1
    fi
  done
  [ $status = 0 ] && echo && echo "gemm_lab: all checks passed"
  return $status
}
if [ -n "${OUT:-}" ]; then
  run_all 2>&1 | tee "$OUT/gemm_lab.md"
else
  run_all 2>&1
fi
