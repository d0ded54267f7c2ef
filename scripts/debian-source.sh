# shellcheck shell=bash
# Sourced by sqlite-source.sh and mhd-source.sh: fetching the files of a
# Debian source package, checked, and applying its patches as dpkg-source
# would. Messages name the script that sourced this.

# debian_fetch BASE DIR "NAME SHA256"...: downloads each NAME from BASE
# into DIR and checks its SHA-256. Returns 1, saying why, at the first
# file that cannot be fetched or does not match.
debian_fetch() {
  local base=$1 dir=$2 f name sum
  shift 2
  for f in "$@"; do
    name=${f% *} sum=${f#* }
    if ! curl -fsS --connect-timeout 20 --max-time 300 --retry 2 \
        -o "$dir/$name" "$base/$name"; then
      echo "$(basename "$0" .sh): cannot fetch $base/$name" >&2
      return 1
    fi
    if [ "$(sha256sum "$dir/$name" | cut -d' ' -f1)" != "$sum" ]; then
      echo "$(basename "$0" .sh): $name does not have the expected SHA-256" >&2
      return 1
    fi
  done
}

# debian_patch SRC: applies the patches of SRC/debian/patches in the order
# of their series, each exactly (no fuzz, as dpkg-source applies them).
debian_patch() {
  (cd "$1" &&
    while read -r p _ || [ -n "$p" ]; do
      case $p in '' | '#'*) continue ;; esac
      patch -p1 -s -F0 -N --batch <"debian/patches/$p"
    done <debian/patches/series)
}
