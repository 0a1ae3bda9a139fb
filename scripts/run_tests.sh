#!/usr/bin/env bash
# Builds the project and runs the test suite: the CPU tests, and the GPU tests too when a CUDA
# device is present (without one each GPU test program exits 77 and meson reports it skipped).
#
#   bash scripts/run_tests.sh           the whole suite (the default; CI runs this)
#   bash scripts/run_tests.sh --quick   quick mode, also QUICK=1: KDA_TEST_QUICK=1 for the test
#                                       programs (the GPU programs run their reduced sets) and the
#                                       tests in meson suite 'slow' (the CPU emulations of the
#                                       kernels, most of the suite's time) are left out
#   bash scripts/run_tests.sh --help    this, and the test programs of the build directory
#
# Environment: BUILD_DIR (default build), KDA_REQUIRE_GPU=1 (a missing GPU fails the GPU programs
# instead of skipping them), MESON_TEST_ARGS (extra `meson test` arguments, e.g. "--suite cpu").
#
# Output ends with two lines:
#   G GPU test programs skipped (no CUDA device): packed_conv_gpu, module_gpu, ...
#   tests: N passed, M failed, K skipped
# N, M and K of the last line count doctest test cases, summed over the programs that ran (K:
# test cases doctest skipped). A program that fails without a doctest summary (crash, timeout)
# counts as one failed test case. Skipped GPU programs are not test cases: the line before says
# how many there were (it is printed only when some were). Exit status: 0 when nothing failed,
# else 1 (2 for a bad argument).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
quick=${QUICK:-0}
help=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    -h|--help) help=1 ;;
    *) echo "run_tests.sh: unknown argument \"$arg\" (see --help)" >&2; exit 2 ;;
  esac
done
# The test programs of the configured build directory in meson suite $1 (cpu, slow or gpu), as
# "name, name, ...".
tests_in() {
  meson introspect --tests "$build" | python3 -c '
import json, sys
print(", ".join(t["name"] for t in json.load(sys.stdin) if any(s.split(":")[-1] == sys.argv[1] for s in t["suite"])))' "$1"
}
if [ "$help" = 1 ]; then
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
  echo
  if [ -f "$build/build.ninja" ]; then
    echo "The test programs of $build (tests/meson.build):"
    for suite in cpu slow gpu; do
      names=$(tests_in $suite)
      n=$(echo "$names" | tr ',' '\n' | grep -c .)
      case $suite in
        cpu) echo "  $n CPU test programs: ${names:-none}" ;;
        slow) echo "  $n of them in suite 'slow' (left out by --quick): ${names:-none}" ;;
        gpu) echo "  $n GPU test programs: ${names:-none}" ;;
      esac
    done
  else
    echo "$build is not configured yet; once it is (this script does that), --help lists its test programs."
  fi
  exit 0
fi
[ "$quick" = 0 ] || [ "$quick" = 1 ] || { echo "run_tests.sh: QUICK must be 0 or 1, not \"$quick\"" >&2; exit 2; }

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release || { echo "tests: 0 passed, 1 failed (meson setup failed)"; exit 1; }
fi
ninja -C "$build" -j "$(nproc)" || { echo "tests: 0 passed, 1 failed (build failed)"; exit 1; }

extra=()
if [ "$quick" = 1 ]; then
  export KDA_TEST_QUICK=1
  extra+=(--no-suite slow)
  slow=$(tests_in slow)
  if [ -n "$slow" ]; then
    echo "run_tests.sh: quick mode: KDA_TEST_QUICK=1, suite 'slow' left out ($slow)"
  else
    echo "run_tests.sh: quick mode: KDA_TEST_QUICK=1; no test is in suite 'slow' (tests/meson.build), so all run"
  fi
fi

rm -f "$build/meson-logs/testlog.json"
# shellcheck disable=SC2086
meson test -C "$build" --print-errorlogs --num-processes "$(nproc)" "${extra[@]}" ${MESON_TEST_ARGS:-}
meson_rc=$?

python3 - "$build/meson-logs/testlog.json" "$meson_rc" <<'PY'
import json, re, sys
path, meson_rc = sys.argv[1], int(sys.argv[2])
summary = re.compile(r"\[doctest\] test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed \|\s*(\d+) skipped")
passed = failed = skipped = 0
gpu_skipped, broken = [], []
try:
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
except OSError:
    lines = []
    failed += 1; broken.append("(meson wrote no testlog.json)")
for line in lines:
    if not line.strip():
        continue
    t = json.loads(line)
    name, result = t.get("name", "?").split(" / ")[-1], t.get("result", "?")  # "kda-prefill:cpu / config"
    out = (t.get("stdout") or "") + (t.get("stderr") or "")
    if result == "SKIP":  # exit 77: a GPU program without a CUDA device
        gpu_skipped.append(name)
        continue
    m = summary.findall(out)
    if m:
        p, f, s = (int(x) for x in m[-1][1:])
        passed += p; failed += f; skipped += s
        if result != "OK" and f == 0:  # failed outside its test cases (e.g. at exit)
            failed += 1; broken.append(f"{name} ({result} with no failed test case)")
    elif result != "OK":
        failed += 1; broken.append(f"{name} ({result}, no doctest summary)")
if broken:
    print("test programs that failed without a doctest summary: " + ", ".join(broken))
if gpu_skipped:
    print(f"{len(gpu_skipped)} GPU test program{'s' if len(gpu_skipped) != 1 else ''} skipped "
          f"(no CUDA device): {', '.join(gpu_skipped)}")
if meson_rc and not failed:  # meson failed for a reason the log does not show: count it
    failed += 1
print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
PY
