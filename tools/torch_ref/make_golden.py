"""Golden reference values for PagedOptim's GPT-2 forward/backward and AdamW steps.

Rerun (deterministic; rewrites tests/golden/gpt2_ref.safetensors):

    /usr/bin/python3 tools/torch_ref/make_golden.py

(/usr/bin/python3 has Debian's python3-torch 1.13; the pyenv python3 on PATH has no torch.)

Config: n_layer 2, n_embd 64, n_head 4, vocab 512, seq 32, batch 4. All maths in float64,
stored as float32 ("F32") unless noted. Contents of the file:
  tokens            I32 [B, T+1]   inputs = tokens[:, :T], targets = tokens[:, 1:]
  <name>            F32            initial weights, Hugging Face names, Conv1D [in, out]
  grad.<name>       F32            d(mean loss)/d(param) at the initial weights
  loss0             F32 [1]        loss at the initial weights (loss0_f64: F64 [1])
  losses            F32 [3]        loss before each of the 3 AdamW steps (losses_f64: F64)
  grad_norms        F32 [3]        global grad norm before clipping, per step
  lrs               F32 [3]        learning rate used at each step
  after3.<name>     F32            weights after the 3 steps
  __metadata__      hyperparameters as strings
The initial weights are rounded to float32 first, so the stored weights are exactly the
inputs of the float64 computation. The 3 steps use the SAME batch. AdamW is
torch.optim.AdamW, weight decay only on params with dim >= 2; clip_grad_norm_(grad_clip)
(g *= grad_clip / (norm + 1e-6) when norm > grad_clip) before each step; lr from the
warmup+cosine schedule (tools/torch_ref/gpt2.py: lr_at). torch's AdamW update, step t>=1:
    p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2 import GPT2, lr_at, param_groups  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "tests", "golden", "gpt2_ref.safetensors")

CFG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, seq_len=32, batch_size=4)
HP = dict(lr=1e-3, min_lr=1e-4, warmup_steps=1, steps=3, beta1=0.9, beta2=0.95, eps=1e-8,
          weight_decay=0.1, grad_clip=0.74)
# grad_clip: the initial gradient norm here is ~0.762 (< 1.0), so 1.0 would never clip.
# 0.74 clips step 0 (norm 0.762) but not steps 1 and 2 (0.725, 0.692): both paths, and
# the clipped step-0 gradient lives on in Adam's moments. main() asserts this pattern.
SEED = 1234

_DTYPES = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("int32"): "I32",
           np.dtype("int64"): "I64", np.dtype("uint16"): "U16"}


def write_safetensors(path, tensors, metadata):
    """Minimal safetensors writer: u64 LE header length, JSON header padded with spaces to
    a multiple of 8, then the raw little-endian tensor bytes in header order."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        data = arr.tobytes()
        header[name] = {"dtype": _DTYPES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    inv = {v: k for k, v in _DTYPES.items()}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=inv[info["dtype"]].newbyteorder("<")).reshape(info["shape"])
    return header.get("__metadata__", {}), out


def f32(t):
    return t.detach().to(torch.float32).cpu().numpy()


def finite_difference_check(model, inputs, targets, grads, entries, h=1e-5):
    """Central differences in float64 for a few parameter entries; returns the worst
    error as a multiple of the tolerance 1e-10 + 1e-6*|g| (pass: < 1)."""
    params = dict(model.named_parameters())
    worst = 0.0
    with torch.no_grad():
        for name, idx in entries:
            p = params[name]
            old = p[idx].item()
            p[idx] = old + h
            lp = model(inputs, targets)[1].item()
            p[idx] = old - h
            lm = model(inputs, targets)[1].item()
            p[idx] = old
            fd = (lp - lm) / (2 * h)
            an = grads[name][idx].item()
            err = abs(fd - an) / (1e-10 + 1e-6 * abs(an))
            print(f"  fd check {name}{list(idx)}: analytic {an:+.10e} numeric {fd:+.10e} "
                  f"abs err {abs(fd - an):.1e}")
            worst = max(worst, err)
    return worst


def main():
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    B, T = CFG["batch_size"], CFG["seq_len"]
    model = GPT2(CFG["n_layer"], CFG["n_embd"], CFG["n_head"], CFG["vocab_size"], T).double()
    model.init_weights(generator=gen, std=0.02, random_small=True)
    with torch.no_grad():  # round to float32 so the stored weights are exactly the inputs
        for p in model.parameters():
            p.copy_(p.float().double())
    tokens = torch.randint(0, CFG["vocab_size"], (B, T + 1), generator=gen, dtype=torch.int64)
    inputs, targets = tokens[:, :T], tokens[:, 1:]

    tensors = {"tokens": tokens.to(torch.int32).numpy()}
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        tensors[n] = f32(p)

    # Gradient at the initial weights.
    model.zero_grad(set_to_none=True)
    _, loss0 = model(inputs, targets)
    loss0.backward()
    grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for n in names:
        tensors["grad." + n] = f32(grads0[n])
    tensors["loss0"] = np.array([loss0.item()], dtype=np.float32)
    tensors["loss0_f64"] = np.array([loss0.item()], dtype=np.float64)
    norm0 = torch.sqrt(sum((g * g).sum() for g in grads0.values())).item()

    # Sanity: finite differences on a few entries (float64).
    entries = [("wte.weight", (int(tokens[0, 3]), 5)), ("wpe.weight", (7, 11)),
               ("h.0.attn.c_attn.weight", (3, 70)), ("h.1.mlp.c_proj.bias", (9,)),
               ("h.0.ln_1.weight", (2,)), ("ln_f.bias", (13,)), ("h.1.attn.c_proj.weight", (5, 6))]
    worst = finite_difference_check(model, inputs, targets, grads0, entries)
    assert worst < 1, f"finite-difference check failed: worst error/tolerance {worst:.2f}"

    hp = dict(HP)
    assert norm0 > hp["grad_clip"], f"grad norm {norm0} must exceed grad_clip {hp['grad_clip']}"

    # 3 AdamW steps on the same batch.
    opt = torch.optim.AdamW(param_groups(model, hp["weight_decay"]), lr=hp["lr"],
                            betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])
    losses, norms, lrs = [], [], []
    for step in range(hp["steps"]):
        lr = lr_at(step, hp["lr"], hp["min_lr"], hp["warmup_steps"], hp["steps"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp["grad_clip"]).item()
        opt.step()
        losses.append(loss.item())
        norms.append(norm)
        lrs.append(lr)
    clipped = [n > hp["grad_clip"] for n in norms]
    assert clipped == [True, False, False], f"expected clipping at step 0 only: {norms}"
    tensors["losses"] = np.array(losses, dtype=np.float32)
    tensors["losses_f64"] = np.array(losses, dtype=np.float64)
    tensors["grad_norms"] = np.array(norms, dtype=np.float32)
    tensors["lrs"] = np.array(lrs, dtype=np.float32)
    for n, p in model.named_parameters():
        tensors["after3." + n] = f32(p)

    meta = dict(CFG)
    meta.update(hp)
    meta["seed"] = SEED
    meta["generator"] = "tools/torch_ref/make_golden.py (torch %s, float64 maths)" % torch.__version__
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    write_safetensors(OUT, tensors, meta)

    # Read back and verify.
    meta_r, back = read_safetensors(OUT)
    assert set(back) == set(tensors) and all(np.array_equal(back[k], tensors[k]) for k in tensors)
    assert meta_r["grad_clip"] == str(hp["grad_clip"])

    print(f"wrote {os.path.relpath(OUT, ROOT)} ({os.path.getsize(OUT)} bytes, {len(tensors)} tensors)")
    print(f"  config: {CFG}")
    print(f"  hyperparameters: {hp}")
    print(f"  params: {sum(p.numel() for p in model.parameters())}")
    print(f"  loss0 = {loss0.item():.10f} (ln V = {np.log(CFG['vocab_size']):.6f})")
    print(f"  losses = {[round(x, 8) for x in losses]}")
    print(f"  grad_norms (pre-clip) = {[round(x, 6) for x in norms]}; clipped at grad_clip "
          f"{hp['grad_clip']}: {clipped}")
    print(f"  lrs = {lrs}")
    print(f"  finite-difference check passed: worst error/tolerance {worst:.3f}")


if __name__ == "__main__":
    main()
