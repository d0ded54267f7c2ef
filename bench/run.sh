#!/usr/bin/env bash
# idem's benchmark: prints figures, never passes or fails on time. It fails
# loudly only when an answer under load had an unexpected status, or a
# request got none within 10 s.
#
# In one run, on this machine:
#   1. nginx answering POST /payments with a fixed 201: the HTTP ceiling;
#      then idem-floor (tools/floor): libmicrohttpd set up as idemd sets
#      it up, answering at once, and after a payment's two group commits
#      (a file written and fdatasynced per batch) with none of idemd's own
#      work: what idemd's design leaves of the ceiling on this machine;
#   2. idemd on a fresh SQLite database, default (durable) settings:
#      new-key payments, new-key refunds (of 1, taken in turn from 256
#      payments), new-key orders, replays, key reuse with another
#      body; req/s, p50, p99, the slowest answer and the ratio to nginx;
#   3. the same on PostgreSQL (a throwaway cluster), with pgbench running
#      the same statements, one transaction per write, and as its baseline
#      (the physical limit) batched and pipelined as the group commit
#      sends them; then one and two instances behind nginx;
#   4. a long run of mixed requests, reporting idemd's RSS before and after;
#   5. with --tls, new-key payments and replays over HTTPS (keep-alive, a
#      throwaway ECDSA P-256 certificate), and replays on a new connection
#      each: idemd serving it itself (--tls-cert), and nginx terminating
#      it in front of a plain idemd, against the same over plain HTTP, in
#      three alternating rounds.
#   6. (right after 1) idemd gateway on SQLite in front of that nginx,
#      POST /payments a keyed route: new keys and replays as a ratio of
#      nginx alone (docs/gateway.md, "Performance").
#
# Usage: bench/run.sh [--duration S] [--long N] [--skip-pg] [--tls] [--gateway-only]
#   --duration S  seconds per wrk run after a 2 s warm-up (default 10)
#   --long N      requests in the RSS run (default 1000000; 0 skips it)
#   --tls         adds the TLS runs (5; 27 runs more)
#   --gateway-only  runs 1 and 6 alone
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
duration=10
long=1000000
skip_pg=0
tls=0
gateway_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --duration) duration=$2; shift 2 ;;
    --long) long=$2; shift 2 ;;
    --skip-pg) skip_pg=1; shift ;;
    --tls) tls=1; shift ;;
    --gateway-only) gateway_only=1; shift ;;
    *) echo "usage: bench/run.sh [--duration S] [--long N] [--skip-pg] [--tls] [--gateway-only]" >&2; exit 2 ;;
  esac
done

"$repo/scripts/deps.sh" wrk nginx-light
cmake -S "$repo" -B "$repo/build-bench" -DCMAKE_BUILD_TYPE=Release -DIDEM_BUILD_TESTS=OFF >/dev/null
cmake --build "$repo/build-bench" -j"$(nproc)" >/dev/null
# IDEM_BENCH_IDEMD: another idemd binary to measure (builds compared in
# alternating runs), else this tree's.
idemd=${IDEM_BENCH_IDEMD:-"$repo/build-bench/idemd"}
floor="$repo/build-bench/tools/floor/idem-floor"
nginx=$(command -v nginx || echo /usr/sbin/nginx)

run=$(mktemp -d /tmp/idem-bench.XXXXXX)
pg=""
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$run/nginx.pid" ] && kill "$(cat "$run/nginx.pid")" 2>/dev/null || true
  [ -n "$pg" ] && "$repo/scripts/pg-cluster.sh" destroy "$pg" >/dev/null 2>&1 || true
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
wait_http() {
  for _ in $(seq 100); do curl -sk -o /dev/null "$scheme://127.0.0.1:$1/${2:-healthz}" && return 0; sleep 0.1; done
  echo "bench: nothing answers on port $1" >&2; exit 1
}

# thread_ticks PID -> "writer event other" CPU ticks (user + system) of
# PID's threads: the store's writer, libmicrohttpd's event threads, the rest.
thread_ticks() {
  local t comm w=0 e=0 o=0 ticks
  for t in /proc/"$1"/task/*; do
    comm=$(cat "$t/comm" 2>/dev/null) || continue
    # comm may hold spaces; the fields after it are counted from its ")".
    ticks=$(sed -E 's/.*\) //' "$t/stat" 2>/dev/null | awk '{ print $12 + $13 }') || continue
    case "$comm" in
      idem-writer|idem-pg-writer) w=$((w + ticks)) ;;
      MHD-*) e=$((e + ticks)) ;;
      *) o=$((o + ticks)) ;;
    esac
  done
  echo "$w $e $o"
}

failures=0
baseline=0
scheme=http # wrk_run's; https for the TLS runs
close=0     # 1: a new connection for every request (Connection: close)
cpu_pid="" # the idemd whose threads' CPU wrk_run reports, if any
# wrk_run LABEL PORT MODE PATH BODY EXPECT [KEY] -> prints a line, sets $rps
wrk_run() {
  local label=$1 port=$2 mode=$3 path=$4 body=$5 expect=$6 key=${7:-bench-key}
  local env=(IDEM_TOKEN="${token:-}" IDEM_MODE="$mode" IDEM_PATH="$path" IDEM_BODY="$body"
             IDEM_EXPECT="$expect" IDEM_KEY="$key" IDEM_CLOSE="$close"
             IDEM_PATHS="${IDEM_PATHS:-}")
  # A request unanswered after 10 s counts as lost (wrk's default is 2 s:
  # a slower answer still came, and shows in the max column instead).
  env "${env[@]}" wrk -t1 -c64 -d2s --timeout 10s -s "$repo/bench/load.lua" \
    "$scheme://127.0.0.1:$port" >/dev/null 2>&1 || true
  local out full before="" after="" wrk_cpu
  [ -n "$cpu_pid" ] && before=$(thread_ticks "$cpu_pid")
  # bash's time keyword: wrk's own CPU (user and system seconds).
  wrk_cpu=$( { TIMEFORMAT='%U %S'; time env "${env[@]}" wrk -t1 -c64 -d"${duration}s" --latency \
             --timeout 10s -s "$repo/bench/load.lua" "$scheme://127.0.0.1:$port" \
             >"$run/wrk.out" 2>&1; } 2>&1) || true
  [ -n "$cpu_pid" ] && after=$(thread_ticks "$cpu_pid")
  full=$(cat "$run/wrk.out")
  out=$(grep '^result' <<<"$full") || true
  rps=$(sed -E 's/.*rps=([0-9]+).*/\1/' <<<"$out")
  local p50 p99 max bad ratio
  p50=$(sed -E 's/.*p50_ms=([0-9.]+).*/\1/' <<<"$out")
  p99=$(sed -E 's/.*p99_ms=([0-9.]+).*/\1/' <<<"$out")
  max=$(sed -E 's/.*max_ms=([0-9.]+).*/\1/' <<<"$out")
  bad=$(sed -E 's/.*bad=([0-9]+).*/\1/' <<<"$out")
  ratio=$(awk -v a="${rps:-0}" -v b="$baseline" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
  printf '%-44s %9s req/s  p50 %7s ms  p99 %7s ms  max %8s ms  x%s of baseline\n' \
    "$label" "${rps:-?}" "${p50:-?}" "${p99:-?}" "${max:-?}" "$ratio"
  # CPU per request: steadier from run to run than req/s on a shared
  # machine, so a change's effect shows in fewer runs.
  local reqs
  reqs=$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$out")
  if [ -n "$before" ] && [ -n "$after" ] && [ "${reqs:-0}" -gt 0 ] 2>/dev/null; then
    awk -v b="$before" -v a="$after" -v w="$wrk_cpu" -v n="$reqs" -v hz="$(getconf CLK_TCK)" 'BEGIN {
      split(b, x, " "); split(a, y, " "); split(w, z, " ")
      us = 1e6 / hz / n
      printf "  CPU per request: idemd %.1f us (writer %.1f, event threads %.1f, other %.1f), wrk %.1f us\n",
        (y[1] + y[2] + y[3] - x[1] - x[2] - x[3]) * us, (y[1] - x[1]) * us, (y[2] - x[2]) * us,
        (y[3] - x[3]) * us, (z[1] + z[2]) * 1e6 / n }'
  fi
  if [ -z "$out" ] || [ "${bad:-1}" != 0 ]; then
    echo "bench: FAILED: $label: ${bad:-?} requests did not get $expect (a wrong status," \
         "or no answer within 10 s)" >&2
    grep '^unexpected' <<<"$full" >&2 || true
    failures=$((failures + 1))
  fi
}

pay='{"amount": 15990, "currency": "BRL"}'
refund='{"amount": 1}'
order='{"customer_id": "c1", "items": [{"sku": "A1", "quantity": 2, "unit_price": 1000}], "currency": "BRL"}'

# The kernel's automatic scheduling groups (one per session): with them
# on, PostgreSQL runs on this 2-core machine stalled for up to seconds now
# and then (fewer and shorter since the bound on workers at work), and not
# once with them off (docs/performance.md, "Workers at work at once"). The
# figures say which way the machine was set.
autogroup=$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null || echo "?")
echo "== machine: $(nproc) cores; kernel.sched_autogroup_enabled=$autogroup;" \
     "wrk -t1 -c64, ${duration}s per run after a 2 s warm-up"

# 1. nginx: the HTTP ceiling.
port_ng=$(free_port)
mkdir -p "$run"/{body,proxy,fastcgi,uwsgi,scgi}
cat >"$run/nginx.conf" <<NGINX
worker_processes auto;
pid $run/nginx.pid;
error_log $run/nginx-error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $run/body; proxy_temp_path $run/proxy;
  fastcgi_temp_path $run/fastcgi; uwsgi_temp_path $run/uwsgi; scgi_temp_path $run/scgi;
  server {
    listen 127.0.0.1:$port_ng;
    location = /payments {
      default_type application/json;
      return 201 '{"id":"pay_0123456789abcdefghijklmn","amount":15990,"currency":"BRL","order_id":null,"status":"succeeded","created_at":"2026-01-01T00:00:00Z"}';
    }
  }
}
NGINX
# start_nginx: nginx on $run/nginx.conf, which listens on $port_ng.
# free_port only probes: another process may take the port first. Then
# nginx exits at once, and another port is tried, loudly after five.
start_nginx() {
  local attempt old_port
  for attempt in 1 2 3 4 5; do
    "$nginx" -c "$run/nginx.conf" 2>"$run/nginx-start.log" && return 0
    if [ "$attempt" = 5 ]; then
      echo "bench: nginx did not start:" >&2
      cat "$run/nginx-start.log" >&2
      exit 1
    fi
    old_port=$port_ng
    port_ng=$(free_port)
    sed -i -E "s/listen 127.0.0.1:$old_port([ ;])/listen 127.0.0.1:$port_ng\1/" "$run/nginx.conf"
  done
}
start_nginx
wait_http "$port_ng" payments
token=""
wrk_run "nginx: fixed 201 for POST /payments" "$port_ng" new /payments "$pay" 201
baseline=${rps:-0}

# 6. idemd gateway in front of the same nginx: every new key a durable
# record (reservation, the upstream's answer, completion) before its 201.
port_gw=$(free_port)
"$idemd" gateway --upstream "http://127.0.0.1:$port_ng" --route 'POST /payments' \
  --listen "127.0.0.1:$port_gw" --admin-listen "127.0.0.1:$(free_port)" \
  --db "$run/gateway.db" 2>"$run/gateway.log" &
pids+=($!)
gateway_pid=$!
wait_http "$port_gw" payments
curl -s -o /dev/null -X POST "http://127.0.0.1:$port_gw/payments" \
  -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-key' -d "$pay"
# CPU per request as idemd's: the store's writer, the event threads, and
# the rest (the upstream's I/O thread, workers, the log).
cpu_pid=$gateway_pid
wrk_run "idemd gateway: new-key POST /payments" "$port_gw" new /payments "$pay" 201
wrk_run "idemd gateway: replays of one key" "$port_gw" replay /payments "$pay" 201 bench-key
cpu_pid=""
kill "$gateway_pid"; wait "$gateway_pid" 2>/dev/null || true
kill "$(cat "$run/nginx.pid")"; rm -f "$run/nginx.pid"
if [ "$gateway_only" = 1 ]; then
  [ "$failures" = 0 ] || exit 1
  exit 0
fi

# floor_run LABEL ARGS... -> idem-floor with ARGS, measured as nginx was.
floor_run() {
  local label=$1 port="" fpid
  shift
  "$floor" --port 0 "$@" >"$run/floor.out" 2>"$run/floor.err" &
  fpid=$!
  pids+=("$fpid")
  for _ in $(seq 100); do
    port=$(sed -nE 's/^listening on 127\.0\.0\.1:([0-9]+)$/\1/p' "$run/floor.out")
    [ -n "$port" ] && break
    sleep 0.05
  done
  [ -n "$port" ] || { echo "bench: idem-floor did not start:" >&2; cat "$run/floor.err" >&2; exit 1; }
  wrk_run "$label" "$port" new /payments "$pay" 201
  kill "$fpid"; wait "$fpid" 2>/dev/null || true
}
floor_run "floor: libmicrohttpd, answered at once"
floor_run "floor: + a payment's two group commits" --commits 2 --file "$run/floor.wal"

# 2. idemd on SQLite, default settings.
start_idemd() { # NAME DB [FLAGS...] -> a fresh idemd on DB, with the key
                # bench-key used once; sets token, idemd_pid, idemd_port
  local name=$1 db=$2 port
  shift 2
  port=$(free_port)
  token=$("$idemd" tenant create bench --db "$db")
  "$idemd" serve --db "$db" --listen "127.0.0.1:$port" "$@" 2>"$run/idemd-$name.log" &
  pids+=($!)
  cpu_pid=$!
  idemd_pid=$!
  idemd_port=$port
  wait_http "$port"
  curl -sk -o /dev/null -X POST "$scheme://127.0.0.1:$port/payments" -H "Authorization: Bearer $token" \
    -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-key' -d "$pay"
}
# refund_payments -> sets refund_paths: the refunds routes of 256 payments
# of the largest amount, made on $idemd_port, which a refund of 1 each
# never empties.
refund_payments() {
  local id
  refund_paths=""
  for i in $(seq 1 256); do
    id=$(curl -s -X POST "$scheme://127.0.0.1:$idemd_port/payments" -H "Authorization: Bearer $token" \
      -H 'Content-Type: application/json' -H "Idempotency-Key: bench-refunded-$i" \
      -d '{"amount": 9007199254740991}' | sed -E 's/.*"id":"([^"]+)".*/\1/')
    refund_paths="$refund_paths /payments/$id/refunds"
  done
}
bench_idemd() { # NAME DB -> runs the five cases against a fresh idemd
  local name=$1
  start_idemd "$@"
  wrk_run "idemd $name: new-key POST /payments" "$idemd_port" new /payments "$pay" 201
  refund_payments
  IDEM_PATHS="$refund_paths" wrk_run "idemd $name: new-key refunds of payments" \
    "$idemd_port" new /payments "$refund" 201
  wrk_run "idemd $name: new-key POST /orders" "$idemd_port" new /orders "$order" 201
  wrk_run "idemd $name: replays of one key" "$idemd_port" replay /payments "$pay" 201 bench-key
  wrk_run "idemd $name: key reused with another body" "$idemd_port" mismatch /payments "$pay" 422 bench-key
}
bench_idemd sqlite "$run/idem.db"

# 4. The long mixed run, on the SQLite server just measured.
rss() { awk '/VmRSS/ { print $2 }' "/proc/$1/status"; }
if [ "$long" -gt 0 ]; then
  # Size the run from a short probe of the same mix, so it serves about N.
  # The probe is also the warm-up: the start figure is taken after it, once
  # the threads that serve the mix have run.
  probe=$(env IDEM_TOKEN="$token" IDEM_MODE=mixed IDEM_PATH=/payments IDEM_BODY="$pay" IDEM_EXPECT=201 \
          wrk -t1 -c64 -d3s --timeout 10s -s "$repo/bench/load.lua" "http://127.0.0.1:$idemd_port" 2>&1 |
          grep '^result') || true
  per_s=$(sed -E 's/.*rps=([0-9]+).*/\1/' <<<"$probe")
  per_s=${per_s:-5000}
  # A quarter more time than the probe's rate needs: a long run is slower.
  secs=$(( long * 5 / 4 / (per_s > 0 ? per_s : 5000) + 1 ))
  rss_start=$(rss "$idemd_pid")
  out=$(env IDEM_TOKEN="$token" IDEM_MODE=mixed IDEM_PATH=/payments IDEM_BODY="$pay" IDEM_EXPECT=201 \
        wrk -t1 -c64 -d"${secs}s" --timeout 10s -s "$repo/bench/load.lua" "http://127.0.0.1:$idemd_port" 2>&1 |
        grep '^result') || true
  rss_end=$(rss "$idemd_pid")
  reqs=$(sed -E 's/.*requests=([0-9]+).*/\1/' <<<"$out")
  bad=$(sed -E 's/.*bad=([0-9]+).*/\1/' <<<"$out")
  echo "long mixed run: ${reqs:-?} requests in ${secs}s; idemd RSS ${rss_start} KiB at start, ${rss_end} KiB at end ($(( (rss_end - rss_start) / 1024 )) MiB growth)"
  [ "${bad:-1}" = 0 ] || { echo "bench: FAILED: long run: ${bad:-?} unexpected answers" >&2; failures=$((failures + 1)); }
fi
kill "$idemd_pid"; wait "$idemd_pid" 2>/dev/null || true

# 5. TLS (--tls), on SQLite: payments and replays over HTTPS with
# keep-alive, and replays on a new connection each (a TLS handshake per
# request), with idemd serving HTTPS itself and with nginx terminating it
# in front of a plain idemd, each on a fresh idemd; in three alternating
# rounds, each starting over plain HTTP, whose figures are the baseline
# ("x... of baseline") of the round's two HTTPS runs of the same case.
tls_cases() { # LABEL PORT: the three cases, each against its figure in plain[]
  local label=$1 port=$2
  baseline=${plain[0]:-0}
  wrk_run "$label: new-key POST /payments" "$port" new /payments "$pay" 201
  plain[0]=${plain[0]:-$rps}
  baseline=${plain[1]:-0}
  wrk_run "$label: replays of one key" "$port" replay /payments "$pay" 201 bench-key
  plain[1]=${plain[1]:-$rps}
  close=1 baseline=${plain[2]:-0}
  wrk_run "$label: replays, a new connection each" "$port" replay /payments "$pay" 201 bench-key
  plain[2]=${plain[2]:-$rps}
  close=0
}
stop_idemd() {
  kill "$idemd_pid"; wait "$idemd_pid" 2>/dev/null || true
}
if [ "$tls" = 1 ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
    -keyout "$run/tls.key" -out "$run/tls.crt" -subj /CN=127.0.0.1 \
    -addext subjectAltName=IP:127.0.0.1 >/dev/null 2>&1
  for round in 1 2 3; do
    plain=() scheme=http
    start_idemd "plain-$round" "$run/plain-$round.db"
    tls_cases "$round plain HTTP" "$idemd_port"
    stop_idemd
    scheme=https
    start_idemd "tls-$round" "$run/tls-$round.db" --tls-cert "$run/tls.crt" --tls-key "$run/tls.key"
    tls_cases "$round HTTPS, idemd --tls-cert" "$idemd_port"
    stop_idemd
    scheme=http
    start_idemd "nginx-$round" "$run/nginx-$round.db"
    port_ng=$(free_port)
    cat >"$run/nginx.conf" <<NGINX
worker_processes 1;
pid $run/nginx.pid;
error_log $run/nginx-error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $run/body; proxy_temp_path $run/proxy;
  fastcgi_temp_path $run/fastcgi; uwsgi_temp_path $run/uwsgi; scgi_temp_path $run/scgi;
  upstream idem { server 127.0.0.1:$idemd_port; keepalive 64; keepalive_timeout 5s; }
  server {
    listen 127.0.0.1:$port_ng ssl;
    ssl_certificate $run/tls.crt;
    ssl_certificate_key $run/tls.key;
    ssl_protocols TLSv1.2 TLSv1.3;
    location / {
      proxy_pass http://idem;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
NGINX
    start_nginx
    scheme=https
    # The CPU printed is idemd's alone: nginx's worker is not counted.
    wait_http "$port_ng"
    tls_cases "$round HTTPS, nginx in front (1 worker)" "$port_ng"
    kill "$(cat "$run/nginx.pid")"; rm -f "$run/nginx.pid"
    stop_idemd
  done
  scheme=http baseline=0
fi

# 3. PostgreSQL, against pgbench running the same statements.
if [ "$skip_pg" = 0 ]; then
  pg=$(mktemp -d /tmp/idem-pg.XXXXXX)
  url=$("$repo/scripts/pg-cluster.sh" start "$pg")
  "$idemd" migrate --db "$url" 2>/dev/null
  psql "$url" -qc "INSERT INTO tenants (name, created_at) VALUES ('pgbench', 0)"
  tid=$(psql "$url" -Atc "SELECT id FROM tenants WHERE name = 'pgbench'")
  # pgbench_script B PIPE: the statements of B payments as idemd's writes
  # make them (a reservation with the payment's row and its outbox row;
  # a completion with the payment's update and the outbox row's delete),
  # B reservations in one transaction and B completions in the next, as
  # the group commit batches them; with PIPE, each transaction in one
  # round trip (libpq's pipeline, as idemd sends a batch's queued
  # statements). Every statement finds its row by its primary key.
  pgbench_script() {
    local b=$1 pipe=$2 i
    for i in $(seq "$b"); do echo "\\set k$i random(1, 2000000000)"; done
    [ "$pipe" = 1 ] && echo '\startpipeline'
    echo 'BEGIN;'
    for i in $(seq "$b"); do cat <<SQL
INSERT INTO idempotency_records (tenant_id, operation, key, fingerprint, state, correlation_id, owner_token, lease_expires_at, created_at, updated_at, resource_id) VALUES ($tid, 'create_payment', :client_id || '-' || :k$i, 'f', 'processing', 'c', 'o', 1, 1, 1, 'pb_' || :client_id || '_' || :k$i) ON CONFLICT (tenant_id, operation, key) DO NOTHING;
INSERT INTO resources (id, tenant_id, kind, status, body, created_at, updated_at) VALUES ('pb_' || :client_id || '_' || :k$i, $tid, 'payment', 'pending', '{}', 1, 1) ON CONFLICT DO NOTHING;
INSERT INTO outbox (resource_id, tenant_id, operation, key, created_at, next_attempt_at) VALUES ('pb_' || :client_id || '_' || :k$i, $tid, 'create_payment', :client_id || '-' || :k$i, 1, 1) ON CONFLICT DO NOTHING;
SQL
    done
    echo 'COMMIT;'
    echo 'BEGIN;'
    for i in $(seq "$b"); do cat <<SQL
UPDATE idempotency_records SET state = 'completed', response_status = 201, response_body = '{}', owner_token = NULL, updated_at = 2, expires_at = 3 WHERE tenant_id = $tid AND operation = 'create_payment' AND key = :client_id || '-' || :k$i AND state = 'processing' AND owner_token = 'o';
UPDATE resources SET status = 'succeeded', updated_at = 2 WHERE tenant_id = $tid AND id = 'pb_' || :client_id || '_' || :k$i;
DELETE FROM outbox WHERE tenant_id = $tid AND resource_id = 'pb_' || :client_id || '_' || :k$i;
SQL
    done
    echo 'COMMIT;'
    [ "$pipe" = 1 ] && echo '\endpipeline'
    true
  }
  # pgbench_tps FILE CLIENTS MODE -> transactions (pairs) a second
  pgbench_tps() {
    pgbench -n -M "$3" -c "$2" -j 2 -T "$duration" -f "$1" "$url" 2>/dev/null |
      awk '/^tps/ { print int($3) }' | tail -n 1
  }
  pgbench_script 1 0 >"$run/pgbench.sql"
  tps=$(pgbench_tps "$run/pgbench.sql" 64 simple)
  echo "pgbench, the two transactions of one payment (-c 64):  ${tps:-?} payments/s"
  # The physical limit: the same statements batched and pipelined, the
  # best of a few batch sizes and client counts (payments/s = TPS x B).
  best=0 best_at=""
  for b in 4 16 32; do
    pgbench_script "$b" 1 >"$run/pgbench-$b.sql"
    for c in 4 8; do
      t=$(pgbench_tps "$run/pgbench-$b.sql" "$c" prepared)
      if [ "$(( ${t:-0} * b ))" -gt "$best" ]; then best=$(( ${t:-0} * b )); best_at="B=$b, -c $c, $t TPS"; fi
    done
  done
  echo "pgbench, B payments per transaction pair, pipelined (best: $best_at):  $best payments/s"
  baseline=$best
  bench_idemd postgresql "$url"
  kill "$idemd_pid"; wait "$idemd_pid" 2>/dev/null || true

  # Through nginx (deploy/nginx/idem.conf): one instance, then two on the
  # same database; the same token, new keys each run (load.lua).
  pg_behind_nginx() { # N -> wrk runs through nginx in front of N instances
    local n=$1 ports=() i port lb
    for i in $(seq "$n"); do
      port=$(free_port)
      "$idemd" serve --db "$url" --listen "127.0.0.1:$port" 2>"$run/idemd-nginx-$n-$i.log" &
      pids+=($!)
      wait_http "$port"
      ports+=("$port")
    done
    lb=$(free_port)
    mkdir -p "$run/lb"/{body,proxy,fastcgi,uwsgi,scgi}
    sed -e "s|@RUN@|$run/lb|g" -e "s|@PORT_A@|${ports[0]}|g" -e "s|@PORT_B@|${ports[$((n - 1))]}|g" \
        -e "s|@PORT_LB@|$lb|g" "$repo/deploy/nginx/idem.conf" >"$run/lb/nginx.conf"
    "$nginx" -c "$run/lb/nginx.conf" -e "$run/lb/error.log" 2>/dev/null || "$nginx" -c "$run/lb/nginx.conf"
    wait_http "$lb"
    cpu_pid=""
    wrk_run "idemd postgresql x$n behind nginx: new-key POST /payments" "$lb" new /payments "$pay" 201
    wrk_run "idemd postgresql x$n behind nginx: new-key POST /orders" "$lb" new /orders "$order" 201
    wrk_run "idemd postgresql x$n behind nginx: replays of one key" "$lb" replay /payments "$pay" 201 bench-key
    kill "$(cat "$run/lb/nginx.pid")"
    for i in $(seq "$n"); do
      kill "${pids[$(( ${#pids[@]} - i ))]}" 2>/dev/null || true
      wait "${pids[$(( ${#pids[@]} - i ))]}" 2>/dev/null || true
    done
  }
  pg_behind_nginx 1
  pg_behind_nginx 2
fi

if [ "$failures" -gt 0 ]; then
  echo "bench: $failures run(s) had unexpected answers" >&2
  exit 1
fi
