# Shared by the eval/prepare/fetch-*.sh scripts (sourced, not run): cache location, sha256 checks,
# the early exit when the verified file is already cached, and the atomic install.
#
#   fetch_init TOOL NAME SHA256 [CACHE_DIR]   sets $here (eval/prepare/), $root, $cache, $out;
#                                            prints $out and exits 0 when already verified
#   die MESSAGE                              "TOOL: error: MESSAGE" on stderr, exit 1
#   sha256_of FILE                           hex digest
#   install_verified SRC WHAT                checks SRC against SHA256, moves it into $out

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="$(cd "$here/../.." && pwd)"

die() { echo "$FETCH_TOOL: error: $*" >&2; exit 1; }

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then
    sha256sum "$1" | awk '{print $1}'
  else
    python3 -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for b in iter(lambda: f.read(1<<20), b""): h.update(b)
print(h.hexdigest())' "$1"
  fi
}

fetch_init() {
  FETCH_TOOL="$1"; FETCH_NAME="$2"; FETCH_SHA256="$3"
  cache="${4:-$root/models/cache}"
  mkdir -p "$cache"
  cache="$(cd "$cache" && pwd)"
  out="$cache/$FETCH_NAME"
  if [ -f "$out" ]; then
    local have
    have="$(sha256_of "$out")"
    if [ "$have" = "$FETCH_SHA256" ]; then
      echo "$out"
      exit 0
    fi
    echo "$FETCH_TOOL: $out has sha256 $have, expected $FETCH_SHA256; fetching again" >&2
    rm -f "$out"
  fi
}

install_verified() {
  local src="$1" what="$2" have
  have="$(sha256_of "$src")"
  if [ "$have" != "$FETCH_SHA256" ]; then
    rm -f "$src"
    die "$what has sha256 $have, expected $FETCH_SHA256"
  fi
  local part="$cache/.$FETCH_NAME.part"
  [ "$src" = "$part" ] || mv -f "$src" "$part"
  mv -f "$part" "$out"
  echo "$out"
}
