#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster for tests and benchmarks, run as the
# `postgres` OS user (PostgreSQL refuses root) in a directory of its own,
# listening only on a unix socket in that directory.
#
#   pg-cluster.sh init DIR     initdb into DIR (made if missing)
#   pg-cluster.sh start DIR    start it; prints the connection URL
#   pg-cluster.sh stop DIR     fast shutdown
#   pg-cluster.sh url DIR      print the connection URL
#   pg-cluster.sh destroy DIR  stop and remove DIR
set -euo pipefail

cmd=${1:?usage: pg-cluster.sh init|start|stop|url|destroy DIR}
dir=${2:?usage: pg-cluster.sh init|start|stop|url|destroy DIR}
bindir=${PG_BINDIR:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
port=5432 # a unix socket in $dir: the port only names the socket file

die() { echo "pg-cluster: $*" >&2; exit 1; }
as_pg() {
  if [ "$(id -un)" = postgres ]; then "$@"; else runuser -u postgres -- "$@"; fi
}
[ -x "$bindir/initdb" ] || die "PostgreSQL server binaries not found (install the postgresql package)"
id postgres >/dev/null 2>&1 || die "there is no 'postgres' OS user"

url() { echo "postgresql:///postgres?host=$dir&port=$port&user=idem"; }

case $cmd in
  init)
    mkdir -p "$dir"
    chown postgres: "$dir" 2>/dev/null || true
    chmod 700 "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_pg "$bindir/initdb" -D "$dir/data" -U idem -A trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 ||
        die "initdb failed; see $dir/initdb.log"
    fi
    ;;
  start)
    [ -f "$dir/data/PG_VERSION" ] || "$0" init "$dir"
    as_pg "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
      -o "-k $dir -p $port -c listen_addresses='' -c max_connections=200" start >/dev/null ||
      die "PostgreSQL did not start; see $dir/server.log"
    url
    ;;
  stop)
    [ -f "$dir/data/postmaster.pid" ] || exit 0
    as_pg "$bindir/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
    ;;
  url) url ;;
  destroy)
    "$0" stop "$dir" || true
    rm -rf "$dir"
    ;;
  *) die "unknown command '$cmd'" ;;
esac
