#!/usr/bin/env bash
# The Debian package of the build in $1 (source in $2, project version $3,
# cpack $4): makes it with cpack (which first brings the build up to date,
# as `make package` does) into a temporary directory, extracts it with
# dpkg -x and dpkg -e, and checks what it holds: the control fields and
# maintainer scripts, the programs, libraries, headers, CMake and
# pkg-config files, licences, man pages (rendered without a warning),
# idemd.service and the environment file (a line for every variable idemd
# has and for no other, each value accepted; idemd(8) describes every
# option too). Then it runs the extracted programs: --version,
# idemd serve on 127.0.0.1 with a database in the temporary directory,
# a tenant made by the extracted idemd, a payment with curl (201) and its
# replay by the extracted idem client, a SIGHUP (ignored) and a SIGTERM
# (exit 0). Last, systemd-analyze verify on the unit, when installed.
# Exits 77 (skipped) without dpkg-deb or cpack; removes everything it
# made, and stops the server, either way.
set -euo pipefail
build=$1 src=$2 version=$3 cpack=${4:-cpack}
for tool in dpkg dpkg-deb curl "$cpack"; do
  if ! command -v "$tool" >/dev/null; then
    echo "test_package: $tool not found: skipped"
    exit 77
  fi
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/idem-package-XXXXXX")
server=
cleanup() {
  if [[ -n $server ]]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "test_package: $*" >&2; exit 1; }

# The package, named as Debian names it.
(cd "$build" && "$cpack" -G DEB -B "$tmp/out") >"$tmp/cpack.log" 2>&1 ||
  { cat "$tmp/cpack.log"; tail -n 20 "$tmp"/out/_CPack_Packages/*/DEB/PreinstallOutput.log 2>/dev/null || true
    fail "cpack -G DEB failed"; }
arch=$(dpkg --print-architecture)
deb=$tmp/out/idem_${version}_${arch}.deb
[[ -f $deb ]] || fail "no $(basename "$deb"); cpack made: $(cd "$tmp/out" && echo *.deb)"
root=$tmp/root
dpkg -x "$deb" "$root"
dpkg -e "$deb" "$tmp/control"

# Control: fields, conffiles, maintainer scripts.
field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Package) == idem && $(field Version) == "$version" && $(field Architecture) == "$arch" ]] ||
  fail "control says $(field Package) $(field Version) $(field Architecture)"
depends=$(field Depends)
for dep in adduser procps libc6 libjansson4 libcurl4 libpq5 libgnutls30; do
  [[ ", $depends," == *", $dep"[\ ,]* ]] || fail "Depends lacks $dep: $depends"
done
[[ $(cat "$tmp/control/conffiles") == /etc/default/idemd ]] ||
  fail "conffiles: $(cat "$tmp/control/conffiles")"
for s in postinst prerm postrm; do
  [[ -x $tmp/control/$s ]] || fail "no executable $s"
  sh -n "$tmp/control/$s" || fail "$s is not valid sh"
done
# (its lines continued with a backslash joined first)
sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$tmp/control/postinst" | grep -q 'adduser .*--system .* idem$' ||
  fail "postinst makes no system user idem"
# Everything root's: nobody else may replace the programs.
if dpkg-deb -c "$deb" | awk '$2 != "root/root"' | grep -q .; then
  fail "files not owned by root: $(dpkg-deb -c "$deb" | awk '$2 != "root/root"')"
fi

# Contents. The library directory is the build's (lib, or Debian's
# multiarch lib/x86_64-linux-gnu when configured for /usr).
libdir=$(cd "$root/usr" && find . -name libidem.a -printf '%h\n' | sed 's|^\./||')
[[ -n $libdir ]] || fail "no libidem.a"
for f in usr/bin/idemd usr/bin/idem usr/bin/idem-psp \
         usr/include/idem/engine.h usr/include/idem/client.h usr/include/idem/store.h \
         "usr/$libdir/libidem.a" "usr/$libdir/libidem_client.a" \
         "usr/$libdir/cmake/idem/idemConfig.cmake" "usr/$libdir/cmake/idem/idemConfigVersion.cmake" \
         "usr/$libdir/pkgconfig/idem.pc" "usr/$libdir/pkgconfig/idem-client.pc" \
         usr/lib/systemd/system/idemd.service etc/default/idemd \
         usr/share/man/man8/idemd.8.gz usr/share/man/man1/idem.1.gz usr/share/man/man1/idem-psp.1.gz \
         usr/share/doc/idem/LICENSE usr/share/doc/idem/copyright usr/share/doc/idem/licenses/README \
         usr/share/doc/idem/licenses/sqlite.txt usr/share/doc/idem/licenses/libmicrohttpd.txt \
         usr/share/doc/idem/licenses/gnutls.txt \
         usr/share/doc/idem/licenses/LGPL-2.1 usr/share/doc/idem/licenses/mhd-epoll-suspend.patch \
         usr/share/doc/idem/licenses/mhd-header-nul.patch; do
  [[ -e $root/$f ]] || fail "not in the package: $f"
done
if [[ -n $(find "$root" -path "$root/usr/local" -o -path "$root/usr/etc") ]]; then
  fail "the package has usr/local or usr/etc: $(dpkg-deb -c "$deb" | grep -E 'usr/(local|etc)')"
fi
grep -q '^MIT License$' "$root/usr/share/doc/idem/LICENSE" || fail "LICENSE is not idem's MIT licence"
grep -q "^Version: $version$" "$root/usr/$libdir/pkgconfig/idem.pc" || fail "idem.pc is not version $version"
# The .pc files find the package where it is extracted (${pcfiledir}).
read -r inc < <(PKG_CONFIG_PATH=$root/usr/$libdir/pkgconfig pkg-config --cflags-only-I idem-client)
[[ $inc == -I* && $(realpath -m "${inc#-I}") == "$(realpath "$root/usr/include")" ]] ||
  fail "idem-client.pc points elsewhere: $inc"

# Man pages: gzipped roff with the version in the title line, rendered
# without a warning.
for page in man8/idemd.8 man1/idem.1 man1/idem-psp.1; do
  gz=$root/usr/share/man/$page.gz
  gzip -t "$gz" || fail "$page.gz is not gzip"
  zcat "$gz" | grep -q "^\.TH .* \"idem $version\" " || fail "$page: no \"idem $version\" in .TH"
  if command -v groff >/dev/null; then
    warnings=$(zcat "$gz" | groff -man -Tutf8 -ww 2>&1 >/dev/null)
    [[ -z $warnings ]] || fail "$page: groff warns: $warnings"
  fi
done

# The programs: idem's own libraries are linked in (the package ships
# only archives of them), and each says the project's version.
idemd=$root/usr/bin/idemd
for p in idemd idem idem-psp; do
  if ldd "$root/usr/bin/$p" | grep -q 'not found\|libidem'; then
    fail "$p links what the package lacks: $(ldd "$root/usr/bin/$p")"
  fi
  out=$("$root/usr/bin/$p" --version) || fail "$p --version failed"
  [[ $out == "$p $version" || $out == "$p $version (git "*")" ]] || fail "$p --version says: $out"
done

# The unit: what it runs, as whom, where, and its bounds.
unit=$root/usr/lib/systemd/system/idemd.service
# shellcheck disable=SC2016 # $MAINPID is systemd's, not the shell's
for line in 'Type=exec' 'User=idem' 'Group=idem' 'StateDirectory=idem' 'WorkingDirectory=/var/lib/idem' \
            'Environment=IDEMD_DB=/var/lib/idem/idem.db' 'EnvironmentFile=-/etc/default/idemd' \
            'ExecStart=/usr/bin/idemd serve' 'ExecReload=/bin/kill -HUP $MAINPID' 'Restart=on-failure' \
            'RestartPreventExitStatus=2' 'NoNewPrivileges=yes' 'CapabilityBoundingSet=' \
            'ProtectSystem=strict' 'ProtectHome=yes' 'PrivateTmp=yes' 'PrivateDevices=yes' \
            'RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX' 'SystemCallFilter=@system-service' \
            'WantedBy=multi-user.target'; do
  grep -qxF "$line" "$unit" || fail "idemd.service lacks '$line'"
done
# TimeoutStopSec above idemd's own --shutdown-timeout plus a provider
# call that may still be running (idemd --help gives the defaults).
seconds() { sed -n "s/^ *$1 .*(default: \([0-9]*\)s)$/\1/p"; }
shutdown=$("$idemd" --help | seconds --shutdown-timeout)
provider=$("$idemd" --help | seconds --provider-timeout)
stop=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s$/\1/p' "$unit")
[[ -n $shutdown && -n $provider && -n $stop ]] || fail "cannot read the timeouts ($shutdown, $provider, $stop)"
((stop > shutdown + provider)) || fail "TimeoutStopSec=${stop}s is not above ${shutdown}s + ${provider}s"

# The environment file: NAME=value lines of variables idemd has, none
# empty, and idemd accepts them all (the database given by flag, which
# wins over IDEMD_DB).
envfile=$root/etc/default/idemd
cmp -s "$envfile" "$src/deploy/systemd/idemd.default" || fail "etc/default/idemd is not deploy/systemd/idemd.default"
known=$("$idemd" --help | awk '$2 ~ /^IDEMD_/ {print $2}')
while IFS= read -r line; do
  [[ $line =~ ^#?(IDEMD_[A-Z_]+)=(.*)$ ]] || { [[ $line == \#* || -z $line ]] && continue; fail "environment file: '$line'"; }
  grep -qx "${BASH_REMATCH[1]}" <<<"$known" || fail "environment file: idemd has no ${BASH_REMATCH[1]}"
  [[ $line == \#* || -n ${BASH_REMATCH[2]} ]] || fail "environment file: ${BASH_REMATCH[1]} is set empty"
done <"$envfile"
grep -qx 'IDEMD_DB=/var/lib/idem/idem.db' "$envfile" || fail "environment file: no IDEMD_DB=/var/lib/idem/idem.db"
# Every variable idemd has is in the file (set or commented out), and
# every option in idemd(8): a new option needs both.
for var in $known; do
  grep -Eq "^#?$var=" "$envfile" || fail "environment file: no line for $var (idemd --help lists it)"
  flag=$("$idemd" --help | awk -v v="$var" '$2 == v {print $1}')
  zcat "$root/usr/share/man/man8/idemd.8.gz" | grep -q "^\.BI* ${flag//-/\\\\-}\( \|\$\)" ||
    fail "idemd(8) does not describe $flag (docs/man/idemd.8)"
done
# shellcheck disable=SC1090 # the file under test
(set -a && . "$envfile" && exec "$idemd" migrate --db "$tmp/env.db") >"$tmp/env.log" 2>&1 ||
  { cat "$tmp/env.log"; fail "idemd refuses the environment file"; }

# idemd from the package: serve, a tenant, a payment, its replay.
db=$tmp/idem.db
"$idemd" serve --listen 127.0.0.1:0 --db "$db" 2>"$tmp/idemd.err" &
server=$!
port=
for _ in $(seq 100); do
  port=$(sed -n 's/.*"msg":"listening","listen":"127\.0\.0\.1:\([0-9]*\)".*/\1/p' "$tmp/idemd.err")
  [[ -n $port ]] && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
[[ -n $port ]] || { cat "$tmp/idemd.err"; fail "the extracted idemd did not start"; }
key=$("$idemd" tenant create pkg --db "$db") || fail "idemd tenant create failed"
body='{"amount": 15990, "currency": "BRL", "order_id": "ord_pkg"}'
status=$(curl -s -o "$tmp/pay.json" -w '%{http_code}' -X POST "http://127.0.0.1:$port/payments" \
  -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -H 'Idempotency-Key: package-1' -d "$body") || fail "curl failed"
[[ $status == 201 ]] || fail "payment: $status $(cat "$tmp/pay.json")"
grep -q '"status":"succeeded"' "$tmp/pay.json" || fail "payment: $(cat "$tmp/pay.json")"
IDEM_TOKEN=$key "$root/usr/bin/idem" request --key package-1 POST "http://127.0.0.1:$port/payments" \
  "$body" >"$tmp/replay.json" 2>"$tmp/replay.err" || fail "idem request: $(cat "$tmp/replay.err")"
grep -q '"replayed":true' "$tmp/replay.json" || fail "no replay: $(cat "$tmp/replay.json")"
# What `systemctl reload` sends (ExecReload), then what `systemctl stop` does.
kill -HUP "$server"
for _ in $(seq 50); do
  grep -q '"msg":"SIGHUP: ignored"' "$tmp/idemd.err" && break
  sleep 0.1
done
kill -0 "$server" 2>/dev/null || fail "idemd ended on SIGHUP"
grep -q '"msg":"SIGHUP: ignored"' "$tmp/idemd.err" || fail "no 'SIGHUP: ignored' line"
kill -TERM "$server"
rc=0
wait "$server" || rc=$?
server=
[[ $rc == 0 ]] || { cat "$tmp/idemd.err"; fail "idemd exited $rc on SIGTERM"; }

# systemd-analyze verify: it wants the programs the unit runs, so a copy
# of the unit runs the extracted idemd, and finds the man page it names
# in the package. No running systemd is needed.
if ! command -v systemd-analyze >/dev/null; then
  echo "test_package: systemd-analyze not found (Debian package systemd): the unit was not verified"
elif [[ ! -x /bin/kill ]]; then
  echo "test_package: no /bin/kill (Debian package procps, a dependency of idem): the unit was not verified"
else
  mkdir "$tmp/unit"
  sed "s|^ExecStart=/usr/bin/idemd |ExecStart=$idemd |" "$unit" >"$tmp/unit/idemd.service"
  MANPATH=$root/usr/share/man systemd-analyze verify "$tmp/unit/idemd.service" >"$tmp/verify.log" 2>&1 ||
    { cat "$tmp/verify.log"; fail "systemd-analyze verify idemd.service failed"; }
  [[ ! -s $tmp/verify.log ]] || { cat "$tmp/verify.log"; fail "systemd-analyze verify has warnings"; }
fi
echo "test_package: ok ($(basename "$deb"))"
