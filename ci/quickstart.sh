#!/usr/bin/env bash
# The main job on a fresh machine: prepare the pinned SmolLM2 artifact and the corpus, then
# score the four quick streams (one per domain) with a bounded CPU protocol and print the
# domain/overall table. Extra arguments are passed to ninfer-perplexity; --context, --stride
# and --max-tokens replace the bounded defaults (1024, 512, 2048).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash eval/prepare/prepare-smollm2.sh
python3 eval/corpora/perplexity-1m/build.py -q --quick
cargo build --release --quiet --bin ninfer-perplexity
# The bounded protocol's flags are defaults: a flag given on the command line replaces its
# default (clap refuses a flag given twice).
defaults=()
for pair in "--context 1024" "--stride 512" "--max-tokens 2048"; do
  flag=${pair%% *}
  given=0
  for a in "$@"; do
    case "$a" in "$flag"|"$flag="*) given=1 ;; esac
  done
  if [ "$given" = 0 ]; then defaults+=($pair); fi
done
exec target/release/ninfer-perplexity smollm2-135m-bf16 \
  --corpus eval/corpora/perplexity-1m/manifest.json --quick "${defaults[@]}" "$@"
