#!/usr/bin/env bash
# Installs the Debian packages idem builds and tests with, only when missing,
# then makes SQLite's source (scripts/sqlite-source.sh) and libmicrohttpd
# (scripts/mhd-source.sh) for the build.
# Runs apt-get update once, and only if something has to be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(build-essential cmake pkg-config
      libmicrohttpd-dev libjansson-dev libcmocka-dev libcurl4-openssl-dev
      libsqlite3-dev libpq-dev libssl-dev libjemalloc-dev sqlite3 nginx-light
      postgresql postgresql-client  # throwaway clusters of the PostgreSQL tests
      python3 python3-yaml python3-jsonschema  # tests/api/check_openapi.py
      php-cli php-sqlite3  # the PHP application behind idemd gateway (tests/gateway)
      curl tcl xz-utils patch  # scripts/sqlite-source.sh, scripts/mhd-source.sh
      libgnutls28-dev  # HTTPS in libmicrohttpd (scripts/mhd-source.sh), linked by idemd
      openssl  # throwaway certificates of tests/tls/test_tls.sh
      prometheus  # promtool, for tests/integration/test_promtool.c (the package
                  # also brings a Prometheus server on :9090 where systemd runs)
      dpkg-dev systemd groff-base  # tests/package: dpkg-shlibdeps for cpack,
                                   # systemd-analyze verify, groff -ww
)
pkgs+=("$@")

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

scripts/sqlite-source.sh ||
  echo "deps: building with the system's SQLite instead (slower: docs/performance.md)" >&2
scripts/mhd-source.sh ||
  echo "deps: building with the system's libmicrohttpd instead (slower: docs/performance.md)" >&2
