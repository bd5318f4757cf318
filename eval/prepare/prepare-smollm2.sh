#!/usr/bin/env bash
# Prepares the project's default real artifacts: fetches the pinned SmolLM2-135M GGUF
# (sha256-checked) and packs it into models/smollm2-135m-{bf16,f32,fp8,nvfp4}.ninfer (fp8 and
# nvfp4: the decoder linears quantized by the packer, the rest bf16).
#
# Idempotent: an artifact whose digest already equals the one pinned in eval/registry.json
# is kept; anything else is (re)packed. Packing is deterministic, so the pinned digest
# also proves that the packer still produces the same bytes.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"

gguf="$(bash eval/prepare/fetch-smollm2.sh models/cache | tail -n 1)"
cargo build --release --quiet --bin ninfer-pack
pack=target/release/ninfer-pack

pinned_digest() {
  python3 - "$1" <<'PY'
import json, sys
reg = json.load(open("eval/registry.json"))
for a in reg["artifacts"]:
    if a["name"] == sys.argv[1]:
        print(a.get("digest") or "")
PY
}

for fmt in bf16 f32 fp8 nvfp4; do
  name="smollm2-135m-$fmt"
  out="models/$name.ninfer"
  want="$(pinned_digest "$name")"
  if [ -f "$out" ] && [ -n "$want" ]; then
    have="$("$pack" inspect "$out" 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])' || true)"
    if [ "$have" = "$want" ]; then
      echo "prepare-smollm2: $out is up to date ($have)" >&2
      continue
    fi
  fi
  "$pack" gguf "$gguf" -o "$out" --weights "$fmt"
  have="$("$pack" inspect "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["digest"])')"
  if [ -n "$want" ] && [ "$have" != "$want" ]; then
    echo "prepare-smollm2: warning: $out has digest $have but eval/registry.json pins $want" >&2
    echo "prepare-smollm2: (the packer's output changed: review, then update the registry)" >&2
  fi
done
