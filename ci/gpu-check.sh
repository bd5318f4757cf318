#!/usr/bin/env bash
# The CUDA scorer's GPU check: builds (or unpacks prebuilt binaries), runs the device KV
# codec and CUDA-vs-CPU parity tests, benchmarks SmolLM2 on the quick corpus for every KV
# format and a Qwen3-8B-shaped random-weight artifact at context 4096 / stride 2048, and
# prints a short table last. See docs/cuda.md.
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
# Deadline (build and run): one for the whole script, GPU_CHECK_DEADLINE_S seconds from its
# start (default 540, under the device tool's 600 s cut; in build mode the cargo build counts
# too). Each step gets min(its own timeout, the seconds left), and is skipped, and recorded
# as "skipped (deadline)", when fewer than 20 s are left; a skipped step makes the exit
# status 1. The summary table is printed from an EXIT trap, so it also comes when a step
# failed, was skipped, or the script was interrupted (INT, TERM, HUP; not SIGKILL).
#
# Output: logs and JSON are written into a temporary work directory (its path is printed),
# and at the end (also from the EXIT trap) $OUT gets exactly two files: gpu-check.tar.gz
# (the whole work directory: step logs, steps.txt, gpu.txt, parity.jsonl, bench.json,
# smollm2-*.json, kld-gpu-vs-cpu-*.json, kld-cpu-vs-gpu-f32.json, run-*/) and summary.txt
# (the table). The device tool brings back at most 8 files from $OUT.
#
# CUDA libraries: every candidate directory (/usr/local/nvidia/lib64, /usr/local/nvidia/lib,
# /usr/local/cuda/lib64, /usr/local/cuda/targets/x86_64-linux/lib, pip wheels'
# site-packages/nvidia/*/lib found through python3, /usr/lib/x86_64-linux-gnu) that holds
# any of libcuda.so*, libcublas.so*, libnvrtc.so* is added, de-duplicated, to
# LD_LIBRARY_PATH and to NINFER_CUDA_LIB_DIR (colon separated, after any value already
# set); stderr says which directory provided which library.
#
# Environment: GPU_CHECK_ONLY (step-name prefixes to run, space separated, e.g.
# "kv-codecs parity sanitize"; default every step), GPU_CHECK_DEADLINE_S (540), GPU_CHECK_LAYERS (36: layers of the
# Qwen3-8B-shaped model), GPU_CHECK_WINDOWS (16), GPU_CHECK_PARITY_TOKENS (1024), OUT
# (where gpu-check.tar.gz and summary.txt go; default eval/.cache/gpu-check-out).
set -uo pipefail
t_start=$(date +%s)
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mode="${1:-build}"
carry="$root/eval/.cache/gpu-carry"
stash="$root/eval/.cache/gpu-stash"
gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The device checks are the `parity` test binary (its `::cuda` cases and `nvrtc::`) and the
# `cuda` bench.
bins=(parity cuda)

say() { echo "gpu-check: $*" >&2; }

test_binary() { # the newest built executable of a test or bench target
  ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -n 1
}
build_checks() { # the parity test binary and the cuda bench, not run
  cargo test --release --quiet --no-run --test parity >/dev/null 2>&1 &&
    cargo bench --quiet --no-run --bench cuda >/dev/null 2>&1
}

case "$mode" in
bundle)
  set -e
  cargo build --release --quiet --bins
  build_checks
  work="$(mktemp -d)"
  mkdir -p "$work/bin" "$work/cubin" "$work/streams" "$carry" "$stash"
  cp target/release/ninfer-perplexity target/release/ninfer-pack "$work/bin/"
  for t in "${bins[@]}"; do cp "$(test_binary "$t")" "$work/bin/$t"; done
  strip "$work/bin/"*
  # Fill the CUBIN cache for sm_90 with the exact programs the binaries embed.
  export NINFER_NVRTC_LIB_DIR="${NINFER_NVRTC_LIB_DIR:-$(bash ci/install-nvrtc.sh)}"
  NINFER_CUDA_CACHE_DIR="$work/cubin" "$work/bin/parity" nvrtc:: --quiet >/dev/null
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
    say "bundle: no SmolLM2 GGUF in models/cache (run bash eval/prepare/fetch-smollm2.sh models/cache)"
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

deadline_s="${GPU_CHECK_DEADLINE_S:-540}"
case "$deadline_s" in
'' | *[!0-9]*) echo "gpu-check: GPU_CHECK_DEADLINE_S must be a whole number of seconds" >&2; exit 2 ;;
esac
min_step_s=20
elapsed_s() { echo $(( $(date +%s) - t_start )); }
left_s() { echo $(( t_start + deadline_s - $(date +%s) )); }
cap_s() { # min(N, seconds left), at least 1
  local l; l=$(left_s)
  [ "$l" -lt "$1" ] && set -- "$l"
  [ "$1" -lt 1 ] && set -- 1
  echo "$1"
}

OUT="${OUT:-$root/eval/.cache/gpu-check-out}"
mkdir -p "$OUT"
# $OUT holds only the two packed files; drop them and what older versions left loose there.
rm -rf "$OUT"/gpu-check.tar.gz "$OUT"/summary.txt "$OUT"/parity.jsonl "$OUT"/bench.json \
  "$OUT"/smollm2-*.json "$OUT"/kld-*.json "$OUT"/steps.txt "$OUT"/gpu.txt "$OUT"/run-* \
  "$OUT"/nvrtc.log "$OUT"/kv-codecs.log "$OUT"/parity.log "$OUT"/smollm2-*.log "$OUT"/bench.log
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")" || { say "cannot create a work directory"; exit 1; }
steps="$work/steps.txt"
: >"$steps"
say "logs and JSON in $work; packed into $OUT/gpu-check.tar.gz at the end (deadline ${deadline_s}s)"
export NINFER_REPO="$root"
export NINFER_PARITY_OUT="$work/parity.jsonl"
export NINFER_PARITY_TOKENS="${GPU_CHECK_PARITY_TOKENS:-1024}"

summary() { # the table, from the work directory
  python3 - "$work" <<'PY'
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
    for l in open(os.path.join(out, "parity.jsonl")):
        try:
            par.append(json.loads(l))
        except ValueError:
            pass  # blank, or cut short by an interrupted step
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
sm = {kv: load(f"smollm2-{kv}.json") for kv in ["f32", "bf16", "int8", "fp8", "fp8-tensor", "nvfp4", "k8v4"]}
if any(sm.values()):
    cpu = {}
    for (case, kv), v in rows.items():
        if case.startswith("smollm2") and "bf16" in v:
            cpu[kv] = v["bf16"]["max_stream_dmean_nll"]
    print("== SmolLM2-135M, quick corpus, context 4096 / stride 2048, --device cuda (bf16 mode) ==")
    print(f"{'kv':<10} {'tokens/s':>10} {'mean NLL':>9} {'vs f32':>8} {'|dNLL| vs CPU*':>14} {'peak RSS':>9}")
    base = sm["f32"]["overall"]["mean_nll"] if sm.get("f32") else None
    for kv, r in sm.items():
        if not r:
            print(f"{kv:<10} {'failed':>10}")
            continue
        m = r["overall"]["mean_nll"]
        d = f"{m-base:+.4f}" if base is not None else "-"
        c = f"{cpu[kv]:.2e}" if kv in cpu else "-"
        print(f"{kv:<10} {r['throughput']['processed_tokens_per_s']:>10.0f} {m:>9.5f} {d:>8} {c:>14} {r.get('peak_rss_bytes',0)/2**30:>8.1f}G")
    print("  * CPU comparison from the parity step (first tokens of each quick stream, context 512 / stride 256)")
def kld_rows(title, head, rows):
    if not any(r for _, r in rows):
        return
    print(title)
    print(f"{'kv':<6} {'positions':>9} {head[0]:>13} {head[1]:>13} {'kld p99':>9} {'JS':>10} {'top-1 agree':>11} {'top-10':>7} {'dNLL':>10}")
    for kv, r in rows:
        x = (r or {}).get("overall", {}).get("reference")
        if not x:
            print(f"{kv:<6} {'failed':>9}")
            continue
        print(f"{kv:<6} {x['positions']:>9} {x['mean_kld']:>13.3e} {x['mean_kld_reverse']:>13.3e} {x['kld_p99']:>9.2e} {x.get('mean_js', 0):>10.3e} {x['top1_agreement']:>11.4f} {x.get('top10_overlap', 0):>7.4f} {x['delta_nll']:>+10.2e}")
kld_rows("== SmolLM2, the CPU's f32-KV run saved as the reference, each GPU run (bf16 mode) compared on the device (--kld-base), 2048 tokens of each quick stream; dNLL = GPU - CPU ==",
         ("KL(CPU||GPU)", "KL(GPU||CPU)"),
         [(kv, load(f"kld-gpu-vs-cpu-{kv}.json")) for kv in ("f32", "bf16", "fp8", "int8", "nvfp4", "k8v4")])
kld_rows("== SmolLM2, the GPU's f32-KV run (bf16 mode) saved, read by the CPU f32-KV run (--kld-base); dNLL = CPU - GPU ==",
         ("KL(GPU||CPU)", "KL(CPU||GPU)"),
         [("f32", load("kld-cpu-vs-gpu-f32.json"))])
for name in ("bench.json", "bench-hybrid.json", "bench-moe.json"):
  b = load(name)
  if b:
    print(f"== {b['preset']} random weights, {b['layers']} layers ({b['params']/1e9:.2f}B params), kv {b['kv']}, context {b['context']} / stride {b['stride']}, {b['windows']} windows ==")
    print(f"processed {b['tokens_per_s']:.0f} tokens/s, {b['tflops']:.0f} TFLOP/s = {100*b['fraction_of_gemm']:.0f}% of the measured bf16 GEMM rate "
          f"({b['gemm_bf16_tflops']:.0f} TFLOP/s; target >= 40%); load {b['load_s']:.1f}s, warm-up {b['warmup_s']:.1f}s, "
          f"peak allocated {b['peak_allocated_bytes']/2**30:.1f} GiB, device used {b['peak_used_bytes']/2**30:.1f} GiB")
    if "delta_rule_cuda_cores_ms" in b:
      print(f"chunked delta rule per layer, same inputs: CUDA cores {b['delta_rule_cuda_cores_ms']:.2f} ms, "
            f"tensor cores (3xTF32) {b['delta_rule_tensor_cores_ms']:.2f} ms "
            f"({b['delta_rule_cuda_cores_ms']/b['delta_rule_tensor_cores_ms']:.2f}x); outputs within {b['delta_rule_max_rel_diff']:.1e}")
  else:
    print(f"== random-weight benchmark ({name}): no result ==")
PY
}

status=0
step_pid=""
step_name=""
finished=""
stop_step() { # the running step, if any (timeout forwards the signal to the test)
  if [ -n "$step_pid" ]; then kill -TERM "$step_pid" 2>/dev/null; step_pid=""; fi
}
finish() { # EXIT trap: the table (stdout and $OUT/summary.txt) and the tarball, always
  local rc=$?
  [ -n "$finished" ] && return
  finished=1
  stop_step
  [ "$rc" -eq 0 ] && [ "$status" -ne 0 ] && rc=$status
  echo "total $(elapsed_s)s of a ${deadline_s}s deadline, exit status $rc" >>"$steps"
  local sum="$work/summary.txt"
  summary >"$sum" 2>"$work/summary.err" ||
    { echo "(the summary script failed, see summary.err in the tarball; the steps:)"; cat "$steps"; } >>"$sum"
  cat "$sum"
  cp "$sum" "$OUT/summary.txt"
  if tar -C "$work" -czf "$OUT/gpu-check.tar.gz" .; then
    say "packed $work into $OUT/gpu-check.tar.gz; table in $OUT/summary.txt"
  else
    say "packing $work into $OUT/gpu-check.tar.gz failed"
  fi
  exit "$rc"
}
on_signal() { # name, exit status
  echo "interrupted by SIG$1 after $(elapsed_s)s${step_name:+, during $step_name}" >>"$steps"
  say "interrupted by SIG$1"
  stop_step
  exit "$2"
}
trap finish EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

# CUDA libraries: every candidate directory holding the driver (libcuda), cuBLAS or NVRTC;
# on an H200 machine the driver and the toolkit or pip wheels are in different directories.
mapfile -t pip_dirs < <(python3 - 2>/dev/null <<'PY'
import glob, os, site
roots = []
try:
    roots += site.getsitepackages()
except Exception:
    pass
try:
    roots.append(site.getusersitepackages())
except Exception:
    pass
seen = []
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        if d not in seen:
            seen.append(d)
print("\n".join(seen))
PY
)
libdirs=""
seen_dirs=" "
found_libs=" "
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  "${pip_dirs[@]}" /usr/lib/x86_64-linux-gnu; do
  [ -n "$d" ] && [ -d "$d" ] || continue
  real="$(readlink -f "$d")"
  case "$seen_dirs" in *" $real "*) continue ;; esac
  seen_dirs="$seen_dirs$real "
  here=""
  for lib in libcuda libcublas libnvrtc; do
    for f in "$d/$lib".so*; do
      [ -e "$f" ] || continue
      here="$here ${f##*/}"
      found_libs="$found_libs$lib "
    done
  done
  [ -n "$here" ] || continue
  libdirs="${libdirs:+$libdirs:}$d"
  say "library dir $d:$here"
done
for lib in libcuda libcublas libnvrtc; do
  case "$found_libs" in *" $lib "*) ;; *) say "no $lib.so* in any candidate directory (left to the loader's default search)" ;; esac
done
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+${libdirs:+:}$LD_LIBRARY_PATH}"
if [ -n "$libdirs" ]; then
  export NINFER_CUDA_LIB_DIR="${NINFER_CUDA_LIB_DIR:+$NINFER_CUDA_LIB_DIR:}$libdirs"
fi
say "library path: $LD_LIBRARY_PATH"
say "NINFER_CUDA_LIB_DIR: ${NINFER_CUDA_LIB_DIR:-}"
timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 |
  tee "$work/gpu.txt" >&2

if [ "$mode" = run ]; then
  bin="$(mktemp -d)"
  tar -C "$bin" -xJf "$carry/bundle.tar.xz" || {
    say "no bundle in $carry (run: bash ci/gpu-check.sh bundle)"
    echo "setup FAILED: no bundle in $carry" >>"$steps"
    exit 1
  }
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
        timeout -k 10 "$(cap_s 120)" "$PACK" gguf /tmp/smollm2.gguf -o models/smollm2-135m-bf16.ninfer --weights bf16 >&2 ||
          { say "packing SmolLM2 failed: SmolLM2 rows skipped"; echo "setup: packing SmolLM2 FAILED" >>"$steps"; status=1; }
      else
        say "the stashed SmolLM2 GGUF parts do not hash to the pinned sha256: SmolLM2 rows skipped"
      fi
    else
      say "SmolLM2 GGUF parts not stashed (see docs/cuda.md): SmolLM2 rows skipped"
    fi
  fi
else
  export NINFER_CUDA_CACHE_DIR="$root/eval/.cache/cubin"
  cargo build --release --quiet --bins || { echo "setup FAILED: cargo build" >>"$steps"; exit 1; }
  build_checks || { echo "setup FAILED: cargo test --no-run --test parity, cargo bench --no-run --bench cuda" >>"$steps"; exit 1; }
  NP="$root/target/release/ninfer-perplexity"; PACK="$root/target/release/ninfer-pack"
  tb() { test_binary "$1"; }
  [ -f models/smollm2-135m-bf16.ninfer ] || bash eval/prepare/prepare-smollm2.sh >&2 || true
fi
say "setup done in $(elapsed_s)s, $(left_s)s left"
echo "setup done in $(elapsed_s)s" >>"$steps"

step() { # name, timeout seconds, command...
  local name="$1" limit="$2"; shift 2
  local left note="" t0 rc
  if [ -n "${GPU_CHECK_ONLY:-}" ]; then
    local p chosen=""
    for p in $GPU_CHECK_ONLY; do case "$name" in "$p"*) chosen=1 ;; esac; done
    if [ -z "$chosen" ]; then
      echo "$name skipped (not in GPU_CHECK_ONLY)" >>"$steps"
      return 0
    fi
  fi
  left=$(left_s)
  if [ "$left" -lt "$min_step_s" ]; then
    echo "$name skipped (deadline): ${left}s left, planned ${limit}s" >>"$steps"
    say "$name skipped (deadline): ${left}s left"
    status=1
    return 0
  fi
  if [ "$left" -lt "$limit" ]; then note=" (cut from ${limit}s by the deadline)"; limit=$left; fi
  t0=$(date +%s)
  # In the background, so that a signal to this script is handled at once (wait returns).
  timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1 &
  step_pid=$!
  step_name=$name
  wait "$step_pid"
  rc=$?
  step_pid=""
  step_name=""
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s, limit ${limit}s$note" >>"$steps"
  if [ $rc -ne 0 ]; then
    status=1
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && say "$name timed out after ${limit}s"
    say "$name FAILED (rc $rc), tail of $name.log:"
    tail -n 25 "$work/$name.log" >&2
  fi
  return 0
}

# Order (issue 37): what a first GPU can tell least elsewhere comes first. The parity steps
# synchronize after every launch (NINFER_CUDA_SYNC=1), so a device fault names its kernel.
# 1. Kernels compile for this device (fills the CUBIN cache when building here).
[ "$mode" = build ] && step nvrtc 240 "$(tb parity)" nvrtc:: --nocapture
# 2. Device codecs store the CPU's bits (the `::cuda` half of each parity case).
NINFER_CUDA_SYNC=1 step kv-codecs 120 "$(tb parity)" ::cuda --skip model:: --nocapture --test-threads 1
# 2b. Every kernel against its CPU twin on this GPU (the emulated device's checks, run here:
#     the bit-for-bit claims meet the GPU's FMA contraction and libm; checks of the emulator
#     itself skip themselves).
NINFER_KERNEL_DEVICE=cuda NINFER_CUDA_SYNC=1 step kernels-gpu 150 "$(tb parity)" kernels:: --nocapture --test-threads 1
# 3. Parity with the CPU reference: the hybrid and MoE cases first, then the rest.
skip=()
[ -f models/smollm2-135m-bf16.ninfer ] || { skip=(--skip smollm2); say "no SmolLM2 artifact: its parity is skipped"; }
NINFER_CUDA_SYNC=1 step parity-hybrid 150 "$(tb parity)" --exact \
  model::random_hybrid_matches_the_cpu_for_every_kv_format::cuda --nocapture
NINFER_CUDA_SYNC=1 step parity-moe 150 "$(tb parity)" --exact \
  model::tiny_moe_families_match_the_cpu_for_every_kv_format::cuda --nocapture
NINFER_CUDA_SYNC=1 step parity 240 "$(tb parity)" ::cuda --skip kv:: --skip random_hybrid_matches \
  --skip tiny_moe_families --nocapture --test-threads 1 "${skip[@]}"
# 4. The Qwen3.5 27B hybrid's shape (its first GPU_CHECK_HYBRID_LAYERS layers, the 3:1
#    DeltaNet/attention pattern kept), random weights, context 4096 / stride 2048.
NINFER_BENCH_OUT="$work/bench-hybrid.json" NINFER_BENCH_PRESET=qwen3_5-27b \
  NINFER_BENCH_LAYERS="${GPU_CHECK_HYBRID_LAYERS:-8}" NINFER_BENCH_WINDOWS="${GPU_CHECK_HYBRID_WINDOWS:-8}" \
  step bench-hybrid 150 "$(tb cuda)"
# 5. The Qwen3.5-35B-A3B mixture of experts' shape (256 experts, 8 chosen, a shared expert;
#    its first GPU_CHECK_MOE_LAYERS layers), random weights, same protocol.
NINFER_BENCH_OUT="$work/bench-moe.json" NINFER_BENCH_PRESET=qwen3_5-35b-a3b \
  NINFER_BENCH_LAYERS="${GPU_CHECK_MOE_LAYERS:-8}" NINFER_BENCH_WINDOWS="${GPU_CHECK_MOE_WINDOWS:-8}" \
  step bench-moe 150 "$(tb cuda)"
# 6. Qwen3-8B-shaped random weights at context 4096 / stride 2048.
NINFER_BENCH_OUT="$work/bench.json" NINFER_BENCH_LAYERS="${GPU_CHECK_LAYERS:-36}" \
  NINFER_BENCH_WINDOWS="${GPU_CHECK_WINDOWS:-16}" step bench 300 "$(tb cuda)"
# 7. SmolLM2 quick corpus, default protocol, every KV format, on the GPU.
if [ -f models/smollm2-135m-bf16.ninfer ]; then
  for kv in f32 bf16 int8 fp8 fp8-tensor nvfp4 k8v4; do
    step "smollm2-$kv" 90 "$NP" models/smollm2-135m-bf16.ninfer --corpus eval/corpora/perplexity-1m/manifest.json \
      --quick --device cuda --kv-dtype "$kv" --output "$work/run-$kv" --log-level warn
    [ -f "$work/run-$kv/report.json" ] && cp "$work/run-$kv/report.json" "$work/smollm2-$kv.json"
  done
  # 7b. The GPU held to the CPU position by position (the first 2048 tokens of each quick
  #     stream): the CPU's exact run (f32 KV) saved as the reference, then every KV format
  #     on the GPU (bf16 mode) compared with it on the device (--kld-base): KL(CPU || GPU)
  #     both ways, top-1 agreement, paired dNLL. Then the other direction of the file: the
  #     GPU's f32-KV run saved, read back by the CPU.
  step save-cpu 120 "$NP" models/smollm2-135m-bf16.ninfer --corpus eval/corpora/perplexity-1m/manifest.json \
    --quick --max-tokens 2048 --device cpu --kv-dtype f32 --save-reference "$work/cpu.ref" \
    --output "$work/run-save-cpu" --log-level warn
  if [ -f "$work/cpu.ref" ]; then
    for kv in f32 bf16 fp8 int8 nvfp4 k8v4; do
      step "kld-gpu-$kv" 60 "$NP" models/smollm2-135m-bf16.ninfer --corpus eval/corpora/perplexity-1m/manifest.json \
        --quick --max-tokens 2048 --device cuda --kv-dtype "$kv" --kld-base "$work/cpu.ref" \
        --output "$work/run-kld-gpu-$kv" --log-level warn
      [ -f "$work/run-kld-gpu-$kv/report.json" ] && cp "$work/run-kld-gpu-$kv/report.json" "$work/kld-gpu-vs-cpu-$kv.json"
    done
    rm -f "$work/cpu.ref" # about 18 MB; its numbers are in the reports
  fi
  step save-gpu-f32 60 "$NP" models/smollm2-135m-bf16.ninfer --corpus eval/corpora/perplexity-1m/manifest.json \
    --quick --max-tokens 2048 --device cuda --kv-dtype f32 --save-reference "$work/gpu-f32.ref" \
    --output "$work/run-save-f32" --log-level warn
  if [ -f "$work/gpu-f32.ref" ]; then
    step kld-cpu-f32 90 "$NP" models/smollm2-135m-bf16.ninfer --corpus eval/corpora/perplexity-1m/manifest.json \
      --quick --max-tokens 2048 --device cpu --kv-dtype f32 --kld-base "$work/gpu-f32.ref" \
      --output "$work/run-kld-f32" --log-level warn
    [ -f "$work/run-kld-f32/report.json" ] && cp "$work/run-kld-f32/report.json" "$work/kld-cpu-vs-gpu-f32.json"
    rm -f "$work/gpu-f32.ref"
  fi
fi
# 8. compute-sanitizer (where the tool is there and the runtime lets it read the device):
#    memcheck over the KV codecs and the small hybrid's parity (few tokens); racecheck, about
#    50 times slower, over the kernel checks of the Gated DeltaNet, attention, q/k/v and MoE
#    kernels on this GPU (the shapes of tests/parity/kernels.rs: small), then the KV codecs.
sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -n 1)"
if [ -n "$sanitizer" ]; then
  NINFER_PARITY_OUT="$work/sanitize.jsonl" NINFER_PARITY_TOKENS=128 step sanitize-memcheck 90 "$sanitizer" --tool memcheck --error-exitcode 9 \
    "$(tb parity)" ::cuda --skip model::tiny --skip smollm2 --skip reruns --skip batching --skip bad_token \
    --nocapture --test-threads 1
  for part in delta attention qkv moe expert; do
    NINFER_KERNEL_DEVICE=cuda step "sanitize-racecheck-$part" 90 "$sanitizer" --tool racecheck --error-exitcode 9 \
      "$(tb parity)" "$part" --skip model:: --skip planted --skip strict --skip race_checker --nocapture --test-threads 1
  done
  NINFER_PARITY_OUT="$work/sanitize.jsonl" step sanitize-racecheck 90 "$sanitizer" --tool racecheck --error-exitcode 9 \
    "$(tb parity)" ::cuda --skip model:: --nocapture --test-threads 1
else
  echo "sanitize skipped: no compute-sanitizer" >>"$steps"
fi

say "finished in $(elapsed_s)s"
exit $status # the EXIT trap prints the table and packs $work into $OUT
