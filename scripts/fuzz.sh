#!/usr/bin/env bash
# Fuzzes idem for a bounded time: installs clang and its fuzzer runtime if
# missing, builds the libFuzzer targets of fuzz/ (IDEM_FUZZ=ON, ASan and
# UBSan) in build-fuzz, and runs each for SECONDS_PER_TARGET (default 60) on
# a copy of its seed corpus with its dictionary. Fails on any crash, leak,
# timeout or broken property; the input that did it is left in
# build-fuzz/run/TARGET/artifacts/ (copy it to fuzz/crashes/TARGET/ so that
# ctest fuzz_regress_* replays it from then on).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_key fuzz_body fuzz_request fuzz_webhook fuzz_gateway)

scripts/deps.sh clang libclang-rt-14-dev

jobs=$(nproc 2>/dev/null || echo 2)
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

echo "== fuzz build (clang, IDEM_FUZZ=ON)"
CC=clang cmake -S . -B build-fuzz -DIDEM_FUZZ=ON -DIDEM_BUILD_TESTS=OFF -DIDEM_WERROR=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j"$jobs" --target "${targets[@]}" >/dev/null

status=0
for t in "${targets[@]}"; do
  work="build-fuzz/run/$t"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp fuzz/corpus/"$t"/* "$work/corpus/"
  echo "== fuzz $t for ${secs}s"
  if build-fuzz/fuzz/"$t" -max_total_time="$secs" -timeout=30 -print_final_stats=1 \
       -dict=fuzz/"$t".dict -artifact_prefix="$work/artifacts/" "$work/corpus" \
       >"$work/log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/log")
    echo "   $t: ${runs:-?} inputs, ${rate:-?} exec/s, no crash"
  else
    status=1
    echo "   $t FAILED; the end of its log ($work/log):"
    grep -E "property failed|ERROR|SUMMARY|Test unit written" "$work/log" | head -20 | sed 's/^/     /'
    tail -n 5 "$work/log" | sed 's/^/     /'
    ls "$work/artifacts" | sed "s|^|   saved: $work/artifacts/|"
  fi
done
exit $status
