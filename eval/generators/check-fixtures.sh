#!/usr/bin/env bash
# Checks that every committed file under eval/fixtures/ is what its generator writes today,
# byte for byte. Sets up eval/.venv (setup-python.sh), fetches the pinned inputs (SmolLM2 GGUF,
# Qwen3 tokenizer) if missing, runs every generator of this folder with --out into a
# scratch directory (the committed files are never touched), then prints one line per
# committed file:
#
#   same     FILE
#   differs  FILE   (how: tensors and ULPs for .safetensors, values for .json)
#   missing  FILE   (the generator did not write it, or failed)
#   extra    FILE   (written by a generator, not committed)
#   orphan   FILE   (committed, but no generator here owns it)
#
# and exits 1 if any line is not `same`. Development / optional CI check, not part of the test
# run: about 11 minutes on 2 cores, plus the venv's first install (~1.5 min here).
#
# The bytes depend on the kind of CPU (README.md, "Reproducing the bytes"): the committed
# files were made on two kinds of machine, and each generator pins PyTorch's kernels to its
# own kind (cpu_pins.py): avx512 (hybrid, weights, kld: any CPU with AVX-512), zen3 (fixtures,
# moe: an AMD EPYC Zen 3, AVX2 without AVX-512), avx2 (kv: any CPU with AVX2). No machine is
# of every kind, so a full run has `differs` lines on any one machine; the lines of a
# generator whose kind this CPU is not are marked `(other CPU kind)`.
#
# Usage: bash eval/generators/check-fixtures.sh [--keep DIR] [--this-cpu] [GENERATOR...]
#   GENERATOR: fixtures hybrid moe weights kld kv (default: all; with a subset only the
#              files those generators own are compared)
#   --this-cpu: only the generators whose kind this CPU is (exit 0 when all of those reproduce)
#   --keep DIR: write the generated files under DIR (kept) instead of a temporary directory
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

all=(fixtures hybrid moe weights kld kv)
keep=""
this_cpu=0
sel=()
while [ $# -gt 0 ]; do
  case "$1" in
    --keep) keep="${2:?--keep needs a directory}"; shift 2 ;;
    --this-cpu) this_cpu=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *)
      case " ${all[*]} " in *" $1 "*) sel+=("$1") ;; *) echo "check-fixtures: unknown generator '$1' (one of: ${all[*]})" >&2; exit 2 ;; esac
      shift ;;
  esac
done
[ ${#sel[@]} -gt 0 ] || sel=("${all[@]}")

# Which generator writes which committed file (paths relative to eval/fixtures/).
owner() {
  case "$1" in
    smollm2_tokenizer.json|smollm2_logprobs.json|tiny-qwen3/*|tiny-qwen2/*|tiny_qwen3_logprobs.json|tiny_qwen2_logprobs.json) echo fixtures ;;
    tiny-qwen3_5/*|tiny_qwen3_5_logprobs.json) echo hybrid ;;
    tiny-qwen3_moe/*|tiny-qwen3_5_moe/*|tiny-qwen3_next/*|tiny_qwen3_moe_logprobs.json|tiny_qwen3_5_moe_logprobs.json|tiny_qwen3_next_logprobs.json) echo moe ;;
    quantized/*) echo weights ;;
    smollm2_kld_f32_vs_nvfp4.json) echo kld ;;
    kv/*) echo kv ;;
    *) echo "" ;;
  esac
}
profile_of() {  # the CPU kind its committed files were made on (pin_cpu in the script)
  case "$1" in
    hybrid|weights|kld) echo avx512 ;;
    fixtures|moe) echo zen3 ;;
    kv) echo avx2 ;;
  esac
}
script_of() {
  case "$1" in
    fixtures) echo make_fixtures.py ;;
    hybrid) echo make_hybrid_fixtures.py ;;
    moe) echo make_moe_fixtures.py ;;
    weights) echo make_weight_fixtures.py ;;
    kld) echo make_kld_fixture.py ;;
    kv) echo make_kv_fixtures.py ;;
  esac
}

t_start=$(date +%s)
echo "check-fixtures: setting up eval/.venv (eval/generators/setup-python.sh)" >&2
venv="$(bash "$here/setup-python.sh" | tail -n 1)"
py="$venv/bin/python"
bash eval/prepare/fetch-smollm2.sh models/cache >/dev/null
bash eval/prepare/fetch-qwen3-tokenizer.sh models/cache >/dev/null

profiles=()
for g in "${sel[@]}"; do
  p="$(profile_of "$g")"
  case " ${profiles[*]} " in *" $p "*) ;; *) profiles+=("$p") ;; esac
  [ "$(grep -c "pin_cpu(\"$p\")" "$here/$(script_of "$g")")" = 1 ] \
    || { echo "check-fixtures: $(script_of "$g") does not pin the $p kernels" >&2; exit 2; }
done
"$py" "$here/cpu_pins.py" --check "${profiles[@]}" >&2 || true
runnable() { PYTHONDONTWRITEBYTECODE=1 "$py" -c "import sys; sys.path.insert(0, '$here'); import cpu_pins; sys.exit(0 if cpu_pins.can_run('$1') else 1)"; }
if [ "$this_cpu" = 1 ]; then
  keep_sel=()
  for g in "${sel[@]}"; do
    if runnable "$(profile_of "$g")"; then keep_sel+=("$g"); else echo "check-fixtures: skipping $g (made on another kind of CPU: $(profile_of "$g"))" >&2; fi
  done
  sel=("${keep_sel[@]}")
  [ ${#sel[@]} -gt 0 ] || { echo "check-fixtures: no generator's fixtures were made on this kind of CPU"; exit 1; }
fi
other=()
for g in "${sel[@]}"; do runnable "$(profile_of "$g")" || other+=("$g"); done

if [ -n "$keep" ]; then
  mkdir -p "$keep"
  out="$(cd "$keep" && pwd)"
  if [ -n "$(ls -A "$out")" ]; then
    echo "check-fixtures: $out is not empty" >&2
    exit 2
  fi
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
gen="$out/fixtures"
logs="$out/logs"
mkdir -p "$gen" "$logs"

export PYTHONDONTWRITEBYTECODE=1
failed=()
for g in "${sel[@]}"; do
  s="$(script_of "$g")"
  t0=$(date +%s)
  echo "check-fixtures: running $s --out ... (log: $logs/$g.log)" >&2
  if "$py" "$here/$s" --out "$gen" >"$logs/$g.log" 2>&1; then
    echo "check-fixtures: $s done in $(( $(date +%s) - t0 )) s" >&2
  else
    echo "check-fixtures: $s FAILED after $(( $(date +%s) - t0 )) s; last lines of its log:" >&2
    tail -n 20 "$logs/$g.log" | sed 's/^/    /' >&2
    failed+=("$g")
  fi
done

selected() { case " ${sel[*]} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

bad=0
n=0
while IFS= read -r rel; do
  o="$(owner "$rel")"
  if [ -z "$o" ]; then
    printf 'orphan   %s\n' "eval/fixtures/$rel"
    bad=$((bad + 1)); n=$((n + 1))
    continue
  fi
  selected "$o" || continue
  n=$((n + 1))
  if [ ! -f "$gen/$rel" ]; then
    printf 'missing  %s\n' "eval/fixtures/$rel"
    bad=$((bad + 1))
  elif cmp -s "eval/fixtures/$rel" "$gen/$rel"; then
    printf 'same     %s\n' "eval/fixtures/$rel"
  else
    note=""
    case " ${other[*]} " in *" $o "*) note=" (other CPU kind: made on $(profile_of "$o"))" ;; esac
    printf 'differs  %s   (%s)%s\n' "eval/fixtures/$rel" \
      "$("$py" "$here/diff_fixture.py" "eval/fixtures/$rel" "$gen/$rel" 2>&1 | tail -n 1)" "$note"
    bad=$((bad + 1))
  fi
done < <(cd eval/fixtures && find . -type f | sed 's#^\./##' | LC_ALL=C sort)

while IFS= read -r rel; do
  if [ ! -f "eval/fixtures/$rel" ]; then
    printf 'extra    %s\n' "eval/fixtures/$rel"
    bad=$((bad + 1))
  fi
done < <(cd "$gen" && find . -type f | sed 's#^\./##' | LC_ALL=C sort)

total=$(( $(date +%s) - t_start ))
if [ ${#failed[@]} -gt 0 ]; then
  echo "check-fixtures: generators that failed: ${failed[*]} (logs under $logs${keep:+, kept})"
fi
if [ "$bad" -eq 0 ] && [ ${#failed[@]} -eq 0 ]; then
  echo "check-fixtures: all $n files reproduce byte for byte (${sel[*]}; $total s)"
else
  echo "check-fixtures: $bad of $n files do not reproduce (${sel[*]}; $total s)"
  exit 1
fi
