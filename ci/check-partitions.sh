#!/usr/bin/env bash
# Checks that cargo-nextest's hash partitions spread the regression harness's trials over
# runners correctly: for n = 3 the partitions of the CPU tier are disjoint and together are
# exactly the tests the harness lists itself (its CPU-tier trials and its own gate tests; every
# one a test of its own, selected with --exact). Run by ci/test.sh after `cargo test`; GPU runners partition the same way
# (ci/examples/gpu-gate-matrix.yml).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
nextest="${NINFER_NEXTEST:-$(bash ci/install-nextest.sh)}"
n=3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export NINFER_HARNESS_FLAGS="--tier cpu"
list() { # $1: output file; rest: nextest filter arguments
  local out="$1"; shift
  "$nextest" nextest list --release --test harness --message-format json "$@" > "$out"
}
list "$work/all.json"
for i in $(seq 1 $n); do
  list "$work/part-$i.json" --partition "hash:$i/$n"
done
# The harness's own list (libtest format: "NAME: test").
bin="$(python3 - "$work/all.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
(s,) = [s for s in d["rust-suites"].values() if s["binary-name"] == "harness"]
print(s["binary-path"])
PY
)"
NINFER_HARNESS_FLAGS="--tier cpu" "$bin" --list 2>/dev/null | sed -n 's/: test$//p' | sort > "$work/harness.txt"
python3 - "$work" "$n" <<'PY'
import json, sys
work, n = sys.argv[1], int(sys.argv[2])
def matching(path):
    d = json.load(open(path))
    (s,) = [s for s in d["rust-suites"].values() if s["binary-name"] == "harness"]
    return {name for name, t in s["testcases"].items() if t["filter-match"]["status"] == "matches"}
everything = matching(f"{work}/all.json")
own = set(open(f"{work}/harness.txt").read().split())
parts = [matching(f"{work}/part-{i}.json") for i in range(1, n + 1)]
union = set().union(*parts)
overlap = sum(len(p) for p in parts) - len(union)
ok = everything == own and union == everything and overlap == 0 and all(parts)
print(f"check-partitions: {len(everything)} tests with --tier cpu (the harness lists {len(own)}); "
      f"hash partitions of {n}: {[len(p) for p in parts]}, {overlap} in two, "
      f"{len(everything - union)} in none: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
