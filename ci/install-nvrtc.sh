#!/usr/bin/env bash
# Installs NVRTC for the CPU-only kernel compile check (tests/parity/nvrtc.rs) and prints the
# directory holding libnvrtc.so.13, for NINFER_NVRTC_LIB_DIR:
#
#   export NINFER_NVRTC_LIB_DIR="$(bash ci/install-nvrtc.sh)"
#
# NVRTC comes from PyPI's nvidia-cuda-nvrtc wheel (pinned version and sha256), fetched with
# pip and unpacked into eval/.cache/nvrtc (git-ignored); nothing is installed system-wide
# and no GPU or driver is needed. Idempotent: a second run only prints the directory.
# Progress goes to stderr; stdout is the directory alone.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="13.0.88"
wheel="nvidia_cuda_nvrtc-${version}-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
sha256="ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"
dest="${NINFER_NVRTC_CACHE:-$root/eval/.cache/nvrtc}"
lib="$dest/$version/nvidia/cu13/lib"

if [ -f "$lib/libnvrtc.so.13" ] && [ -f "$lib/.complete" ]; then
    echo "$lib"
    exit 0
fi
if [ "$(uname -m)" != "x86_64" ]; then
    echo "install-nvrtc: only x86_64 wheels are pinned here (this is $(uname -m))" >&2
    exit 1
fi
# The project's venv pip when there is one, else the system's.
py=python3
[ -x "$root/eval/.venv/bin/python" ] && py="$root/eval/.venv/bin/python"
mkdir -p "$dest/wheels"
if [ ! -f "$dest/wheels/$wheel" ]; then
    "$py" -m pip --version >/dev/null 2>&1 || {
        echo "install-nvrtc: pip is not available for $py (install python3-pip)" >&2
        exit 1
    }
    echo "install-nvrtc: downloading nvidia-cuda-nvrtc==$version (about 90 MB)" >&2
    "$py" -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --dest "$dest/wheels" "nvidia-cuda-nvrtc==$version" >&2
fi
echo "$sha256  $dest/wheels/$wheel" | sha256sum -c --quiet - >&2 || {
    echo "install-nvrtc: sha256 mismatch for $wheel" >&2
    exit 1
}
rm -rf "$dest/$version"
mkdir -p "$dest/$version"
python3 - "$dest/wheels/$wheel" "$dest/$version" >&2 <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith("nvidia/cu13/lib/") and ".alt." not in n]
    z.extractall(sys.argv[2], names)
PY
touch "$lib/.complete"
echo "install-nvrtc: NVRTC $version in $lib" >&2
echo "$lib"
