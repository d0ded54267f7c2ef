#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test twice: a normal
# build with -Werror, then the same suite under AddressSanitizer and
# UndefinedBehaviorSanitizer; then fuzzes briefly. Extra arguments go to
# ctest (e.g. -L unit) and skip the fuzzing.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh

jobs=$(nproc 2>/dev/null || echo 2)
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"

run() {
  local name=$1; shift
  echo "== $name build"
  cmake -S . -B "build-$name" -DIDEM_WERROR=ON "$@" >/dev/null
  cmake --build "build-$name" -j"$jobs" >/dev/null
  echo "== $name tests"
  (cd "build-$name" && ctest --output-on-failure --timeout 600 "${CTEST_ARGS[@]}")
}

CTEST_ARGS=("$@")
run check -DCMAKE_BUILD_TYPE=RelWithDebInfo
run asan -DCMAKE_BUILD_TYPE=Debug -DIDEM_SANITIZE=ON
# A whole run (no ctest arguments) also fuzzes each target for 20 s
# (scripts/fuzz.sh; about a minute in all, plus its clang build).
if [ ${#CTEST_ARGS[@]} -eq 0 ]; then
  scripts/fuzz.sh 20
fi
echo "== all tests passed (normal and ASan+UBSan builds)"
