#!/bin/bash
# One call on the GPU host: build lily with CUDA, run the GPU tests, then (stage "bench") generate the
# full-size synthetic checkpoint and measure it (engine table, per-group and per-kernel profiles), and the
# full-size vision tower (bench_vision.py on the tiny text model).
# LABS="gemv gemm ..." also builds and runs benchmarks/<name>_lab.sh while lily builds (the GPU is idle
# then); their tables go to <name>_lab.txt. Every log ends in $OUT/logs.tgz (tests.log, bench.log,
# kernels.log and vision.log also beside it: the device tool returns at most 8 files); a short table is
# printed last.
# PROFILE=0 skips the per-group and per-kernel profiles of the bench stage. TEST_JOBS=N runs the GPU
# tests in N pytest-xdist workers instead of one process per file (unmeasured: compare the wall time).
#   bash benchmarks/gpu_host.sh [tests|bench|all] [pytest -k expression]
set -uo pipefail
stage=${1:-all}
kexpr=${2:-}
OUT=${OUT:-/tmp/lily-out}          # the device tool sets OUT; a local default otherwise
FULL=${FULL:-/tmp/full}            # where the full-size synthetic checkpoint is written
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
source "$(dirname "$0")/host_lib.sh"   # host_build, host_full_checkpoint
labs_pid=
if [[ -n ${LABS:-} ]]; then
  (for lab in $LABS; do bash "benchmarks/${lab}_lab.sh" >"$OUT/${lab}_lab.txt" 2>&1 || echo "LAB $lab FAILED" >>"$OUT/${lab}_lab.txt"; done) &
  labs_pid=$!
fi
host_build || exit 1
[[ -n $labs_pid ]] && wait "$labs_pid"
cd /tmp  # import the installed package, not the source tree
src=$OLDPWD
python3 -c "import lily; from lily import _core; print('cuda available:', _core.backend_available('cuda'))"
if [[ $stage == bench || $stage == all ]]; then
  host_full_checkpoint "$FULL"
  export LILY_FULL_CHECKPOINT=$FULL
fi
if [[ $stage == tests || $stage == all ]]; then
  t0=$(date +%s)
  if [[ ${TEST_JOBS:-1} -gt 1 ]]; then
    # TEST_JOBS worker processes (the image's pytest-xdist), tests dealt one by one; a crashed worker is
    # reported as such and replaced
    python3 -m pytest -q -p no:cacheprovider -n "$TEST_JOBS" --dist load "$src/tests/gpu" ${kexpr:+-k "$kexpr"} \
      --tb=short -rfE 2>&1 | grep -v "tensor/s" >"$OUT/tests_all.log"
    echo "tests/gpu with $TEST_JOBS workers: rc ${PIPESTATUS[0]}: $(tail -1 "$OUT/tests_all.log")" | tee "$OUT/tests.log"
  else
    # one process per file: a crash in one file is reported as that file's result and the others still run
    # (-n 0: no xdist workers, whatever pyproject's addopts say)
    for f in "$src"/tests/gpu/test_*.py; do
      python3 -m pytest -q -p no:cacheprovider -n 0 "$f" ${kexpr:+-k "$kexpr"} --tb=short -rfE 2>&1 \
        | grep -v "tensor/s" >"$OUT/tests_$(basename "$f" .py).log"
      echo "$(basename "$f"): rc ${PIPESTATUS[0]}: $(tail -1 "$OUT/tests_$(basename "$f" .py).log")"
    done | tee "$OUT/tests.log"
  fi
  grep -h "^FAILED\|^ERROR" "$OUT"/tests_*.log | head -40
  echo "gpu tests: $(( $(date +%s) - t0 )) s"
fi
if [[ $stage == bench || $stage == all ]]; then
  profile=${PROFILE:-1}
  python3 "$src/benchmarks/bench_engine.py" --model "$FULL" --contexts ${CONTEXTS:-1024,4096,16384} \
    $([[ $profile == 1 ]] && echo --profile) --json "$OUT/bench.json" 2>&1 | grep -v "tensor/s" | tee "$OUT/bench.log" | tail -70
  if [[ $profile == 1 ]]; then  # per-kernel device times of eager decode steps and one prefill (torch.profiler)
    python3 "$src/benchmarks/kernel_profile.py" --model "$FULL" --context 4096 --rows 30 --short 11 2>&1 \
      | grep -v "tensor/s\|UserWarning\|warn_once" > "$OUT/kernels.log" && echo "kernel profile: kernels.log"
  fi
  # the vision tower (full size, on the tiny text model): encode time per image size, per-op profile, TTFT
  python3 "$src/benchmarks/bench_vision.py" --json "$OUT/vision.json" 2>&1 | tee "$OUT/vision.log" | tail -6
fi
host_pack_out tests.log bench.log kernels.log vision.log  # everything else is in logs.tgz
