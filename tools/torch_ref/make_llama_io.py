"""Fixtures for the Llama import/export tests (tests/checkpoint/{hf_llama,llama2c}_test.cc).

Rerun (deterministic; rewrites tests/golden/llama_io/):

    /usr/bin/python3 tools/torch_ref/make_llama_io.py

A tiny Llama (dim 16, hidden 40, 2 layers, 4 heads, 2 kv heads, vocab 32, seq_len 8) with
random weights in Meta's / llama2.c's layout (interleaved RoPE), written:
  l2c_legacy.bin, l2c_legacy_tied.bin   llama2.c export.py legacy_export (v0): 7 x int32
                                        header, negative vocab_size when untied, freq_cis
  l2c_v1.bin, l2c_v1_tied.bin           export.py version1_export: 256-byte header
  hf/model.safetensors + hf/config.json the untied model as transformers saves it: HF names,
                                        wq/wk permuted by llama2.c's hf_export permute_original
                                        (= transformers' convert_llama_weights_to_hf permute),
                                        metadata {"format": "pt"}, written by st_writer.py
                                        (byte-identical to the safetensors library's output)
  hf/model_bf16.safetensors, hf/model_f16.safetensors   the same tensors cast by torch
  ref_logits.safetensors                reference logits for TOKENS (below), in float64 stored as F32:
                                        tokens I32 [T]; llama2c.untied, llama2c.tied F32 [T, V] from a
                                        transcription of llama2.c's run.c forward (interleaved RoPE on
                                        the unpermuted weights, one position at a time with a KV
                                        cache); hf.untied, hf.tied F32 [T, V] from tools/torch_ref/
                                        llama.py (transformers' rotate-half RoPE) on the HF twin's
                                        permuted weights
The tied files use output = tok_embeddings (the untied model's embedding); the HF twin of a
tied file is hf/model.safetensors without lm_head.weight.

The script also checks the point of the permutation: attention scores under llama2.c's
interleaved RoPE with the original wq/wk equal those under HF's rotate-half RoPE with the
permuted ones.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402
from llama import Llama  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "tests", "golden", "llama_io")

DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 16, 40, 2, 4, 2, 32, 8
HS = DIM // HEADS
THETA = 10000.0


def make_model(seed=1234):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g) * scale).to(torch.float32)

    m = {"tok_embeddings": randn(VOCAB, DIM), "norm": 1 + randn(DIM, scale=0.1),
         "output": randn(VOCAB, DIM), "layers": []}
    for _ in range(LAYERS):
        m["layers"].append({
            "attention_norm": 1 + randn(DIM, scale=0.1), "ffn_norm": 1 + randn(DIM, scale=0.1),
            "wq": randn(HEADS * HS, DIM), "wk": randn(KV_HEADS * HS, DIM),
            "wv": randn(KV_HEADS * HS, DIM), "wo": randn(DIM, HEADS * HS),
            "w1": randn(HIDDEN, DIM), "w2": randn(DIM, HIDDEN), "w3": randn(HIDDEN, DIM)})
    return m


def freqs_cis(end):
    # llama2.c model.py precompute_freqs_cis(dim // n_heads, max_seq_len)
    freqs = 1.0 / (THETA ** (torch.arange(0, HS, 2)[: (HS // 2)].float() / HS))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.cos(freqs), torch.sin(freqs)


def fp32(f, t):
    f.write(t.detach().contiguous().view(-1).to(torch.float32).numpy().astype("<f4").tobytes())


def legacy_export(m, path, shared):
    # export.py legacy_export: weights grouped by type over all layers
    with open(path, "wb") as f:
        vocab = VOCAB if shared else -VOCAB
        f.write(struct.pack("<iiiiiii", DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, vocab, SEQ))
        fp32(f, m["tok_embeddings"])
        for key in ["attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"]:
            for layer in m["layers"]:
                fp32(f, layer[key])
        fp32(f, m["norm"])
        cos, sin = freqs_cis(SEQ * 2)
        fp32(f, cos[:SEQ])
        fp32(f, sin[:SEQ])
        if not shared:
            fp32(f, m["output"])


def version1_export(m, path, shared):
    with open(path, "wb") as f:
        f.write(struct.pack("<I", 0x616B3432))
        f.write(struct.pack("<i", 1))
        f.write(struct.pack("<iiiiiii", DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ))
        f.write(struct.pack("B", int(shared)))
        f.write(b"\0" * (256 - f.tell()))
        weights = [*[l["attention_norm"] for l in m["layers"]], *[l["ffn_norm"] for l in m["layers"]],
                   m["norm"], m["tok_embeddings"]]
        for key in ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]:
            weights += [l[key] for l in m["layers"]]
        if not shared:
            weights.append(m["output"])
        for w in weights:
            fp32(f, w)


def permute_original(w, n_heads, dim1, dim2):
    # llama2.c export.py hf_export
    return w.view(dim1, dim2).reshape(n_heads, dim1 // n_heads // 2, 2, dim2) \
        .transpose(1, 2).reshape(dim1, dim2)


def hf_state_dict(m):
    sd = {"model.embed_tokens.weight": m["tok_embeddings"], "model.norm.weight": m["norm"],
          "lm_head.weight": m["output"]}
    for i, l in enumerate(m["layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = l["attention_norm"]
        sd[p + "self_attn.q_proj.weight"] = permute_original(l["wq"], HEADS, DIM, DIM)
        sd[p + "self_attn.k_proj.weight"] = permute_original(l["wk"], KV_HEADS, KV_HEADS * HS, DIM)
        sd[p + "self_attn.v_proj.weight"] = l["wv"]
        sd[p + "self_attn.o_proj.weight"] = l["wo"]
        sd[p + "post_attention_layernorm.weight"] = l["ffn_norm"]
        sd[p + "mlp.gate_proj.weight"] = l["w1"]
        sd[p + "mlp.down_proj.weight"] = l["w2"]
        sd[p + "mlp.up_proj.weight"] = l["w3"]
    return sd


def check_rope_equivalence(m):
    x = torch.randn(SEQ, DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    cos, sin = [t.double() for t in freqs_cis(SEQ)]
    l = m["layers"][0]

    def interleaved(v, nh):  # llama2.c model.py apply_rotary_emb
        v = v.view(SEQ, nh, HS // 2, 2)
        r, i = v[..., 0], v[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack([r * c - i * s, r * s + i * c], dim=-1).view(SEQ, nh, HS)

    def rotate_half(v, nh):  # transformers apply_rotary_pos_emb
        v = v.view(SEQ, nh, HS)
        c = torch.cat([cos, cos], dim=-1)[:, None, :]
        s = torch.cat([sin, sin], dim=-1)[:, None, :]
        rot = torch.cat([-v[..., HS // 2:], v[..., : HS // 2]], dim=-1)
        return v * c + rot * s

    def scores(q, k):
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    q0, k0 = x @ l["wq"].double().T, x @ l["wk"].double().T
    sd = hf_state_dict(m)
    q1 = x @ sd["model.layers.0.self_attn.q_proj.weight"].double().T
    k1 = x @ sd["model.layers.0.self_attn.k_proj.weight"].double().T
    a = scores(interleaved(q0, HEADS), interleaved(k0, KV_HEADS))
    b = scores(rotate_half(q1, HEADS), rotate_half(k1, KV_HEADS))
    err = (a - b).abs().max().item()
    assert err < 1e-10, f"RoPE conventions disagree by {err}"


# The token sequence of ref_logits.safetensors (< VOCAB, SEQ long).
TOKENS = [1, 7, 30, 2, 19, 0, 25, 12]


def run_c_logits(m, tokens):
    """llama2.c run.c's forward(), position by position, in float64: RMSNorm (eps 1e-5),
    interleaved RoPE on the original (unpermuted) wq/wk rows, grouped-query attention over a
    KV cache, SwiGLU, the classifier. Returns [T, V]."""
    d = lambda t: t.detach().double()  # noqa: E731
    kv_dim = KV_HEADS * HS
    kv_mul = HEADS // KV_HEADS
    key_cache = torch.zeros(LAYERS, len(tokens), kv_dim, dtype=torch.float64)
    value_cache = torch.zeros_like(key_cache)

    def rmsnorm(x, w):
        ss = (x * x).sum() / x.numel() + 1e-5
        return d(w) * (x / torch.sqrt(ss))

    out = []
    for pos, token in enumerate(tokens):
        x = d(m["tok_embeddings"][token]).clone()
        for li, l in enumerate(m["layers"]):
            xb = rmsnorm(x, l["attention_norm"])
            q, k, v = d(l["wq"]) @ xb, d(l["wk"]) @ xb, d(l["wv"]) @ xb
            for i in range(0, DIM, 2):  # RoPE: rotate pairs (i, i+1) of q and, below kv_dim, k
                head_dim = i % HS
                freq = 1.0 / (THETA ** (head_dim / HS))
                val = pos * freq
                fcr, fci = math.cos(val), math.sin(val)
                for vec in ([q, k] if i < kv_dim else [q]):
                    v0, v1 = vec[i].item(), vec[i + 1].item()
                    vec[i], vec[i + 1] = v0 * fcr - v1 * fci, v0 * fci + v1 * fcr
            key_cache[li, pos], value_cache[li, pos] = k, v
            xb = torch.zeros(DIM, dtype=torch.float64)
            for h in range(HEADS):
                qh = q[h * HS:(h + 1) * HS]
                kvh = (h // kv_mul) * HS
                att = torch.stack([(qh * key_cache[li, t, kvh:kvh + HS]).sum() / math.sqrt(HS)
                                   for t in range(pos + 1)])
                att = torch.softmax(att, dim=0)
                xb[h * HS:(h + 1) * HS] = sum(att[t] * value_cache[li, t, kvh:kvh + HS]
                                              for t in range(pos + 1))
            x = x + d(l["wo"]) @ xb
            xb = rmsnorm(x, l["ffn_norm"])
            hb, hb2 = d(l["w1"]) @ xb, d(l["w3"]) @ xb
            hb = hb * (1.0 / (1.0 + torch.exp(-hb))) * hb2
            x = x + d(l["w2"]) @ hb
        x = rmsnorm(x, m["norm"])
        out.append(d(m["output"]) @ x)
    return torch.stack(out)


def hf_logits(sd, tied, tokens):
    """tools/torch_ref/llama.py (the HF math) on the HF state dict, float64. Returns [T, V]."""
    model = Llama(LAYERS, DIM, HEADS, KV_HEADS, HIDDEN, VOCAB, SEQ, norm_eps=1e-5,
                  rope_theta=THETA, tie_embeddings=tied).double()
    state = {k: v.double() for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens]))
    return logits[0]


def reference_logits(m, tied_m, sd):
    out = {"tokens": np.array(TOKENS, dtype=np.int32)}
    for name, mm, tied in [("untied", m, False), ("tied", tied_m, True)]:
        a, b = run_c_logits(mm, TOKENS), hf_logits(sd, tied, TOKENS)
        err = (a - b).abs().max().item()
        assert err < 1e-10, f"run.c and the HF math disagree by {err} ({name})"
        out["llama2c." + name] = a.numpy().astype(np.float32)
        out["hf." + name] = b.numpy().astype(np.float32)
    return out


def config_json():
    c = {"architectures": ["LlamaForCausalLM"], "hidden_size": DIM, "intermediate_size": HIDDEN,
         "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": SEQ,
         "rms_norm_eps": 1e-5, "rope_theta": THETA, "tie_word_embeddings": False,
         "model_type": "llama", "hidden_act": "silu", "torch_dtype": "float32"}
    return json.dumps(c, indent=2, sort_keys=True) + "\n"


def raw(t, dtype, name):
    a = t.detach().contiguous().to(dtype)
    bits = a.view(torch.int16).numpy().astype("<i2").tobytes() if dtype != torch.float32 else \
        a.numpy().astype("<f4").tobytes()
    return (name, list(a.shape), bits)


def main():
    os.makedirs(os.path.join(OUT, "hf"), exist_ok=True)
    m = make_model()
    check_rope_equivalence(m)
    legacy_export(m, os.path.join(OUT, "l2c_legacy.bin"), shared=False)
    version1_export(m, os.path.join(OUT, "l2c_v1.bin"), shared=False)
    tied = dict(m, output=m["tok_embeddings"])
    legacy_export(tied, os.path.join(OUT, "l2c_legacy_tied.bin"), shared=True)
    version1_export(tied, os.path.join(OUT, "l2c_v1_tied.bin"), shared=True)

    sd = hf_state_dict(m)
    for suffix, dtype, name in [("", torch.float32, "F32"), ("_bf16", torch.bfloat16, "BF16"),
                                ("_f16", torch.float16, "F16")]:
        tensors = {k: raw(v, dtype, name) for k, v in sd.items()}
        st_writer.save(os.path.join(OUT, "hf", f"model{suffix}.safetensors"), tensors,
                       {"format": "pt"})
    with open(os.path.join(OUT, "hf", "config.json"), "w") as f:
        f.write(config_json())
    st_writer.save(os.path.join(OUT, "ref_logits.safetensors"), reference_logits(m, tied, sd),
                   {"tokens": " ".join(map(str, TOKENS))})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
