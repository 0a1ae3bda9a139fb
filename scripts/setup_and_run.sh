#!/usr/bin/env bash
# The main job on a new machine: install dependencies if missing, build, and run the example
# prefill driver on configs/default.yaml with --check. Without a GPU the driver says so and
# this script exits 2. Extra arguments go to the driver.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
bash scripts/install_deps.sh
build=${BUILD_DIR:-build}
[ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release
ninja -C "$build"
exec "$build/examples/prefill_driver" --config configs/default.yaml --check "$@"
