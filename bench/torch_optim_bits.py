"""The peer of bench/backend/optim_bits_bench.cc: one AdamW step over N
elements in PyTorch on the CPU, at 32 bits (torch.optim.AdamW, foreach) and
at 8 and 4 bits (bitsandbytes' blockwise algorithm and torchao's 4-bit one,
written here in vectorised torch: bitsandbytes has no CPU package in Debian
and pip is not used here; the nearest code by torch.searchsorted on the
midpoints instead of the reference's argmin over all 256 codes, which needs
256 floats of memory per element).

    /usr/bin/python3 bench/torch_optim_bits.py THREADS MILLIONS

Prints one JSON line per width: best milliseconds of 5 steps after a warm-up.
"""
import json
import sys
import time

import torch


def dynamic_map(signed, exp_bits, total_bits):
    data = []
    for i in range(exp_bits):
        k = 2 ** (i + total_bits - 1 - exp_bits) + 1 if signed else 2 ** (i + total_bits - exp_bits) + 1
        b = torch.tensor([0.1 + 0.9 * j / (k - 1) for j in range(k)], dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2
        scale = 10.0 ** (i - (exp_bits - 1))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def quantize(x, code, mids, block):
    b = x.view(-1, block)
    absmax = b.abs().amax(dim=1).clamp_min(1e-12)
    idx = torch.searchsorted(mids, (b / absmax[:, None]).contiguous())
    return idx.to(torch.uint8).view(-1), absmax


def dequantize(codes, absmax, code, block):
    return (code[codes.long()].view(-1, block) * absmax[:, None]).view(-1)


def step_quant(p, g, st, t, maps, block, lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    (mcode, mmids), (vcode, vmids) = maps
    m = dequantize(st["m"], st["am"], mcode, block)
    v = dequantize(st["v"], st["av"], vcode, block)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    denom = (v.sqrt() / bc2 ** 0.5).add_(eps)
    p.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / bc1)
    st["m"], st["am"] = quantize(m, mcode, mmids, block)
    st["v"], st["av"] = quantize(v, vcode, vmids, block)


def best_ms(fn, runs=5):
    fn()
    best = 1e30
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    n = (int(sys.argv[2]) if len(sys.argv) > 2 else 16) << 20
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    p = torch.randn(n) * 0.1
    g = torch.randn(n) * 0.01
    p.grad = g
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    with torch.no_grad():
        ms = best_ms(opt.step)
    print(json.dumps({"bench": "torch_optim_bits", "bits": 32, "ms": ms, "melem_per_s": n / ms / 1e3,
                      "torch": torch.__version__, "threads": threads}))
    for bits, block in ((8, 256), (4, 128)):
        if bits == 8:
            maps = [dynamic_map(True, 7, 8), dynamic_map(False, 7, 8)]
        else:
            maps = [dynamic_map(True, 3, 4), torch.arange(1, 17, dtype=torch.float32) / 16]
        maps = [(c, ((c[:-1] + c[1:]) / 2).contiguous()) for c in maps]
        st = {"m": torch.zeros(n, dtype=torch.uint8), "v": torch.zeros(n, dtype=torch.uint8),
              "am": torch.zeros(n // block), "av": torch.zeros(n // block)}
        t = [0]

        def one():
            t[0] += 1
            step_quant(p.data, g, st, t[0], maps, block)
        with torch.no_grad():
            ms = best_ms(one)
        print(json.dumps({"bench": "torch_optim_bits", "bits": bits, "ms": ms, "melem_per_s": n / ms / 1e3,
                          "torch": torch.__version__, "threads": threads}))


if __name__ == "__main__":
    main()
