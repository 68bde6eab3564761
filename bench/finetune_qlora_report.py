#!/usr/bin/env python3
"""The table of bench/finetune.sh --qlora: reads OUT/qlora.log (GNU time -v around the engine's
run), OUT/qlora-run/metrics.jsonl and OUT/plan-full.json (pagedoptim plan of a full fine-tune of
the same shape and batch), prints peak RSS, seconds per step and the planner's full fine-tune
memory, and a JSON line. Usage: finetune_qlora_report.py OUT PRESET TOKENS R"""
import json
import os
import re
import sys

out, preset, tokens, r = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
log = open(os.path.join(out, "qlora.log")).read()
rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1))
wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log).group(1)
wall_s = sum(float(p) * 60 ** i for i, p in enumerate(reversed(wall.split(":"))))
quant = re.search(r"hold (\d+) MiB quantized; (\d+) MiB of their f32 values given back", log)
steps = [json.loads(l) for l in open(os.path.join(out, "qlora-run", "metrics.jsonl"))]
steps = [m for m in steps if "step_ms" in m]
if not steps:
    sys.exit("finetune_qlora_report.py: no step in metrics.jsonl")
last = steps[-1]
plan = json.load(open(os.path.join(out, "plan-full.json")))
full = plan["compute_peak_bytes"] + plan.get("host_bytes", 0)
gib = 2.0 ** 30
target = 8 * gib
print(f"{preset} QLoRA: NF4 base, r={r} on every block linear, 1 x {tokens} tokens, bf16, "
      f"activation checkpointing, 2 threads ({plan['model']['parameters'] / 1e9:.2f}B parameters)")
print(f"  peak RSS            {rss_kib * 1024 / gib:8.2f} GiB  (target <= 8 GiB: "
      f"{'PASS' if rss_kib * 1024 <= target else 'FAIL'}; GNU time, the whole process)")
print(f"  seconds per step    {last['step_ms'] / 1000:8.1f}      (step {last['step']}: "
      f"{last['tokens_per_s']:.1f} tokens/s, loss {last['loss']:.4f})")
print(f"  whole run           {wall_s:8.1f} s    (start-up, random base, quantization, {len(steps)} steps)")
if quant:
    print(f"  NF4 base            {int(quant.group(1)) / 1024:8.2f} GiB  "
          f"({int(quant.group(2)) / 1024:.2f} GiB of f32 given back)")
print(f"  full fine-tune      {full / gib:8.2f} GiB  (pagedoptim plan: fp32 weights, gradients, Adam, "
      f"activations; fits this machine: {'yes' if plan['fits'] else 'no'})")
print("  LoRA on a bf16 base: not built (without model.quant the base is held in f32: "
      f"{plan['model']['parameters'] * 4 / gib:.1f} GiB)")
print(json.dumps({"preset": preset, "tokens": tokens, "lora_r": int(r), "peak_rss_bytes": rss_kib * 1024,
                  "step_s": round(last["step_ms"] / 1000, 2), "wall_s": round(wall_s, 1),
                  "full_finetune_planned_bytes": full}))
