#!/usr/bin/env bash
# Prints the path of a cargo-nextest binary: the machine's own when one is on PATH (most CI
# images and this project's development machines have one), else the pinned version built
# from the crate registry into eval/.cache/nextest, once (a few minutes). ci/check-partitions.sh
# uses it to check that hash partitions of the harness's trials are disjoint and cover every
# trial; GPU runners use it to spread the gate (ci/examples/).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if command -v cargo-nextest >/dev/null 2>&1 && cargo-nextest nextest --version >/dev/null 2>&1; then
  command -v cargo-nextest
  exit 0
fi
version=0.9.151
dest="$root/eval/.cache/nextest/$version"
bin="$dest/bin/cargo-nextest"
if [ ! -x "$bin" ] || [ "$("$bin" nextest --version 2>/dev/null | head -n 1 | awk '{print $2}')" != "$version" ]; then
  echo "install-nextest: building cargo-nextest $version (a few minutes, once)" >&2
  cargo install --quiet --locked --force --version "$version" --root "$dest" cargo-nextest >&2
fi
echo "$bin"
