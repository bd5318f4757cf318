#!/usr/bin/env bash
# SmolLM2-135M scored by llama.cpp's `llama-perplexity` and by ninfer-perplexity's
# `--window-plan kld-chunks` on the same tokens, side by side; writes
# eval/results/llama-cpp-smollm2.md.
#
# Text: the first 60,000 characters of the corpus stream en-long-1 with every run of
# whitespace made one space (the two tokenizers split newline runs differently: llama.cpp's
# "smollm" pre-tokenizer merges "\n\n" into one token where the transformers conversion of
# the same GGUF, this tool's reference, keeps two; on single-spaced prose they agree, which
# the script checks token by token from llama.cpp's own --kl-divergence-base dump).
# Protocol: context 512, llama.cpp's chunks (each scoring its last 255 tokens), f32 KV
# cache on both sides, 2 threads. llama.cpp runs twice: on the pinned Q4_1 GGUF as
# published (its CPU kernels multiply Q4_1 weights by activations quantized to 8 bits), and
# on a float32 GGUF of the same dequantized weights (eval/peers/gguf_to_f32.py), which is
# what this tool's f32 artifact holds.
#
# Usage: bash eval/results/llama-cpp-side-by-side.sh   (after bash ci/prepare.sh; builds
# llama-perplexity on first use: eval/peers/llama-cpp.sh, several minutes)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
result=eval/results/llama-cpp-smollm2.md
gguf=models/cache/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] && [ -f models/smollm2-135m-f32.ninfer ] || { echo "run bash ci/prepare.sh first" >&2; exit 1; }
lp="$(bash eval/peers/llama-cpp.sh)"
venv="$(bash eval/generators/setup-python.sh)"
cargo build --release --quiet --bin ninfer-perplexity
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
python3 - "$out/prose.txt" <<'PY'
import re, sys
t = open("eval/corpora/perplexity-1m/streams/en-long-1.txt", encoding="utf-8").read()[:60000]
t = re.sub(r"\s+", " ", t).strip()
open(sys.argv[1], "w", encoding="utf-8").write(t[: t.rfind(" ")])
PY
"$venv/bin/python" eval/peers/gguf_to_f32.py "$gguf" "$out/f32.gguf"
common=(-f "$out/prose.txt" -c 512 -b 512 -t 2 -ctk f32 -ctv f32 --ppl-output-type 1)
"$lp" -m "$gguf" "${common[@]}" --kl-divergence-base "$out/q41.kld" >"$out/q41.txt" 2>"$out/q41.err"
"$lp" -m "$out/f32.gguf" "${common[@]}" >"$out/f32.txt" 2>"$out/f32.err"
rm -f "$out/f32.gguf"
target/release/ninfer-perplexity models/smollm2-135m-f32.ninfer --text "$out/prose.txt" \
  --context 512 --window-plan kld-chunks --kv-dtype f32 --device cpu --threads 2 \
  --save-reference "$out/ours.ref" --output "$out/ours" --log-level error >/dev/null
python3 - "$out" >"$result" <<'PY'
import json, struct, sys, os, math
out = sys.argv[1]
# Token ids: ours from the saved reference (its index is JSON before a u64 length and the
# sha256), llama.cpp's from its dump's header.
b = open(os.path.join(out, "ours.ref"), "rb").read()
n = struct.unpack("<Q", b[-40:-32])[0]
s = json.loads(b[-40 - n:-40])["streams"][0]
ours = struct.unpack(f"<{s['input_tokens']}I", b[s["tokens_offset"]:s["tokens_offset"] + 4 * s["input_tokens"]])
with open(os.path.join(out, "q41.kld"), "rb") as k:
    head = k.read(20)
    assert head[:8] == b"_logits_", head[:8]
    n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head[8:])
    theirs = struct.unpack(f"<{n_chunk * n_ctx}i", k.read(4 * n_chunk * n_ctx))
same = sum(a == b for a, b in zip(ours, theirs))
assert same == len(theirs), f"token ids differ: {len(theirs) - same} of {len(theirs)}"
def llama(name):
    # --ppl-output-type 1: per chunk "offset ppl mean_nll se", cumulative.
    rows = [l.split() for l in open(os.path.join(out, name)) if l.strip() and l.split()[0].isdigit()]
    last = rows[-1]
    return len(rows), float(last[2]), float(last[3])
r = json.load(open(os.path.join(out, "ours", "report.json")))
o = r["overall"]
chunks_q, nll_q, se_q = llama("q41.txt")
chunks_f, nll_f, se_f = llama("f32.txt")
assert chunks_q == chunks_f == len(r["streams"][0]["windows"]) == n_chunk
print("# SmolLM2-135M: llama.cpp `llama-perplexity` and ninfer-perplexity on the same tokens\n")
print(f"Made by `bash eval/results/llama-cpp-side-by-side.sh` (llama.cpp from the llama-cpp-python 0.3.36")
print(f"sdist, CPU build). {len(ours):,} tokens of single-spaced en-long-1 prose; llama.cpp's {n_chunk} chunks")
print(f"of {n_ctx} tokens ({n_chunk * n_ctx:,} token ids checked equal on both sides), each scoring its last")
print(f"{n_ctx - 1 - n_ctx // 2}: {o['scored']:,} positions. f32 KV cache on both sides.\n")
print("| engine | weights | arithmetic | mean NLL | PPL | Δ mean NLL vs this tool |")
print("|---|---|---|---:|---:|---:|")
print(f"| ninfer-perplexity `--window-plan kld-chunks` | f32 (the Q4_1 GGUF dequantized) | f32 | {o['mean_nll']:.6f} | {math.exp(o['mean_nll']):.4f} | - |")
print(f"| llama-perplexity | F32 GGUF (the same values) | f32 | {nll_f:.6f} | {math.exp(nll_f):.4f} | {nll_f - o['mean_nll']:+.6f} |")
print(f"| llama-perplexity | Q4_1 GGUF as published | Q4_1 x Q8 dot products | {nll_q:.6f} | {math.exp(nll_q):.4f} | {nll_q - o['mean_nll']:+.6f} |")
print()
print(f"llama.cpp prints the mean NLL to 6 decimals; its standard error here is {se_f:.4f}.")
PY
cat "$result"
