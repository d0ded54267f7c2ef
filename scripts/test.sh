#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test twice: a normal
# build with -Werror, then the same suite under AddressSanitizer and
# UndefinedBehaviorSanitizer. Extra arguments go to ctest (e.g. -L unit).
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
echo "== all tests passed (normal and ASan+UBSan builds)"
