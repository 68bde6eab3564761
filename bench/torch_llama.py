"""A speed-tuned PyTorch Llama for bench/torch_train.py: the same math as
tools/torch_ref/llama.py (RMSNorm, rotate-half RoPE, SwiGLU, causal attention, tied
head, no biases), written the way an informed user tunes it for the CPU on PyTorch 1.13:

  - one fused q|k|v projection and one fused gate|up projection (the engine fuses too);
  - RoPE on q and k in one pass, with cos/sin computed once at construction (fp32);
  - attention scores as one baddbmm that adds the causal -inf mask and applies the
    1/sqrt(hs) scale inside the GEMM (1.13 has no F.scaled_dot_product_attention,
    which arrived in 2.0), then softmax and bmm; grouped-query heads by expand, not a copy;
  - F.linear everywhere, no module-per-op overhead.

check_against_reference() verifies, on a small model, that the loss and every gradient
equal tools/torch_ref/llama.py's to fp32 rounding, so the timed model is the right one.
Weight names differ from the reference's (fused tensors); timing is init-independent.
"""
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    # name: (n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size) -- src/model/config.cc
    "stories42M": (8, 512, 8, 8, 1376, 32000),
    "llama-124M": (12, 768, 12, 12, 2048, 50257),
}
NORM_EPS = 1e-5
ROPE_THETA = 10000.0


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Block(nn.Module):
    def __init__(self, C, nh, nkv, F_, eps):
        super().__init__()
        self.nh, self.nkv, self.hs, self.eps = nh, nkv, C // nh, eps
        hs = self.hs
        self.attn_norm = nn.Parameter(torch.ones(C))
        self.w_qkv = nn.Parameter(torch.empty((nh + 2 * nkv) * hs, C))  # [q; k; v] rows
        self.w_o = nn.Parameter(torch.empty(C, nh * hs))
        self.mlp_norm = nn.Parameter(torch.ones(C))
        self.w_gate_up = nn.Parameter(torch.empty(2 * F_, C))  # [gate; up] rows
        self.w_down = nn.Parameter(torch.empty(C, F_))

    def forward(self, x, cos, sin, mask):
        B, T, C = x.shape
        nh, nkv, hs = self.nh, self.nkv, self.hs
        qkv = F.linear(rms_norm(x, self.attn_norm, self.eps), self.w_qkv)
        qk, v = qkv.split([(nh + nkv) * hs, nkv * hs], dim=-1)
        qk = qk.view(B, T, nh + nkv, hs)
        half = hs // 2
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        q = qk[:, :, :nh].transpose(1, 2)  # [B, nh, T, hs]
        k = qk[:, :, nh:].transpose(1, 2)  # [B, nkv, T, hs]
        v = v.view(B, T, nkv, hs).transpose(1, 2)
        if nkv != nh:  # query head h reads kv head h // (nh / nkv); expand is a view
            g = nh // nkv
            k = k.unsqueeze(2).expand(B, nkv, g, T, hs).reshape(B, nh, T, hs)
            v = v.unsqueeze(2).expand(B, nkv, g, T, hs).reshape(B, nh, T, hs)
        q = q.reshape(B * nh, T, hs)
        k = k.reshape(B * nh, T, hs)
        v = v.reshape(B * nh, T, hs)
        att = torch.baddbmm(mask, q, k.transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(hs))
        y = torch.bmm(F.softmax(att, dim=-1), v)  # [B*nh, T, hs]
        y = y.view(B, nh, T, hs).transpose(1, 2).reshape(B, T, nh * hs)
        x = x + F.linear(y, self.w_o)
        gate, up = F.linear(rms_norm(x, self.mlp_norm, self.eps), self.w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down)


class TunedLlama(nn.Module):
    def __init__(self, n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size, seq_len,
                 norm_eps=NORM_EPS, rope_theta=ROPE_THETA):
        super().__init__()
        self.seq_len, self.eps = seq_len, norm_eps
        hs = n_embd // n_head
        self.embed = nn.Parameter(torch.empty(vocab_size, n_embd))  # tied with the head
        self.layers = nn.ModuleList([Block(n_embd, n_head, n_kv_head, ffn_hidden, norm_eps)
                                     for _ in range(n_layer)])
        self.norm = nn.Parameter(torch.ones(n_embd))
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hs], halves repeated
        # [T, 1, hs]: broadcasts over [B, T, heads, hs]
        self.register_buffer("cos", emb.cos().float().unsqueeze(1), persistent=False)
        self.register_buffer("sin", emb.sin().float().unsqueeze(1), persistent=False)
        mask = torch.full((seq_len, seq_len), float("-inf")).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def init_weights(self, std=0.02, generator=None):
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * std)
                else:
                    p.fill_(1.0)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.seq_len
        cos, sin, mask = self.cos[:T], self.sin[:T], self.mask[:T, :T]
        x = F.embedding(idx, self.embed)
        for block in self.layers:
            x = block(x, cos, sin, mask)
        logits = F.linear(rms_norm(x, self.norm, self.eps), self.embed)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # embedding once (tied)


def check_against_reference(n_kv_head=2):
    """Loss and gradients of TunedLlama == tools/torch_ref/llama.py's on a small model."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools",
                                    "torch_ref"))
    from llama import Llama  # noqa: E402
    L, C, NH, F_, V, T, B = 2, 64, 4, 96, 97, 16, 3
    ref = Llama(L, C, NH, n_kv_head, F_, V, T, tie_embeddings=True)
    g = torch.Generator().manual_seed(7)
    ref.init_weights(generator=g, random_small=True)
    tun = TunedLlama(L, C, NH, n_kv_head, F_, V, T)
    with torch.no_grad():
        tun.embed.copy_(ref.model.embed_tokens.weight)
        tun.norm.copy_(ref.model.norm.weight)
        for t, r in zip(tun.layers, ref.model.layers):
            t.attn_norm.copy_(r.input_layernorm.weight)
            t.mlp_norm.copy_(r.post_attention_layernorm.weight)
            a, m = r.self_attn, r.mlp
            t.w_qkv.copy_(torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
            t.w_o.copy_(a.o_proj.weight)
            t.w_gate_up.copy_(torch.cat((m.gate_proj.weight, m.up_proj.weight)))
            t.w_down.copy_(m.down_proj.weight)
    idx = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)
    _, lr = ref(idx, tgt)
    _, lt = tun(idx, tgt)
    lr.backward()
    lt.backward()
    err = [abs(lr.item() - lt.item())]
    err.append((tun.embed.grad - ref.model.embed_tokens.weight.grad).abs().max().item())
    for t, r in zip(tun.layers, ref.model.layers):
        a, m = r.self_attn, r.mlp
        gq = torch.cat((a.q_proj.weight.grad, a.k_proj.weight.grad, a.v_proj.weight.grad))
        gg = torch.cat((m.gate_proj.weight.grad, m.up_proj.weight.grad))
        for x, y in ((t.w_qkv.grad, gq), (t.w_gate_up.grad, gg), (t.w_o.grad, a.o_proj.weight.grad),
                     (t.w_down.grad, m.down_proj.weight.grad),
                     (t.attn_norm.grad, r.input_layernorm.weight.grad),
                     (t.mlp_norm.grad, r.post_attention_layernorm.weight.grad)):
            err.append((x - y).abs().max().item())
    return max(err)


if __name__ == "__main__":
    for nkv in (4, 2, 1):
        e = check_against_reference(nkv)
        print(f"n_kv_head={nkv}: max |tuned - reference| over loss and gradients = {e:.2e}")
        if e > 1e-5:
            raise SystemExit("tuned Llama disagrees with tools/torch_ref/llama.py")
