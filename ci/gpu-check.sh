#!/usr/bin/env bash
# The CUDA scorer's GPU check: builds (or unpacks prebuilt binaries), runs the device KV
# codec and CUDA-vs-CPU parity tests, benchmarks SmolLM2 on the quick corpus for every KV
# format and a Qwen3-8B-shaped random-weight artifact at context 4096 / stride 2048, and
# prints a short table last. Sized for one H200 in under 8 minutes. See docs/cuda.md.
#
#   bash ci/gpu-check.sh                 GPU machine with cargo: build here, then check.
#   bash ci/gpu-check.sh bundle          Build machine (no GPU needed): stripped binaries,
#                                        sm_90 CUBINs, corpus streams and the qwen3 tokenizer
#                                        into eval/.cache/gpu-carry (about 12 MB), and the
#                                        SmolLM2 GGUF split into eval/.cache/gpu-stash/{a,b},
#                                        for a GPU machine without cargo or network.
#   bash ci/gpu-check.sh stash DIR       GPU machine: keep a carried GGUF part (DIR is
#                                        eval/.cache/gpu-stash/a or .../b) in /tmp/ninfer-stash
#                                        for a later call on the same (warm) machine.
#   bash ci/gpu-check.sh run             GPU machine: check from the bundle; SmolLM2 rows need
#                                        both stashed parts, else they are skipped and say so.
#
# Environment: GPU_CHECK_LAYERS (36: layers of the Qwen3-8B-shaped model), GPU_CHECK_WINDOWS
# (16), GPU_CHECK_PARITY_TOKENS (1024), OUT (where logs and JSON go; default
# eval/.cache/gpu-check-out).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mode="${1:-build}"
carry="$root/eval/.cache/gpu-carry"
stash="$root/eval/.cache/gpu-stash"
gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
tests=(cuda_nvrtc cuda_kv cuda_parity cuda_bench)

say() { echo "gpu-check: $*" >&2; }

test_binary() { # the newest built test executable for a test target
  ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -n 1
}

case "$mode" in
bundle)
  set -e
  cargo build --release --quiet --bins
  for t in "${tests[@]}"; do cargo test --release --quiet --no-run --test "$t" >/dev/null 2>&1; done
  work="$(mktemp -d)"
  mkdir -p "$work/bin" "$work/cubin" "$work/streams" "$carry" "$stash"
  cp target/release/ninfer-perplexity target/release/ninfer-pack "$work/bin/"
  for t in "${tests[@]}"; do cp "$(test_binary "$t")" "$work/bin/$t"; done
  strip "$work/bin/"*
  # Fill the CUBIN cache for sm_90 with the exact programs the binaries embed.
  export NINFER_NVRTC_LIB_DIR="${NINFER_NVRTC_LIB_DIR:-$(bash ci/install-nvrtc.sh)}"
  NINFER_CUDA_CACHE_DIR="$work/cubin" "$work/bin/cuda_nvrtc" --quiet >/dev/null
  cp eval/corpora/perplexity-1m/streams/*.txt "$work/streams/"
  cp models/cache/qwen3-tokenizer.json "$work/" 2>/dev/null || say "bundle: no qwen3 tokenizer (tiny-qwen3 parity will fail)"
  tar -C "$work" -cJf "$carry/bundle.tar.xz" .
  rm -rf "$work"
  rm -rf "$stash"
  mkdir -p "$stash/a" "$stash/b"
  if [ -f models/cache/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    # Two parts of about 47 MiB: each call carries the repository (~12 MB) plus one part,
    # under the device tool's 64 MiB.
    split -n 2 -d models/cache/SmolLM2-135M-Instruct.Q4_1.gguf "$stash/smollm2.gguf.part-"
    mv "$stash/smollm2.gguf.part-00" "$stash/a/"
    mv "$stash/smollm2.gguf.part-01" "$stash/b/"
  else
    say "bundle: no SmolLM2 GGUF in models/cache (run bash eval/fetch-smollm2.sh models/cache)"
  fi
  du -sh "$carry" "$stash/a" "$stash/b" >&2
  say "device calls: (1) carry eval/.cache/gpu-stash/a: bash ci/gpu-check.sh stash eval/.cache/gpu-stash/a"
  say "              (2) carry eval/.cache/gpu-stash/b: bash ci/gpu-check.sh stash eval/.cache/gpu-stash/b"
  say "              (3) carry eval/.cache/gpu-carry:   bash ci/gpu-check.sh run"
  exit 0
  ;;
stash)
  mkdir -p /tmp/ninfer-stash
  cp "${2:?usage: gpu-check.sh stash DIR}"/smollm2.gguf.part-* /tmp/ninfer-stash/ && ls -la /tmp/ninfer-stash
  exit 0
  ;;
build | run) ;;
*)
  echo "usage: bash ci/gpu-check.sh [build|bundle|stash|run]" >&2
  exit 2
  ;;
esac

t_start=$(date +%s)
OUT="${OUT:-$root/eval/.cache/gpu-check-out}"
mkdir -p "$OUT"
rm -f "$OUT"/parity.jsonl "$OUT"/bench.json "$OUT"/smollm2-*.json
export NINFER_REPO="$root"
export NINFER_PARITY_OUT="$OUT/parity.jsonl"
export NINFER_PARITY_TOKENS="${GPU_CHECK_PARITY_TOKENS:-1024}"

# CUDA libraries: the driver's and the toolkit's or pip wheels' lib directories.
libdirs=""
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import site,glob,os; print(" ".join(sorted({os.path.dirname(p) for s in site.getsitepackages() for p in glob.glob(s+"/nvidia/*/lib/lib*.so*")})))' 2>/dev/null); do
  if ls "$d"/libcuda.so* "$d"/libcublas.so.* "$d"/libnvrtc.so.* >/dev/null 2>&1; then libdirs="$libdirs:$d"; fi
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "library path: $LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt" >&2

if [ "$mode" = run ]; then
  bin="$(mktemp -d)"
  tar -C "$bin" -xJf "$carry/bundle.tar.xz" || { say "no bundle in $carry (run: bash ci/gpu-check.sh bundle)"; exit 1; }
  mkdir -p eval/corpora/perplexity-1m/streams models/cache
  cp -n "$bin"/streams/*.txt eval/corpora/perplexity-1m/streams/
  [ -f "$bin/qwen3-tokenizer.json" ] && cp -n "$bin/qwen3-tokenizer.json" models/cache/
  export NINFER_CUDA_CACHE_DIR="$bin/cubin"
  NP="$bin/bin/ninfer-perplexity"; PACK="$bin/bin/ninfer-pack"
  tb() { echo "$bin/bin/$1"; } # a test executable
  # SmolLM2 from the GGUF carried in two parts by earlier `stash` calls.
  if [ ! -f models/smollm2-135m-bf16.ninfer ]; then
    p0=""; p1=""
    for d in /tmp/ninfer-stash "$stash/a" "$stash/b"; do
      [ -z "$p0" ] && [ -f "$d/smollm2.gguf.part-00" ] && p0="$d/smollm2.gguf.part-00"
      [ -z "$p1" ] && [ -f "$d/smollm2.gguf.part-01" ] && p1="$d/smollm2.gguf.part-01"
    done
    if [ -n "$p0" ] && [ -n "$p1" ]; then
      cat "$p0" "$p1" >/tmp/smollm2.gguf
      if echo "$gguf_sha256  /tmp/smollm2.gguf" | sha256sum -c --quiet -; then
        mkdir -p models
        "$PACK" gguf /tmp/smollm2.gguf -o models/smollm2-135m-bf16.ninfer --weights bf16 >&2
      else
        say "the stashed SmolLM2 GGUF parts do not hash to the pinned sha256: SmolLM2 rows skipped"
      fi
    else
      say "SmolLM2 GGUF parts not stashed (see docs/cuda.md): SmolLM2 rows skipped"
    fi
  fi
else
  export NINFER_CUDA_CACHE_DIR="$root/eval/.cache/cubin"
  cargo build --release --quiet --bins || exit 1
  for t in "${tests[@]}"; do cargo test --release --quiet --no-run --test "$t" >/dev/null 2>&1 || exit 1; done
  NP="$root/target/release/ninfer-perplexity"; PACK="$root/target/release/ninfer-pack"
  tb() { test_binary "$1"; }
  [ -f models/smollm2-135m-bf16.ninfer ] || bash eval/prepare-smollm2.sh >&2 || true
fi
say "setup done in $(( $(date +%s) - t_start ))s"

status=0
step() { # name, timeout seconds, command...
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >>"$OUT/steps.txt"
  if [ $rc -ne 0 ]; then status=1; say "$name FAILED (rc $rc), tail of $OUT/$name.log:"; tail -n 25 "$OUT/$name.log" >&2; fi
  return 0
}
: >"$OUT/steps.txt"

# 1. Kernels compile for this device (fills the CUBIN cache when building here).
[ "$mode" = build ] && step nvrtc 240 "$(tb cuda_nvrtc)" --nocapture
# 2. Device codecs store the CPU's bits.
step kv-codecs 120 "$(tb cuda_kv)" --ignored --nocapture --test-threads 1
# 3. Parity with the CPU reference.
skip=()
[ -f models/smollm2-135m-bf16.ninfer ] || { skip=(--skip smollm2); say "no SmolLM2 artifact: its parity is skipped"; }
step parity 300 "$(tb cuda_parity)" --ignored --nocapture --test-threads 1 "${skip[@]}"
# 4. SmolLM2 quick corpus, default protocol, every KV format, on the GPU.
if [ -f models/smollm2-135m-bf16.ninfer ]; then
  for kv in f32 bf16 int8 fp8 nvfp4 k8v4; do
    rm -rf "$OUT/run-$kv"
    step "smollm2-$kv" 90 "$NP" models/smollm2-135m-bf16.ninfer --corpus eval/corpora/perplexity-1m/manifest.json \
      --quick --device cuda --kv-dtype "$kv" --output "$OUT/run-$kv" --log-level warn
    [ -f "$OUT/run-$kv/report.json" ] && cp "$OUT/run-$kv/report.json" "$OUT/smollm2-$kv.json"
  done
fi
# 5. Qwen3-8B-shaped random weights at context 4096 / stride 2048.
NINFER_BENCH_OUT="$OUT/bench.json" NINFER_BENCH_LAYERS="${GPU_CHECK_LAYERS:-36}" \
  NINFER_BENCH_WINDOWS="${GPU_CHECK_WINDOWS:-16}" step bench 300 "$(tb cuda_bench)" --ignored --nocapture

say "finished in $(( $(date +%s) - t_start ))s (logs in $OUT)"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(p):
    try:
        return json.load(open(os.path.join(out, p)))
    except Exception:
        return None
print()
print("== steps ==")
print(open(os.path.join(out, "steps.txt")).read().rstrip())
par = []
if os.path.exists(os.path.join(out, "parity.jsonl")):
    par = [json.loads(l) for l in open(os.path.join(out, "parity.jsonl")) if l.strip()]
rows = {}
for r in par:
    if "case" in r:
        rows.setdefault((r["case"], r["kv"]), {})[r["precision"]] = r
if rows:
    print("== parity: CUDA vs CPU, max over 4 quick streams (target |dNLL| <= 1e-3) ==")
    print(f"{'case':<20} {'kv':<6} {'dNLL f32-mode':>13} {'dNLL bf16-mode':>14} {'max|dlp| f32':>12} {'max|dlp| bf16':>13}")
    for (case, kv), v in rows.items():
        f, b = v.get("f32", {}), v.get("bf16", {})
        g = lambda d, k: f"{d[k]:.2e}" if k in d else "-"
        print(f"{case:<20} {kv:<6} {g(f,'max_stream_dmean_nll'):>13} {g(b,'max_stream_dmean_nll'):>14} {g(f,'max_abs_dlogprob'):>12} {g(b,'max_abs_dlogprob'):>13}")
for r in par:
    if r.get("check") == "batching":
        print(f"batching {r['precision']}/{r['kv']}: one window per pass vs packed, max |dlp| {r['max_abs_dlogprob']:.2e}")
sm = {kv: load(f"smollm2-{kv}.json") for kv in ["f32", "bf16", "int8", "fp8", "nvfp4", "k8v4"]}
if any(sm.values()):
    cpu = {}
    for (case, kv), v in rows.items():
        if case.startswith("smollm2") and "bf16" in v:
            cpu[kv] = v["bf16"]["max_stream_dmean_nll"]
    print("== SmolLM2-135M, quick corpus, context 4096 / stride 2048, --device cuda (bf16 mode) ==")
    print(f"{'kv':<6} {'tokens/s':>10} {'mean NLL':>9} {'vs f32':>8} {'|dNLL| vs CPU*':>14} {'peak RSS':>9}")
    base = sm["f32"]["overall"]["mean_nll"] if sm.get("f32") else None
    for kv, r in sm.items():
        if not r:
            print(f"{kv:<6} {'failed':>10}")
            continue
        m = r["overall"]["mean_nll"]
        d = f"{m-base:+.4f}" if base is not None else "-"
        c = f"{cpu[kv]:.2e}" if kv in cpu else "-"
        print(f"{kv:<6} {r['throughput']['processed_tokens_per_s']:>10.0f} {m:>9.5f} {d:>8} {c:>14} {r.get('peak_rss_bytes',0)/2**30:>8.1f}G")
    print("  * CPU comparison from the parity step (first tokens of each quick stream, context 512 / stride 256)")
b = load("bench.json")
if b:
    print(f"== {b['preset']} random weights, {b['layers']} layers ({b['params']/1e9:.2f}B params), kv {b['kv']}, context {b['context']} / stride {b['stride']}, {b['windows']} windows ==")
    print(f"processed {b['tokens_per_s']:.0f} tokens/s, {b['tflops']:.0f} TFLOP/s = {100*b['fraction_of_gemm']:.0f}% of the measured bf16 GEMM rate "
          f"({b['gemm_bf16_tflops']:.0f} TFLOP/s; target >= 40%); load {b['load_s']:.1f}s, warm-up {b['warmup_s']:.1f}s, "
          f"peak allocated {b['peak_allocated_bytes']/2**30:.1f} GiB, device used {b['peak_used_bytes']/2**30:.1f} GiB")
else:
    print("== random-weight benchmark: no result ==")
PY
exit $status
