#!/usr/bin/env bash
# The first of the README's two commands, for a new machine: installs the build dependencies when
# they are missing (scripts/install_deps.sh), builds, checks the config with
# `prefill_driver --validate` (it prints the resolved sizes and the device memory the module will
# take; no GPU needed), then runs the example prefill driver on it with --check.
#
#   bash scripts/setup_and_run.sh [DRIVER ARGS...]    e.g. --lengths 4096,100 --iters 50
#   CONFIG=configs/tiny.yaml bash scripts/setup_and_run.sh
#
# Environment: BUILD_DIR (default build), CONFIG (default configs/default.yaml).
# Exit status:
#   0  the driver ran on the GPU and its checks passed
#   1  installing the dependencies, the build, the run or a check failed
#   2  the config is invalid (the message names file:line: key), or it is valid but no CUDA device
#      is usable here (the last line says which); without a GPU, bash scripts/run_tests.sh runs
#      the CPU tests
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
build=${BUILD_DIR:-build}
config=${CONFIG:-configs/default.yaml}
say() { echo "setup_and_run.sh: $*"; }

bash scripts/install_deps.sh || exit 1
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release || { say "meson setup failed"; exit 1; }
fi
ninja -C "$build" || { say "the build failed"; exit 1; }
driver=$build/examples/prefill_driver

"$driver" --validate --config "$config" "$@"
rc=$?
if [ $rc -ne 0 ]; then
  say "the config check failed (exit $rc): $config"
  exit "$rc"
fi

err=$(mktemp)
trap 'rm -f "$err"' EXIT
"$driver" --config "$config" --check "$@" 2> >(tee "$err" >&2)
rc=$?
wait  # for tee
if [ $rc -eq 2 ] && grep -q "no CUDA device is usable" "$err"; then
  say "built, and $config is valid; no CUDA device is usable here, so the prefill did not run (exit 2)."
  say "the driver needs an NVIDIA Hopper GPU (H100/H200); without one, bash scripts/run_tests.sh runs the CPU tests"
elif [ $rc -ne 0 ]; then
  say "prefill_driver exited $rc"
else
  say "done: the driver ran on $config and its checks passed"
fi
exit $rc
