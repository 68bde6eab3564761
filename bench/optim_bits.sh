#!/usr/bin/env bash
# The AdamW step at 32, 8 and 4 bits of state (optim.state_bits), in RAM, in
# one run: ours (bench/backend/optim_bits_bench.cc, GB/s against a STREAM
# triad measured in the same process) and PyTorch's on the same element
# count and threads (bench/torch_optim_bits.py: torch.optim.AdamW at 32
# bits, bitsandbytes' and torchao's blockwise algorithms in vectorised torch
# at 8 and 4). Prints each width's step time, elements per second, the ratio
# ours / torch, and ours against the memory bandwidth (target >= 0.8).
# Not measured yet: Adam state paged to NVMe at 8 bits (paging quantized state
# is not built: plan/capabilities.cc refuses it).
#   bench/optim_bits.sh [--build DIR] [--threads N] [--millions M]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; THREADS=2; MILLIONS=16
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --millions) MILLIONS="$2"; shift 2 ;;
    *) echo "optim_bits.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/bench/optim_bits_bench"
[ -x "$BIN" ] || { echo "optim_bits.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
OURS=$("$BIN" "$THREADS" "$MILLIONS")
TORCH=$(/usr/bin/python3 bench/torch_optim_bits.py "$THREADS" "$MILLIONS")
echo "$OURS" | grep -v '^{'
echo "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $THREADS threads, ${MILLIONS}M elements"
/usr/bin/python3 - "$OURS" "$TORCH" <<'PY'
import json, sys
ours = {r["bits"]: r for r in map(json.loads, (l for l in sys.argv[1].splitlines() if l.startswith("{")))}
torch = {r["bits"]: r for r in map(json.loads, (l for l in sys.argv[2].splitlines() if l.startswith("{")))}
print(f"{'bits':>4} {'ours ms':>9} {'torch ms':>9} {'ours/torch speed':>17} {'ours GB/s':>10} {'of triad':>9}")
for b in (32, 8, 4):
    o, t = ours[b], torch[b]
    print(f"{b:>4} {o['ms']:>9.2f} {t['ms']:>9.2f} {t['ms'] / o['ms']:>16.2f}x {o['gbs']:>10.1f} "
          f"{o['gbs'] / o['triad_gbs']:>8.0%}")
print(f"torch {torch[32]['torch']}; memory bandwidth (triad) {ours[32]['triad_gbs']:.1f} GB/s")
PY
