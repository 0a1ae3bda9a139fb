#!/usr/bin/env bash
# Builds the project and runs the whole test suite (CPU tests; GPU tests too when a CUDA device
# is present, else meson reports them skipped). Ends with "tests: N passed, M failed, K skipped"
# summed over doctest test cases; exits non-zero on any failure.
#   BUILD_DIR (default build), KDA_REQUIRE_GPU=1 (fail instead of skipping GPU tests),
#   MESON_TEST_ARGS (extra arguments for `meson test`, e.g. "--suite cpu").
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release || exit 1
fi
ninja -C "$build" -j "$(nproc)" || { echo "tests: 0 passed, 1 failed (build failed)"; exit 1; }

# shellcheck disable=SC2086
meson test -C "$build" --print-errorlogs --num-processes "$(nproc)" ${MESON_TEST_ARGS:-}
meson_rc=$?

log="$build/meson-logs/testlog.txt"
python3 - "$log" "$meson_rc" <<'PY'
import re, sys
log, meson_rc = sys.argv[1], int(sys.argv[2])
text = open(log, encoding="utf-8", errors="replace").read()
passed = failed = skipped = 0
# doctest's summary: "[doctest] test cases: 12 | 12 passed | 0 failed | 0 skipped"
for m in re.finditer(r"\[doctest\] test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed \|\s*(\d+) skipped", text):
    passed += int(m.group(2)); failed += int(m.group(3)); skipped += int(m.group(4))
# Programs that printed no doctest summary: skipped (exit 77) or crashed.
prog_skipped = len(re.findall(r"^result:\s+exit status 77\s*$", text, re.M))
summary_count = len(re.findall(r"\[doctest\] test cases:", text))
programs = len(re.findall(r"^test:\s+\S+", text, re.M))
crashed = max(0, programs - summary_count - prog_skipped)
failed += crashed
print(f"(test programs: {programs}, skipped without a GPU: {prog_skipped}, without a summary: {crashed})")
print(f"tests: {passed} passed, {failed} failed, {skipped + prog_skipped} skipped")
sys.exit(1 if (failed or meson_rc) else 0)
PY
