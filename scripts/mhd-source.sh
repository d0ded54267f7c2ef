#!/usr/bin/env bash
# Builds libmicrohttpd as a static library from Debian 12's own source
# package of the version it ships, with Debian's patches and then idem's
# (scripts/mhd-epoll-suspend.patch, then scripts/mhd-header-nul.patch), in
# .deps/libmicrohttpd (CMake links idemd against it when it is there;
# docs/performance.md, "libmicrohttpd built with idem", and the patches'
# own headers say why). The package's files are checked against the
# SHA-256 sums below before anything is unpacked. Does nothing when
# .deps/libmicrohttpd is already built for this version and these
# patches. Exits non-zero, leaving no .deps/libmicrohttpd, when the files
# cannot be fetched or do not match, or the build fails: idemd is then
# built with the system's libmicrohttpd instead. As for SQLite
# (sqlite-source.sh), `version` and the sums follow Debian's updates of
# the package.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/debian-source.sh
. scripts/debian-source.sh

version=0.9.75-6
base=http://deb.debian.org/debian/pool/main/libm/libmicrohttpd
files=(
  "libmicrohttpd_0.9.75.orig.tar.xz 796e7e217a4802679fcac667a4e98501c53185dcf50ca0583870e84192620131"
  "libmicrohttpd_$version.debian.tar.xz 566c247bfbf67e20858705ae695f58db747d50ed8512f2bc46a28bef9086e5af"
)
patch_files=(scripts/mhd-epoll-suspend.patch scripts/mhd-header-nul.patch scripts/mhd-half-close.patch)
# What is built: the package's version, idem's patches and this script.
stamp="$version $(cat "${patch_files[@]}" scripts/mhd-source.sh | sha256sum | cut -d' ' -f1)"

out=.deps/libmicrohttpd
debian_begin "$out" lib/libmicrohttpd.a "$stamp"
debian_fetch "$base" "$work" "${files[@]}"

echo "mhd-source: building libmicrohttpd $version with ${patch_files[*]} in $out" >&2
src="$work/libmicrohttpd-0.9.75"
tar -xf "$work/libmicrohttpd_0.9.75.orig.tar.xz" -C "$work"
tar -xf "$work/libmicrohttpd_$version.debian.tar.xz" -C "$src"
# What dpkg-source would do, then idem's patches, in order, exactly too.
debian_patch "$src"
for p in "${patch_files[@]}"; do
  patch -d "$src" -p1 -s -F0 -N --batch <"$p"
done

# Debian's configuration, with GnuTLS for HTTPS as Debian's has it
# (idemd --tls-cert/--tls-key; CMake links GnuTLS's shared library), less
# what idemd never uses (the documentation, examples and libcurl-based
# tests), as a static library, with the flags Debian builds the package
# with (its rules ask for every hardening option).
cflags="-O2 -fstack-protector-strong" cppflags="-D_FORTIFY_SOURCE=2"
if command -v dpkg-buildflags >/dev/null; then
  cflags=$(DEB_BUILD_MAINT_OPTIONS=hardening=+all dpkg-buildflags --get CFLAGS)
  cppflags=$(DEB_BUILD_MAINT_OPTIONS=hardening=+all dpkg-buildflags --get CPPFLAGS)
fi
(cd "$src" &&
  ./configure -q --disable-shared --enable-static --with-pic \
    --enable-https --with-gnutls --disable-doc --disable-examples --disable-curl \
    CFLAGS="$cflags" CPPFLAGS="$cppflags" >"$work/configure.log" 2>&1 &&
  make -s -j"$(nproc)" -C src/microhttpd >"$work/make.log" 2>&1) || {
  echo "mhd-source: the build failed; the last lines of its log:" >&2
  tail -n 20 "$work/configure.log" "$work/make.log" 2>/dev/null >&2 || true
  exit 1
}

mkdir -p "$stage/lib" "$stage/include"
cp "$src/src/microhttpd/.libs/libmicrohttpd.a" "$stage/lib/"
cp "$src/src/include/microhttpd.h" "$stage/include/"
debian_finish "$out" "$stamp"
