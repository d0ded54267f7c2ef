#!/usr/bin/env bash
# New-key payments per second with and without a concurrent flood of
# forged provider events at POST /webhooks/provider (docs/payments.md,
# "Webhooks"): the flood must not slow the payment routes much, since a
# forged event is refused in the event thread after one HMAC. idemd on
# SQLite and the sandbox, wrk on 127.0.0.1. Prints figures; never
# passes or fails on them.
# Usage: bench/webhook_flood.sh [SECONDS] [IDEMD]   (defaults 10, build/idemd)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-10}
idemd=${2:-$repo/build/idemd}
run=$(mktemp -d /tmp/idem-flood.XXXXXX)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$run"' EXIT

port=$((20000 + RANDOM % 20000))
token=$("$idemd" tenant create flood --db "$run/idem.db")
"$idemd" serve --db "$run/idem.db" --listen "127.0.0.1:$port" \
  --provider-webhook-secret "bench-secret" 2>/dev/null &
pid=$!
for _ in $(seq 300); do curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break; sleep 0.1; done

payments() {
  IDEM_TOKEN="$token" IDEM_MODE=new IDEM_PATH=/payments IDEM_BODY='{"amount": 15990}' \
    IDEM_EXPECT=201 wrk -t1 -c32 -d"${secs}s" --timeout 10s -s "$repo/bench/load.lua" \
    "http://127.0.0.1:$port" 2>&1 | grep '^result'
}
flood() {
  wrk -t1 -c32 -d"${secs}s" --timeout 10s -s "$repo/bench/webhook_flood.lua" \
    "http://127.0.0.1:$port" 2>&1 | grep '^result'
}

# idemd's CPU time (user + system, clock ticks).
cpu() { awk '{ print $14 + $15 }' "/proc/$pid/stat"; }

before=$(cpu)
alone=$(flood)
after=$(cpu)
requests=$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$alone")
echo "the flood alone:         $alone"
echo "  idemd's CPU per forged event: $(( (after - before) * 1000000 / $(getconf CLK_TCK) / requests )) us"
echo "payments alone:          $(payments)"
flood >"$run/flood" &
fpid=$!
echo "payments under a flood:  $(payments)"
wait "$fpid"
echo "the flood (forged, 400): $(cat "$run/flood")"
curl -s "http://127.0.0.1:$port/metrics" | grep '^idem_webhooks_total{result="forged"}'
