#!/usr/bin/env bash
# Runs a command against a fresh throwaway PostgreSQL cluster, then stops
# and removes it. The command finds the cluster in IDEM_TEST_STORE_URL (its
# connection URL) and IDEM_TEST_PG_DIR (for pg-cluster.sh stop/start).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d /tmp/idem-pg.XXXXXX)
trap '"$here/pg-cluster.sh" destroy "$dir" >/dev/null 2>&1 || true' EXIT
IDEM_TEST_STORE_URL=$("$here/pg-cluster.sh" start "$dir")
export IDEM_TEST_STORE_URL IDEM_TEST_PG_DIR=$dir
"$@"
