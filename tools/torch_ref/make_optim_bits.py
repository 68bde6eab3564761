"""Reference values for PagedOptim's 8- and 4-bit AdamW state (optim.state_bits, issue 37).

Rerun (deterministic; rewrites tests/golden/optim_bits_ref.safetensors):

    /usr/bin/python3 tools/torch_ref/make_optim_bits.py

numpy ports, written here, of the published algorithms:
  - the maps: bitsandbytes' create_dynamic_map (functional.py) for 8 bits, signed
    (Adam's m) and unsigned (v); torchao's 4-bit maps (optim/subclass_4bit.py):
    m on create_dynamic_map(signed, 3 exponent bits, 4 bits), v on the linear
    map linspace(0, 1, 17)[1:] (no zero).
  - blockwise quantization: bitsandbytes' PyTorch reference
    (_quantize_blockwise_pytorch: absmax per block, 0 -> 1, the code at
    argmin |x / absmax - code|, the first on a tie) and torchao's
    quantize_4bit_with_qmap (absmax clipped to 1e-12, the lower neighbour by
    binary search, the upper one when the residual is >= half the gap).
  - the steps: bitsandbytes' optimizer_update_8bit_blockwise_pytorch
    ("adam": decay p *= 1 - lr*wd BEFORE the step, addcdiv with the
    unquantized new m and v, then requantize) and torchao's single_param_adam
    (AdamW: p - lr*wd*p, lerp moments, f32 step and lr, then requantize).
    Each is run twice: with the library's own float32 operations ("ref") and
    with adamw_update's ("ours": the C++ kernel's order, unfused). The
    algorithm is the same; a one-ulp difference in a moment now and then
    lands on the other side of a code boundary, which moves that element's
    trajectory (docs/optim_bits.md).

The linspace: create_dynamic_map calls torch.linspace(0.1, 1, k) in float32,
and torch computes it differently per CPU dispatch (this Debian build's
default, AVX2 and AVX-512 kernels give three different maps, 44-45 of 256
entries a unit in the last place apart). The construction here takes the
exact points 0.1 + 0.9 j / (k - 1) rounded to float32 (the C++ uses the same
expression); `torch_signed8` and `torch_unsigned8` record torch's own maps on
this machine, which the test holds within one ulp.

Gradients come from a counter-based hash (splitmix64 of step and element),
so C++ regenerates them exactly: g = (u24 / 2^24 - 0.5) * 2^-(block % 8),
u24 the hash's top 24 bits; element 5 always 0; block 3 all 0; every 37th
step element 700 spikes to 50.
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402

F = np.float32
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "golden",
                   "optim_bits_ref.safetensors")


def linspace32(a, b, k):
    return np.array([a + (b - a) * j / (k - 1) for j in range(k)], dtype=F)


def dynamic_map(signed, max_exponent_bits, total_bits):
    data = []
    non_sign_bits = total_bits - 1
    assert 2 ** (non_sign_bits - max_exponent_bits) - 1 == 0  # no "additional items" here
    for i in range(max_exponent_bits):
        k = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        b = linspace32(0.1, 1.0, k)
        means = (b[:-1] + b[1:]) / F(2)
        scale = F(10.0 ** (-(max_exponent_bits - 1) + i))
        assert 10 ** (-(max_exponent_bits - 1) + i) == 10.0 ** (-(max_exponent_bits - 1) + i)
        data += list(scale * means)
        if signed:
            data += list(-scale * means)
    data += [F(0), F(1)]
    assert len(data) == 2 ** total_bits
    return np.array(sorted(data), dtype=F)


SIGNED8 = dynamic_map(True, 7, 8)
UNSIGNED8 = dynamic_map(False, 7, 8)
SIGNED4 = dynamic_map(True, 3, 4)
UNSIGNED4 = (np.arange(1, 17, dtype=np.float64) / 16).astype(F)


def torch_maps():
    import torch  # only to record torch's own linspace-based maps

    def bnb(signed):
        data = []
        for i in range(7):
            k = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
            b = torch.linspace(0.1, 1, k)
            means = (b[:-1] + b[1:]) / 2.0
            data += ((10 ** (-6 + i)) * means).tolist()
            if signed:
                data += (-(10 ** (-6 + i)) * means).tolist()
        data += [0, 1.0]
        data.sort()
        return np.array(data, dtype=F)
    return bnb(True), bnb(False)


def blocks(x, block):
    n = x.size
    nb = (n + block - 1) // block
    pad = np.zeros(nb * block, dtype=F)
    pad[:n] = x
    return pad.reshape(nb, block), n


def absmax_of(b):
    # torch.max propagates NaN
    a = np.abs(b)
    out = np.max(a, axis=1)
    out[np.isnan(a).any(axis=1)] = np.nan
    return out.astype(F)


def quantize_bnb(x, code, block):
    b, n = blocks(x, block)
    absmax = absmax_of(b)
    absmax[absmax == 0] = F(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = (b / absmax[:, None]).astype(F)
        diff = np.abs(scaled[:, :, None] - code[None, None, :]).astype(F)
    idx = np.argmin(diff, axis=2).astype(np.uint8)  # NaN rows: index 0, as torch
    idx[np.isnan(scaled)] = 0
    return idx.reshape(-1)[:n], absmax


def dequantize(codes, absmax, code, block):
    vals = code[codes.astype(np.int64)]
    b, n = blocks(vals, block)
    return (b * absmax[:, None]).astype(F).reshape(-1)[:n]


def quantize_ao4(x, qmap, block):
    b, n = blocks(x, block)
    scale = absmax_of(b)
    scale = np.where(np.isnan(scale), scale, np.maximum(scale, F(1e-12))).astype(F)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = (b / scale[:, None]).astype(F)
        codes = np.where(s >= qmap[8], 8, 0)
        for step in (4, 2, 1):
            codes = codes + np.where(s >= qmap[codes + step], step, 0)
        up = np.minimum(codes + 1, 15)
        residual = (s - qmap[codes]).astype(F)
        codes = np.where(residual >= ((qmap[up] - qmap[codes]) * F(0.5)).astype(F), up, codes)
    return codes.astype(np.uint8).reshape(-1)[:n], scale


def pack4(codes):
    c = codes.astype(np.uint8)
    if c.size % 2:
        c = np.append(c, np.uint8(0))
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8)


def grads(step, n, tensor):
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (np.uint64(step) << np.uint64(40)) ^ (np.uint64(tensor) << np.uint64(32)) ^ i
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float64)
    g = (u / 2.0 ** 24 - 0.5) * np.exp2(-((i.astype(np.int64) // 256) % 8).astype(np.float64))
    g = g.astype(F)
    g[5] = 0
    g[3 * 256:4 * 256] = 0
    if step % 37 == 0 and n > 700:
        g[700] = F(50)
    return g


# Hyperparameters of the step tests.
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1
STEPS = 100
SIZES = [3000, 4096]  # tensor 0: a tail block (3000 = 11 * 256 + 184); tensor 1 no decay
DECAY = [True, False]


def ours_step(p, m, v, g, step, wd):
    """adamw_update's float32 operations, in its order, unfused (adamw_quant.cc
    is compiled with -ffp-contract=off): what the C++ kernel computes."""
    lr, b1, b2, eps = F(LR), F(B1), F(B2), F(EPS)
    bc1 = 1.0 - float(b1) ** step
    bc2 = 1.0 - float(b2) ** step
    decay = F(1.0 - float(lr) * float(F(wd)))
    neg_step = F(-(float(lr) / bc1))
    bc2_sqrt = F(math.sqrt(bc2))
    omb1, omb2 = F(1.0 - float(b1)), F(1.0 - float(b2))
    pd = (p * decay).astype(F)
    m = (m * b1 + g * omb1).astype(F)
    v = (v * b2 + omb2 * g * g).astype(F)
    denom = (np.sqrt(v) / bc2_sqrt + eps).astype(F)
    return (pd + neg_step * m / denom).astype(F), m, v


def bnb_step(p, m, v, g, step, wd):
    """optimizer_update_8bit_blockwise_pytorch's "adam" branch."""
    m = (m * F(B1) + F(1 - B1) * g).astype(F)
    v = (v * F(B2) + F(1 - B2) * g * g).astype(F)
    bc1 = 1.0 - B1 ** step
    bc2 = 1.0 - B2 ** step
    denom = (np.sqrt(v) / F(math.sqrt(bc2)) + F(EPS)).astype(F)
    if wd > 0:
        p = (p * F(1.0 - LR * wd)).astype(F)
    return (p + F(-LR / bc1) * (m / denom)).astype(F), m, v


def lerp(a, b, w):
    w = F(w)
    return (a + w * (b - a)).astype(F) if w < 0.5 else (b - (b - a) * (F(1) - w)).astype(F)


def ao_step(p, m, v, g, step, wd):
    """torchao's single_param_adam, AdamW: lr and step are float32 tensors."""
    lr = F(LR)
    p = (p - (lr * F(wd)) * p).astype(F)
    st = F(step)
    bc1 = F(1) - F(B1) ** st
    bc2 = F(1) - F(B2) ** st
    m = lerp(m, g, 1 - B1)
    v = lerp(v, (g * g).astype(F), 1 - B2)
    denom = (np.sqrt(v) / np.sqrt(bc2) + F(EPS)).astype(F)
    return (p - lr * (m / bc1) / denom).astype(F), m, v


def quantized(step_fn, quantize, m_map, v_map):
    """One step on quantized state: decode m and v, step_fn, encode again."""
    def run(p, mc, am, vc, av, g, step, wd, block):
        m = dequantize(mc, am, m_map, block)
        v = dequantize(vc, av, v_map, block)
        p, m, v = step_fn(p, m, v, g, step, wd)
        mc, am = quantize(m, m_map, block)
        vc, av = quantize(v, v_map, block)
        return p, mc, am, vc, av
    return run


def main():
    out = {"map.signed8": SIGNED8, "map.unsigned8": UNSIGNED8, "map.signed4": SIGNED4,
           "map.unsigned4": UNSIGNED4}
    ts, tu = torch_maps()
    out["torch_signed8"], out["torch_unsigned8"] = ts, tu

    # Quantization edge cases: a tail block, an all-zero block, -1.0 and 1.0,
    # values on the midpoints between codes, NaN and Inf in blocks of their own.
    rng = np.random.default_rng(37)
    x = rng.standard_normal(1000).astype(F) * F(0.01)
    x[256:512] = 0
    x[600] = F(-1.0)
    x[601] = F(1.0)
    x[602] = F(-1.0)
    mids = ((SIGNED8[:-1] + SIGNED8[1:]) / F(2)).astype(F)
    x[620:620 + 8] = mids[100:108]
    out["q.x"] = x
    out["q8s.codes"], out["q8s.absmax"] = quantize_bnb(x, SIGNED8, 256)
    xa = np.abs(x)
    out["q8u.x"] = xa
    out["q8u.codes"], out["q8u.absmax"] = quantize_bnb(xa, UNSIGNED8, 256)
    q4, a4 = quantize_ao4(x, SIGNED4, 128)
    out["q4s.codes"], out["q4s.absmax"] = pack4(q4), a4
    q4, a4 = quantize_ao4(xa, UNSIGNED4, 128)
    out["q4u.codes"], out["q4u.absmax"] = pack4(q4), a4
    bad = np.full(512, F(0.5), dtype=F)
    bad[3] = np.nan
    bad[300] = np.inf
    bad[301] = -np.inf
    out["bad.x"] = bad
    out["bad8s.codes"], out["bad8s.absmax"] = quantize_bnb(bad, SIGNED8, 256)
    q4, a4 = quantize_ao4(bad, SIGNED4, 128)
    out["bad4s.codes"], out["bad4s.absmax"] = pack4(q4), a4

    # 100 steps of each: the library's own float32 order ("ref") and
    # adamw_update's ("ours"), from the same initial parameters.
    for bits, block, ref, quantize, maps in ((8, 256, bnb_step, quantize_bnb, (SIGNED8, UNSIGNED8)),
                                             (4, 128, ao_step, quantize_ao4, (SIGNED4, UNSIGNED4))):
        for t, n in enumerate(SIZES):
            p0 = (rng.standard_normal(n) * 0.02).astype(F)
            out[f"adam{bits}.{t}.p0"] = p0
            for order, step_fn in (("ref", ref), ("ours", ours_step)):
                fn = quantized(step_fn, quantize, *maps)
                p = p0.copy()
                nb = (n + block - 1) // block
                # the zero state as both libraries make it: codes 0, scales 0
                mc = np.zeros(n, np.uint8)
                vc = np.zeros(n, np.uint8)
                am = np.zeros(nb, F)
                av = np.zeros(nb, F)
                wd = WD if DECAY[t] else 0.0
                for s in range(1, STEPS + 1):
                    p, mc, am, vc, av = fn(p, mc, am, vc, av, grads(s, n, t), s, wd, block)
                    if s == 1:
                        out[f"adam{bits}.{t}.{order}.p1"] = p
                pre = f"adam{bits}.{t}.{order}."
                out[pre + "p"] = p
                out[pre + "m"] = mc if bits == 8 else pack4(mc)
                out[pre + "v"] = vc if bits == 8 else pack4(vc)
                out[pre + "m_absmax"] = am
                out[pre + "v_absmax"] = av
    meta = {"lr": repr(LR), "beta1": repr(B1), "beta2": repr(B2), "eps": repr(EPS),
            "weight_decay": repr(WD), "steps": str(STEPS)}
    st_writer.save(OUT, out, meta)
    print("wrote", os.path.normpath(OUT), sum(a.nbytes for a in out.values()), "bytes of tensors")
    d8 = np.count_nonzero(ts != SIGNED8), np.count_nonzero(tu != UNSIGNED8)
    print("torch's maps on this machine differ from the exact construction in", d8, "entries")


if __name__ == "__main__":
    main()
