#!/usr/bin/env bash
# The first of the README's two commands, for a new machine: installs the build dependencies when
# they are missing (scripts/install_deps.sh), builds, checks the config with
# `prefill_driver --validate` (it prints the resolved sizes and the device memory the module will
# take; no GPU needed), then runs the example prefill driver on it with --check.
#
#   bash scripts/setup_and_run.sh [--help] [DRIVER ARGS...] [-- DRIVER ARGS...]
#   bash scripts/setup_and_run.sh --lengths 4096,100 --iters 50
#   bash scripts/setup_and_run.sh --validate          only build and check the config
#   bash scripts/setup_and_run.sh -- --help           the driver's flags
#   CONFIG=configs/tiny.yaml bash scripts/setup_and_run.sh
#
# This script's own flag is --help (-h): it prints this and exits 0, building and running
# nothing. Every other argument, and every argument after `--`, is the driver's (its --help lists
# them); a --config among them replaces CONFIG. With the driver's --validate (or --help) the
# script stops after that call: no prefill runs.
#
# Environment: BUILD_DIR (default build), CONFIG (default configs/default.yaml).
# The last line says what ran. Exit status:
#   0  the prefill ran on the GPU and the driver's checks passed; or only --validate (the config
#      is valid) or a --help was asked for
#   1  installing the dependencies, the build, the run or a check failed
#   2  the driver refused its arguments (the last line says so), the config is invalid (the message
#      names file:line: key), or it is valid but no CUDA device is usable here (the last line says
#      which); without a GPU, bash scripts/run_tests.sh runs the CPU tests
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
build=${BUILD_DIR:-build}
config=${CONFIG:-configs/default.yaml}
say() { echo "setup_and_run.sh: $*"; }

args=()          # the driver's arguments, --config taken out
validate=0       # the driver's --validate: check the config only
driver_help=0    # the driver's --help
own=1            # before `--`: this script's --help is its own
while [ $# -gt 0 ]; do
  a=$1
  shift
  if [ $own = 1 ]; then
    case "$a" in
      -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
                 say "printed this script's help; nothing was built or run"; exit 0 ;;
      --) own=0; continue ;;
    esac
  fi
  case "$a" in
    --config) if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config=$1; shift; continue; fi ;;
    --validate) validate=1 ;;
    -h|--help) driver_help=1 ;;
  esac
  args+=("$a")
done

bash scripts/install_deps.sh || { say "installing the build dependencies failed; nothing ran"; exit 1; }
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release || { say "meson setup failed; nothing ran"; exit 1; }
fi
ninja -C "$build" || { say "the build failed; nothing ran"; exit 1; }
driver=$build/examples/prefill_driver

if [ $driver_help = 1 ]; then
  "$driver" "${args[@]}"
  rc=$?
  say "built; printed prefill_driver's help (exit $rc); the prefill did not run"
  exit $rc
fi

out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
# The config check first, with the driver's arguments (so that a batch that does not fit is found
# here too); a refused argument is the driver's usage message, not a config error.
"$driver" --validate --config "$config" "${args[@]}" 2> >(tee "$err" >&2)
rc=$?
wait  # for tee
if [ $rc -ne 0 ]; then
  if grep -q '^usage: ' "$err"; then
    say "prefill_driver refused its arguments (exit $rc): ${args[*]}; its flags: $driver --help (this script's own: --help)"
  else
    say "the config check failed (exit $rc): $config; the prefill did not run"
  fi
  exit $rc
fi
if [ $validate = 1 ]; then
  say "built, and $config is valid (prefill_driver --validate); the prefill did not run"
  exit 0
fi

"$driver" --config "$config" --check "${args[@]}" 2> >(tee "$err" >&2) | tee "$out"
rc=${PIPESTATUS[0]}
wait  # for tee
if [ $rc -eq 2 ] && grep -q "no CUDA device is usable" "$err"; then
  say "the driver needs an NVIDIA Hopper GPU (H100/H200); without one, bash scripts/run_tests.sh runs the CPU tests"
  say "built, and $config is valid; no CUDA device is usable here, so the prefill did not run (exit 2)"
elif [ $rc -ne 0 ]; then
  say "prefill_driver ran on $config and exited $rc (see its messages above)"
elif check=$(grep -E '^check: .*: OK$' "$out"); then
  say "done: the prefill ran on the GPU with $config and the driver's check passed (${check#check: })"
elif check=$(grep -E '^prefix sharing: OK' "$out"); then
  say "done: the prefix-sharing scenario ran on the GPU with $config: ${check#prefix sharing: }"
else
  say "done: prefill_driver ran on $config and exited 0: $(tail -1 "$out")"
fi
exit $rc
