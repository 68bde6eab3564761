"""Plain PyTorch GPT-2: the model PagedOptim implements, written for clarity.

Used by tools/torch_ref/make_golden.py (golden values for the engine's tests) and
bench/torch_train.py (the PyTorch side of the training benchmark).

Runs on PyTorch 1.13 (Debian's python3-torch): invoke it with /usr/bin/python3.

Model (must match the engine exactly):
  x = wte[idx] + wpe[pos]
  L blocks, pre-LayerNorm (eps 1e-5):
    x = x + attn(ln_1(x)),  x = x + mlp(ln_2(x))
    attn: qkv = h @ c_attn.weight + c_attn.bias  (C -> 3C; q|k|v along the last axis,
          each split into NH heads of hs = C/NH), causal softmax(q k^T / sqrt(hs)) v,
          heads concatenated, then c_proj (C -> C, bias)
    mlp:  c_fc (C -> 4C, bias), GELU (tanh approximation), c_proj (4C -> C, bias)
  ln_f, logits = ln_f(x) @ wte^T (tied head), loss = mean cross-entropy over B*T.
  No dropout.

Parameter names and layouts follow Hugging Face GPT-2 (Conv1D weights are [in, out],
y = x @ W + b); there are no attn.bias mask buffers.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-5

PRESETS = {
    # name: (n_layer, n_embd, n_head, vocab_size)
    "gpt2-tiny-golden": (2, 64, 4, 512),
    "bench-small": (6, 384, 6, 50257),
    "gpt2-124M": (12, 768, 12, 50257),
}


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: weight [in, out], y = x @ weight + bias."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1])


def attention_mask(T, positions, device):
    """True where a query may not see a key: a later position, and with positions [B, T]
    (packed rows: each example's positions count up from 0) another example of the row
    (block-diagonal causal attention). [T, T], or [B, 1, T, T] with positions."""
    future = torch.ones(T, T, dtype=torch.bool, device=device).triu_(1)
    if positions is None:
        return future
    example = torch.cumsum((positions == 0).long(), dim=1)  # [B, T]
    other = example[:, :, None] != example[:, None, :]
    return (future[None] | other)[:, None]


class Attention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head = n_head
        self.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)

    def forward(self, x, positions=None):
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = k.view(B, T, nh, hs).transpose(1, 2)
        v = v.view(B, T, nh, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(attention_mask(T, positions, x.device), float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = Conv1D(n_embd, 4 * n_embd)
        self.c_proj = Conv1D(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=LN_EPS)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, eps=LN_EPS)
        self.mlp = MLP(n_embd)

    def forward(self, x, positions=None):
        x = x + self.attn(self.ln_1(x), positions)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    def __init__(self, n_layer, n_embd, n_head, vocab_size, seq_len):
        super().__init__()
        self.n_layer, self.n_embd, self.n_head = n_layer, n_embd, n_head
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, eps=LN_EPS)

    def init_weights(self, generator=None, std=0.02, random_small=False):
        """Weights ~ N(0, std). With random_small, biases ~ 0.1*N(0,1) and LayerNorm
        weights ~ 1 + 0.1*N(0,1) (so their gradients are exercised in tests);
        otherwise biases 0 and LayerNorm weights 1 (the usual GPT-2 init)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std)
                elif not random_small:
                    p.fill_(1.0 if (".ln_" in "." + name and name.endswith("weight")) else 0.0)
                elif name.endswith("weight"):  # LayerNorm weight
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=generator, dtype=torch.float64))

    def forward(self, idx, targets=None, positions=None):
        """positions [B, T]: packed rows (attention_mask); targets -1 are ignored."""
        B, T = idx.shape
        assert T <= self.seq_len
        pos = torch.arange(T, device=idx.device) if positions is None else positions
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, positions)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t()  # tied head
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # wte counted once (tied)


def flops_per_token(n_params, n_layer, n_embd, seq_len):
    """Training FLOPs per token: 6*N (N including embeddings, tied head once) + attention 12*L*C*T."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


def param_groups(model, weight_decay):
    """AdamW groups: decay on parameters with dim >= 2, none on biases and LayerNorm."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step, lr, min_lr, warmup_steps, steps, schedule="cosine"):
    """Learning rate for 0-based step `step` of `steps` (linear warmup then cosine to min_lr)."""
    if schedule == "constant":
        return lr
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    ratio = (step - warmup_steps) / max(1, steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)
