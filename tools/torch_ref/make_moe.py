"""Golden reference for PagedOptim's mixture-of-experts MLP (src/model/moe.h), in float64.

Rerun (deterministic; rewrites tests/golden/moe_<case>.safetensors, or the cases named):

    /usr/bin/python3 tools/torch_ref/make_moe.py [mixtral qwen_raw skewed]

(/usr/bin/python3 has Debian's python3-torch 1.13; the pyenv python3 on PATH has no torch.)

The layer, written here from Hugging Face's MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock
math (transformers models/mixtral/modeling_mixtral.py, models/qwen2_moe/modeling_qwen2_moe.py):

    logits = x Wr^T                                  (router, no bias)
    p      = softmax(logits)                         (in float64 here; f32 in the engine)
    w, sel = topk(p, k); w /= sum(w)                 (Mixtral; Qwen2-MoE norm_topk_prob=False
                                                      keeps w raw: case qwen_raw)
    out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = sel[t, j]

and the losses, whose definitions the engine names (moe.h):

    balance = alpha * E * (1/S) * sum_sequences sum_i f_i * P_i
              f_i = the sequence's slots routed to i / (T k)   (a constant: no gradient)
              P_i = the sequence's mean p[:, i]
    z       = zc * (1/N) * sum_rows logsumexp(logits)^2

The objective differentiated is sum(out * dout) + balance + z, dout fixed. Inputs are drawn in
float32 (what the engine reads), the arithmetic is float64.

Routing is discrete: a row whose sorted top-(k+1) probabilities are closer than MARGIN (in the
float64 values) could flip between float32 and float64, so a seed with such a row is skipped
and the next one tried; metadata "skipped_seeds" says how many, and the test prints it.

Contents of moe_<case>.safetensors (F32 unless noted):
  x [R, C], dout [R, C], router [E, C], experts.<e>.w1 [F, C] (gate), .w3 [F, C] (up),
  .w2 [C, F] (down)                                  inputs (Mixtral's names)
  out [R, C], dx [R, C], grad.router, grad.experts.<e>.w1/w3/w2
  chosen [R, k] I32                                 the experts of each row, by falling p
  balance [1], z [1]                                 the losses' values
  __metadata__  C, F, E, k, B, T (R = B T), router (softmax_topk | softmax_topk_raw),
                aux, z_coef, seed, skipped_seeds
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as Fn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(ROOT, "tests", "golden")
MARGIN = 1e-4

CASES = {
    # Mixtral's router: top 2 of 4, renormalised, both losses on.
    "mixtral": dict(C=16, F=24, E=4, k=2, B=2, T=8, router="softmax_topk", aux=0.01, z_coef=0.001, skew=False),
    # Qwen2-MoE with norm_topk_prob = False: the raw probabilities weigh the experts.
    "qwen_raw": dict(C=16, F=12, E=6, k=2, B=3, T=4, router="softmax_topk_raw", aux=0.02, z_coef=0.0, skew=False),
    # A router pushed away from experts 2 and 3: they get no row (top 1 of 4).
    "skewed": dict(C=8, F=8, E=4, k=1, B=2, T=4, router="softmax_topk", aux=0.01, z_coef=0.001, skew=True),
}


def draw(case, seed):
    g = np.random.default_rng(seed)
    C, F, E, B, T = case["C"], case["F"], case["E"], case["B"], case["T"]
    f32 = lambda *shape, scale=1.0: (g.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    x = f32(B * T, C)
    router = f32(E, C, scale=0.5)
    if case["skew"]:  # rows along u; experts 2 and 3 point away from it
        u = np.ones(C, dtype=np.float32) / np.sqrt(C)
        x = (x + 3.0 * u).astype(np.float32)
        router[2:] = (router[2:] - 4.0 * u).astype(np.float32)
    w1 = f32(E, F, C, scale=C ** -0.5)
    w3 = f32(E, F, C, scale=C ** -0.5)
    w2 = f32(E, C, F, scale=F ** -0.5)
    dout = f32(B * T, C, scale=0.1)
    return dict(x=x, router=router, w1=w1, w3=w3, w2=w2, dout=dout)


def margin_ok(p, k):
    top = torch.sort(p, dim=-1, descending=True).values[:, : k + 1]
    return bool((top[:, :-1] - top[:, 1:]).min() >= MARGIN) if top.shape[1] > k else True


def layer(case, t):
    C, F, E, k, B, T = (case[n] for n in ("C", "F", "E", "k", "B", "T"))
    x, router, w1, w3, w2 = t["x"], t["router"], t["w1"], t["w3"], t["w2"]
    logits = x @ router.T
    p = torch.softmax(logits, dim=-1)
    w, sel = torch.topk(p, k, dim=-1)
    if case["router"] == "softmax_topk":
        w = w / w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.where(sel == e)
        if rows.numel() == 0:
            continue
        h = x[rows]
        y = (Fn.silu(h @ w1[e].T) * (h @ w3[e].T)) @ w2[e].T
        out = out.index_add(0, rows, y * w[rows, slot, None])
    S = B
    balance = torch.zeros((), dtype=torch.float64)
    for q in range(B):
        counts = torch.bincount(sel[q * T:(q + 1) * T].reshape(-1), minlength=E).to(torch.float64)
        f = counts / (T * k)
        P = p[q * T:(q + 1) * T].mean(dim=0)
        balance = balance + (f * P).sum()
    balance = case["aux"] * E / S * balance
    z = case["z_coef"] / (B * T) * (torch.logsumexp(logits, dim=-1) ** 2).sum()
    return out, p, sel, balance, z


def make(name):
    case = CASES[name]
    skipped = 0
    seed = 1000
    while True:
        raw = draw(case, seed)
        t = {n: torch.tensor(v, dtype=torch.float64, requires_grad=n != "dout") for n, v in raw.items()}
        out, p, sel, balance, z = layer(case, t)
        if margin_ok(p.detach(), case["k"]):
            break
        skipped += 1
        seed += 1
    if case["skew"]:
        assert not bool(((sel == 2) | (sel == 3)).any()), "skewed: experts 2 and 3 got rows"
    loss = (out * t["dout"]).sum() + balance + z
    loss.backward()
    E = case["E"]
    f32 = lambda a: a.detach().numpy().astype(np.float32)  # noqa: E731
    tensors = {"x": raw["x"], "dout": raw["dout"], "router": raw["router"], "out": f32(out), "dx": f32(t["x"].grad),
               "grad.router": f32(t["router"].grad), "chosen": sel.numpy().astype(np.int32),
               "balance": np.array([balance.item()], dtype=np.float32), "z": np.array([z.item()], dtype=np.float32)}
    for e in range(E):
        for w in ("w1", "w3", "w2"):
            tensors[f"experts.{e}.{w}"] = raw[w][e]
            tensors[f"grad.experts.{e}.{w}"] = f32(t[w].grad[e])
    meta = {n: case[n] for n in ("C", "F", "E", "k", "B", "T", "router", "aux", "z_coef")}
    meta.update(seed=seed, skipped_seeds=skipped)
    path = os.path.join(GOLDEN, f"moe_{name}.safetensors")
    st_writer.save(path, tensors, {n: str(v) for n, v in meta.items()})
    print(f"{path}: seed {seed} ({skipped} skipped), balance {balance.item():.6g}, z {z.item():.6g}, "
          f"rows per expert {torch.bincount(sel.reshape(-1), minlength=E).tolist()}")


if __name__ == "__main__":
    for n in sys.argv[1:] or list(CASES):
        make(n)
