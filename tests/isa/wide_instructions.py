#!/usr/bin/python3
"""Fails if an AVX-512 or AMX instruction sits outside the dispatched kernels.

Usage: wide_instructions.py BINARY...

The engine is built for x86-64-v3; only the kernel builds of the avx512 and
avx512bf16 paths (namespaces po::backend::cpu::avx512 and ::avx512bf16,
backend/cpu/kernel_isa.h) may hold wider instructions, and they run only
where cpuid says they can. An instruction is AVX-512 when it is EVEX-encoded
(in 64-bit mode an instruction whose first byte after the address-size and
segment prefixes is 0x62), AMX when it is one of the tile instructions. The
scan must find EVEX code in the kernels themselves, or it proves nothing.
"""
import re
import subprocess
import sys

ALLOWED = re.compile(r"po::backend::cpu::avx512(bf16)?::")
AMX = re.compile(r"^(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilerelease|tilezero|tdp)")
PREFIXES = {"67", "2e", "36", "3e", "26", "64", "65"}


def scan(binary):
    out = subprocess.run(["objdump", "-d", "-C", "--insn-width=15", binary], check=True,
                         capture_output=True, text=True).stdout
    wide, fn = {}, None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
            continue
        parts = line.split("\t")
        if fn is None or len(parts) < 3:
            continue
        raw = parts[1].split()
        while raw and raw[0] in PREFIXES:
            raw = raw[1:]
        mnemonic = parts[2].split()[0] if parts[2].split() else ""
        if (raw and raw[0] == "62") or AMX.match(mnemonic):
            wide.setdefault(fn, parts[2].strip())
    return wide


def main():
    status = 0
    for binary in sys.argv[1:]:
        wide = scan(binary)
        inside = [f for f in wide if ALLOWED.search(f)]
        outside = [f for f in wide if not ALLOWED.search(f)]
        print(f"{binary}: {len(inside)} functions with AVX-512 code, all in the avx512/avx512bf16 "
              f"kernels" if not outside else f"{binary}: {len(outside)} functions outside the "
              f"dispatched kernels hold AVX-512 or AMX instructions:")
        for f in outside[:40]:
            print(f"  {f}: {wide[f]}")
        if outside:
            status = 1
        if not inside:
            print(f"{binary}: no EVEX instruction found even in the avx512 kernels: the scan is broken")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
