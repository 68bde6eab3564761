#!/usr/bin/env python3
"""Writes an llm.c token file of N uniformly random GPT-2 token ids (seed 0):
the data of the speed benchmarks, which measure speed, not learning.
Usage: random_tokens.py OUT [N=2000000] [VOCAB=50257]"""
import random
import struct
import sys

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2_000_000
vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 50257
random.seed(0)
header = [0] * 256
header[0], header[1], header[2] = 20240520, 1, n
with open(out, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack("<%dH" % n, *(random.randrange(vocab) for _ in range(n))))
