#!/bin/bash
# lily vs MLX-LM on the GPU host in one call (docs/bench.md): numerics, then the throughput sweep
# within what is left of a wall-clock deadline, then the report. Everything lands in $OUT; a short
# table is printed last.
#   [PYTHONPATH=$HOME/site] [LILY_COMMIT=sha] bash benchmarks/sweep_host.sh [all|build|numerics|sweep]
# (build: only build lily and write the checkpoint, e.g. in the call that brings the first MLX wheels)
# Environment (defaults in brackets):
#   OUT [/tmp/lily-out]  FULL checkpoint folder [/tmp/full; written unless complete and REUSE=1]
#   DEADLINE  seconds for this whole script, from its start [540]; the sweep gets what is left minus 20 s
#   BUDGET    the sweep's time budget in seconds, instead of the DEADLINE rule
#   ARM_TIMEOUT [240]  CONTEXTS [all]  ROUNDS [2]  ENGINES [lily,mlx]  MAX_CONTEXT [e.g. mlx=16K]
#   DEVICE [cuda]  CPU_LAYERS [4]  NUMERICS_TIMEOUT per engine [150]  NUMERICS_BUDGET all engines [240]
#   NUMERICS_REDUCED / NUMERICS_FULL  engines of each numerics run [lily-DEVICE,lily-cpu,mlx,mlx-fp32 /
#             lily-DEVICE,mlx,mlx-fp32]; NUMERICS_FULL= (empty) skips the full-model run
#   RESUME_FROM  a results.json of an earlier call: its measured arms are kept, the rest is run
#   MLX_WARMUP_TIMEOUT [420]  SKIP_MLX_WARMUP: skip the untimed MLX run that fills its kernel cache
#   SKIP_BUILD (reuse the installed lily)  DRY=1: no GPU, no build: a micro checkpoint, CPU, 256 and 512
set -uo pipefail
stage=${1:-all}
t_start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
src=$(dirname "$here")
OUT=${OUT:-/tmp/lily-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) LILY_SOURCE_DIR=$src
source "$here/host_lib.sh"   # host_build, host_full_checkpoint
if [[ -n ${DRY:-} ]]; then
  DEVICE=${DEVICE:-cpu}
  CONTEXTS=${CONTEXTS:-256,512}
  CPU_LAYERS=${CPU_LAYERS:-4}  # mlx-lm's qwen3_5 needs >= 4 layers
  FULL=${FULL:-$OUT/micro}
  (cd /tmp && python3 -c "from lily.bench import micro_checkpoint; micro_checkpoint('$FULL')") || exit 1
  echo "dry run: micro checkpoint $FULL, device $DEVICE"
else
  FULL=${FULL:-/tmp/full}
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
  host_build || exit 1
  host_full_checkpoint "$FULL" || exit 1
fi
if [[ $stage == build ]]; then
  echo "total: $(( $(date +%s) - t_start )) s"
  exit 0
fi
DEVICE=${DEVICE:-cuda}
NUMERICS_REDUCED=${NUMERICS_REDUCED-}
NUMERICS_FULL=${NUMERICS_FULL-default}
cd /tmp  # import the installed package, not the source tree
py="python3 -m lily.bench.cli"
if python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device(), 'mlx_lm', mlx_lm.__version__)" \
    2>/dev/null; then
  # MLX compiles its CUDA kernels on first use (NVRTC, cached on disk): on a fresh host that took
  # longer than a 150 s arm timeout (2026-11-29). One untimed short run fills the cache first.
  if [[ ,${ENGINES:-lily,mlx}, == *,mlx,* && -z ${SKIP_MLX_WARMUP:-} ]]; then
    t0=$(date +%s)
    timeout "${MLX_WARMUP_TIMEOUT:-420}" python3 -m lily.bench.arm --engine mlx --model "$FULL" --context 256 \
      --decode 4 --device "$DEVICE" >"$OUT/mlx_warmup.log" 2>&1
    echo "mlx kernel-cache warm-up: exit $?, $(( $(date +%s) - t0 )) s (untimed; log: mlx_warmup.log)"
  fi
else
  echo "MLX-LM is not importable here (PYTHONPATH=${PYTHONPATH:-}): its arms will say so"
fi

if [[ $stage == numerics || $stage == all ]]; then
  t0=$(date +%s)
  args=(--model "$FULL" --device "$DEVICE" --cpu-layers "${CPU_LAYERS:-4}" --timeout "${NUMERICS_TIMEOUT:-150}"
        --time-budget "${NUMERICS_BUDGET:-240}"
        --out "$OUT/numerics.json" --no-hash)
  [[ -n $NUMERICS_REDUCED ]] && args+=(--reduced-engines "$NUMERICS_REDUCED")
  [[ $NUMERICS_FULL != default ]] && args+=(--full-engines "$NUMERICS_FULL")
  $py numerics "${args[@]}" >"$OUT/numerics.log" 2>&1
  echo "numerics: exit $?, $(( $(date +%s) - t0 )) s (log: numerics.log)"
fi

if [[ $stage == sweep || $stage == all ]]; then
  budget=${BUDGET:-$(( ${DEADLINE:-540} - ($(date +%s) - t_start) - 20 ))}
  args=(--model "$FULL" --device "$DEVICE" --engines "${ENGINES:-lily,mlx}" --rounds "${ROUNDS:-2}"
        --time-budget "$budget" --arm-timeout "${ARM_TIMEOUT:-240}" --out "$OUT/results.json")
  [[ -n ${CONTEXTS:-} ]] && args+=(--contexts "$CONTEXTS")
  for cap in ${MAX_CONTEXT:-}; do args+=(--max-context "$cap"); done
  if [[ -n ${RESUME_FROM:-} ]]; then
    cp "$RESUME_FROM" "$OUT/results.json" && args+=(--resume)
  fi
  echo "sweep: budget ${budget} s"
  $py sweep "${args[@]}" >"$OUT/sweep.log" 2>&1
  echo "sweep: exit $?, $(( $(date +%s) - t_start )) s since start (log: sweep.log)"
fi

if [[ -f $OUT/results.json ]]; then
  rep=(report "$OUT/results.json" --markdown "$OUT/results.md")
  [[ -f $OUT/numerics.json ]] && rep+=(--numerics "$OUT/numerics.json")
  python3 -c "import matplotlib" 2>/dev/null && rep+=(--plot "$OUT/results.png")
  $py "${rep[@]}" || echo "report failed"
  echo "---- $OUT/results.md ----"
  grep -E "^- (GPU|lily|mlx|checkpoint|limits):" "$OUT/results.md"
  sed -n '/^| context/,/^$/p' "$OUT/results.md"
  grep -E "^\[[0-9]+\] " "$OUT/results.md"
  sed -n '/^## Numerics/,$p' "$OUT/results.md" | grep -E "^\||checkpoint \(|^not run"
elif [[ -f $OUT/numerics.json ]]; then
  python3 -c "import json, sys; from lily.bench.report import numerics_table; \
print(numerics_table(json.load(open(sys.argv[1]))))" "$OUT/numerics.json"
fi
echo "total: $(( $(date +%s) - t_start )) s"
