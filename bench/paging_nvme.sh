#!/usr/bin/env bash
# Paged optimizer state on this disk, in one run:
#  (a) fio: sequential O_DIRECT read and write, 1 MiB blocks, queue depth 8,
#      on the file system of the swap directory (io_uring engine);
#  (b) gpt2-124M (fp32, B4 x T256, 1 process x 2 threads), Adam m and v (1 GB)
#      in 8 MiB pages with a compute budget that keeps only a handful resident,
#      the rest on NVMe: the page traffic's read and write bandwidth during the
#      optimizer's sweep against fio's, the prefetch hit rate, the I/O wait,
#      peak RSS against the compute budget;
#  (c) the same model with everything in RAM: step time paged / in RAM
#      (target <= 1.25).
#   bench/paging_nvme.sh [--build DIR] [--dir SWAPDIR] [--steps N]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build; STEPS=5; DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --dir) DIR="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    *) echo "paging_nvme.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
BIN="$BUILD/pagedoptim"
[ -x "$BIN" ] || { echo "paging_nvme.sh: $BIN not found; run scripts/setup first" >&2; exit 1; }
command -v fio >/dev/null || { echo "paging_nvme.sh: fio not installed (scripts/setup installs it)" >&2; exit 1; }
OUT=$(mktemp -d "${DIR:-/tmp}/po_paging.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
/usr/bin/python3 bench/random_tokens.py "$OUT/tokens.bin" 500000

for rw in write read; do
  fio --name=seq$rw --filename="$OUT/fio.bin" --rw=$rw --bs=1M --iodepth=8 --direct=1 \
    --ioengine=io_uring --size=2G --runtime=20 --time_based=0 --output-format=json \
    > "$OUT/fio_$rw.json"
done
rm -f "$OUT/fio.bin"

COMMON=(train -c configs/gpt2-124M-bench.toml --set data.train="$OUT/tokens.bin"
        --set train.steps="$STEPS" --set train.threads=2 --set train.checkpoint_interval=0)
"$BIN" "${COMMON[@]}" --set run.dir="$OUT/ram" > "$OUT/ram.log" 2>&1 \
  || { echo "in-RAM run failed:"; tail -5 "$OUT/ram.log"; exit 1; }
PAGED=(--set memory.nvme_dir="$OUT/swap" --set memory.page_size=8MiB)
# The smallest compute budget the engine accepts (it names it), plus 4 pages.
MIN=$("$BIN" "${COMMON[@]}" "${PAGED[@]}" --set memory.compute_budget=1 --set run.dir="$OUT/probe" 2>&1 \
      | sed -n 's/.*at least \([0-9]*\) bytes.*/\1/p' | head -1 || true)
[ -n "$MIN" ] || { echo "no minimum compute budget named"; exit 1; }
BUDGET=$((MIN + 4 * 8388608))
"$BIN" "${COMMON[@]}" "${PAGED[@]}" --set memory.compute_budget="$BUDGET" --set run.dir="$OUT/paged" \
  > "$OUT/paged.log" 2>&1 || { echo "paged run failed:"; tail -5 "$OUT/paged.log"; exit 1; }
grep -A6 "paged optimizer state" "$OUT/paged.log" | sed 's/^/  /'

/usr/bin/python3 - "$OUT" "$BUDGET" <<'PY'
import json, sys
out, budget = sys.argv[1], int(sys.argv[2])
def fio(rw):
    j = json.load(open(f"{out}/fio_{rw}.json"))["jobs"][0][rw]
    return j["bw_bytes"]
fr, fw = fio("read"), fio("write")
def recs(run, key):
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if f'"{key}"' in l]
ram = recs("ram", "loss")[1:]     # the first step pays one-time costs
paged = recs("paged", "loss")[1:]
pg = [r["paging"] for r in recs("paged", "paging")][1:]
ms = lambda rs: sum(r["step_ms"] for r in rs) / len(rs)
t_ram, t_paged = ms(ram), ms(paged)
rd = sum(p["nvme_read_bytes"] for p in pg); wr = sum(p["nvme_written_bytes"] for p in pg)
sweep = sum(p["pass_ms"] for p in pg) / 1000
wait = sum(p["io_wait_ms"] for p in pg) / len(pg)
hit = sum(p["prefetch_hit_rate"] for p in pg) / len(pg)
rss = paged[-1]["peak_rss_bytes"]
GB = 1e9
print(f"fio (O_DIRECT, 1 MiB, QD 8): read {fr/GB:.2f} GB/s, write {fw/GB:.2f} GB/s")
print(f"page traffic per step: read {rd/len(pg)/GB:.2f} GB, written {wr/len(pg)/GB:.2f} GB; "
      f"optimizer sweep {sweep/len(pg)*1000:.0f} ms/step")
print(f"during the sweep: read {rd/sweep/GB:.2f} GB/s = {rd/sweep/fr:.2f} of fio, "
      f"write {wr/sweep/GB:.2f} GB/s = {wr/sweep/fw:.2f} of fio "
      f"(reads and writes share the disk: together {(rd+wr)/sweep/GB:.2f} GB/s)")
print(f"prefetch hit rate {hit:.3f}; I/O wait {wait:.0f} ms/step")
print(f"peak RSS {rss/GB:.2f} GB vs compute budget {budget/GB:.2f} GB (ratio {rss/budget:.2f})")
print(f"step time: in RAM {t_ram:.0f} ms, optimizer state on NVMe {t_paged:.0f} ms -> "
      f"{t_paged/t_ram:.3f}x   (target <= 1.25: {'PASS' if t_paged/t_ram <= 1.25 else 'FAIL'})")
print(json.dumps({"bench": "paging_nvme", "fio_read": fr, "fio_write": fw, "read_bytes": rd,
                  "written_bytes": wr, "sweep_s": sweep, "hit_rate": hit, "io_wait_ms": wait,
                  "peak_rss": rss, "budget": budget, "step_ms_ram": t_ram, "step_ms_paged": t_paged}))
PY
