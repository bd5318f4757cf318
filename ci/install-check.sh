#!/usr/bin/env bash
# Shows that the CPU path's bits do not depend on how the crate is built.
#
# Cargo reads the repository's .cargo/config.toml (which pins matrixmultiply's depth block,
# MATMUL_SGEMM_KC=768) only when it runs from inside the repository or installs with
# `--path`. `cargo install --git`, a library dependency, or any build started elsewhere gets
# matrixmultiply's default depth block, other bits, and the engine must notice (a probe) and
# run its own GEMM, which defines the bits. This script builds the evaluator that way (cargo
# started outside the repository, its own target directory so the workspace build is left
# alone), scores the same text with that binary and the workspace one, and requires:
#   - the outside build says it runs tile16 only (it really took the other path),
#   - both report.json files hold identical window NLL sums, stream totals and token counts.
# Needs the prepared SmolLM2 artifact (bash ci/prepare.sh). Usage: bash ci/install-check.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

artifact=models/smollm2-135m-f32.ninfer
if [ ! -f "$artifact" ]; then
  echo "install-check: $artifact is missing: run bash ci/prepare.sh" >&2
  exit 1
fi
work="$root/target/install-check"
mkdir -p "$work"
# Started outside the repository: cargo discovers configuration from the current directory.
(cd "${TMPDIR:-/tmp}" && env -u MATMUL_SGEMM_KC cargo build --quiet --release --locked \
  --manifest-path "$root/Cargo.toml" --target-dir "$work/build" --bin ninfer-perplexity)
cargo build --release --quiet --bin ninfer-perplexity

text="$work/text.txt"
# A fixed English and Chinese text with digits and code, long enough for several windows.
python3 - "$text" <<'PY'
import sys
para = ("The regression harness scores every stream of the corpus with the artifact's own "
        "tokenizer; 12345 tokens later the mean NLL is compared with the baseline. "
        "数据流以窗口为单位评分，每个窗口从空的缓存开始。 for (int i = 0; i < n; ++i) x[i] += y[i];\n")
open(sys.argv[1], "w").write(para * 40)
PY
rm -rf "$work/out-installed" "$work/out-workspace"
args=(--text "$text" --context 256 --stride 128 --max-tokens 1024 --kv-dtype int8 --device cpu --threads 2)
"$work/build/release/ninfer-perplexity" "$artifact" "${args[@]}" --output "$work/out-installed" \
  --log-level debug >/dev/null 2>"$work/installed.log"
target/release/ninfer-perplexity "$artifact" "${args[@]}" --output "$work/out-workspace" \
  --log-level debug >/dev/null 2>"$work/workspace.log"

grep -h "cpu gemm" "$work/installed.log" "$work/workspace.log" | sed 's/^/install-check: /'
if ! grep -q "tile16 only" "$work/installed.log"; then
  echo "install-check: the outside build did not fall back to tile16; the check would prove nothing" >&2
  exit 1
fi
python3 - "$work/out-installed/report.json" "$work/out-workspace/report.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
def numbers(r):
    return [(s["id"], s["input_tokens"], s["scored"], s["nll_sum"].hex(), s["nll_sq_sum"].hex(),
             [(w["begin"], w["start"], w["end"], w["nll_sum"].hex()) for w in s["windows"]])
            for s in r["streams"]]
if numbers(a) != numbers(b):
    print("install-check: FAILED: the outside build scores different bits", file=sys.stderr)
    print(numbers(a), numbers(b), sep="\n", file=sys.stderr)
    sys.exit(1)
s = a["streams"][0]
print(f"install-check: same bits from both builds ({len(s['windows'])} windows, "
      f"{s['scored']} targets, nll_sum {s['nll_sum']!r})")
PY
