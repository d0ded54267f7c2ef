#!/usr/bin/env bash
# Two idemd instances on one throwaway PostgreSQL database behind nginx
# (deploy/nginx/idem.conf), then 20 copies of one payment and one order sent
# at once through nginx: exactly one of each must exist, every answer must be
# 201 with the same id, both instances must have served requests, and nginx
# answers GET /metrics 404.
# Usage: scripts/scale-demo.sh [path/to/idemd]   (default: build/idemd)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
idemd=$(realpath "${1:-$repo/build/idemd}")
[ -x "$idemd" ] || { echo "scale-demo: no idemd at $idemd (build first)" >&2; exit 1; }
command -v nginx >/dev/null || "$repo/scripts/deps.sh" nginx-light
nginx=$(command -v nginx || echo /usr/sbin/nginx)

run=$(mktemp -d /tmp/idem-scale.XXXXXX)
pg=$(mktemp -d /tmp/idem-pg.XXXXXX) # its own directory: the postgres user must own it
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$run/nginx.pid" ] && kill "$(cat "$run/nginx.pid")" 2>/dev/null || true
  "$repo/scripts/pg-cluster.sh" destroy "$pg" >/dev/null 2>&1 || true
  rm -rf "$run"
}
trap cleanup EXIT

free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 20000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
}
wait_http() { # port [pid]: fails early when that process has exited
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$1/healthz" >/dev/null && return 0
    [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null && return 1
    sleep 0.1
  done
  echo "scale-demo: nothing answers on port $1" >&2; return 1
}

db=$("$repo/scripts/pg-cluster.sh" start "$pg")
key=$("$idemd" tenant create shop --db "$db")
# A small provider delay makes the copies overlap, so some of them really
# wait for the original on the other instance. A port found free may be
# taken before idemd binds it (tests run in parallel): then another.
start_idemd() { # prints "port pid" of an idemd that answers
  local port pid
  for _ in 1 2 3 4 5; do
    port=$(free_port)
    "$idemd" serve --db "$db" --listen "127.0.0.1:$port" --sandbox-delay 200ms \
      >"$run/idemd-$port.out" 2>"$run/idemd-$port.log" &
    pid=$!
    if wait_http "$port" "$pid"; then echo "$port $pid"; return 0; fi
    kill "$pid" 2>/dev/null || true
    echo "scale-demo: idemd on port $port did not start:" >&2
    tail -n 5 "$run/idemd-$port.log" >&2
  done
  return 1
}
read -r port_a pid_a < <(start_idemd); pids+=("$pid_a")
read -r port_b pid_b < <(start_idemd); pids+=("$pid_b")
port_lb=$(free_port)

mkdir -p "$run"/{body,proxy,fastcgi,uwsgi,scgi}
sed -e "s|@RUN@|$run|g" -e "s|@PORT_A@|$port_a|g" -e "s|@PORT_B@|$port_b|g" \
    -e "s|@PORT_LB@|$port_lb|g" "$repo/deploy/nginx/idem.conf" >"$run/nginx.conf"
"$nginx" -c "$run/nginx.conf" -e "$run/error.log" 2>/dev/null || "$nginx" -c "$run/nginx.conf"
wait_http "$port_lb"
echo "scale-demo: nginx on 127.0.0.1:$port_lb -> idemd on $port_a and $port_b, PostgreSQL in $pg"

fail=0
send_twenty() { # path body key -> prints "status id" per answer
  local dir="$run/answers.$3"
  mkdir -p "$dir"
  export URL="http://127.0.0.1:$port_lb$1" BODY="$2" IKEY="$3" KEY="$key" DIR="$dir"
  seq 20 | xargs -P 20 -I{} sh -c 'curl -s -X POST "$URL" \
      -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
      -H "Idempotency-Key: $IKEY" -d "$BODY" -o "$DIR/$1.body" \
      -w "%{http_code}" >"$DIR/$1.code"' _ {}
  for i in $(seq 20); do
    printf '%s %s\n' "$(cat "$dir/$i.code" 2>/dev/null || echo 000)" \
      "$(grep -o '"id":"[a-z]*_[a-z0-9]*"' "$dir/$i.body" 2>/dev/null | head -n 1)"
  done
}
for case in "/payments|{\"amount\": 15990}|pay-once|payments" \
            "/orders|{\"customer_id\": \"c1\", \"items\": [{\"sku\": \"A1\", \"quantity\": 2, \"unit_price\": 1000}]}|order-once|orders"; do
  IFS='|' read -r path body k table <<<"$case"
  answers=$(send_twenty "$path" "$body" "$k")
  distinct=$(sort -u <<<"$answers")
  rows=$(psql "$db" -tAc "SELECT count(*) FROM $table")
  echo "scale-demo: POST $path x20 -> $(wc -l <<<"$answers") answers, distinct: $distinct; rows in $table: $rows"
  if [ "$(wc -l <<<"$distinct")" != 1 ] || [ "${distinct%% *}" != 201 ] || [ "$rows" != 1 ]; then
    echo "scale-demo: FAILED for $path" >&2; fail=1
  fi
done
# The example keeps /metrics off the public side.
status=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port_lb/metrics")
echo "scale-demo: GET /metrics through nginx -> $status"
if [ "$status" != 404 ]; then
  echo "scale-demo: FAILED: nginx passes /metrics through" >&2; fail=1
fi
served_a=$(grep -c '"msg":"request"' "$run/idemd-$port_a.log" || true)
served_b=$(grep -c '"msg":"request"' "$run/idemd-$port_b.log" || true)
echo "scale-demo: requests served by instance A: $served_a, by instance B: $served_b"
if [ "$served_a" -lt 2 ] || [ "$served_b" -lt 2 ]; then
  echo "scale-demo: FAILED: the load did not reach both instances" >&2; fail=1
fi
[ $fail = 0 ] && echo "scale-demo: OK"
exit $fail
