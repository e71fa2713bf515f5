#!/usr/bin/env bash
# Chunked GDN prefill lab (benchmarks/gdn_lab.cu): builds it (~30 s) and runs it (~5-10 s) on the H200.
# Prints markdown tables, a "gdn_lab bits:" hash line and "gdn_lab: all checks ok" or "gdn_lab: FAIL"
# (exit 1); with OUT set it also writes $OUT/gdn_lab.md. Flags as CMakeLists.txt's CUDA ones.
# BASE=<commit or tree folder>: also builds the lab against that commit's (folder's) csrc/cuda/kernels/gdn_chunk.cuh (the rest of
# csrc as in the tree), runs it, and FAILs unless both print the same bits line: a change meant to keep
# every value (index math, load instructions) must give the same o, state and workspace bits. With
# BASE_BITS=differ (a change of the arithmetic: BASE=2efb1ff, the 3xTF32 kernels, against 3xBF16) it
# prints the base's table instead, for the times side by side (the base must have prep_kernel<>).
# No GPU needed for the host emulation of the same kernels (it prints its own bit hashes):
#   g++ -O2 -std=c++20 -I csrc -o "${TMPDIR:-/tmp}/gdn_emu" benchmarks/gdn_emu.cpp && "${TMPDIR:-/tmp}/gdn_emu"
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="${TMPDIR:-/tmp}"
build() {  # build <csrc dir> <binary>
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills \
    -I "$1" -o "$2" benchmarks/gdn_lab.cu
}
build csrc "$tmp/gdn_lab"
"$tmp/gdn_lab" | tee "$tmp/gdn_lab.out"
if [[ -n "${BASE:-}" ]]; then
  rm -rf "$tmp/gdn_lab_base" && mkdir -p "$tmp/gdn_lab_base" && cp -r csrc "$tmp/gdn_lab_base/"
  if [[ -d "$BASE" ]]; then cp "$BASE/csrc/cuda/kernels/gdn_chunk.cuh" "$tmp/gdn_lab_base/csrc/cuda/kernels/gdn_chunk.cuh"
  else git show "$BASE:csrc/cuda/kernels/gdn_chunk.cuh" > "$tmp/gdn_lab_base/csrc/cuda/kernels/gdn_chunk.cuh"; fi
  build "$tmp/gdn_lab_base/csrc" "$tmp/gdn_lab_base/gdn_lab"
  "$tmp/gdn_lab_base/gdn_lab" > "$tmp/gdn_lab_base.out" || true
  new=$(grep '^gdn_lab bits:' "$tmp/gdn_lab.out") old=$(grep '^gdn_lab bits:' "$tmp/gdn_lab_base.out")
  echo "base $BASE: $old"
  if [[ "${BASE_BITS:-same}" == differ ]]; then echo "## base $BASE"; grep '^|' "$tmp/gdn_lab_base.out"; exit 0; fi
  if [[ "$new" != "$old" ]]; then echo "gdn_lab: FAIL (bits differ from $BASE)"; exit 1; fi
  echo "gdn_lab: bit-identical to $BASE"
fi
