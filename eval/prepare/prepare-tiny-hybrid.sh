#!/usr/bin/env bash
# Packs the committed tiny Qwen3.5 checkpoints with the pinned Qwen3 tokenizer into the
# harness's CPU-tier artifacts: the hybrid (eval/fixtures/tiny-qwen3_5, written by
# eval/generators/make_hybrid_fixtures.py) into models/tiny-qwen3_5-f32.ninfer, and the hybrid
# mixture of experts (eval/fixtures/tiny-qwen3_5_moe, eval/generators/make_moe_fixtures.py)
# into models/tiny-qwen3_5_moe-f32.ninfer.
#
# Idempotent: an artifact whose digest equals the one eval/registry.json pins is kept.
# Packing is deterministic, so the pinned digest also proves the packer still produces the
# same bytes.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"

tok="$(bash eval/prepare/fetch-qwen3-tokenizer.sh | tail -n 1)"
cargo build --release --quiet --bin ninfer-pack
pack=target/release/ninfer-pack
pack_one() {
name=$1
fixture=$2
out="models/$name.ninfer"
want="$(python3 - "$name" <<'PY'
import json, sys
for a in json.load(open("eval/registry.json"))["artifacts"]:
    if a["name"] == sys.argv[1]:
        print(a.get("digest") or "")
PY
)"
digest() { "$pack" inspect "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])'; }
if [ -f "$out" ] && [ -n "$want" ] && [ "$(digest "$out" 2>/dev/null || true)" = "$want" ]; then
  echo "prepare-tiny-hybrid: $out is up to date ($want)" >&2
  return 0
fi
mkdir -p models
"$pack" hf "$fixture" --tokenizer "$tok" --weights f32 -o "$out"
have="$(digest "$out")"
if [ -n "$want" ] && [ "$have" != "$want" ]; then
  echo "prepare-tiny-hybrid: warning: $out has digest $have but eval/registry.json pins $want" >&2
  echo "prepare-tiny-hybrid: (the packer's output changed: review, then update the registry)" >&2
fi
}

pack_one tiny-qwen3_5-f32 eval/fixtures/tiny-qwen3_5
pack_one tiny-qwen3_5_moe-f32 eval/fixtures/tiny-qwen3_5_moe
