#!/usr/bin/env bash
# The fuzzers under CTest (label fuzz, tests/CMakeLists.txt).
#
#   fuzz/ctest_run.sh build FUZZ_BUILD_DIR TARGET...     bring the fuzz build up to date
#   fuzz/ctest_run.sh run FUZZ_BUILD_DIR TARGET SECONDS  run one fuzzer over its seeds
#
# A missing fuzz build or binary is a failure that says to run scripts/setup,
# never a skip: CI must not pass because the fuzzers were not built. Each run
# starts from a fresh corpus next to the binaries, with fuzz/seeds/TARGET
# read-only beside it (the regression inputs run first, every time); a crash
# is kept in FUZZ_BUILD_DIR/crashes/TARGET/.
set -uo pipefail
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode="${1:?usage: ctest_run.sh build|run FUZZ_BUILD_DIR ...}"
build="${2:?no fuzz build directory given}"
shift 2
hint="run scripts/setup (it builds the fuzzers with clang into $build), or scripts/fuzz --build"

case "$mode" in
  build)
    if [[ ! -f "$build/build.ninja" ]]; then
      echo "FAIL: no fuzz build in $build: $hint" >&2
      exit 1
    fi
    exec ninja -C "$build" "$@"
    ;;
  run)
    target="${1:?no fuzzer given}"
    secs="${2:-5}"
    bin="$build/fuzz/$target"
    if [[ ! -x "$bin" ]]; then
      echo "FAIL: fuzzer $bin not built: $hint" >&2
      exit 1
    fi
    corpus="$build/ctest-corpus/$target"
    crashes="$build/crashes/$target"
    rm -rf "$corpus"
    mkdir -p "$corpus" "$crashes"
    seeds=()
    [[ -d "$src/fuzz/seeds/$target" ]] && seeds=("$src/fuzz/seeds/$target")
    dict=()
    [[ -f "$src/fuzz/$target.dict" ]] && dict=(-dict="$src/fuzz/$target.dict")
    log="$build/$target.ctest.log"
    "$bin" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      "${dict[@]}" -artifact_prefix="$crashes/" "$corpus" "${seeds[@]}" >"$log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
      echo "FAIL: $target exited $rc; log $log, crashing input in $crashes/:" >&2
      tail -40 "$log" >&2
      exit 1
    fi
    grep -E "stat::number_of_executed_units|#[0-9]+ *DONE" "$log" | tail -2
    ;;
  *)
    echo "ctest_run.sh: unknown mode '$mode' (build | run)" >&2
    exit 2
    ;;
esac
