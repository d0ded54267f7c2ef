# shellcheck shell=bash
# Sourced by sqlite-source.sh and mhd-source.sh: making a directory of
# .deps whole or not at all, fetching the files of a Debian source package,
# checked, and applying its patches as dpkg-source would. Messages name the
# script that sourced this.

# debian_begin OUT FILE STAMP: for a script that makes the directory OUT.
# One run at a time (a lock per OUT). Exits the script when OUT/FILE is
# there and OUT/VERSION holds STAMP. Otherwise removes OUT first (another
# version, or a run cut short: gone before anything can fail, so that a
# failure leaves the build on the system's library, as the scripts say)
# and sets `work`, a temporary directory, and `stage`, one beside OUT for
# debian_finish to rename into place; both go when the script exits.
debian_begin() {
  local out=$1 file=$2 stamp=$3
  mkdir -p "$(dirname "$out")"
  exec 9>"$out.lock"
  flock 9
  [ -f "$out/$file" ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$stamp" ] && exit 0
  rm -rf "$out"
  work=$(mktemp -d)
  stage=$(mktemp -d "$out.XXXXXX")
  trap 'rm -rf "$work" "$stage"' EXIT
}

# debian_finish OUT STAMP: notes STAMP in the stage debian_begin made, now
# full, and renames it to OUT: CMake never sees half of it.
debian_finish() {
  echo "$2" >"$stage/VERSION"
  chmod 755 "$stage"
  mv -T "$stage" "$1"
}

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
