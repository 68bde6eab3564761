# Sourced by the one-machine scaling benchmarks (dp_scaling.sh,
# tp_scaling.sh): their arguments (--steps N, --build DIR), the binary, a
# scratch directory with random bench-small tokens, and run NAME ARGS...,
# which trains bench-small (global batch 8 x 256, micro-batch 4) into
# $OUT/NAME with its log in $OUT/NAME.log. Set NAME to the script's name first.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=13; BUILD=build
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    *) echo "$NAME: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "$NAME: $BIN not found; run scripts/setup first" >&2; exit 1; }
OUT=$(mktemp -d "/tmp/po_${NAME%.sh}.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
echo "== ${NAME%.sh}: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin"
common=(-c configs/bench-small.toml --set data.train="$OUT/tokens.bin" --set train.steps="$STEPS"
        --set train.micro_batch_size=4 --set train.checkpoint_interval=0)
run() {  # name, then extra arguments
  local name=$1; shift
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$BIN" train "${common[@]}" --set run.dir="$OUT/$name" \
    "$@" > "$OUT/$name.log" 2>&1 || { echo "$NAME: run $name failed:"; tail -5 "$OUT/$name.log"; exit 1; }
}
