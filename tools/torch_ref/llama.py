"""Plain PyTorch Llama: the model PagedOptim implements for arch = "llama", written here
from the Hugging Face Llama math (transformers' modeling_llama.py) for clarity.

Used by tools/torch_ref/make_golden_llama.py (golden values for the engine's tests).
Runs on PyTorch 1.13 (Debian's python3-torch): invoke it with /usr/bin/python3.

Model (must match the engine exactly):
  x = embed_tokens[idx]                               (no position table)
  L blocks, pre-norm:
    x = x + o_proj(attn(input_layernorm(x)))
    x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),  h = post_attention_layernorm(x)
  RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight     (no bias, no mean subtraction)
  attn: q = q_proj(h) [NH heads], k = k_proj(h), v = v_proj(h) [NKV heads each], head size
        hs = C / NH; rotate-half RoPE on q and k at positions 0..T-1 with
        inv_freq[i] = 1 / theta^(2i / hs), i < hs/2, angle = t * inv_freq, and
        rope(x) = x * cos + rotate_half(x) * sin, cos/sin repeated over both halves,
        rotate_half([x1, x2]) = [-x2, x1];
        grouped-query: kv head j serves query heads j*G .. j*G+G-1, G = NH / NKV
        (repeat_interleave over the head dim, transformers' repeat_kv);
        causal softmax(q k^T / sqrt(hs)) v, heads concatenated, o_proj.
  model.norm, logits = norm(x) @ W^T with W = lm_head.weight, or embed_tokens.weight when
  tied; loss = mean cross-entropy over B*T. No biases, no dropout.

Linear weights are nn.Linear's [out, in] (y = x @ W^T), under Hugging Face names:
model.embed_tokens.weight, model.layers.N.{input_layernorm, post_attention_layernorm}.weight,
model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.mlp.{gate,up,down}_proj.weight,
model.norm.weight, lm_head.weight (untied only).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2 import attention_mask  # noqa: E402  (the scripts put this directory on sys.path)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(T, hs, theta, dtype=torch.float64):
    """cos, sin [T, hs], each half repeated (transformers' LlamaRotaryEmbedding), computed
    in float64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    t = torch.arange(T, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [T, hs/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, heads, T, hs]; cos, sin [T, hs]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, n_kv_head, theta):
        super().__init__()
        assert n_embd % n_head == 0 and n_head % n_kv_head == 0
        self.n_head, self.n_kv_head, self.hs = n_head, n_kv_head, n_embd // n_head
        self.theta = theta
        self.q_proj = nn.Linear(n_embd, n_head * self.hs, bias=False)
        self.k_proj = nn.Linear(n_embd, n_kv_head * self.hs, bias=False)
        self.v_proj = nn.Linear(n_embd, n_kv_head * self.hs, bias=False)
        self.o_proj = nn.Linear(n_head * self.hs, n_embd, bias=False)

    def forward(self, x, positions=None):
        B, T, C = x.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.hs
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = self.k_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # [B, nkv, T, hs]
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)
        cos, sin = rope_cos_sin(T, hs, self.theta, x.dtype)
        if positions is not None:  # packed rows: each token at its own position
            cos, sin = cos[positions][:, None], sin[positions][:, None]  # [B, 1, T, hs]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = nh // nkv  # query head h reads kv head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = F.softmax(att.masked_fill(attention_mask(T, positions, x.device), float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, nh * hs)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd, ffn_hidden):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, n_kv_head, ffn_hidden, eps, theta):
        super().__init__()
        self.input_layernorm = RMSNorm(n_embd, eps)
        self.self_attn = Attention(n_embd, n_head, n_kv_head, theta)
        self.post_attention_layernorm = RMSNorm(n_embd, eps)
        self.mlp = MLP(n_embd, ffn_hidden)

    def forward(self, x, positions=None):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Decoder(nn.Module):
    """Holds the "model." part of the names (transformers' LlamaModel)."""

    def __init__(self, n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size, eps, theta):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.ModuleList([Block(n_embd, n_head, n_kv_head, ffn_hidden, eps, theta)
                                     for _ in range(n_layer)])
        self.norm = RMSNorm(n_embd, eps)

    def forward(self, idx, positions=None):
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, positions)
        return self.norm(x)


class Llama(nn.Module):
    def __init__(self, n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size, seq_len,
                 norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False):
        super().__init__()
        self.seq_len, self.tie = seq_len, tie_embeddings
        self.model = Decoder(n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size,
                             norm_eps, rope_theta)
        self.lm_head = None if tie_embeddings else nn.Linear(n_embd, vocab_size, bias=False)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.tie else self.lm_head.weight

    def init_weights(self, generator=None, std=0.02, random_small=False):
        """Matrices ~ N(0, std). With random_small, RMSNorm weights ~ 1 + 0.1*N(0,1) (so
        their gradients are exercised in tests); otherwise 1."""
        with torch.no_grad():
            for _, p in self.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std)
                elif random_small:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator,
                                                    dtype=torch.float64))
                else:
                    p.fill_(1.0)

    def forward(self, idx, targets=None, positions=None):
        """positions [B, T]: packed rows (gpt2.attention_mask); targets -1 are ignored."""
        assert idx.shape[1] <= self.seq_len
        logits = self.model(idx, positions) @ self.head_weight().t()
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss
