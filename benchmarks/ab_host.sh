#!/bin/bash
# Side by side on the GPU host: builds this tree and each tree of BASE (a commit of this repository, or a
# folder holding another tree, e.g. `git archive C | tar -x -C .ab-base` carried to the host: its .git
# may lag; several, space-separated, to attribute stacked changes in one call), writes the full-size
# synthetic checkpoint once, then runs bench_engine.py alternately (each base in order, then this tree)
# for ROUNDS rounds at CONTEXTS, compares the text path's bits (text_digest.py) of every base with this
# tree's, and prints the per-round rows and the medians of every build.
#   BASE=8dd1df3 ROUNDS=2 CONTEXTS=4096 [LABS="gemv gemm"] [GENERATE=128] bash benchmarks/ab_host.sh
#   BASE="$PWD/.ab-base $PWD/.ab-mid" ... (the first base installs to ${TMPDIR:-/tmp}/ab-basepkg, the
#   next to ab-basepkg2, ...). A tree with a fresh .prebuilt wheel (benchmarks/prebuild.sh) is not compiled.
# Rows: decode as Model.generate runs it (pipelined where the build has it), the same steps one at a
# time, and Model.generate's stream in tokens/s (GENERATE tokens; 0 skips it).
# LABS run after the builds and before the benchmark. Logs end in $OUT/logs.tgz (ab.log, build.log,
# base_build*.log, <lab>_lab.txt; ab.log also beside it).
set -uo pipefail
: "${BASE:?set BASE to a commit or a tree folder (or several)}"
OUT=${OUT:-${TMPDIR:-/tmp}/lily-out}
FULL=${FULL:-${TMPDIR:-/tmp}/full}
ROUNDS=${ROUNDS:-2}
CONTEXTS=${CONTEXTS:-4096}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
source "$(dirname "$0")/host_lib.sh"
src=$(pwd)
read -r -a bases <<<"$BASE"
pids=() pkgs=()
for i in "${!bases[@]}"; do
  n=$([[ $i == 0 ]] && echo "" || echo $((i + 1)))
  basedir=${TMPDIR:-/tmp}/ab-base$n basepkg=${TMPDIR:-/tmp}/ab-basepkg$n
  pkgs+=("$basepkg")
  rm -rf "$basedir" "$basepkg"
  if [[ -d ${bases[$i]} ]]; then
    cp -r "${bases[$i]}" "$basedir"
  else
    git worktree prune
    git worktree add -f "$basedir" "${bases[$i]}" >"$OUT/worktree$n.log" 2>&1 \
      || { cat "$OUT/worktree$n.log"; echo "no commit ${bases[$i]}"; exit 1; }
  fi
  (host_prebuilt_install "$basedir" "$basepkg" >"$OUT/base_build$n.log" 2>&1 \
    || { rm -rf "$basepkg"; python3 -m pip install -q --no-build-isolation --no-deps --target "$basepkg" "$basedir" \
           >>"$OUT/base_build$n.log" 2>&1; } || echo "BASE BUILD FAILED: ${bases[$i]}") &
  pids+=($!)
done
host_build || exit 1
wait "${pids[@]}"
labs_pid=
if [[ -n ${LABS:-} ]]; then  # the labs (LABS="gemv gemm ...") run before the benchmark, never beside it
  (for lab in $LABS; do bash "benchmarks/${lab}_lab.sh" >"$OUT/${lab}_lab.txt" 2>&1 || echo "LAB $lab FAILED" >>"$OUT/${lab}_lab.txt"; done) &
  labs_pid=$!
fi
cd "${TMPDIR:-/tmp}"  # import the installed package, not the source tree
host_full_checkpoint "$FULL" || exit 1
[[ -n $labs_pid ]] && wait "$labs_pid"
builds=()
for i in "${!bases[@]}"; do builds+=("base$i"); done
builds+=(new)
for ((r = 1; r <= ROUNDS; ++r)); do
  for b in "${builds[@]}"; do
    path=$([[ $b == new ]] && echo "" || echo "${pkgs[${b#base}]}")
    PYTHONPATH=$path python3 "$src/benchmarks/bench_engine.py" --model "$FULL" --contexts "$CONTEXTS" \
      --generate "${GENERATE:-128}" --json "$OUT/ab_${b}_$r.json" 2>&1 | grep -v "tensor/s" >>"$OUT/ab.log"
  done
done
# the text path's bits under every build (benchmarks/text_digest.py: chunked prefill + graph decode logits)
digests=()
for b in "${builds[@]}"; do
  path=$([[ $b == new ]] && echo "" || echo "${pkgs[${b#base}]}")
  d=$(PYTHONPATH=$path python3 "$src/benchmarks/text_digest.py" --model "$FULL" 2>&1 | grep "text digest")
  echo "$b: $d" | tee -a "$OUT/ab.log"
  d=${d#*text digest }; digests+=("${d%% *}")  # the hash alone (graph nodes may differ)
done
for i in "${!bases[@]}"; do
  if [[ -n ${digests[$i]} && ${digests[$i]} == "${digests[-1]}" ]]; then verdict="bit-identical"
  else verdict="DIFFERENT bits (or a failed run)"; fi
  echo "text path, ${bases[$i]} vs this tree: $verdict" | tee -a "$OUT/ab.log"
done
python3 - "$OUT" "$ROUNDS" "${builds[@]}" -- "${bases[@]}" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
sep = sys.argv.index("--")
builds, names = sys.argv[3:sep], sys.argv[sep + 1:] + ["this tree"]
rows = {}
for i, build in enumerate(builds):
    for r in range(1, rounds + 1):
        try:
            res = json.load(open(f"{out}/ab_{build}_{r}.json"))
        except OSError:
            continue
        for row in res["rows"]:
            rows.setdefault((row["context"], i), []).append(row)
print(f"| context | build | decode ms/tok (rounds) | median | one at a time ms/tok | generate tok/s | "
      f"prefill ms (rounds) | median | graph nodes |")
print("|---:|---|---|---:|---:|---:|---|---:|---:|")
med = lambda rs, key: f"{statistics.median(x[key] for x in rs):.3f}" if key in rs[0] else "-"
for (ctx, i), rs in sorted(rows.items()):
    d = [x["decode_ms"] for x in rs]
    p = [x["prefill_s"] * 1e3 for x in rs]
    mode = "" if rs[0].get("pipelined") else " (one at a time)"
    print(f"| {ctx} | {names[i]} | {', '.join(f'{v:.3f}' for v in d)}{mode} | {statistics.median(d):.3f} | "
          f"{med(rs, 'decode_sync_ms')} | {med(rs, 'generate_tok_s')} | "
          f"{', '.join(f'{v:.1f}' for v in p)} | {statistics.median(p):.1f} | {rs[0]['graph_nodes']} |")
EOF
host_pack_out ab.log  # everything else is in logs.tgz
