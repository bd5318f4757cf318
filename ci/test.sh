#!/usr/bin/env bash
# The project's test command: prepares the pinned model, tokenizer and corpus (idempotent),
# then runs the corpus builder's unit tests, `cargo test --release` (the library's unit tests,
# the integration binary `it`, the device-parity binary `parity` on the emulated device, and
# the regression harness), the nextest partition check and the build-independence check
# (ci/install-check.sh). Arguments go to `cargo test --release` (every test binary takes the
# harness's flags: `bash ci/test.sh -- --kv-dtype fp8`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash ci/prepare.sh
python3 -m unittest discover -s eval/corpora/perplexity-1m -q
# NVRTC (PyPI nvidia-cuda-nvrtc) lets tests/parity/nvrtc.rs compile every kernel for sm_90
# without a GPU; a failed download fails here rather than silently skipping that test.
NINFER_NVRTC_LIB_DIR="$(bash ci/install-nvrtc.sh)"
export NINFER_NVRTC_LIB_DIR
# The emulated CUDA device (tests/parity/, the harness's emu tier) compiles the kernels with
# g++ at first use.
if ! command -v g++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q g++ >/dev/null
  else
    echo "ci: the emulated CUDA device needs g++ (apt-get install g++)" >&2
    exit 1
  fi
fi
cargo test --release "$@"
# The harness's trials split over runners with cargo-nextest's hash partitions: disjoint,
# covering every trial (docs/harness.md).
NINFER_NEXTEST="$(bash ci/install-nextest.sh)" bash ci/check-partitions.sh
# The CPU bits must not depend on how the crate is built (a build without .cargo/config.toml).
bash ci/install-check.sh
