#!/usr/bin/env bash
# Development probe on the GPU machine: the GPU test programs one by one and the tuning
# benchmarks (GEMM candidates, conv tunings, KDA core), each under a time limit, logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kda-gpu-out}
b=${BUILD_DIR:-build-gpu}
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name" 2>&1
  echo "== $name: rc $? in $((SECONDS - t0)) s: $(grep -E 'test cases:|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$name" | tail -1)"
}
export KDA_REQUIRE_GPU=1
for step in ${PROBE_STEPS:-module conv steps chunked gemm tunings core}; do
  case $step in
    module) run module.log 150 "$b/tests/test_module_gpu" ;;
    conv) run conv.log 100 "$b/tests/test_packed_conv_gpu" ;;
    steps) run steps.log 60 "$b/tests/test_kda_recurrence_token_gpu"; run norm.log 30 "$b/tests/test_gated_rmsnorm_gpu" ;;
    chunked) run chunked.log 60 "$b/tests/test_kda_chunked_gpu" ;;
    gemm) run gemm.md 60 "$b/bench/bench_gemm" ;;
    tunings) run tunings.md 100 "$b/bench/bench_conv_tunings" --quick ;;
    core) run core.md 100 "$b/bench/bench_kda_core" ;;
    memcheck) for t in "$b"/tests/test_*_gpu; do KDA_TEST_QUICK=1 run "memcheck-$(basename "$t").log" 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$t"; done ;;
    racecheck) for t in "$b"/tests/test_*_gpu; do KDA_TEST_QUICK=1 run "racecheck-$(basename "$t").log" 120 compute-sanitizer --tool racecheck --error-exitcode 3 "$t"; done ;;
    *) echo "gpu_probe.sh: unknown step $step" ;;
  esac
done
