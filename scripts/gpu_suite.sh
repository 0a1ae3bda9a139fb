#!/usr/bin/env bash
# The GPU job: build, GPU tests, compute-sanitizer, benchmarks and the driver, on a machine with
# an NVIDIA Hopper GPU. Logs and tables go to $OUT (default /tmp/kda-gpu-out); a summary is
# printed last.
#   scripts/gpu_suite.sh [info] [build] [test] [sanitize] [bench] [steps] [profile] [driver] [tp]
#   (default: info build test sanitize bench driver tp)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kda-gpu-out}
mkdir -p "$OUT"
build=${BUILD_DIR:-build-gpu}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(info build test sanitize bench driver tp)
export PATH=/usr/local/cuda/bin:$PATH
summary=()
note() { summary+=("$1"); echo "== $1"; }

for stage in "${stages[@]}"; do
  case "$stage" in
    info)
      note "info: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -1)"
      ;;
    build)
      start=$SECONDS
      # nccl.h: the toolkit's or the system's; else the first one found elsewhere (a Python
      # wheel's, next to a system libnccl), so the tensor-parallel paths get built.
      nccl_inc=
      if [ ! -f /usr/local/cuda/include/nccl.h ] && [ ! -f /usr/include/nccl.h ]; then
        h=$(find / -xdev -name nccl.h -path '*include*' 2>/dev/null | head -1)
        [ -n "$h" ] && nccl_inc="-Dnccl_include=$(dirname "$h")"
      fi
      { [ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release -Dptxas_verbose=true $nccl_inc; } > "$OUT/build.log" 2>&1
      note "build: $(grep -E 'NCCL \(tensor' "$OUT/build.log" | head -1 | sed 's/^ *//')"
      if ninja -C "$build" -j "$(nproc)" >> "$OUT/build.log" 2>&1; then
        note "build: ok in $((SECONDS - start)) s; spills: $(grep -c 'bytes spill stores' "$OUT/build.log") reports, nonzero: $(grep -E '[1-9][0-9]* bytes spill (stores|loads)' "$OUT/build.log" | wc -l)"
      else
        tail -40 "$OUT/build.log"; note "build: FAILED"; break
      fi
      ;;
    test)
      # The GPU programs (meson suite gpu); TEST_SUITE=all adds the CPU suite, which CI runs anyway.
      suite_args="--suite gpu"
      [ "${TEST_SUITE:-gpu}" = all ] && suite_args=
      KDA_REQUIRE_GPU=1 BUILD_DIR="$build" MESON_TEST_ARGS="$suite_args" timeout "${TEST_TIMEOUT:-400}" \
        bash scripts/run_tests.sh > "$OUT/tests.log" 2>&1
      rc=$?
      cp "$build/meson-logs/testlog.txt" "$OUT/testlog.txt" 2>/dev/null
      grep -E "^(not ok|FAIL| *[0-9]+/[0-9]+ .*(FAIL|ERROR|TIMEOUT))" "$OUT/tests.log" | head -20
      note "test (rc $rc): $(tail -1 "$OUT/tests.log")"
      ;;
    sanitize)
      sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
      : > "$OUT/sanitize.log"
      # SANITIZE="tool:program ..." picks the runs. Default: memcheck and racecheck on every GPU
      # test program but test_module_faults_gpu (it makes cudaMalloc fail on purpose, which
      # compute-sanitizer reports as an API error), and synccheck too on test_module_sanitize_gpu
      # (one module forward of every kind: graphs on and off, checkpoints, external pools, a cut
      # sequence).
      runs=${SANITIZE:-}
      if [ -z "$runs" ]; then
        for t in "$build"/tests/test_*_gpu; do
          [ "$(basename "$t")" = test_module_faults_gpu ] && continue
          runs="$runs memcheck:$(basename "$t") racecheck:$(basename "$t")"
        done
        runs="$runs synccheck:test_module_sanitize_gpu"
      fi
      for run in $runs; do
        tool=${run%%:*}
        t="$build/tests/${run#*:}"
        {
          echo "---- $tool $(basename "$t")"
          KDA_TEST_QUICK=1 timeout "${SANITIZE_TIMEOUT:-240}" "$sanitizer" --tool "$tool" --error-exitcode 3 "$t"
        } >> "$OUT/sanitize.log" 2>&1
          rc=$?
          note "sanitize $tool $(basename "$t"): rc $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize.log" | tail -1)"
      done
      ;;
    bench)
      # BENCHES picks and orders the benchmarks (default: all five). bench_conv_tunings runs its
      # quick launch-shape sweep (rc 1: a tuning's bits differ from the default's).
      : > "$OUT/bench.log"
      for b in ${BENCHES:-conv module kda_core gemm conv_tunings}; do
        args=(--out "$OUT/bench_$b.md")
        [ "$b" = conv_tunings ] && args+=(--quick)
        timeout "${BENCH_TIMEOUT:-300}" "$build/bench/bench_$b" "${args[@]}" >> "$OUT/bench.log" 2>&1
        note "bench_$b rc $?"
        cat "$OUT/bench_$b.md" 2>/dev/null
      done
      ;;
    steps)
      # Per-step GPU time of one layer (profile_steps), both configs.
      timeout "${BENCH_TIMEOUT:-150}" "$build/bench/bench_module" --steps-only --out "$OUT/bench_steps.md" > "$OUT/steps.log" 2>&1
      note "bench_module --steps-only rc $?"
      cat "$OUT/bench_steps.md" 2>/dev/null
      ;;
    profile)
      # Nsight Compute on the packed conv (16384 x 1) and the chunked core (H 12, 1 x 16384), clocks
      # left alone. PROFILE="conv core" picks the parts; "state" profiles one launch of phase 2
      # (the kda_chunk_state kernel) on H 12, 1 x 16384; "prep" one launch of phase 1 (H 12,
      # 1 x 16384) with every section, its report and its SASS with per-instruction stall samples
      # as CSV (ncu_prep_sass.csv).
      ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis --section InstructionStats"
      for part in ${PROFILE:-conv core}; do
        case "$part" in
          conv) timeout 240 "$ncu_bin" --clock-control none $sections -k regex:packed_conv_kernel --launch-skip 5 --launch-count 1 \
                  "$build/bench/bench_conv" --quick --case 16384x1 > "$OUT/ncu_conv.txt" 2>&1 ;;
          core) timeout 300 "$ncu_bin" --clock-control none $sections -k regex:kda_chunk --launch-skip 2 --launch-count 4 \
                  "$build/bench/bench_kda_core" --quick --reps 20 > "$OUT/ncu_core.txt" 2>&1 ;;
          prep)
            timeout 300 "$ncu_bin" --clock-control none --set full -k regex:kda_chunk_prep --launch-skip 1 --launch-count 1 \
              -o "$OUT/ncu_prep" -f "$build/bench/bench_kda_core" --quick --reps 20 > "$OUT/ncu_prep.txt" 2>&1
            "$ncu_bin" -i "$OUT/ncu_prep.ncu-rep" --page details >> "$OUT/ncu_prep.txt" 2>&1
            "$ncu_bin" -i "$OUT/ncu_prep.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_prep_sass.csv" 2>&1 ;;
          state) timeout 300 "$ncu_bin" --clock-control none $sections -k regex:kda_chunk_state --launch-skip 3 \
                   --launch-count 1 "$build/bench/bench_kda_core" --quick --reps 20 > "$OUT/ncu_state.txt" 2>&1 ;;
        esac
        note "ncu $part rc $?"
      done
      ;;
    driver)
      timeout "${DRIVER_TIMEOUT:-120}" "$build/examples/prefill_driver" --config configs/default.yaml --check > "$OUT/driver.log" 2>&1
      rc=$?
      tail -25 "$OUT/driver.log"
      note "driver --check rc $rc"
      timeout "${DRIVER_TIMEOUT:-120}" "$build/examples/prefill_driver" --config configs/default.yaml --prefix-sharing \
        > "$OUT/driver_prefix_sharing.log" 2>&1
      rc=$?
      tail -6 "$OUT/driver_prefix_sharing.log"
      note "driver --prefix-sharing rc $rc: $(tail -1 "$OUT/driver_prefix_sharing.log")"
      # The same with bf16 state pools.
      sed -e 's/recurrent_dtype: fp32/recurrent_dtype: bf16/' -e 's/conv_dtype: fp32/conv_dtype: bf16/' \
        configs/default.yaml > "$OUT/default-bf16-pools.yaml"
      for mode in --check --prefix-sharing; do
        timeout "${DRIVER_TIMEOUT:-120}" "$build/examples/prefill_driver" --config "$OUT/default-bf16-pools.yaml" $mode \
          > "$OUT/driver_bf16${mode}.log" 2>&1
        rc=$?
        tail -4 "$OUT/driver_bf16${mode}.log"
        note "driver bf16 pools $mode rc $rc: $(tail -1 "$OUT/driver_bf16${mode}.log")"
      done
      ;;
    tp)
      # Tensor parallelism: the driver's ranks against TP = 1, on as many GPUs as there are (1, 2,
      # 4). NVLink multicast stays off (the driver also sets it when unset). TP_CONFIG picks the
      # whole-model config (its heads must divide by the rank count).
      gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
      : > "$OUT/tp.log"
      for n in 1 2 4; do
        [ "$n" -le "$gpus" ] || continue
        echo "---- --tp $n" >> "$OUT/tp.log"
        NCCL_NVLS_ENABLE=0 timeout "${DRIVER_TIMEOUT:-300}" "$build/examples/prefill_driver" \
          --config "${TP_CONFIG:-configs/kimi-linear-48b-tp1.yaml}" --tp "$n" --check >> "$OUT/tp.log" 2>&1
        rc=$?
        note "driver --tp $n rc $rc"
      done
      tail -40 "$OUT/tp.log"
      ;;
    *) echo "gpu_suite.sh: unknown stage \"$stage\" (info build test sanitize bench steps profile driver tp)"; exit 2 ;;
  esac
done
echo
printf '%s\n' "${summary[@]}"
