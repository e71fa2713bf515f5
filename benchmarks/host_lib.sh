# Functions shared by the GPU-host scripts (gpu_host.sh, sweep_host.sh); source it, with OUT set.
# Both run from the repository root and leave the working directory as they found it.

# Build and install lily (CUDA backend) into the host's python, or reuse the installed one when
# SKIP_BUILD is set and lily imports. The build log goes to $OUT/build.log.
host_build() {
  local t0
  t0=$(date +%s)
  # a carried nanobind wheel (.whl/nanobind-*.whl, e.g. PyPI's, as CI builds with) replaces the image's
  if compgen -G ".whl/nanobind-*.whl" >/dev/null; then
    local site=${TMPDIR:-/tmp}/nbsite
    python3 -m pip install -q --no-deps --target "$site" .whl/nanobind-*.whl && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    echo "build: nanobind $(python3 -c 'import nanobind; print(nanobind.__version__)') (carried)"
  else
    echo "build: nanobind $(python3 -c 'import nanobind; print(nanobind.__version__)') (the image's)"
  fi
  if [[ -n ${SKIP_BUILD:-} ]] && (cd /tmp && python3 -c "import lily._core") 2>/dev/null; then
    echo "build: reusing the installed lily"
  elif host_prebuilt_install . "" >"$OUT/build.log" 2>&1; then
    echo "build: installed the prebuilt wheel $(basename .prebuilt/lily-*.whl)"
  elif ! python3 -m pip install --no-build-isolation --no-deps -v . >>"$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40
    echo "BUILD FAILED"; return 1
  fi
  grep -E "spill|lily:" "$OUT/build.log" 2>/dev/null | grep -v " 0 bytes spill" | head -20
  echo "build: $(( $(date +%s) - t0 )) s"
}

# A hash of the sources a build of tree DIR compiles and packages (csrc, src, CMakeLists.txt,
# pyproject.toml): benchmarks/prebuild.sh stores it beside the wheel it builds. The file order is
# C-locale (the host's and this machine's locales differ).
host_source_hash() {
  (cd "$1" && find csrc src CMakeLists.txt pyproject.toml -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
     | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}

# Install tree DIR's prebuilt wheel (DIR/.prebuilt, benchmarks/prebuild.sh) into the host's python, or
# into folder TARGET when given, if its hash matches DIR's sources and its CUDA backend loads there.
# Fails otherwise (no wheel, stale, or it does not load on this image), so the caller builds instead.
host_prebuilt_install() {
  local dir=$1 target=$2 whl
  whl=$(compgen -G "$dir/.prebuilt/lily-*.whl" | head -1)
  [[ -n $whl && -f $dir/.prebuilt/SOURCE_HASH ]] || { echo "prebuilt: none in $dir"; return 1; }
  [[ $(cat "$dir/.prebuilt/SOURCE_HASH") == $(host_source_hash "$dir") ]] || { echo "prebuilt: stale for $dir"; return 1; }
  if [[ -n $target ]]; then
    python3 -m pip install -q --no-deps --upgrade --target "$target" "$whl" || return 1  # a warm host's earlier copy
  else
    python3 -m pip install -q --no-deps --force-reinstall "$whl" || return 1
  fi
  (cd /tmp && PYTHONPATH=${target:-${PYTHONPATH:-}} python3 -c \
    "import lily._core as c; assert c.backend_available('cuda'), 'no CUDA backend'") || { echo "prebuilt: does not load here"; return 1; }
}

# Write the full-size synthetic Qwen3.6-35B-A3B checkpoint (MLX 4-bit, ~19.5 GB, deterministic) to
# DIR with the installed lily. With REUSE=1, a complete earlier copy (config.json is written last)
# is kept.
host_full_checkpoint() {
  local dir=$1 t0
  t0=$(date +%s)
  if [[ -n ${REUSE:-} && -f $dir/config.json ]]; then
    echo "full-size checkpoint: reusing $dir ($(du -sh "$dir" | cut -f1))"
    return 0
  fi
  (cd /tmp && python3 -c "from lily.checkpoint import synthetic; synthetic.make_checkpoint('$dir', 'qwen3.6-35b-a3b', with_tokenizer=False)") \
    || { echo "CHECKPOINT FAILED"; return 1; }
  echo "full-size checkpoint: $(( $(date +%s) - t0 )) s, $(du -sh "$dir" | cut -f1)"
}

# The device tool returns at most 8 files from $OUT: pack every file of $OUT into $OUT/logs.tgz, then
# remove all but logs.tgz and the named files (e.g. `host_pack_out bench.log kernels.log`).
host_pack_out() {
  (cd "$OUT" || return 1
   tar czf "${TMPDIR:-/tmp}/lily-logs.tgz" --exclude=logs.tgz . && mv "${TMPDIR:-/tmp}/lily-logs.tgz" logs.tgz
   for f in *; do
     [[ $f == logs.tgz ]] && continue
     keep=0
     for k in "$@"; do [[ $f == "$k" ]] && keep=1; done
     [[ $keep == 1 ]] || rm -rf -- "$f"
   done)
}
