#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: a normal build with
# -Werror, then the same suite under AddressSanitizer and
# UndefinedBehaviorSanitizer; then, on a whole run, the unit and
# integration tests under ThreadSanitizer (SQLite only, to keep CI short)
# and a short fuzz of each target. Extra arguments go to ctest (e.g.
# -L unit) and limit the run to the first two stages.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
# The tests run what ships: SQLite and libmicrohttpd as deps.sh builds them
# (docs/performance.md). Where deb.debian.org cannot be reached,
# IDEM_TEST_SYSTEM_LIBS=1 tests with the system's libraries instead.
if [ "${IDEM_TEST_SYSTEM_LIBS:-0}" != 1 ]; then
  for f in .deps/sqlite/sqlite3.c .deps/libmicrohttpd/lib/libmicrohttpd.a; do
    if [ ! -f "$f" ]; then
      echo "test: $f was not built (see deps above); IDEM_TEST_SYSTEM_LIBS=1 tests the system's libraries" >&2
      exit 1
    fi
  done
fi

jobs=$(nproc 2>/dev/null || echo 2)
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp"

# stage NAME "CTEST ARGS" CMAKE ARGS...
stage() {
  local name=$1 args=$2; shift 2
  echo "== $name build"
  cmake -S . -B "build-$name" -DIDEM_WERROR=ON "$@" >/dev/null
  cmake --build "build-$name" -j"$jobs" >/dev/null
  echo "== $name tests"
  # shellcheck disable=SC2086 # args is a list of ctest arguments
  (cd "build-$name" && ctest --output-on-failure --timeout 900 -j"$jobs" $args)
}

args="$*"
stage check "$args" -DCMAKE_BUILD_TYPE=RelWithDebInfo
stage asan "$args" -DCMAKE_BUILD_TYPE=Debug -DIDEM_SANITIZE=ON
if [ $# -eq 0 ]; then
  stage tsan "-L unit|integration -LE slow|pg" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DIDEM_TSAN=ON
  # Each fuzz target for 20 s (under a minute and a half in all, plus its clang build).
  scripts/fuzz.sh 20
fi
echo "== all tests passed"
