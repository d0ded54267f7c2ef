#!/usr/bin/env bash
# Installs the build in $1 (source in $2, compiler $3) into a temporary
# prefix, builds examples/embed against that prefix only, checks that
# idem.pc and idem-client.pc link a program each, then starts the example
# on 127.0.0.1 and runs conformance.py against it. Fails on any step;
# removes everything it made, and stops the server, either way.
set -euo pipefail
build=$1 src=$2 cc=${3:-cc}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/idem-install-XXXXXX")
server=
cleanup() {
  if [[ -n $server ]]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "test_install: $*" >&2; exit 1; }

prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install failed"; }
for f in bin/idemd bin/idem bin/idem-psp include/idem/engine.h include/idem/client.h \
         lib/libidem.a lib/libidem_client.a lib/cmake/idem/idemConfig.cmake \
         lib/cmake/idem/idemConfigVersion.cmake lib/pkgconfig/idem.pc lib/pkgconfig/idem-client.pc \
         share/doc/idem/LICENSE share/doc/idem/licenses/README share/doc/idem/licenses/sqlite.txt \
         share/doc/idem/licenses/libmicrohttpd.txt share/doc/idem/licenses/gnutls.txt \
         share/doc/idem/licenses/LGPL-2.1 \
         share/doc/idem/licenses/mhd-epoll-suspend.patch share/doc/idem/licenses/mhd-header-nul.patch \
         share/doc/idem/licenses/mhd-half-close.patch \
         share/doc/idem/copyright share/man/man8/idemd.8.gz share/man/man1/idem.1.gz \
         share/man/man1/idem-psp.1.gz lib/systemd/system/idemd.service etc/default/idemd; do
  [[ -e $prefix/$f ]] || fail "not installed: $f"
done
grep -q '^MIT License$' "$prefix/share/doc/idem/LICENSE" || fail "share/doc/idem/LICENSE is not idem's MIT licence"
# The unit runs the idemd of this prefix with this prefix's environment
# file (cmake/install-service.cmake; the Debian package's, /usr's, is
# checked by tests/package).
grep -qx "ExecStart=$prefix/bin/idemd serve" "$prefix/lib/systemd/system/idemd.service" ||
  fail "idemd.service does not run $prefix/bin/idemd: $(grep ExecStart "$prefix/lib/systemd/system/idemd.service")"
grep -qx "EnvironmentFile=-$prefix/etc/default/idemd" "$prefix/lib/systemd/system/idemd.service" ||
  fail "idemd.service does not read $prefix/etc/default/idemd"
# The patches installed are the ones the build applied (scripts/mhd-source.sh).
for p in mhd-epoll-suspend.patch mhd-header-nul.patch mhd-half-close.patch; do
  cmp -s "$src/scripts/$p" "$prefix/share/doc/idem/licenses/$p" || fail "share/doc/idem/licenses/$p differs from scripts/$p"
done

# The example, from the prefix alone: nothing of the build or source tree.
cmake -S "$src/examples/embed" -B "$tmp/embed" -DCMAKE_C_COMPILER="$cc" \
      -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_FLAGS=-Werror >"$tmp/embed.log" 2>&1 ||
  { cat "$tmp/embed.log"; fail "examples/embed does not configure against $prefix"; }
grep -qx "idem_DIR:PATH=$prefix/lib/cmake/idem" "$tmp/embed/CMakeCache.txt" ||
  fail "examples/embed found another idem: $(grep '^idem_DIR' "$tmp/embed/CMakeCache.txt")"
cmake --build "$tmp/embed" >>"$tmp/embed.log" 2>&1 ||
  { cat "$tmp/embed.log"; fail "examples/embed does not build against $prefix"; }

# idem::client from the package: it links, and without libidem or a store.
mkdir "$tmp/cli"
cat >"$tmp/cli/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(cli LANGUAGES C)
find_package(idem REQUIRED)
add_executable(cli client.c)
target_link_libraries(cli PRIVATE idem::client)
CM
cat >"$tmp/cli/client.c" <<'C'
#include <idem/client.h>
#include <stdio.h>
int main(void) { printf("%s\n", idem_client_outcome_str(IDEM_CLIENT_DONE)); return 0; }
C
{ cmake -S "$tmp/cli" -B "$tmp/cli/build" -DCMAKE_C_COMPILER="$cc" -DCMAKE_PREFIX_PATH="$prefix" &&
  cmake --build "$tmp/cli/build"; } >"$tmp/cli.log" 2>&1 ||
  { cat "$tmp/cli.log"; fail "a program does not build with idem::client"; }
[[ $("$tmp/cli/build/cli") == "final answer" ]] || fail "the program linked with idem::client does not run"
if grep -Eq 'libidem\.a|libidem_sqlite|libpq|sqlite3' "$tmp/cli/build/CMakeFiles/cli.dir/link.txt"; then
  fail "idem::client drags in the stores: $(cat "$tmp/cli/build/CMakeFiles/cli.dir/link.txt")"
fi

# pkg-config: a program against each .pc file, the client's without the
# stores (no libpq, no SQLite on its link line).
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
cat >"$tmp/engine.c" <<'C'
#include <idem/engine.h>
#include <stdio.h>
int main(void) { printf("%s\n", idem_decision_name(idem_decide(NULL, "f", 0))); return 0; }
C
cat >"$tmp/client.c" <<'C'
#include <idem/client.h>
#include <stdio.h>
int main(void) { printf("%s\n", idem_client_outcome_str(IDEM_CLIENT_DONE)); return 0; }
C
# shellcheck disable=SC2046 # word splitting of pkg-config's flags is meant
"$cc" -Werror -o "$tmp/engine" "$tmp/engine.c" $(pkg-config --cflags --libs --static idem) ||
  fail "a program does not link with pkg-config --static idem"
[[ $("$tmp/engine") == reserve ]] || fail "the program linked with idem.pc does not run"
client_libs=$(pkg-config --cflags --libs --static idem-client)
for word in $client_libs; do
  case $word in
    -lidem | -lidem_sqlite | -lsqlite3 | -lpq) fail "idem-client.pc drags in the stores: $client_libs" ;;
  esac
done
# shellcheck disable=SC2086
"$cc" -Werror -o "$tmp/client" "$tmp/client.c" $client_libs ||
  fail "a program does not link with pkg-config --static idem-client"
[[ $("$tmp/client") == "final answer" ]] || fail "the program linked with idem-client.pc does not run"
# The example again, with pkg-config instead of CMake (as its README says).
# shellcheck disable=SC2046
"$cc" -Werror -o "$tmp/embed-pc" "$src/examples/embed/notes.c" \
  $(pkg-config --cflags --libs --static idem) $(pkg-config --cflags --libs libmicrohttpd) ||
  fail "examples/embed does not build with pkg-config"

# The server, on a port of its own choosing (0) on the loopback only.
"$tmp/embed/embed-notes" 0 "$tmp/notes.db" >"$tmp/server.out" 2>"$tmp/server.err" &
server=$!
port=
for _ in $(seq 100); do
  port=$(sed -n 's|^listening on http://127\.0\.0\.1:\([0-9][0-9]*\)$|\1|p' "$tmp/server.out")
  [[ -n $port ]] && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
[[ -n $port ]] || { cat "$tmp/server.err"; fail "embed-notes did not start"; }

python3 "$here/conformance.py" "http://127.0.0.1:$port" "$tmp/notes.db" ||
  { cat "$tmp/server.err"; fail "conformance cases failed"; }

kill -TERM "$server"
for _ in $(seq 100); do
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$server" 2>/dev/null; then fail "embed-notes did not stop on SIGTERM"; fi
wait "$server" || fail "embed-notes exited with $?"
server=
echo "test_install: ok"
