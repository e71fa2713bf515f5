#!/bin/bash
# Side by side on the GPU host: builds this tree and BASE (a commit of this repository, or a folder holding
# another tree, e.g. `git archive C | tar -x -C .ab-base` carried to the host: its .git may lag) in one call, writes
# the full-size synthetic checkpoint once, then runs bench_engine.py alternately (base, new) for ROUNDS
# rounds at CONTEXTS, compares the text path's bits (text_digest.py) under both, and prints the per-round rows
# and the medians of both builds last.
#   BASE=8dd1df3 ROUNDS=2 CONTEXTS=4096 [LABS="gemv gemm"] bash benchmarks/ab_host.sh
# LABS run after the builds and before the benchmark. Logs end in $OUT/logs.tgz (ab.log, build.log,
# base_build.log, <lab>_lab.txt; ab.log also beside it).
set -uo pipefail
: "${BASE:?set BASE to a commit}"
OUT=${OUT:-${TMPDIR:-/tmp}/lily-out}
FULL=${FULL:-${TMPDIR:-/tmp}/full}
ROUNDS=${ROUNDS:-2}
CONTEXTS=${CONTEXTS:-4096}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
source "$(dirname "$0")/host_lib.sh"
src=$(pwd)
basedir=${TMPDIR:-/tmp}/ab-base basepkg=${TMPDIR:-/tmp}/ab-basepkg
rm -rf "$basedir" "$basepkg"
if [[ -d $BASE ]]; then
  cp -r "$BASE" "$basedir"
else
  git worktree prune
  git worktree add -f "$basedir" "$BASE" >"$OUT/worktree.log" 2>&1 || { cat "$OUT/worktree.log"; echo "no commit $BASE"; exit 1; }
fi
(python3 -m pip install -q --no-build-isolation --no-deps --target "$basepkg" "$basedir" >"$OUT/base_build.log" 2>&1 \
  || echo "BASE BUILD FAILED") &
base_pid=$!
host_build || exit 1
wait "$base_pid"
labs_pid=
if [[ -n ${LABS:-} ]]; then  # the labs (LABS="gemv gemm ...") run before the benchmark, never beside it
  (for lab in $LABS; do bash "benchmarks/${lab}_lab.sh" >"$OUT/${lab}_lab.txt" 2>&1 || echo "LAB $lab FAILED" >>"$OUT/${lab}_lab.txt"; done) &
  labs_pid=$!
fi
cd "${TMPDIR:-/tmp}"  # import the installed package, not the source tree
host_full_checkpoint "$FULL" || exit 1
[[ -n $labs_pid ]] && wait "$labs_pid"
for ((r = 1; r <= ROUNDS; ++r)); do
  for build in base new; do
    path=$([[ $build == base ]] && echo "$basepkg" || echo "")
    PYTHONPATH=$path python3 "$src/benchmarks/bench_engine.py" --model "$FULL" --contexts "$CONTEXTS" \
      --json "$OUT/ab_${build}_$r.json" 2>&1 | grep -v "tensor/s" >>"$OUT/ab.log"
  done
done
# the text path's bits under both builds (benchmarks/text_digest.py: chunked prefill + graph decode logits)
digests=()
for build in base new; do
  path=$([[ $build == base ]] && echo "$basepkg" || echo "")
  d=$(PYTHONPATH=$path python3 "$src/benchmarks/text_digest.py" --model "$FULL" 2>&1 | grep "text digest")
  echo "$build: $d" | tee -a "$OUT/ab.log"
  digests+=("${d%% (*}")
done
if [[ -n ${digests[0]} && ${digests[0]} == "${digests[1]}" ]]; then verdict="bit-identical"; else verdict="DIFFERENT bits (or a failed run)"; fi
echo "text path: $verdict" | tee -a "$OUT/ab.log"
python3 - "$OUT" "$ROUNDS" "$BASE" <<'EOF'
import json, statistics, sys
out, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for build in ("base", "new"):
    for r in range(1, rounds + 1):
        try:
            res = json.load(open(f"{out}/ab_{build}_{r}.json"))
        except OSError:
            continue
        for row in res["rows"]:
            rows.setdefault((row["context"], build), []).append(row)
print(f"| context | build | decode ms/tok (rounds) | median | prefill ms (rounds) | median | graph nodes |")
print("|---:|---|---|---:|---|---:|---:|")
for (ctx, build), rs in sorted(rows.items()):
    d = [x["decode_ms"] for x in rs]
    p = [x["prefill_s"] * 1e3 for x in rs]
    name = base if build == "base" else "this tree"
    print(f"| {ctx} | {name} | {', '.join(f'{v:.3f}' for v in d)} | {statistics.median(d):.3f} | "
          f"{', '.join(f'{v:.1f}' for v in p)} | {statistics.median(p):.1f} | {rs[0]['graph_nodes']} |")
EOF
host_pack_out ab.log  # everything else is in logs.tgz
