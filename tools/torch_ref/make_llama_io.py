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
The tied files use output = tok_embeddings (the untied model's embedding); the HF twin of a
tied file is hf/model.safetensors without lm_head.weight.

The script also checks the point of the permutation: attention scores under llama2.c's
interleaved RoPE with the original wq/wk equal those under HF's rotate-half RoPE with the
permuted ones.
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402

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
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
