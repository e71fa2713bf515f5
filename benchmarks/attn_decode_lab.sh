#!/usr/bin/env bash
# Decode-attention lab (benchmarks/attn_decode_lab.cu): builds it for several CTA shapes (warps x tile rows
# x least rows a CTA; ~20 s each, in parallel) and runs each on the H200 (~5 s each, mostly the host
# reference), then compares every shape's o with the first's. SHAPES="4x32x32 4x64x64 4x32x64 4x32x128" by
# default (the first is the engine's).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${OUT_DIR:-${TMPDIR:-/tmp}/attn_decode_lab}
mkdir -p "$dir"
shapes=${SHAPES:-"4x32x32 4x64x64 4x32x64 4x32x128"}
for sh in $shapes; do
  nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -lineinfo -Xptxas=-warn-spills -I csrc \
    -DLILY_DECODE_WARPS="$(cut -dx -f1 <<<"$sh")" -DLILY_DECODE_TILE="$(cut -dx -f2 <<<"$sh")" \
    -DLILY_DECODE_MIN_ROWS="$(cut -dx -f3 <<<"$sh")" -o "$dir/lab_$sh" benchmarks/attn_decode_lab.cu &
done
wait
for sh in $shapes; do OUT_DIR=$dir "$dir/lab_$sh" | { [[ $sh == "${shapes%% *}" ]] && cat || tail -n +3; }; done
python3 - "$dir" $shapes <<'PY'
import sys, numpy as np
d, shapes = sys.argv[1], sys.argv[2:]
tag = lambda s: "w%s_t%s_r%s" % tuple(s.split("x"))
for ctx in (4096, 32768, 131072):
    a = np.fromfile(f"{d}/o_{tag(shapes[0])}_{ctx}.bin", np.float32)
    for s in shapes[1:]:
        b = np.fromfile(f"{d}/o_{tag(s)}_{ctx}.bin", np.float32)
        print(f"context {ctx}: {s} vs {shapes[0]}: max rel diff {np.abs(a - b).max() / np.abs(a).max():.2e}")
PY
