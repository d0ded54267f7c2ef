#!/usr/bin/env bash
# Installs what is missing, builds idemd, makes sure a demo tenant exists in
# ./idem.db, prints its API key and a curl line, and starts the server on
# 127.0.0.1:8080 (Ctrl-C stops it). Run it again: it reuses the same key.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

"$repo/scripts/deps.sh"
cmake -S "$repo" -B "$repo/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$repo/build" -j"$(nproc 2>/dev/null || echo 2)" >/dev/null
idemd="$repo/build/idemd"

db=${IDEMD_DB:-./idem.db}
listen=${IDEMD_LISTEN:-127.0.0.1:8080}
keyfile=./.idem-demo-key
if [ -s "$keyfile" ] && [ -f "$db" ]; then
  key=$(cat "$keyfile")
else
  key=$("$idemd" tenant create demo --db "$db" 2>/dev/null) ||
    key=$("$idemd" tenant create "demo-$(date +%s)" --db "$db")
  (umask 077 && printf '%s\n' "$key" > "$keyfile")
fi

cat <<MSG

idemd is starting on http://$listen with the database $db
Demo API key: $key

Try (run it twice: the second answer is a replay of the first):

  curl -i -X POST http://$listen/payments \\
    -H 'Authorization: Bearer $key' \\
    -H 'Content-Type: application/json' \\
    -H 'Idempotency-Key: demo-order-1' \\
    -d '{"amount": 15990, "currency": "BRL"}'

MSG
exec "$idemd" serve --db "$db" --listen "$listen"
