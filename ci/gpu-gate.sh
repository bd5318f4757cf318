#!/usr/bin/env bash
# GPU CI gate: fails a merge when perplexity drifts on the GPU.
#
# Runs on a self-hosted runner with an NVIDIA GPU and driver (no CUDA toolkit needed: the
# backend loads the driver, NVRTC and cuBLAS at run time). Steps:
#   1. prepare the registered artifacts that have a recipe, and the corpus (ci/prepare.sh);
#   2. build the harness with the default features (CUDA included);
#   3. run the harness's GPU tier: every registered gpu-tier artifact that is present, the
#      whole corpus, the default protocol (context 4096, stride 2048), every KV format;
#   4. write the reports (trials.jsonl, summary.md, harness.log) to $NINFER_GATE_REPORTS
#      (default profiles/gpu-gate/<UTC time>/) and, on GitHub Actions, append the summary to
#      the job summary;
#   5. exit non-zero on drift, on any failed trial, or when no GPU trial ran at all (a gate
#      that ignored everything proves nothing).
#
# Nothing is written into the tree (CI=true): to update GPU baselines, run the harness on the
# GPU machine without CI set and review the pending snapshots with `cargo insta review`
# (docs/harness.md). Extra arguments go to the harness (name filters, --kv-dtype,
# --artifact, --device cuda:N, libtest flags).
#
# `ci/gpu-gate.sh --first-run [ARGS]`, once on a new GPU (class): instead of gating, it
# writes the GPU tier's baselines into the tree (baselines/<artifact>/cuda-smXY-bf16/...),
# then scores every GPU trial NINFER_GATE_SPREAD_RUNS times (default 3) with the harness's
# `--measure-spread` and writes the proposed registry `gate` entries (θ from the measured
# paired spread) to $NINFER_GATE_REPORTS/proposed-gate.txt. Review both, commit the
# baselines and paste the entries into eval/registry.json: the GPU tier goes from stated
# tolerances to measured gates in one call.
#
# Environment:
#   NINFER_GATE_REPORTS    report directory
#   NINFER_GATE_SKIP_PREPARE=1   skip step 1 (artifacts and corpus already in place)
#   NINFER_GATE_ALLOW_IGNORED=1  do not fail when some gpu-tier artifact file is missing
set -euo pipefail
first_run=0
if [ "${1:-}" = "--first-run" ]; then
    first_run=1
    shift
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export CI=true
export CARGO_TERM_COLOR=never

reports="${NINFER_GATE_REPORTS:-$root/profiles/gpu-gate/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$reports"
reports="$(cd "$reports" && pwd)"
start=$(date +%s)

if [ "${NINFER_GATE_SKIP_PREPARE:-0}" != 1 ]; then
    echo "gpu-gate: preparing artifacts and corpus" >&2
    bash ci/prepare.sh
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader \
        | tee "$reports/gpu.txt" >&2 || true
else
    echo "gpu-gate: nvidia-smi not found; the harness will say whether CUDA is usable" >&2
fi

echo "gpu-gate: building" >&2
cargo test --release --test harness --no-run

if [ "$first_run" = 1 ]; then
    echo "gpu-gate: first run: writing GPU baselines into the tree; reports in $reports" >&2
    set +e
    env -u CI INSTA_UPDATE=always NINFER_HARNESS_REPORT_DIR="$reports" \
        cargo test --release --test harness -- --tier gpu --test-threads 1 "$@" 2>&1 | tee "$reports/baselines.log"
    set -e
    echo "gpu-gate: first run: measuring the run-to-run spread (${NINFER_GATE_SPREAD_RUNS:-3} runs per trial)" >&2
    set +e
    cargo test --release --test harness -- --tier gpu --test-threads 1 \
        --measure-spread "${NINFER_GATE_SPREAD_RUNS:-3}" "$@" 2>&1 | tee "$reports/spread.log"
    status=${PIPESTATUS[0]}
    set -e
    grep -E -A1 '^spread .*(proposed registry|bit-identical)' "$reports/spread.log" > "$reports/proposed-gate.txt" || true
    measured="$(grep -E '^test result:' "$reports/spread.log" | tail -1 | sed -nE 's/.* ([0-9]+) passed.*/\1/p')"
    if [ "${measured:-0}" -eq 0 ]; then
        echo "gpu-gate: first run FAILED: no GPU trial ran; is a GPU visible and the CUDA backend built? See $reports/baselines.log" >&2
        exit 1
    fi
    echo "gpu-gate: first run done (exit $status): review \`git status baselines/\` and $reports/proposed-gate.txt, then commit the baselines and paste the gate entries into eval/registry.json" >&2
    cat "$reports/proposed-gate.txt" >&2
    exit "$status"
fi

echo "gpu-gate: running the GPU tier; reports in $reports" >&2
set +e
NINFER_HARNESS_REPORT_DIR="$reports" \
    cargo test --release --test harness -- --tier gpu --test-threads 1 "$@" 2>&1 | tee "$reports/harness.log"
status=${PIPESTATUS[0]}
set -e

summary="$reports/summary.md"
if [ ! -f "$summary" ]; then
    echo "gpu-gate: the harness wrote no summary (exit $status); see $reports/harness.log" >&2
    exit $(( status == 0 ? 1 : status ))
fi
{
    echo
    echo "Gate run on $(hostname) in $(( $(date +%s) - start ))s; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
} >> "$summary"
if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then
    cat "$summary" >> "$GITHUB_STEP_SUMMARY"
fi

# "N passed; M failed; K ignored" from libtest's result line.
result="$(grep -E '^test result:' "$reports/harness.log" | tail -1 || true)"
passed="$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$result")"
ignored="$(sed -nE 's/.* ([0-9]+) ignored.*/\1/p' <<<"$result")"
if [ "$status" -ne 0 ]; then
    echo "gpu-gate: FAILED: drift or errors ($result); see $summary" >&2
    exit "$status"
fi
if [ "${passed:-0}" -eq 0 ]; then
    echo "gpu-gate: FAILED: no GPU trial ran ($result); is a GPU visible and the CUDA backend built? See $reports/harness.log" >&2
    exit 1
fi
if [ "${ignored:-0}" -gt 0 ] && [ "${NINFER_GATE_ALLOW_IGNORED:-0}" != 1 ]; then
    echo "gpu-gate: FAILED: $ignored GPU trial(s) ignored (a registered artifact is missing?); set NINFER_GATE_ALLOW_IGNORED=1 to accept that" >&2
    grep -E '^harness: .* ignored' "$reports/harness.log" >&2 || true
    exit 1
fi
echo "gpu-gate: passed ($result)" >&2
