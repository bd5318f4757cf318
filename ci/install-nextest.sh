#!/usr/bin/env bash
# Installs the pinned cargo-nextest (from the crate registry, built from source) into
# eval/.cache/nextest, once, and prints the path of its binary. tests/nextest_partition.rs
# uses it (NINFER_NEXTEST) to check that hash partitions of the harness's trials are
# disjoint and cover every trial; GPU runners use it to spread the gate (ci/examples/).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version=0.9.151
dest="$root/eval/.cache/nextest/$version"
bin="$dest/bin/cargo-nextest"
if [ ! -x "$bin" ] || [ "$("$bin" nextest --version 2>/dev/null | head -n 1 | awk '{print $2}')" != "$version" ]; then
  echo "install-nextest: building cargo-nextest $version (a few minutes, once)" >&2
  cargo install --quiet --locked --force --version "$version" --root "$dest" cargo-nextest >&2
fi
echo "$bin"
