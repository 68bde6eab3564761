"""Golden reference values for PagedOptim's Llama forward/backward and AdamW steps.

Rerun (deterministic; rewrites tests/golden/llama_ref_*.safetensors):

    /usr/bin/python3 tools/torch_ref/make_golden_llama.py

(/usr/bin/python3 has Debian's python3-torch 1.13; the pyenv python3 on PATH has no torch.)

The Llama of tools/torch_ref/llama.py at n_layer 2, n_embd 64, n_head 4, ffn_hidden 176,
vocab 512, seq 32, batch 4 (GPT-2 golden's sizes), norm_eps 1e-5, rope_theta 10000, one
file per case:
  llama_ref_kv4.safetensors        n_kv_head 4 (multi-head), untied head
  llama_ref_kv2.safetensors        n_kv_head 2 (grouped-query), untied head
  llama_ref_kv1.safetensors        n_kv_head 1 (multi-query), untied head
  llama_ref_kv2_tied.safetensors   n_kv_head 2, head tied to model.embed_tokens.weight
Contents of each file (as tests/golden/gpt2_ref.safetensors; all maths in float64, stored
as float32 "F32" unless noted):
  tokens            I32 [B, T+1]   inputs = tokens[:, :T], targets = tokens[:, 1:]
  <name>            F32            initial weights, Hugging Face names, [out, in]
  grad.<name>       F32            d(mean loss)/d(param) at the initial weights
  loss0             F32 [1]        loss at the initial weights (loss0_f64: F64 [1])
  losses            F32 [3]        loss before each of the 3 AdamW steps (losses_f64: F64)
  grad_norms        F32 [3]        global grad norm before clipping, per step
  lrs               F32 [3]        learning rate used at each step
  after3.<name>     F32            weights after the 3 steps
  __metadata__      shapes (n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size,
                    seq_len, batch_size, norm_eps, rope_theta, tie = 0|1) and the
                    hyperparameters, as strings
The initial weights are rounded to float32 first, so the stored weights are exactly the
inputs of the float64 computation. Matrices ~ N(0, 0.02), RMSNorm weights 1 + 0.1*N(0, 1)
(so their gradients are exercised). The 3 steps use the SAME batch; AdamW, clipping and
schedule as make_golden.py (torch.optim.AdamW, decay only on tensors with dim >= 2,
clip_grad_norm_ before each step, gpt2.py's lr_at). grad_clip is set per case just below
the initial gradient norm, so step 0 clips; main() asserts that it does and that a later
step does not.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402
from gpt2 import lr_at, param_groups  # noqa: E402
from llama import Llama  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT_DIR = os.path.join(ROOT, "tests", "golden")

CFG = dict(n_layer=2, n_embd=64, n_head=4, ffn_hidden=176, vocab_size=512, seq_len=32,
           batch_size=4, norm_eps=1e-5, rope_theta=10000.0)
HP = dict(lr=1e-3, min_lr=1e-4, warmup_steps=1, steps=3, beta1=0.9, beta2=0.95, eps=1e-8,
          weight_decay=0.1)
# name: (n_kv_head, tied)
CASES = {"kv4": (4, False), "kv2": (2, False), "kv1": (1, False), "kv2_tied": (2, True)}
SEED = 1234


def f32(t):
    return t.detach().to(torch.float32).cpu().numpy()


def finite_difference_check(model, inputs, targets, grads, entries, h=1e-5):
    """Central differences in float64; returns the worst error as a multiple of the
    tolerance 1e-10 + 1e-6*|g| (pass: < 1)."""
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
            worst = max(worst, abs(fd - an) / (1e-10 + 1e-6 * abs(an)))
    return worst


def make_case(name, n_kv_head, tied):
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    B, T = CFG["batch_size"], CFG["seq_len"]
    model = Llama(CFG["n_layer"], CFG["n_embd"], CFG["n_head"], n_kv_head, CFG["ffn_hidden"],
                  CFG["vocab_size"], T, CFG["norm_eps"], CFG["rope_theta"], tied).double()
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

    model.zero_grad(set_to_none=True)
    _, loss0 = model(inputs, targets)
    loss0.backward()
    grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for n in names:
        tensors["grad." + n] = f32(grads0[n])
    tensors["loss0"] = np.array([loss0.item()], dtype=np.float32)
    tensors["loss0_f64"] = np.array([loss0.item()], dtype=np.float64)
    norm0 = torch.sqrt(sum((g * g).sum() for g in grads0.values())).item()

    L = "model.layers."
    entries = [("model.embed_tokens.weight", (int(tokens[0, 3]), 5)),
               (L + "0.self_attn.q_proj.weight", (3, 17)),
               (L + "0.self_attn.k_proj.weight", (9, 2)),
               (L + "1.self_attn.v_proj.weight", (12, 40)),
               (L + "1.self_attn.o_proj.weight", (5, 6)),
               (L + "0.mlp.gate_proj.weight", (100, 7)), (L + "1.mlp.up_proj.weight", (3, 63)),
               (L + "0.mlp.down_proj.weight", (8, 150)), (L + "0.input_layernorm.weight", (2,)),
               (L + "1.post_attention_layernorm.weight", (33,)), ("model.norm.weight", (13,))]
    if not tied:
        entries.append(("lm_head.weight", (int(tokens[1, 4]), 21)))
    worst = finite_difference_check(model, inputs, targets, grads0, entries)
    assert worst < 1, f"{name}: finite-difference check failed: worst error/tolerance {worst:.2f}"

    hp = dict(HP)
    hp["grad_clip"] = float("%.3g" % (0.97 * norm0))  # clips step 0 (asserted below)

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
    assert clipped[0] and not all(clipped), f"{name}: want step 0 clipped, a later one not: {norms}"
    tensors["losses"] = np.array(losses, dtype=np.float32)
    tensors["losses_f64"] = np.array(losses, dtype=np.float64)
    tensors["grad_norms"] = np.array(norms, dtype=np.float32)
    tensors["lrs"] = np.array(lrs, dtype=np.float32)
    for n, p in model.named_parameters():
        tensors["after3." + n] = f32(p)

    meta = dict(CFG)
    meta.update(n_kv_head=n_kv_head, tie=int(tied))
    meta.update(hp)
    meta["seed"] = SEED
    meta["generator"] = ("tools/torch_ref/make_golden_llama.py (torch %s, float64 maths)"
                         % torch.__version__)
    path = os.path.join(OUT_DIR, "llama_ref_%s.safetensors" % name)
    st_writer.save(path, tensors, {k: str(v) for k, v in meta.items()})
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes, "
          f"{len(tensors)} tensors, {sum(p.numel() for p in model.parameters())} params)")
    print(f"  n_kv_head {n_kv_head}, tied {tied}: loss0 {loss0.item():.10f} "
          f"(ln V = {np.log(CFG['vocab_size']):.6f}), losses {[round(x, 8) for x in losses]}")
    print(f"  grad_norms {[round(x, 6) for x in norms]}, grad_clip {hp['grad_clip']}: "
          f"clipped {clipped}; finite differences worst error/tolerance {worst:.3f}")


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    for name, (n_kv_head, tied) in CASES.items():
        make_case(name, n_kv_head, tied)


if __name__ == "__main__":
    main()
