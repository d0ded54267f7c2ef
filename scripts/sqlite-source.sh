#!/usr/bin/env bash
# Makes SQLite's single-file source (the amalgamation: sqlite3.c and
# sqlite3.h) from Debian 12's own source package of the library it ships,
# with Debian's patches, in .deps/sqlite (CMake builds idem against it when
# it is there; docs/performance.md, "SQLite built with idem" says why).
# The package's files are checked against the SHA-256 sums below before
# anything is unpacked. Does nothing when .deps/sqlite is already made for
# this version. Exits non-zero, leaving no .deps/sqlite, when the files
# cannot be fetched or do not match: the build then uses the system's
# libsqlite3 instead. `version` and the sums follow Debian's updates of
# the package; once Debian replaces this version, its files leave the
# archive, and the build falls back to the system's library until they
# are brought up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/debian-source.sh
. scripts/debian-source.sh

version=3.40.1-2+deb12u2
base=http://deb.debian.org/debian/pool/main/s/sqlite3
files=(
  "sqlite3_3.40.1.orig.tar.xz aaa776260ab4dc976db34aa7891819484c8676b5b2783123ebc6301e2ca5d655"
  "sqlite3_$version.debian.tar.xz 0843bc12e4364076477935ce313a6d0796fd899a989ff18ebb6545540e10e4ca"
)

out=.deps/sqlite
debian_begin "$out" sqlite3.c "$version"
debian_fetch "$base" "$work" "${files[@]}"

echo "sqlite-source: making SQLite $version's amalgamation in $out" >&2
# What dpkg-source would do: SQLite's release, then Debian's patches
# (security fixes among them) in the order of their series, each applied
# exactly (no fuzz, as dpkg-source applies them).
tar -xf "$work/sqlite3_3.40.1.orig.tar.xz" -C "$work"
tar -xf "$work/sqlite3_$version.debian.tar.xz" -C "$work/sqlite3-3.40.1"
debian_patch "$work/sqlite3-3.40.1"
mkdir "$work/build"
(cd "$work/build" && ../sqlite3-3.40.1/configure >/dev/null && make sqlite3.c >/dev/null)

cp "$work/build/sqlite3.c" "$work/build/sqlite3.h" "$stage/"
debian_finish "$out" "$version"
