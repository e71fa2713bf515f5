#!/usr/bin/env bash
# Hand-over lab (benchmarks/cluster_lab.cu): one dependent phase through device memory over the whole GPU
# against one inside a thread-block cluster (DSMEM + cluster barrier). Builds it (~10 s) and runs it
# (~1 s) on the H200; prints a markdown table, with OUT set also $OUT/cluster_lab.md.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -o "${TMPDIR:-/tmp}/cluster_lab" benchmarks/cluster_lab.cu
if [[ -n ${OUT:-} ]]; then "${TMPDIR:-/tmp}/cluster_lab" | tee "$OUT/cluster_lab.md"; else "${TMPDIR:-/tmp}/cluster_lab"; fi
