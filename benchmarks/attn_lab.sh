#!/usr/bin/env bash
# Prefill attention lab (benchmarks/attn_lab.cu): attention_prefill_kernel<256> (mma.sync) against
# attention_prefill_wgmma_kernel (kernels/attention_wgmma.cuh, what the engine runs at D = 256) at the
# engine's shapes, timed and self-checked. Builds it and runs it on the GPU under a 120 s time-out (a
# protocol bug on the wgmma kernel's consumer side hangs instead of trapping: kernels/attention_wgmma.cuh,
# awg_wait).
# Exit status 1 on any FAIL, CUDA error or time-out. With OUT set it also writes $OUT/attn_lab.md.
# Flags as CMakeLists.txt's CUDA ones; -Xptxas=-v prints the register counts.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${TMPDIR:-/tmp}/attn_lab"
rm -f "$BIN"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills,-v \
  -I csrc -o "$BIN" benchmarks/attn_lab.cu 2>&1 | grep -E "error|warning|C75|Compiling entry|Used|spill" || true
[ -x "$BIN" ] || exit 1
run() {
  timeout 120 "$BIN"
  local rc=$?
  if [ $rc != 0 ]; then
    [ $rc = 124 ] && echo "attn_lab: timed out after 120 s (hang?)" || echo "attn_lab: exit status $rc"
    return 1
  fi
  echo && echo "attn_lab: all checks passed"
}
if [ -n "${OUT:-}" ]; then
  run 2>&1 | tee "$OUT/attn_lab.md"
else
  run 2>&1
fi
