"""PyTorch side of the training benchmark (bench/train_vs_torch.sh).

Trains the same model as PagedOptim in fp32 (or with --autocast bf16, PyTorch's CPU
mixed precision) on the CPU: GPT-2 presets with
tools/torch_ref/gpt2.py, Llama presets (stories42M, llama-124M) with bench/torch_llama.py
(the reference Llama's math, tuned: fused q|k|v and gate|up, baddbmm-masked attention), with
what a fair, informed user would do for speed: 2 intra-op threads, AdamW with
foreach=True, set_to_none grads, no autograd overhead outside the step. Runs --warmup
untimed steps then --steps timed ones and prints one JSON line:

  {"engine":"pytorch","preset":...,"tokens_per_s":...,"step_ms":...,"loss":...,"peak_rss_bytes":...}

With --lora R (GPT-2 presets), the model is frozen and every block linear (c_attn,
attn.c_proj, c_fc, mlp.c_proj) gets a LoRA adapter as PEFT's LoraLayer computes it,
h = base(x) + s * (x @ A^T) @ B^T, s = alpha / r: AdamW and clipping over the adapters alone
(the PyTorch side of bench/finetune.sh).

Usage: /usr/bin/python3 bench/torch_train.py --preset bench-small [--data FILE.bin]
(/usr/bin/python3 has Debian's python3-torch 1.13.) The environment (OPENBLAS_*,
GLIBC_TUNABLES, OMP_*) is whatever the caller sets; the wrapper script runs it twice.
"""
import argparse
import json
import os
import resource
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "torch_ref"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2 import GPT2, PRESETS, flops_per_token, param_groups  # noqa: E402
from torch_llama import PRESETS as LLAMA_PRESETS, TunedLlama  # noqa: E402

DEFAULT_BATCH = {"bench-small": 8, "gpt2-124M": 4, "stories42M": 8, "llama-124M": 4}


def load_tokens(path):
    """llm.c token file: 256 int32 header ([0]=20240520, [1]=1, [2]=count), then uint16."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(1024), dtype="<i4")
        if header[0] != 20240520 or header[1] != 1:
            raise SystemExit(f"{path}: not an llm.c token file (magic {header[0]}, version {header[1]})")
        return np.frombuffer(f.read(), dtype="<u2", count=int(header[2])).astype(np.int64)


class LoraConv1D(torch.nn.Module):
    """A frozen GPT-2 Conv1D (y = x @ W + b, W [in, out]) with PEFT's LoRA:
    + s * (x @ A^T) @ B^T, A [r, in] Kaiming-uniform, B [out, r] = 0."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base
        n_in, n_out = base.weight.shape
        self.lora_A = torch.nn.Parameter(torch.empty(r, n_in).uniform_(-n_in ** -0.5, n_in ** -0.5))
        self.lora_B = torch.nn.Parameter(torch.zeros(n_out, r))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scale


def add_lora(model, r, alpha):
    """Freezes `model` and wraps every block linear; returns a module holding the adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = torch.nn.ModuleList()
    for block in model.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                             (block.mlp, "c_proj")):
            wrapped = LoraConv1D(getattr(parent, name), r, alpha)
            setattr(parent, name, wrapped)
            adapters.append(wrapped)
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList([p for a in adapters for p in (a.lora_A, a.lora_B)])
    return holder


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(DEFAULT_BATCH), default="bench-small")
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: 8 bench-small and stories42M, 4 gpt2-124M and llama-124M)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--data", default="", help="llm.c token file (default: random tokens)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--label", default="", help="free text copied into the JSON line")
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none",
                    help="bf16: forward and loss under torch.autocast('cpu', dtype=torch.bfloat16) "
                         "(fp32 master weights and optimizer, as PyTorch's CPU mixed precision does)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on every block linear (0: full training)")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    B, T = args.batch or DEFAULT_BATCH[args.preset], args.seq
    if args.preset in LLAMA_PRESETS:
        L, C, NH, NKV, FF, V = LLAMA_PRESETS[args.preset]
        model = TunedLlama(L, C, NH, NKV, FF, V, T)
    else:
        L, C, NH, V = PRESETS[args.preset]
        model = GPT2(L, C, NH, V, T)
    model.init_weights(std=0.02)
    model.train()
    n_params = model.num_params()
    trainable = model
    n_adapter = 0
    if args.lora:
        if args.preset in LLAMA_PRESETS:
            raise SystemExit("--lora: GPT-2 presets only")
        trainable = add_lora(model, args.lora, args.lora_alpha)
        n_adapter = sum(p.numel() for p in trainable.parameters())

    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    try:
        opt = torch.optim.AdamW(param_groups(trainable, 0.1), foreach=True, **opt_kwargs)
    except TypeError:  # older torch without foreach
        opt = torch.optim.AdamW(param_groups(trainable, 0.1), **opt_kwargs)

    n_total = args.warmup + args.steps
    if args.data:
        toks = load_tokens(args.data)
        if len(toks) and int(toks.max()) >= V:
            raise SystemExit(f"{args.data}: token id {int(toks.max())} >= vocab size {V} of {args.preset}")
        need = n_total * B * T + 1
        if len(toks) < need:
            toks = np.tile(toks, need // max(1, len(toks)) + 1)
        toks = torch.from_numpy(toks[:need].copy())
        batches = [toks[i * B * T:(i + 1) * B * T + 1] for i in range(n_total)]
        batches = [(b[:-1].view(B, T), b[1:].view(B, T)) for b in batches]
    else:
        g = torch.Generator().manual_seed(42)
        batches = []
        for _ in range(n_total):
            b = torch.randint(0, V, (B, T + 1), generator=g)
            batches.append((b[:, :-1].contiguous(), b[:, 1:].contiguous()))

    times, loss_v = [], float("nan")
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if args.autocast == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
        else:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable.parameters(), 1.0)
        opt.step()
        loss_v = loss.item()  # the step is complete (CPU, synchronous)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
        print(f"step {step:3d} loss {loss_v:.4f} {dt * 1000:.0f} ms"
              f"{'' if step >= args.warmup else ' (warm-up)'}", file=sys.stderr, flush=True)

    step_s = sum(times) / len(times)
    tok_s = B * T / step_s
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    fpt = flops_per_token(n_params, L, C, T)
    if args.lora:  # a frozen base: forward and input gradients (4 flops per parameter), adapters 6
        fpt = 4 * n_params + 6 * n_adapter + 12 * L * C * T
    print(json.dumps({
        "engine": "pytorch", "preset": args.preset, "label": args.label, "autocast": args.autocast,
        "tokens_per_s": round(tok_s, 2), "step_ms": round(step_s * 1000, 2), "loss": round(loss_v, 5),
        "batch_size": B, "seq_len": T, "threads": args.threads, "n_params": n_params,
        "flops_per_token": fpt, "gflops": round(tok_s * fpt / 1e9, 2), "peak_rss_bytes": peak,
        "torch": torch.__version__, "lora_r": args.lora, "adapter_params": n_adapter,
    }), flush=True)


if __name__ == "__main__":
    main()
