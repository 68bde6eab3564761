#!/usr/bin/env bash
# bench/train_vs_torch.sh measures MFU against the sgemm peak gemm_bench
# measures in the same run. Without that measurement (gemm_bench missing,
# failing, or printing no peak) it must stop with a clear error and a non-zero
# exit, never fall back to a number from another machine.
#
#   tests/bench/train_vs_torch_peak_test.sh SOURCE_DIR
set -uo pipefail
src="${1:?usage: train_vs_torch_peak_test.sh SOURCE_DIR}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/po_peak_test.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
fails=0

# A build directory whose pagedoptim must never be reached: the peak comes first.
mkdir -p "$tmp/build/bench"
printf '#!/bin/sh\necho "pagedoptim should not run before the peak is measured" >&2\nexit 3\n' \
  >"$tmp/build/pagedoptim"
chmod +x "$tmp/build/pagedoptim"

expect_error() {  # name, expected message fragment
  local name="$1" want="$2" out rc
  out="$(bash "$src/bench/train_vs_torch.sh" --presets bench-small --build "$tmp/build" \
         --out "$tmp/out-$name" 2>&1)"
  rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "FAIL $name: exit 0 without a measured peak; output:"; echo "$out"; fails=1
  elif ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL $name: exit $rc but no '$want' in the output:"; echo "$out"; fails=1
  elif grep -qE "347|REFERENCE.md" <<<"$(sed "s|$tmp||g" <<<"$out")"; then
    echo "FAIL $name: a hard-coded peak appears in the output:"; echo "$out"; fails=1
  else
    echo "ok   $name: exit $rc, $(grep -F -- "$want" <<<"$out" | head -1)"
  fi
}

expect_error missing "gemm_bench not found"

printf '#!/bin/sh\necho "illegal instruction" >&2\nexit 132\n' >"$tmp/build/bench/gemm_bench"
chmod +x "$tmp/build/bench/gemm_bench"
expect_error failing "gemm_bench failed (exit 132)"

printf '#!/bin/sh\necho "{\\"bench\\":\\"lm_head\\",\\"gflops\\":10}"\n' >"$tmp/build/bench/gemm_bench"
expect_error no_peak_line "no sgemm_peak line"

printf '#!/bin/sh\necho "{\\"bench\\":\\"sgemm_peak\\",\\"threads\\":2,\\"gflops\\":0.0}"\n' \
  >"$tmp/build/bench/gemm_bench"
expect_error zero_peak "no sgemm_peak line with a positive gflops"

# bf16 rows need the bf16 GEMM's own peak, not the sgemm's.
printf '#!/bin/sh\necho "{\\"bench\\":\\"sgemm_peak\\",\\"threads\\":2,\\"gflops\\":300.0}"\n' \
  >"$tmp/build/bench/gemm_bench"
expect_error no_bf16_peak "no bf16_peak line with a positive gflops"

exit $fails
