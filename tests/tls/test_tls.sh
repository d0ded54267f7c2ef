#!/usr/bin/env bash
# idemd serving HTTPS itself (--tls-cert, --tls-key; docs/operations.md,
# "TLS"), with the idemd in $1: a throwaway self-signed certificate for
# 127.0.0.1 made with openssl, idemd on SQLite in a temporary directory
# with it and a plain metrics listener, a payment over HTTPS with
# curl --cacert and its replay (same key: the same body with "replayed"
# and Idempotent-Replayed), curl refusing the certificate without
# --cacert, plain HTTP to the TLS port getting no answer and making no
# payment, the metrics listener counting in plain HTTP, then SIGTERM
# (exit 0, no sanitizer report). Then the start-up errors: one file without
# the other (2), a missing or unreadable file, a key of another
# certificate, a key given as the certificate (1). Exits 77 (skipped)
# without openssl or curl; stops the server and removes everything either
# way.
set -euo pipefail
idemd=$1
for tool in openssl curl; do
  if ! command -v "$tool" >/dev/null; then
    echo "test_tls: $tool not found: skipped"
    exit 77
  fi
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/idem-tls-XXXXXX")
server=
cleanup() {
  if [[ -n $server ]]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "test_tls: $*" >&2; exit 1; }
sanitizer_clean() {
  ! grep -E 'ERROR: (Address|Leak)Sanitizer|WARNING: ThreadSanitizer|runtime error:' "$1" >&2
}

# Throwaway certificates: the one idemd serves, and another with its key.
cert() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -keyout "$tmp/$1.key" -out "$tmp/$1.crt" -subj "/CN=$2" -addext "subjectAltName=$3" \
    >"$tmp/openssl.log" 2>&1 || { cat "$tmp/openssl.log"; fail "openssl req failed"; }
}
cert server 127.0.0.1 IP:127.0.0.1
cert other other.invalid DNS:other.invalid

# idemd with them, the kernel's pick of ports for both listeners.
db=$tmp/idem.db
"$idemd" serve --listen 127.0.0.1:0 --db "$db" --tls-cert "$tmp/server.crt" \
  --tls-key "$tmp/server.key" --metrics-listen 127.0.0.1:0 2>"$tmp/idemd.err" &
server=$!
line=
for _ in $(seq 100); do
  line=$(grep '"msg":"listening"' "$tmp/idemd.err" || true)
  [[ -n $line ]] && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
[[ -n $line ]] || { cat "$tmp/idemd.err"; fail "idemd did not start"; }
port=$(sed -n 's/.*"listen":"127\.0\.0\.1:\([0-9]*\)".*/\1/p' <<<"$line")
mport=$(sed -n 's/.*"metrics_listen":"127\.0\.0\.1:\([0-9]*\)".*/\1/p' <<<"$line")
[[ -n $port && -n $mport && $line == *'"tls":"on"'* ]] || fail "listening line: $line"
key=$("$idemd" tenant create tls --db "$db") || fail "idemd tenant create failed"

https=https://127.0.0.1:$port
body='{"amount": 15990, "currency": "BRL", "order_id": "ord_tls"}'
pay() { # pay OUT KEY [curl options...]: POST /payments; prints the status
  local out=$1 k=$2
  shift 2
  curl -s -o "$tmp/$out.json" -D "$tmp/$out.head" -w '%{http_code}' --max-time 10 \
    -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
    -H "Idempotency-Key: $k" -d "$body" "$@"
}
status=$(pay first tls-1 --cacert "$tmp/server.crt" "$https/payments") || fail "curl over HTTPS failed"
[[ $status == 201 ]] || fail "payment over HTTPS: $status $(cat "$tmp/first.json")"
grep -q '"status":"succeeded"' "$tmp/first.json" || fail "payment: $(cat "$tmp/first.json")"
! grep -qi '^Idempotent-Replayed:' "$tmp/first.head" || fail "the first answer is marked replayed"
status=$(pay replay tls-1 --cacert "$tmp/server.crt" "$https/payments") || fail "curl replay failed"
[[ $status == 201 ]] || fail "replay over HTTPS: $status $(cat "$tmp/replay.json")"
grep -qi '^Idempotent-Replayed: true' "$tmp/replay.head" || fail "replay without Idempotent-Replayed: $(cat "$tmp/replay.head")"
want=$(sed 's/}$/,"replayed":true}/' "$tmp/first.json")
[[ $(cat "$tmp/replay.json") == "$want" ]] || fail "replay body: $(cat "$tmp/replay.json"), want $want"

# The certificate is what makes it trusted: without --cacert, curl refuses.
rc=0
curl -s -o /dev/null --max-time 10 "$https/healthz" || rc=$?
[[ $rc == 60 ]] || fail "curl without --cacert: exit $rc, want 60 (certificate not trusted)"

# Plain HTTP to the TLS port: no HTTP answer, no payment.
rc=0
status=$(pay plain tls-plain "http://127.0.0.1:$port/payments") || rc=$?
[[ $rc != 0 && $status == 000 ]] || fail "plain HTTP to the TLS port: exit $rc, status $status"
out=$("$idemd" records --tenant tls --db "$db") || fail "idemd records failed"
[[ $(grep -c create_payment <<<"$out") == 1 ]] || fail "records after plain HTTP: $out"
! grep -q tls-plain <<<"$out" || fail "plain HTTP made a record: $out"

# The metrics listener is plain HTTP, and counts the HTTPS requests.
metrics=$(curl -s --max-time 10 "http://127.0.0.1:$mport/metrics") || fail "GET /metrics on the metrics listener failed"
grep -qx 'idem_requests_total{operation="create_payment",outcome="new"} 1' <<<"$metrics" ||
  fail "metrics: $(grep create_payment <<<"$metrics")"
grep -qx 'idem_requests_total{operation="create_payment",outcome="replay"} 1' <<<"$metrics" ||
  fail "metrics: $(grep create_payment <<<"$metrics")"
status=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$tmp/server.crt" "$https/metrics")
[[ $status == 404 ]] || fail "GET /metrics over HTTPS with --metrics-listen: $status"

kill -TERM "$server"
rc=0
wait "$server" || rc=$?
server=
[[ $rc == 0 ]] || { cat "$tmp/idemd.err"; fail "idemd exited $rc on SIGTERM"; }
sanitizer_clean "$tmp/idemd.err" || fail "sanitizer report in idemd's log"

# Start-up errors: exit status and a message naming what is wrong.
mkdir "$tmp/dir.crt"
start_error() { # start_error STATUS MESSAGE FLAGS...
  local want=$1 msg=$2 rc=0
  shift 2
  timeout 20 "$idemd" serve --listen 127.0.0.1:0 --db "$tmp/err.db" "$@" >"$tmp/err.log" 2>&1 || rc=$?
  [[ $rc == "$want" ]] || { cat "$tmp/err.log"; fail "$*: exit $rc, want $want"; }
  grep -qF -- "$msg" "$tmp/err.log" || fail "$*: no '$msg' in: $(cat "$tmp/err.log")"
  ! grep -q '"msg":"listening"' "$tmp/err.log" || fail "$*: listened"
  sanitizer_clean "$tmp/err.log" || fail "$*: sanitizer report"
}
start_error 2 "--tls-cert and --tls-key go together: --tls-cert was given alone" \
  --tls-cert "$tmp/server.crt"
start_error 2 "--tls-cert and --tls-key go together: --tls-key was given alone" \
  --tls-key "$tmp/server.key"
start_error 2 "invalid value for --tls-cert" --tls-cert "" --tls-key "$tmp/server.key"
start_error 1 "cannot read --tls-cert $tmp/none.crt: No such file or directory" \
  --tls-cert "$tmp/none.crt" --tls-key "$tmp/server.key"
start_error 1 "cannot read --tls-key $tmp/none.key: No such file or directory" \
  --tls-cert "$tmp/server.crt" --tls-key "$tmp/none.key"
start_error 1 "cannot read --tls-cert $tmp/dir.crt: Is a directory" \
  --tls-cert "$tmp/dir.crt" --tls-key "$tmp/server.key"
start_error 1 "--tls-key $tmp/other.key does not go with --tls-cert $tmp/server.crt" \
  --tls-cert "$tmp/server.crt" --tls-key "$tmp/other.key"
start_error 1 "--tls-cert $tmp/server.key: no PEM certificate" \
  --tls-cert "$tmp/server.key" --tls-key "$tmp/server.key"
start_error 1 "--tls-key $tmp/server.crt: no unencrypted PEM private key" \
  --tls-cert "$tmp/server.crt" --tls-key "$tmp/server.crt"
IDEMD_TLS_CERT=$tmp/server.crt start_error 2 "--tls-cert was given alone"
echo "test_tls: ok"
