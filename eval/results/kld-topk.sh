#!/usr/bin/env bash
# What a bounded (top-K) saved reference would lose against the exact one this tool saves,
# on SmolLM2-135M: the quick streams' first MAX_TOKENS tokens (context CONTEXT, stride
# STRIDE) saved twice with --save-reference, once with f32 KV (the reference) and once per
# KV format under test (fp8, the default, and nvfp4); then `benches/kld_topk.rs` applies the
# head to both at every position and compares the exact full-vocabulary KL with the top-K
# forms (score::topk). Writes eval/results/kld-topk-smollm2.md.
#
# Usage: bash eval/results/kld-topk.sh [MAX_TOKENS CONTEXT STRIDE]   (default 2048 1024 512)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
max="${1:-2048}"; ctx="${2:-1024}"; stride="${3:-512}"
art=smollm2-135m-bf16
result=eval/results/kld-topk-smollm2.md
cargo build --release --quiet --bin ninfer-perplexity
bin=target/release/ninfer-perplexity
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
save() { # KV FILE
  "$bin" "$art" --corpus eval/corpora/perplexity-1m/manifest.json --quick \
    --max-tokens "$max" --context "$ctx" --stride "$stride" --device cpu \
    --kv-dtype "$1" --save-reference "$2" --output "$out/run-$1" --log-level error >/dev/null
}
save f32 "$out/f32.bin"
for kv in fp8 nvfp4; do
  save "$kv" "$out/$kv.bin"
  # The in-process full-vocabulary KL of the same run, which the exact column must equal.
  "$bin" "$art" --corpus eval/corpora/perplexity-1m/manifest.json --quick \
    --max-tokens "$max" --context "$ctx" --stride "$stride" --device cpu \
    --kv-dtype "$kv" --reference-kv f32 --output "$out/inproc-$kv" --log-level error >/dev/null
  NINFER_TOPK_ARTIFACT="models/$art.ninfer" NINFER_TOPK_REFERENCE="$out/f32.bin" \
    NINFER_TOPK_RUN="$out/$kv.bin" NINFER_BENCH_OUT="$out/$kv.json" \
    cargo bench --quiet --bench kld_topk >"$out/$kv.txt"
done
python3 - "$out" "$max" "$ctx" "$stride" >"$result" <<'PY'
import json, sys, os
out, mx, ctx, st = sys.argv[1:]
print("# Bounded (top-K) references against the exact one, SmolLM2-135M (bf16 weights)\n")
print(f"Reference: f32 KV; run: each KV format below. The quick streams' first {mx} tokens, context {ctx},")
print(f"stride {st}, CPU. Made by `bash eval/results/kld-topk.sh {mx} {ctx} {st}`.\n")
print("- **tail**: the reference kept as its top K log-probabilities plus one bucket for the rest,")
print("  the live run grouped the same way (a lower bound of the exact KL).")
print("- **union**: the seed engine's `NINFTOPK` form: both sides' top K and the target, each side")
print("  renormalized over that union (each side's true value on every id of the union).")
print("- bytes/pos: K ids (u32) and log-probabilities (f32), the target's log-probability and the")
print("  tail mass. The exact record (this tool's `--save-reference`) is 4 x hidden size bytes.\n")
for kv in ("fp8", "nvfp4"):
    r = json.load(open(os.path.join(out, f"{kv}.json")))
    ip = json.load(open(os.path.join(out, f"inproc-{kv}", "report.json")))["overall"]["reference"]
    assert ip["positions"] == r["positions"], (ip["positions"], r["positions"])
    rel = abs(r["exact_mean_kld"] / ip["mean_kld"] - 1)
    assert rel < 1e-4, f"the exact column is not the in-process KL: {rel}"
    print(f"## KL(f32 KV || {kv} KV): {r['positions']} positions, exact mean {r['exact_mean_kld']:.6e} nats "
          f"(the in-process `--reference-kv f32` run: {ip['mean_kld']:.6e}, relative difference {rel:.1e}), "
          f"exact record {r['exact_bytes_per_position']} bytes/pos\n")
    print("| K | bytes/pos | form | mean KL | mean / exact | median relative error | p99 abs error | max abs error |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for x in r["rows"]:
        print(f"| {x['k']} | {x['bytes_per_position']} | {x['form']} | {x['mean_kld']:.6e} | {x['mean_over_exact']:.4f} | "
              f"{x['median_relative_error']:.3e} | {x['p99_abs_error']:.3e} | {x['max_abs_error']:.3e} |")
    print()
PY
cat "$result"
