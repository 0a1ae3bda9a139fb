#!/usr/bin/env bash
# Benchmarks of two or more source trees of this project, side by side in one run on one GPU
# (docs/perf.md compares speed only within one run). Each TREE is a directory holding a
# checkout, or a git revision of this repository (exported with git archive first, so a
# revision needs the .git directory, a directory does not). Every tree is built in release
# mode in its own build directory, in parallel; then the GPU tests run on every tree, and each
# benchmark runs on the trees in turn. Logs and tables go to $OUT (default
# /tmp/kda-side-by-side); the last lines printed are bench_kda_core's GPU times per tree.
#   scripts/bench_side_by_side.sh TREE TREE [TREE...]
# Environment: CORE_ARGS (bench_kda_core's arguments, default "--reps 20"), MODULE_ARGS
# (bench_module's, default "--config configs/default.yaml --seqs 16 --iters 10"; empty: skip),
# TESTS (GPU test programs run on every tree, default "test_kda_chunked_gpu"; empty: none).
# Exits 77 without an NVIDIA GPU, 2 on bad arguments, 1 when a build, a test or a benchmark
# fails.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 TREE TREE [TREE...] (a directory or a git revision each)"; exit 2; }
if ! nvidia-smi -L > /dev/null 2>&1; then
  echo "bench_side_by_side: no NVIDIA GPU found (nvidia-smi -L failed): nothing to compare"
  exit 77
fi
export PATH=/usr/local/cuda/bin:$PATH
OUT=${OUT:-/tmp/kda-side-by-side}
CORE_ARGS=${CORE_ARGS:---reps 20}
MODULE_ARGS=${MODULE_ARGS---config configs/default.yaml --seqs 16 --iters 10}
TESTS=${TESTS-test_kda_chunked_gpu}
work=$(pwd)/build-side-by-side
mkdir -p "$OUT" "$work"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 > "$OUT/gpu.txt"

# Tree n: its source directory src[n] and its label (the argument, made file-name safe).
src=() label=()
for t in "$@"; do
  name=$(printf '%s' "$t" | tr -c 'A-Za-z0-9._-' '_')
  if [ -d "$t" ]; then
    src+=("$(cd "$t" && pwd)")
  elif git rev-parse --verify -q "$t^{commit}" > /dev/null; then
    rm -rf "$work/$name.src" && mkdir -p "$work/$name.src"
    git archive "$t" | tar -x -C "$work/$name.src" || exit 2
    src+=("$work/$name.src")
  else
    echo "bench_side_by_side: $t is neither a directory nor a git revision"; exit 2
  fi
  label+=("$name")
done

targets="bench/bench_kda_core bench/bench_module"
for t in $TESTS; do targets="$targets tests/$t"; done
jobs=$(( $(nproc) / ${#src[@]} )); [ "$jobs" -ge 1 ] || jobs=1
pids=()
for n in "${!src[@]}"; do
  b="$work/${label[$n]}.build"
  (cd "${src[$n]}" && { [ -f "$b/build.ninja" ] || meson setup "$b" --buildtype=release; } &&
     ninja -C "$b" -j "$jobs" $targets) > "$OUT/build_${label[$n]}.log" 2>&1 &
  pids+=($!)
done
failed=0
for n in "${!pids[@]}"; do
  wait "${pids[$n]}" || { echo "build of ${label[$n]} failed: $OUT/build_${label[$n]}.log"; failed=1; }
done
[ "$failed" -eq 0 ] || exit 1

for t in $TESTS; do
  for n in "${!src[@]}"; do
    log="$OUT/${t}_${label[$n]}.log"
    (cd "${src[$n]}" && KDA_REQUIRE_GPU=1 "$work/${label[$n]}.build/tests/$t") > "$log" 2>&1
    rc=$?
    echo "$t on ${label[$n]}: rc $rc, $(grep -E 'test cases:' "$log" | tail -1)"
    [ "$rc" -eq 0 ] || failed=1
  done
done
for n in "${!src[@]}"; do
  (cd "${src[$n]}" && "$work/${label[$n]}.build/bench/bench_kda_core" $CORE_ARGS) \
    > "$OUT/core_${label[$n]}.md" 2>&1 || { echo "bench_kda_core on ${label[$n]}: rc $?"; failed=1; }
done
if [ -n "$MODULE_ARGS" ]; then
  for n in "${!src[@]}"; do
    (cd "${src[$n]}" && "$work/${label[$n]}.build/bench/bench_module" $MODULE_ARGS) \
      > "$OUT/module_${label[$n]}.md" 2>&1 || { echo "bench_module on ${label[$n]}: rc $?"; failed=1; }
  done
fi

# bench_kda_core's rows (| case | kernel | GPU us | ...) joined by (case, kernel), one column
# of GPU us per tree.
python3 - "$OUT" "${label[@]}" <<'EOF'
import sys
out, labels = sys.argv[1], sys.argv[2:]
rows, keys = {}, []
for lab in labels:
    for line in open(f"{out}/core_{lab}.md", errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[2].replace(".", "", 1).isdigit():
            continue
        key = (cells[0], cells[1])
        if key not in rows:
            rows[key] = {}
            keys.append(key)
        rows[key][lab] = cells[2]
print(open(f"{out}/gpu.txt").read().strip())
print("| case | kernel | " + " | ".join(f"{lab} us" for lab in labels) + " |")
print("| --- | --- |" + " ---: |" * len(labels))
for key in keys:
    print(f"| {key[0]} | {key[1]} | " + " | ".join(rows[key].get(lab, "-") for lab in labels) + " |")
EOF
exit "$failed"
