#!/usr/bin/env bash
# Cargo's runner for this repository's executables (see .cargo/config.toml).
#
# `cargo test --release -- --kv-dtype fp8` hands the arguments after `--` to every test
# executable. The regression harness (tests/harness.rs) understands --kv-dtype, --artifact,
# --device, --tier and --precision; the standard libtest executables (unit and integration tests) would
# reject them as unknown options. This runner removes those flags, with their values,
# for every test executable except the harness, so one command runs the unit tests plus the
# selected harness trials. Anything that is not a test executable runs untouched.
exe="$1"
shift
name="$(basename "$exe")"
case "$exe" in
  */deps/*)
    case "$name" in
      harness-*) exec "$exe" "$@" ;;
    esac
    args=()
    skip=0
    for a in "$@"; do
      if [ "$skip" = 1 ]; then
        skip=0
        continue
      fi
      case "$a" in
        --kv-dtype | --artifact | --device | --tier | --precision) skip=1 ;;
        --kv-dtype=* | --artifact=* | --device=* | --tier=* | --precision=*) ;;
        *) args+=("$a") ;;
      esac
    done
    exec "$exe" ${args[@]+"${args[@]}"}
    ;;
esac
exec "$exe" "$@"
