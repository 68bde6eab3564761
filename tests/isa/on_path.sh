#!/bin/bash
# on_path.sh PATH BINARY [ARGS...]: runs a test binary with its kernels on one
# instruction-set path (PO_ISA=PATH, docs/isa.md). A path this CPU cannot run
# exits 77, which CTest reports as "Skipped" with the line below: CI prints
# the paths its machine could not check.
path=$1
shift
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
need() {
  for f in "$@"; do
    if [[ "$flags" != *" $f "* ]]; then
      echo "PO_ISA=$path: not run: this CPU lacks $f"
      exit 77
    fi
  done
}
avx512="avx512f avx512cd avx512bw avx512dq avx512vl"
case "$path" in
  avx2) need avx2 fma f16c bmi2 ;;
  avx512) need $avx512 ;;
  avx512bf16) need $avx512 avx512_bf16 ;;
  amx) need $avx512 avx512_bf16 amx_tile amx_bf16 ;;
  *) echo "on_path.sh: unknown path $path"; exit 2 ;;
esac
PO_ISA=$path exec "$@"
