"""Reference values for PagedOptim's NF4 weight codec with double quantization
(src/backend/nf4.h; QLoRA's frozen base).

Rerun (deterministic; rewrites tests/golden/nf4_ref.safetensors; needs numpy
only, torch merely records its own float32 mean when it is installed):

    /usr/bin/python3 tools/torch_ref/make_nf4.py

numpy ports, written here, of bitsandbytes' published algorithms
(bitsandbytes/functional.py and backends/default/ops.py, read at 95f9af3 and
at f0e5b85^, the last default backend with the argmin reference):
  - create_normal_map(offset=0.9677083, use_extra_value=True): Phi^-1 at
    torch.linspace(offset, 0.5, 9)[:-1] (8 positive values) and
    -Phi^-1 at torch.linspace(offset, 0.5, 8)[:-1] (7 negative), 0; each
    rounded to float32 (torch.Tensor(list)), sorted, divided by the max in
    float32. Phi^-1 is statistics.NormalDist().inv_cdf (Wichura's AS241, as
    scipy's ndtri is accurate to ~1e-16; no scipy here). The linspace points
    are torch's CPU formula in float32: step = (end - start) / (k - 1), then
    start + step * i below k // 2 and end - step * (k - 1 - i) from there.
    The exact points (start + (end - start) i / (k - 1), rounded) give
    -0.69619304 for entry 1, an ulp from bitsandbytes' table; torch's give
    the table (get_4bit_type's hard-coded NF4 values) bit for bit, which is
    asserted below.
  - create_dynamic_map(signed=True, 7, 8), the nested map: make_optim_bits.py's
    port (the exact linspace points; bitsandbytes' torch.linspace puts some
    entries an ulp away depending on the CPU, src/backend/quant_map.h).
  - quantize_4bit(A, blocksize=64, compress_statistics=True, quant_type="nf4")
    with the default backend's kernel before f0e5b85 (PR #1960):
      absmax = max |A| per block of 64 (the last block short);
      scaled = clamp(A * (1 / absmax), -1, 1) in float32 (a zero block gives
        0 * inf = NaN, which argmin maps to code 0, as CUDA's dQuantizeNF4
        does: its comparisons are all false);
      code = argmin |scaled - value| in float32, the lowest code on a tie;
      an odd count pads `scaled` with 0.0 (the pad nibble is code 7, NF4's 0);
      two codes a byte, the first element in the high nibble;
      offset = absmax.mean(); absmax - offset quantized by quantize_blockwise
      (blocksize 256, the signed dynamic map: the same absmax, reciprocal,
      clamp and argmin), nested absmax float32.
  - dequantize_4bit: absmax = dynamic[code] * nested_absmax, then + offset
    (two float32 operations); w = nf4[code] * absmax.

The mean: torch's float32 mean sums in an order of its own (a CPU cascade, a
GPU tree), so its last bit is the device's. This port fixes one order: the
float64 sum from the first block to the last, divided by the count in
float64, rounded to float32 (the C++ does the same). `<t>.torch_offset` records
this machine's torch float32 mean for comparison, when torch is present.

Where bitsandbytes' own implementations differ (not taken here): CUDA's
dQuantizeNF4 and the default backend since f0e5b85 cut at the float32
midpoints (x > midpoint goes up), so a value exactly on one of 6 of the 15
midpoints takes the lower code where argmin takes the upper one (block 40
of tensor b probes these); since f0e5b85 the default backend also divides
the last short block by its absmax instead of multiplying by the
reciprocal, and scales a zero block by 1 / 1e-38, which codes it as 7
(value 0) instead of 0.

Tensors (each for t in a, b, c):
  map.nf4 F32[16], map.dynamic_signed8 F32[256]
  <t>.w F32[n]            the input
  <t>.codes U8[(n+1)/2]   packed NF4 codes
  <t>.absmax_codes U8[blocks]
  <t>.nested_absmax F32[ceil(blocks / 256)]
  <t>.offset F32[1]
  <t>.absmax F32[blocks]  the first-level float32 absmax (before double quantization)
  <t>.absmax_deq F32[blocks]  the recovered absmax
  <t>.deq F32[n]          the dequantized weights
  <t>.torch_offset F32[1] (torch present only)
  a: 64*300 normal * 0.02; b: 64*256 + 100 with a zero block (5), outliers,
  a block holding 1.0 and the NF4 midpoints (40), and one whose codes tell
  x * (1 / absmax) from x / absmax (41); c: 37 elements.
"""
import os
import sys
from statistics import NormalDist

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402
from make_optim_bits import dynamic_map  # noqa: E402

F = np.float32
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "golden",
                   "nf4_ref.safetensors")
BLOCK = 64
NESTED_BLOCK = 256

# bitsandbytes' hard-coded NF4 table (functional.py get_4bit_type; backends/utils.py).
BNB_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
           -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
           0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def linspace_torch(start, end, k):
    """torch.linspace(start, end, k) in float32, as its CPU kernel computes it."""
    start, end = F(start), F(end)
    step = F(F(end - start) / F(k - 1))
    half = k // 2
    return [F(start + F(step * F(i))) if i < half else F(end - F(step * F(k - 1 - i)))
            for i in range(k)]


def create_normal_map(offset=0.9677083, use_extra_value=True):
    assert use_extra_value
    ppf = NormalDist().inv_cdf
    v1 = [ppf(float(p)) for p in linspace_torch(offset, 0.5, 9)[:-1]]
    v3 = [-ppf(float(p)) for p in linspace_torch(offset, 0.5, 8)[:-1]]
    v = np.array(sorted(F(x) for x in v1 + [0.0] + v3), dtype=F)  # torch.Tensor(v): float32
    return (v / v.max()).astype(F)


NF4 = create_normal_map()
assert [float(x) for x in NF4] == BNB_NF4, NF4
SIGNED8 = dynamic_map(True, 7, 8)


def nblocks(n, block):
    return (n + block - 1) // block


def quantize_blockwise(x, code, block):
    """Codes (unpacked) and float32 absmax: the argmin reference."""
    n = x.size
    nb = nblocks(n, block)
    codes = np.zeros(n, np.uint8)
    absmax = np.zeros(nb, F)
    for b in range(nb):
        blk = x[b * block:(b + 1) * block]
        a = F(np.max(np.abs(blk)))
        with np.errstate(divide="ignore", invalid="ignore"):
            rcp = F(F(1) / a)  # torch: 1 / absmax, float32 (inf for 0)
            scaled = np.clip((blk * rcp).astype(F), F(-1), F(1))  # NaN stays NaN
            diff = np.abs(scaled[:, None] - code[None, :]).astype(F)
        c = np.argmin(diff, axis=1)  # the first on a tie; a NaN row gives 0 (torch too)
        c[np.isnan(scaled)] = 0
        codes[b * block:(b + 1) * block] = c
        absmax[b] = a
    return codes, absmax


def dequantize_blockwise(codes, absmax, code, block):
    vals = code[codes.astype(np.int64)]
    scale = np.repeat(absmax, block)[:codes.size]
    return (vals * scale).astype(F)


def pack4(codes):
    c = codes.astype(np.uint8)
    if c.size % 2:
        c = np.append(c, np.uint8(7))  # scaled padded with 0.0: NF4's code for 0
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8)


def unpack4(packed, n):
    c = np.empty(packed.size * 2, np.uint8)
    c[0::2] = packed >> 4
    c[1::2] = packed & 0xF
    return c[:n]


def mean_f64(a):
    """The fixed order: float64 running sum, first to last, / count, to float32."""
    return F(np.cumsum(a.astype(np.float64))[-1] / a.size)


def quantize_4bit(w):
    codes, absmax = quantize_blockwise(w, NF4, BLOCK)
    assert absmax.size == nblocks(w.size, BLOCK)
    offset = mean_f64(absmax)
    centred = (absmax - offset).astype(F)
    absmax_codes, nested = quantize_blockwise(centred, SIGNED8, NESTED_BLOCK)
    return pack4(codes), absmax_codes, nested, offset, absmax


def dequantize_4bit(packed, absmax_codes, nested, offset, n):
    absmax = dequantize_blockwise(absmax_codes, nested, SIGNED8, NESTED_BLOCK)
    absmax = (absmax + offset).astype(F)
    return dequantize_blockwise(unpack4(packed, n), absmax, NF4, BLOCK), absmax


def reciprocal_probes(absmax):
    """Values x, |x| < absmax, whose code differs between bitsandbytes' x * (1 / absmax)
    and x / absmax: within 64 ulps of each midpoint times absmax."""
    absmax = F(absmax)
    rcp = F(F(1) / absmax)

    def codes(s):
        return np.argmin(np.abs(np.clip(s, F(-1), F(1))[:, None] - NF4[None, :]).astype(F), axis=1)
    found = []
    for m in ((NF4[:-1] + NF4[1:]) / F(2)).astype(F):
        x0 = F(m * absmax)
        xs = (np.int64(x0.view(np.int32)) + np.arange(-64, 65)).astype(np.int32).view(F)
        differ = codes((xs * rcp).astype(F)) != codes((xs / absmax).astype(F))
        found += list(xs[differ])
    return np.array(found, dtype=F)


def inputs():
    rng = np.random.default_rng(4127)
    a = (rng.standard_normal(64 * 300) * 0.02).astype(F)
    b = (rng.standard_normal(64 * 256 + 100) * 0.02).astype(F)
    b[64 * 5:64 * 6] = 0  # a zero block
    b[64 * 9 + 3] = F(5.0)  # outliers
    b[64 * 130 + 63] = F(-3.0)
    b[64 * 200 + 10] = F(0.75)
    # A block with absmax 1.0 (scaled == w exactly): the float32 midpoints of
    # the map, where argmin and a midpoint cut may differ, and their neighbours.
    mids = ((NF4[:-1] + NF4[1:]) / F(2)).astype(F)
    blk = 64 * 40
    b[blk:blk + 64] = 0
    b[blk] = F(1.0)
    b[blk + 1:blk + 16] = mids
    b[blk + 16:blk + 31] = np.nextafter(mids, F(-2))
    b[blk + 31:blk + 46] = np.nextafter(mids, F(2))
    b[blk + 46:blk + 62] = NF4
    b[blk + 62] = F(-1.0)
    # Block 41: absmax 0.3, whose reciprocal is inexact, and values a division
    # would code otherwise than bitsandbytes' product with the reciprocal.
    probes = reciprocal_probes(0.3)
    assert 0 < probes.size < 63
    blk = 64 * 41
    b[blk] = F(0.3)
    b[blk + 1:blk + 1 + probes.size] = probes
    b[-1] = F(-0.25)  # the short last block (36 elements)
    c = (rng.standard_normal(37) * 0.05).astype(F)
    return {"a": a, "b": b, "c": c}


def torch_mean(a):
    try:
        import torch
    except ImportError:
        return None
    return np.array([torch.from_numpy(a.copy()).mean().item()], dtype=F)


def main():
    out = {"map.nf4": NF4, "map.dynamic_signed8": SIGNED8}
    for name, w in inputs().items():
        packed, absmax_codes, nested, offset, absmax = quantize_4bit(w)
        deq, absmax_deq = dequantize_4bit(packed, absmax_codes, nested, offset, w.size)
        out[f"{name}.w"] = w
        out[f"{name}.codes"] = packed
        out[f"{name}.absmax_codes"] = absmax_codes
        out[f"{name}.nested_absmax"] = nested
        out[f"{name}.offset"] = np.array([offset], dtype=F)
        out[f"{name}.absmax"] = absmax
        out[f"{name}.absmax_deq"] = absmax_deq
        out[f"{name}.deq"] = deq
        tm = torch_mean(absmax)
        if tm is not None:
            out[f"{name}.torch_offset"] = tm
            d = abs(int(tm.view(np.int32)[0]) - int(np.array([offset], F).view(np.int32)[0]))
            print(f"{name}: torch's float32 mean is {d} ulp from the float64 one")
        err = np.max(np.abs(deq - w))
        print(f"{name}: n={w.size} blocks={absmax.size} nested={nested.size} "
              f"offset={offset:.6g} max|w - deq|={err:.3g}")
    st_writer.save(OUT, out, {"blocksize": str(BLOCK), "nested_blocksize": str(NESTED_BLOCK)})
    print("wrote", os.path.normpath(OUT), sum(a.nbytes for a in out.values()), "bytes of tensors")


if __name__ == "__main__":
    main()
