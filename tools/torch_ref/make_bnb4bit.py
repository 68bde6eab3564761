"""A Hugging Face "-bnb-4bit" checkpoint of the golden Llama, written with numpy and the stdlib.

Rerun (deterministic; rewrites tests/golden/bnb4bit_llama/):

    /usr/bin/python3 tools/torch_ref/make_bnb4bit.py

What transformers' save_pretrained writes for a model loaded with BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True): every linear layer of the blocks is a
bitsandbytes Linear4bit, whose state dict (Linear4bit._save_to_state_dict, QuantState.as_dict(packed=True))
is, for module M:

    M.weight                                   U8 [(n + 1) / 2, 1]  the NF4 codes, two to a byte, high nibble first
    M.weight.absmax                            U8 [blocks]          the block absmaxes' 8-bit codes (double quantization)
    M.weight.quant_map                         F32 [16]             the NF4 values
    M.weight.nested_absmax                     F32 [blocks / 256]   the absmax codes' own absmaxes
    M.weight.nested_quant_map                  F32 [256]            the signed dynamic map
    M.weight.quant_state.bitsandbytes__nf4     U8 [bytes]           json.dumps of {"quant_type", "blocksize", "dtype",
                                                                    "shape", "nested_blocksize", "nested_dtype",
                                                                    "nested_offset"} as bytes

The codes are make_nf4.py's numpy port of bitsandbytes' quantize_4bit (the engine's own NF4 gives them bit
for bit: tests/optim/nf4_test.cc). The embedding, the norms and the head are stored as F32 (a real
checkpoint stores them in its torch_dtype), and config.json carries transformers' quantization_config.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_nf4  # noqa: E402
import st_writer  # noqa: E402
from make_golden import read_safetensors  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(ROOT, "tests", "golden")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def main():
    meta, tensors = read_safetensors(os.path.join(GOLDEN, "llama_ref_kv2.safetensors"))
    n = lambda k: int(float(meta[k]))  # noqa: E731
    out = {}
    names = [k for k in tensors if k.startswith("model.") or k == "lm_head.weight"]
    quantized = {"model.layers.%d.%s.weight" % (l, m) for l in range(n("n_layer")) for m in LINEARS}
    for name in names:
        w = np.asarray(tensors[name], dtype=np.float32)
        if name not in quantized:
            out[name] = w
            continue
        packed, absmax_codes, nested, offset, _ = make_nf4.quantize_4bit(w.reshape(-1))
        out[name] = np.asarray(packed, dtype=np.uint8).reshape(-1, 1)
        out[name + ".absmax"] = np.asarray(absmax_codes, dtype=np.uint8)
        out[name + ".quant_map"] = np.asarray(make_nf4.NF4, dtype=np.float32)
        out[name + ".nested_absmax"] = np.asarray(nested, dtype=np.float32)
        out[name + ".nested_quant_map"] = np.asarray(make_nf4.SIGNED8, dtype=np.float32)
        state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(w.shape),
                 "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": float(offset)}
        out[name + ".quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
    assert len(quantized - set(names)) == 0
    d = os.path.join(GOLDEN, "bnb4bit_llama")
    os.makedirs(d, exist_ok=True)
    st_writer.save(os.path.join(d, "model.safetensors"), out, {"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": n("n_embd"),
        "intermediate_size": n("ffn_hidden"), "max_position_embeddings": n("seq_len"), "model_type": "llama",
        "num_attention_heads": n("n_head"), "num_hidden_layers": n("n_layer"),
        "num_key_value_heads": n("n_kv_head"), "rms_norm_eps": float(meta["norm_eps"]),
        "rope_theta": float(meta["rope_theta"]), "tie_word_embeddings": bool(n("tie")),
        "torch_dtype": "float32", "vocab_size": n("vocab_size"),
        "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                                "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8"},
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    print("wrote tests/golden/bnb4bit_llama: %d tensors, %d quantized modules" % (len(out), len(quantized)))


if __name__ == "__main__":
    main()
