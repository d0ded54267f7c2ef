#!/usr/bin/env bash
# Installs the Debian packages idem builds and tests with, only when missing.
# Runs apt-get update once, and only if something has to be installed.
set -euo pipefail

pkgs=(build-essential cmake pkg-config
      libmicrohttpd-dev libjansson-dev libcmocka-dev libcurl4-openssl-dev
      libsqlite3-dev libpq-dev libssl-dev libjemalloc-dev sqlite3 nginx-light
      postgresql postgresql-client  # throwaway clusters of the PostgreSQL tests
      python3 python3-yaml python3-jsonschema  # tests/api/check_openapi.py
)
pkgs+=("$@")

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
