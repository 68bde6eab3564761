"""The PyTorch peer of bench/serve_load.sh: the same model shape (GPT-2 or
Llama, random weights) generating with a KV cache the way a tuned PyTorch
user writes it for the CPU (F.linear, a preallocated cache per layer, one
baddbmm/bmm attention over the cached positions, torch.inference_mode), at
batch 1 and at batch B (static batching: B prompts of one length decoding
together). Prints one JSON line per batch: decode tokens/s (all sequences).

  torch_serve.py --arch gpt2|llama --layers L --embd C --heads H --kv-heads K
                 --ffn F --vocab V --ctx N --prompt P --new N --batch 1,32 --threads T
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    C, H, K, hs, Fh, V, L = a.embd, a.heads, a.kv_heads, a.embd // a.heads, a.ffn, a.vocab, a.layers
    llama = a.arch == "llama"
    r = lambda *s: torch.randn(*s) * 0.02
    wte = r(V, C)
    wpe = None if llama else r(a.ctx, C)
    blocks = []
    for _ in range(L):
        b = {"ln1": torch.ones(C), "ln2": torch.ones(C), "qkv": r((H + 2 * K) * hs, C), "o": r(C, H * hs)}
        if llama:
            b["gu"] = r(2 * Fh, C)
            b["down"] = r(C, Fh)
        else:
            b.update(ln1b=torch.zeros(C), ln2b=torch.zeros(C), qkvb=torch.zeros((H + 2 * K) * hs),
                     ob=torch.zeros(C), fc=r(Fh, C), fcb=torch.zeros(Fh), proj=r(C, Fh), projb=torch.zeros(C))
        blocks.append(b)
    lnf = torch.ones(C)
    lnfb = torch.zeros(C)
    if llama:  # rotate-half RoPE tables
        inv = 1.0 / (10000.0 ** (torch.arange(0, hs, 2).float() / hs))
        ang = torch.outer(torch.arange(a.ctx).float(), inv)
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def norm(x, w, b):
        if llama:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        return F.layer_norm(x, (C,), w, b, 1e-5)

    def rope(x, pos):  # x [B, heads, T, hs]
        c, s = cos[pos], sin[pos]
        x1, x2 = x[..., : hs // 2], x[..., hs // 2:]
        return x * c + torch.cat([-x2, x1], -1) * s

    def forward(tokens, pos0, cache):
        B, T = tokens.shape
        pos = torch.arange(pos0, pos0 + T)
        x = wte[tokens] + (0 if llama else wpe[pos])
        for l, b in enumerate(blocks):
            h = norm(x, b["ln1"], None if llama else b["ln1b"])
            qkv = F.linear(h, b["qkv"], None if llama else b["qkvb"])
            q, k, v = qkv.split([H * hs, K * hs, K * hs], -1)
            q = q.view(B, T, H, hs).transpose(1, 2)
            k = k.view(B, T, K, hs).transpose(1, 2)
            v = v.view(B, T, K, hs).transpose(1, 2)
            if llama:
                q, k = rope(q, pos), rope(k, pos)
            kc, vc = cache[l]
            kc[:, :, pos0:pos0 + T] = k
            vc[:, :, pos0:pos0 + T] = v
            n = pos0 + T
            # Grouped-query attention without copying the cache per query
            # head: the G = H / K query heads of a KV head are stacked as
            # G·T rows against that head's keys and values (query head h
            # reads KV head h // G, as repeat_interleave pairs them).
            G = H // K
            mask = torch.full((T, n), float("-inf")).triu(pos0 + 1).repeat(G, 1)
            att = torch.baddbmm(mask.expand(B * K, G * T, n), q.reshape(B * K, G * T, hs),
                                kc[:, :, :n].reshape(B * K, n, hs).transpose(1, 2), alpha=1.0 / math.sqrt(hs))
            y = torch.bmm(att.softmax(-1), vc[:, :, :n].reshape(B * K, n, hs)).view(B, H, T, hs)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, H * hs), b["o"], None if llama else b["ob"])
            h = norm(x, b["ln2"], None if llama else b["ln2b"])
            if llama:
                g, u = F.linear(h, b["gu"]).chunk(2, -1)
                x = x + F.linear(F.silu(g) * u, b["down"])
            else:
                x = x + F.linear(F.gelu(F.linear(h, b["fc"], b["fcb"]), approximate="tanh"), b["proj"], b["projb"])
        return F.linear(norm(x[:, -1], lnf, None if llama else lnfb), wte)

    with torch.inference_mode():
        for B in [int(x) for x in a.batch.split(",")]:
            cache = [(torch.zeros(B, K, a.ctx, hs), torch.zeros(B, K, a.ctx, hs)) for _ in range(L)]
            prompt = torch.randint(0, V, (B, a.prompt))
            t0 = time.perf_counter()
            nxt = forward(prompt, 0, cache).argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            for i in range(a.new - 1):
                nxt = forward(nxt, a.prompt + i, cache).argmax(-1, keepdim=True)
            t2 = time.perf_counter()
            print(json.dumps({"bench": "torch_serve", "arch": a.arch, "batch": B, "prompt": a.prompt,
                              "new": a.new, "prefill_s": t1 - t0,
                              "decode_tokens_per_s": B * (a.new - 1) / (t2 - t1),
                              "torch": torch.__version__, "threads": a.threads}), flush=True)


if __name__ == "__main__":
    main()
