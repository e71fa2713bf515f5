#!/usr/bin/env bash
# Build lily's wheel here for the GPU host's Python (3.12), so that a device call installs it instead of
# compiling there (~45-60 s a build, twice in ab_host.sh). host_build and ab_host.sh use TREE/.prebuilt
# when its SOURCE_HASH matches the tree's sources and the wheel's CUDA backend loads on the host; else
# they build as before (a wheel built on this machine's image may not load on the host's).
#   bash benchmarks/prebuild.sh [TREE]      # TREE: a source tree (default: this repository), e.g. .ab-base
# Then name .prebuilt (and .ab-base) in the device call's carry. PREBUILD_PYTHON picks the interpreter.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tree=$(cd "${1:-$here}" && pwd)
py=${PREBUILD_PYTHON:-}
if [[ -z $py ]]; then  # the first python3.12 that runs (a pyenv shim may not)
  for cand in $(command -v python3.12 2>/dev/null) $(compgen -G "/root/.pyenv/versions/3.12*/bin/python3.12" || true); do
    "$cand" --version >/dev/null 2>&1 && { py=$cand; break; }
  done
fi
[[ -n $py ]] || { echo "prebuild: no python3.12 found (set PREBUILD_PYTHON)"; exit 1; }
source "$here/benchmarks/host_lib.sh"
rm -rf "$tree/.prebuilt"
mkdir -p "$tree/.prebuilt"
t0=$(date +%s)
"$py" -m pip wheel -q --no-deps -w "$tree/.prebuilt" "$tree" >"$tree/.prebuilt/build.log" 2>&1 \
  || { tail -30 "$tree/.prebuilt/build.log"; echo "prebuild: FAILED"; rm -rf "$tree/.prebuilt"; exit 1; }
host_source_hash "$tree" >"$tree/.prebuilt/SOURCE_HASH"
rm -f "$tree/.prebuilt/build.log"
echo "prebuild: $(ls "$tree/.prebuilt"/*.whl) ($(du -h "$tree/.prebuilt"/*.whl | cut -f1), $(( $(date +%s) - t0 )) s), hash $(cat "$tree/.prebuilt/SOURCE_HASH")"
