#!/usr/bin/env bash
# Runs blas_compare with OpenBLAS's environment unset and with the CI setting
# (OPENBLAS_CORETYPE=Haswell). Usage: bench/backend/blas_compare.sh BUILD_DIR [threads] [quick|full]
set -euo pipefail
build=${1:?build dir}; threads=${2:-2}; mode=${3:-full}
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$build/bench/blas_compare" "$threads" "$mode"
OPENBLAS_CORETYPE=Haswell "$build/bench/blas_compare" "$threads" "$mode"
