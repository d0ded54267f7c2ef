#!/usr/bin/env bash
# Makes the Debian package, idem_<version>_amd64.deb: a Release build of
# its own in build-package/ (no tests), for the prefix /usr (libraries in
# Debian's multiarch directory), then `cpack -G DEB`. Prints the package's
# path. Needs what scripts/deps.sh installs and builds (demo.sh and test.sh
# run it); without .deps, the package links the system's SQLite and
# libmicrohttpd and depends on their packages instead. Extra arguments go
# to cmake's configure step (e.g. -DIDEM_PACKAGE_MAINTAINER='Name <mail>').
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=$repo/build-package

for f in "$repo/.deps/sqlite/sqlite3.c" "$repo/.deps/libmicrohttpd/lib/libmicrohttpd.a"; do
  [ -f "$f" ] || echo "package: $f is missing (scripts/deps.sh makes it): the package will use the system's library" >&2
done
cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
      -DIDEM_BUILD_TESTS=OFF "$@" >/dev/null
cmake --build "$build" -j"${JOBS:-$(nproc 2>/dev/null || echo 2)}" >/dev/null
(cd "$build" && cpack -G DEB >"$build/cpack.log") || { cat "$build/cpack.log" >&2; exit 1; }
sed -n 's/^CPack: - package: \(.*\) generated\.$/\1/p' "$build/cpack.log"
