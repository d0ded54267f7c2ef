#!/usr/bin/env bash
# Instructions per request (valgrind --tool=callgrind), for the new-key and
# replay paths of POST /payments, and the new-key path of POST /orders.
# Counts are repeatable for the same binary and inputs, whatever else the
# machine is doing. Each figure is
# (instructions of a run with N requests - a run with none) / N.
# The fourth figure is new-key payments under wrk's 64 connections, whose
# commits carry many writes each, as in bench/run.sh: (instructions of
# that run - a run with none) / its requests.
# Usage: bench/callgrind.sh [N [SECONDS]]   (defaults 300 and 20)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
n=${1:-300}
load_secs=${2:-20}
"$repo/scripts/deps.sh" valgrind wrk
cmake -S "$repo" -B "$repo/build-bench" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_TESTS=OFF >/dev/null
cmake --build "$repo/build-bench" -j"$(nproc)" >/dev/null
idemd="$repo/build-bench/idemd"
run=$(mktemp -d /tmp/idem-cg.XXXXXX)
trap 'rm -rf "$run"' EXIT

# start_server NAME -> sets port, token and pid: idemd under callgrind on a
# fresh database, answering.
start_server() {
  local name=$1
  port=$((20000 + RANDOM % 20000))
  rm -f "$run/$name.db"*
  token=$("$idemd" tenant create cg --db "$run/$name.db")
  # One worker: with many, each request may wake a fresh thread, whose
  # one-time set-up (OpenSSL's per-thread random generator) would be
  # counted as if every request paid it.
  valgrind --tool=callgrind --callgrind-out-file="$run/$name.out" \
    "$idemd" serve --db "$run/$name.db" --listen "127.0.0.1:$port" --workers 1 2>/dev/null &
  pid=$!
  for _ in $(seq 300); do curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break; sleep 0.1; done
}

# profile NAME MODE COUNT [PATH BODY] -> prints the total instruction count
profile() {
  local name=$1 mode=$2 count=$3 path=${4:-/payments} body=${5:-'{\"amount\": 15990}'}
  local port token pid
  start_server "$name"
  # One curl for all requests, so they share a kept-alive connection (as
  # under wrk) and connection set-up is not counted.
  {
    for i in $(seq 0 "$count"); do
      local key=first
      if [ "$mode" = new ] && [ "$i" -gt 0 ]; then key="k$i"; fi
      [ "$i" -gt 0 ] && echo next
      printf 'url = "http://127.0.0.1:%s%s"\nrequest = "POST"\n' "$port" "$path"
      printf 'header = "Authorization: Bearer %s"\nheader = "Content-Type: application/json"\n' "$token"
      printf 'header = "Idempotency-Key: %s"\ndata = "%s"\noutput = "/dev/null"\n' "$key" "$body"
    done
  } >"$run/$name.curl"
  curl -s -K "$run/$name.curl"
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  callgrind_annotate "$run/$name.out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'
}

# profile_load NAME SECONDS -> prints "instructions requests writer
# writes commits": new-key payments from wrk's 64 connections, so that
# commits carry many writes each, as in bench/run.sh; `writer` is the
# store's writer thread's share (writer_loop, inclusive).
profile_load() {
  local name=$1 secs=$2 port token pid res metrics
  start_server "$name"
  res=$(IDEM_TOKEN="$token" IDEM_MODE=new IDEM_PATH=/payments IDEM_BODY='{"amount": 15990}' \
        IDEM_EXPECT=201 wrk -t1 -c64 -d"${secs}s" --timeout 10s -s "$repo/bench/load.lua" \
        "http://127.0.0.1:$port" 2>&1 | grep '^result') || true
  metrics=$(curl -s "http://127.0.0.1:$port/metrics")
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  case "$res" in *" bad=0 "*) ;; *) echo "callgrind: the load run had unexpected answers: $res" >&2; exit 1 ;; esac
  echo "$(callgrind_annotate "$run/$name.out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')" \
    "$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$res")" \
    "$(callgrind_annotate --inclusive=yes "$run/$name.out" 2>/dev/null | awk '/:writer_loop / { gsub(",", "", $1); print $1; exit }')" \
    "$(awk '/^idem_store_writes_total/ { print $2 }' <<<"$metrics")" \
    "$(awk '/^idem_store_commits_total/ { print $2 }' <<<"$metrics")"
}

base=$(profile base replay 0)
new=$(profile new new "$n")
replay=$(profile replay replay "$n")
order=$(profile order new "$n" /orders \
  '{\"customer_id\": \"c1\", \"items\": [{\"sku\": \"A1\", \"quantity\": 2, \"unit_price\": 1000}], \"currency\": \"BRL\"}')
echo "callgrind, instructions per request ($n requests, minus a run with one; kept-alive connection):"
echo "  new-key POST /payments (reserve, sandbox charge, complete): $(( (new - base) / n ))"
echo "  replay of a completed key:                                 $(( (replay - base) / n ))"
echo "  new-key POST /orders (written with its reservation):        $(( (order - base) / n ))"
read -r total reqs writer writes commits <<<"$(profile_load load "$load_secs")"
echo "under load (wrk -c64 for ${load_secs}s: $reqs new-key payments, $((writes / commits)) writes per commit):"
echo "  new-key POST /payments: $(( (total - base) / reqs )), of which the store's writer thread $(( writer / reqs ))"
