#!/usr/bin/env bash
# Copied from shared/tools/install_mlx.sh (shared/ does not travel to the GPU host); the wheels come from
# shared/tools/mlx_wheels.sh, run on the dev machine. See docs/bench.md.
# Reassemble and install the wheels prepared by mlx_wheels.sh, offline, into SITE (then PYTHONPATH=SITE).
#   usage: install_mlx.sh FOLDER SITE   (FOLDER holds the contents of both a/ and b/)
set -euo pipefail
src=${1:?folder} site=${2:?site dir}
name=$(cat "$src/mlx_cuda_13.name")
cat "$src"/mlx_cuda_13.whl.part.* > "$src/$name"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$src/$name" "$src"/mlx-*.whl "$src"/mlx_lm-*.whl
PYTHONPATH="$site" python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device(), 'mlx_lm', mlx_lm.__version__)"
