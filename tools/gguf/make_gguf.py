"""GGUF test fixtures written by numpy (gguf_np.py), independent of the C++
reader and writer in src/checkpoint/gguf*.

    /usr/bin/python3 tools/gguf/make_gguf.py [goldens] [--out DIR]
        writes DIR (default tests/golden/gguf/), deterministically:
        blocks.gguf              alignment 64; every metadata value type; one
                                 tensor per ggml type (t.*, numpy shape [4, 512]),
                                 random K-quant blocks (raw.*, [2, 256]), t.vec
                                 F32 [7], t.cube F32 [2, 3, 4]
        blocks_ref.safetensors   each tensor decoded by numpy, same name and
                                 shape; src.NAME the float32 source of each
                                 converted or quantized t.* tensor
        l2c_v1.gguf, l2c_v1_tied.gguf
                                 tests/golden/llama_io/l2c_v1{,_tied}.bin with
                                 llama.cpp's Llama names, F32, rows as stored
        gpt2_ref.gguf, gpt2_ref_q8_0.gguf, gpt2_ref_q4_0.gguf
                                 tests/golden/gpt2_ref.safetensors' model as
                                 convert_hf_to_gguf's GPT2Model writes it
        gpt2_ref_q8_0_dequant.safetensors, gpt2_ref_q4_0_dequant.safetensors
                                 those files' tensors decoded by numpy, in the
                                 HF names and layout of gpt2_ref.safetensors
    make_gguf.py check [--dir DIR]
        re-reads the goldens and checks them against their sources
    make_gguf.py tokenizer-llama --bin tokenizer.bin --out FILE
        a tensor-less GGUF with llama.cpp's SentencePiece ("llama") tokenizer
        keys from a llama2.c tokenizer.bin
    make_gguf.py tokenizer-gpt2 --encoder encoder.json --bpe vocab.bpe --out FILE
        the same for GPT-2's byte-level BPE ("gpt2")
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "torch_ref"))
import gguf_np as g  # noqa: E402
import st_writer  # noqa: E402

f32 = np.float32
GOLDEN = os.path.join(ROOT, "tests", "golden")


# ------------------------------------------------------------ blocks.gguf

def _f16_midpoints(rng, n, lo_bits, hi_bits):
    """n float32 values exactly halfway between consecutive f16 values whose
    bit patterns lie in [lo_bits, hi_bits) (positive), random signs."""
    h = rng.integers(lo_bits, hi_bits, n).astype("<u2")
    a = h.view("<f2").astype(np.float64)
    b = (h + 1).astype("<u2").view("<f2").astype(np.float64)
    sign = rng.choice([-1.0, 1.0], n)
    return (sign * (a + b) / 2).astype(f32)  # 12 significant bits: exact in float32


def _tie_row(rng):
    """Row 3: uniform in [-1e-3, 1e-3], with blocks of exact rounding ties:
    elements 0-127 (Q8_0 blocks 0-3): amax = 127 * 2^-k so d = 2^-k and x/d is
    an integer + 0.5 (roundf: away from zero) or the float32 just below 0.5;
    elements 128-255 (Q4_0 blocks 4-7): max = -8s or +8s (d = +-s, s = 2^-13),
    x/d + 8.5 an exact integer or a float32 sum that rounds up to one, and
    |max| tied between a positive and a negative element (the first wins);
    elements 256-383: f16 midpoints (normal and subnormal) and bf16 midpoints
    (low 16 bits 0x8000), both even and odd below; 384-511 plain."""
    x = rng.uniform(-1e-3, 1e-3, 512).astype(f32)
    below_half = np.nextafter(f32(0.5), f32(0))
    for b, k, sign in [(0, 17, 1), (1, 18, -1), (2, 17, -1), (3, 20, 1)]:
        s = f32(2.0 ** -k)
        blk = (rng.integers(-127, 127, 32) + 0.5).astype(f32) * s   # |x/d| <= 126.5
        blk[0] = sign * 127 * s                                    # amax: d = s exactly
        blk[1], blk[2] = 0.5 * s, -0.5 * s                         # roundf -> 1, -1
        blk[3], blk[4] = 2.5 * s, -2.5 * s                         # -> 3, -3 (not banker's 2, -2)
        blk[5], blk[6] = below_half * s, -below_half * s           # -> 0, 0
        blk[7] = -sign * 127 * s                                   # |amax| twice
        x[32 * b:32 * b + 32] = blk
    s = f32(2.0 ** -13)
    for b, first in [(4, -8), (5, 8), (6, -8), (7, 8)]:
        # x = (m + 0.5) * s with m in [-8, 7]: x*id + 8.5 = m + 9 when d = s
        blk = (rng.integers(-8, 8, 32) + 0.5).astype(f32) * s
        blk[0] = first * s                 # the max (|x| = 8s), first of two
        blk[9] = -first * s                # same |x|, opposite sign: not chosen
        # x/d = m + 0.5 - ulp: the float32 sum x/d + 8.5 rounds up to m + 9
        # (exact arithmetic would truncate to m + 8)
        for i, m in enumerate((0, 2, 3, 6)):
            blk[1 + i] = (1 if first < 0 else -1) * np.nextafter(f32(m + 0.5), f32(0)) * s
        x[32 * b:32 * b + 32] = blk
    x[256:304] = _f16_midpoints(rng, 48, 0x0400, 0x1418)   # normal f16 below ~1e-3
    x[304:336] = _f16_midpoints(rng, 32, 0x0001, 0x03FF)   # subnormal f16
    u = x[336:384].view("<u4")                              # bf16 ties
    x[336:384] = ((u & 0xFFFF0000) | 0x8000).view(f32)
    return x


def make_source(rng):
    """[4, 512] float32: normal*0.02; normal*3 with an outlier 40; zeros; ties."""
    x = np.zeros((4, 512), f32)
    x[0] = rng.standard_normal(512) * 0.02
    x[1] = rng.standard_normal(512) * 3
    x[1, rng.integers(0, 512)] = 40.0
    x[3] = _tie_row(rng)
    return x


def _raw_k_blocks(rng, type_name, f16_offsets, cases):
    """Two blocks of random bytes whose f16 fields (at `f16_offsets` of each
    block) hold finite values of the kinds in cases[block][field]:
    'neg' a negative normal, 'sub' a subnormal (random sign), 'pos' normal."""
    size = g.TYPES[type_name][2]
    raw = rng.integers(0, 256, (2, size), dtype=np.uint8)
    for blk, kinds in enumerate(cases):
        for off, kind in zip(f16_offsets, kinds):
            mant = int(rng.integers(1, 1 << 10))
            if kind == "sub":
                bits = mant | (int(rng.integers(0, 2)) << 15)
            else:
                bits = (int(rng.integers(1, 31)) << 10) | mant | ((kind == "neg") << 15)
            raw[blk, off:off + 2] = np.array([bits], "<u2").view(np.uint8)
    return raw.tobytes(), (2, 256)


def blocks_metadata():
    """blocks.gguf's metadata: one key per value type, five arrays."""
    return [
        ("general.architecture", "str", "blocks-test"),
        ("test.u8", "u8", 200),
        ("test.i8", "i8", -100),
        ("test.u16", "u16", 60000),
        ("test.i16", "i16", -30000),
        ("test.u32", "u32", 4000000000),
        ("test.i32", "i32", -2000000000),
        ("test.f32", "f32", 3.14159),   # not an f32 value: stored rounded
        ("test.bool", "bool", True),
        ("test.str", "str", "héllo wörld ✓ 日本語 🤖"),
        ("test.u64", "u64", (1 << 63) + 12345),          # > 2^53 and > INT64_MAX
        ("test.i64", "i64", -((1 << 53) + 1)),           # < -2^53
        ("test.f64", "f64", 2.718281828459045),
        ("test.arr_u32", ("arr", "u32"), [0, 1, 4294967295, 123456]),
        # no integral floats: JSON writers print 2.0 as "2" or "2.0"
        ("test.arr_f32", ("arr", "f32"), [0.5, -1.5, 1e-7, 3.4028234663852886e38, -2.75e-3]),
        ("test.arr_str", ("arr", "str"), ["a", "", "ünï", "with space", "日本", "<0x0A>"]),
        ("test.arr_i8", ("arr", "i8"), [-128, -1, 0, 127]),
        ("test.arr_empty", ("arr", "u32"), []),
    ]


def write_blocks(out):
    rng = np.random.default_rng(20240601)
    kv = blocks_metadata()
    tensors, ref = [], {}
    for name, t in [("t.f32", "F32"), ("t.f16", "F16"), ("t.bf16", "BF16"), ("t.q8_0", "Q8_0"),
                    ("t.q4_0", "Q4_0"), ("t.q4_k", "Q4_K"), ("t.q6_k", "Q6_K")]:
        x = make_source(rng)
        tensors.append((name, t, x))
        if t != "F32":
            ref["src." + name] = x
    tensors.append(("raw.q4_k", "Q4_K", _raw_k_blocks(rng, "Q4_K", (0, 2), [("neg", "sub"), ("sub", "neg")])))
    tensors.append(("raw.q6_k", "Q6_K", _raw_k_blocks(rng, "Q6_K", (208,), [("neg",), ("sub",)])))
    tensors.append(("t.vec", "F32", rng.standard_normal(7).astype(f32)))
    tensors.append(("t.cube", "F32", rng.standard_normal((2, 3, 4)).astype(f32)))
    path = os.path.join(out, "blocks.gguf")
    g.write_gguf(path, kv, tensors, alignment=64)
    for t in g.read_gguf(path)["tensors"]:
        ref[t["name"]] = g.tensor_f32(t)
    st_writer.save(os.path.join(out, "blocks_ref.safetensors"), ref,
                   {"generator": "tools/gguf/make_gguf.py (numpy decoding of blocks.gguf)"})


# ----------------------------------------------------------- llama2.c files

def read_llama2c_v1(path):
    """A llama2.c version-1 checkpoint (export.py version1_export; see
    src/checkpoint/llama2c.h): 256-byte header (u32 magic "ak42", i32 version,
    i32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len,
    u8 shared_classifier, zeros), then float32 arrays in this order:
    rms_att [L,C], rms_ffn [L,C], rms_final [C], tok_embeddings [V,C],
    wq [L,C,C], wk [L,KV,C], wv [L,KV,C], wo [L,C,C], w1 [L,F,C], w2 [L,C,F],
    w3 [L,F,C], output [V,C] (only when not shared)."""
    buf = open(path, "rb").read()
    magic, version, C, F, L, H, HKV, V, T = struct.unpack_from("<Ii7i", buf, 0)
    assert magic == 0x616B3432 and version == 1, path
    shared = buf[36]
    KV = HKV * C // H
    shapes = [("rms_att", (L, C)), ("rms_ffn", (L, C)), ("rms_final", (C,)), ("tok", (V, C)),
              ("wq", (L, C, C)), ("wk", (L, KV, C)), ("wv", (L, KV, C)), ("wo", (L, C, C)),
              ("w1", (L, F, C)), ("w2", (L, C, F)), ("w3", (L, F, C))]
    if not shared:
        shapes.append(("output", (V, C)))
    w, off = {}, 256
    for name, shape in shapes:
        n = int(np.prod(shape))
        w[name] = np.frombuffer(buf, "<f4", n, off).astype(f32).reshape(shape)
        off += 4 * n
    assert off == len(buf), f"{path}: {len(buf) - off} bytes left over"
    hp = dict(dim=C, hidden_dim=F, n_layers=L, n_heads=H, n_kv_heads=HKV, vocab_size=V, seq_len=T,
              shared=bool(shared))
    return hp, w


def write_llama2c_gguf(src, dst, name):
    hp, w = read_llama2c_v1(src)
    kv = [("general.architecture", "str", "llama"),
          ("general.name", "str", name),
          ("llama.context_length", "u32", hp["seq_len"]),
          ("llama.embedding_length", "u32", hp["dim"]),
          ("llama.block_count", "u32", hp["n_layers"]),
          ("llama.feed_forward_length", "u32", hp["hidden_dim"]),
          ("llama.attention.head_count", "u32", hp["n_heads"]),
          ("llama.attention.head_count_kv", "u32", hp["n_kv_heads"]),
          ("llama.attention.layer_norm_rms_epsilon", "f32", 1e-5),   # llama2.c's
          ("llama.rope.freq_base", "f32", 10000.0),
          ("llama.rope.dimension_count", "u32", hp["dim"] // hp["n_heads"]),
          ("llama.vocab_size", "u32", hp["vocab_size"])]
    # llama2.c keeps Meta's interleaved-RoPE row order for wq/wk, which is the
    # order llama.cpp stores: rows are copied unpermuted.
    t = [("token_embd.weight", "F32", w["tok"])]
    for i in range(hp["n_layers"]):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", "F32", w["rms_att"][i]),
              (b + "attn_q.weight", "F32", w["wq"][i]),
              (b + "attn_k.weight", "F32", w["wk"][i]),
              (b + "attn_v.weight", "F32", w["wv"][i]),
              (b + "attn_output.weight", "F32", w["wo"][i]),
              (b + "ffn_norm.weight", "F32", w["rms_ffn"][i]),
              (b + "ffn_gate.weight", "F32", w["w1"][i]),
              (b + "ffn_down.weight", "F32", w["w2"][i]),
              (b + "ffn_up.weight", "F32", w["w3"][i])]
    t.append(("output_norm.weight", "F32", w["rms_final"]))
    if not hp["shared"]:
        t.append(("output.weight", "F32", w["output"]))
    g.write_gguf(dst, kv, t)


# ------------------------------------------------------------------ GPT-2

def read_safetensors(path):
    buf = open(path, "rb").read()
    n = struct.unpack_from("<Q", buf)[0]
    header = json.loads(buf[8:8 + n])
    meta = header.pop("__metadata__", None)
    dt = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "F16": "<f2"}
    out = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        out[name] = np.frombuffer(buf[8 + n + b:8 + n + e], dt[h["dtype"]]).reshape(h["shape"])
    return meta, out


# HF GPT-2 name (after h.N.) -> (llama.cpp name after blk.N., Conv1D: stored [in, out])
GPT2_BLOCK = {
    "ln_1.weight": ("attn_norm.weight", False), "ln_1.bias": ("attn_norm.bias", False),
    "attn.c_attn.weight": ("attn_qkv.weight", True), "attn.c_attn.bias": ("attn_qkv.bias", False),
    "attn.c_proj.weight": ("attn_output.weight", True), "attn.c_proj.bias": ("attn_output.bias", False),
    "ln_2.weight": ("ffn_norm.weight", False), "ln_2.bias": ("ffn_norm.bias", False),
    "mlp.c_fc.weight": ("ffn_up.weight", True), "mlp.c_fc.bias": ("ffn_up.bias", False),
    "mlp.c_proj.weight": ("ffn_down.weight", True), "mlp.c_proj.bias": ("ffn_down.bias", False),
}
GPT2_TOP = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
            "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}


def gpt2_tensors(st):
    """[(gguf name, hf name, transposed, f32 array in GGUF layout)] in the
    model's order, plus output.weight (a copy of token_embd: GPT-2 ties them).
    Only the model's tensors of gpt2_ref.safetensors (no grad./after3. etc.);
    attn.bias / attn.masked_bias buffers would be skipped."""
    strip = "transformer." if any(k.startswith("transformer.") for k in st) else ""
    model = {k[len(strip):]: v for k, v in st.items() if k.startswith(strip)}
    out = [(GPT2_TOP["wte.weight"], "wte.weight", False, model["wte.weight"]),
           (GPT2_TOP["wpe.weight"], "wpe.weight", False, model["wpe.weight"])]
    i = 0
    while f"h.{i}.ln_1.weight" in model:
        for hf, (name, conv) in GPT2_BLOCK.items():
            w = model[f"h.{i}.{hf}"]
            out.append((f"blk.{i}.{name}", f"h.{i}.{hf}", conv, np.ascontiguousarray(w.T) if conv else w))
        i += 1
    out += [(GPT2_TOP[k], k, False, model[k]) for k in ("ln_f.weight", "ln_f.bias")]
    out.append(("output.weight", None, False, model["wte.weight"]))
    return [(a, b, c, np.ascontiguousarray(d, dtype=f32)) for a, b, c, d in out], i


def write_gpt2(out):
    meta, st = read_safetensors(os.path.join(GOLDEN, "gpt2_ref.safetensors"))
    tensors, n_layer = gpt2_tensors(st)
    C = tensors[0][3].shape[1]
    kv = [("general.architecture", "str", "gpt2"),
          ("general.name", "str", "gpt2_ref"),
          ("gpt2.context_length", "u32", tensors[1][3].shape[0]),
          ("gpt2.embedding_length", "u32", C),
          ("gpt2.feed_forward_length", "u32", next(t[3].shape[0] for t in tensors if t[0] == "blk.0.ffn_up.weight")),
          ("gpt2.block_count", "u32", n_layer),
          ("gpt2.attention.head_count", "u32", int(meta["n_head"])),
          ("gpt2.attention.layer_norm_epsilon", "f32", 1e-5),
          ("gpt2.vocab_size", "u32", tensors[0][3].shape[0])]
    g.write_gguf(os.path.join(out, "gpt2_ref.gguf"), kv, [(n, "F32", w) for n, _, _, w in tensors])
    for q in ("Q8_0", "Q4_0"):
        path = os.path.join(out, f"gpt2_ref_{q.lower()}.gguf")
        qt = [(n, q if w.ndim == 2 and w.shape[1] % 32 == 0 else "F32", w) for n, _, _, w in tensors]
        g.write_gguf(path, kv, qt)
        back = {t["name"]: g.tensor_f32(t) for t in g.read_gguf(path)["tensors"]}
        deq = {}
        for name, hf, conv, _ in tensors:
            if hf is not None:  # output.weight has no HF tensor (tied to wte)
                deq[hf] = np.ascontiguousarray(back[name].T) if conv else back[name]
        st_writer.save(os.path.join(out, f"gpt2_ref_{q.lower()}_dequant.safetensors"), deq, meta)


# -------------------------------------------------------------- tokenizers

def cmd_tokenizer_llama(args):
    """llama2.c tokenizer.bin: i32 max_token_length, then per piece f32 score,
    i32 byte length, the bytes, to end of file. llama2.c's export wrote "▁" as
    " " and pieces 1 and 2 as "\\n<s>\\n" and "\\n</s>\\n"."""
    buf = open(args.bin, "rb").read()
    pos, tokens, scores = 4, [], []
    while pos < len(buf):
        score, n = struct.unpack_from("<fi", buf, pos)
        piece = buf[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        scores.append(float(score))
        tokens.append(piece)
    tokens = [{1: "<s>", 2: "</s>"}.get(i, p.replace(" ", "\u2581")) for i, p in enumerate(tokens)]

    def kind(i, p):  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 6 byte
        if i == 0:
            return 2
        if i in (1, 2):
            return 3
        if len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            return 6
        return 1
    kv = [("general.architecture", "str", "llama"),
          ("tokenizer.ggml.model", "str", "llama"),
          ("tokenizer.ggml.tokens", ("arr", "str"), tokens),
          ("tokenizer.ggml.scores", ("arr", "f32"), scores),
          ("tokenizer.ggml.token_type", ("arr", "i32"), [kind(i, p) for i, p in enumerate(tokens)]),
          ("tokenizer.ggml.bos_token_id", "u32", 1),
          ("tokenizer.ggml.eos_token_id", "u32", 2),
          ("tokenizer.ggml.unknown_token_id", "u32", 0),
          ("tokenizer.ggml.add_bos_token", "bool", True)]
    g.write_gguf(args.out, kv, [])


def cmd_tokenizer_gpt2(args):
    enc = json.load(open(args.encoder, encoding="utf-8"))
    tokens = [t for t, _ in sorted(enc.items(), key=lambda kv: kv[1])]
    assert [enc[t] for t in tokens] == list(range(len(tokens))), "encoder.json ids are not 0..N-1"
    lines = open(args.bpe, encoding="utf-8").read().split("\n")
    start = 1 if lines and lines[0].startswith("#version") else 0
    merges = [ln for ln in lines[start:] if ln.strip()]
    eot = enc["<|endoftext|>"]
    kv = [("general.architecture", "str", "gpt2"),
          ("tokenizer.ggml.model", "str", "gpt2"),
          ("tokenizer.ggml.tokens", ("arr", "str"), tokens),
          ("tokenizer.ggml.token_type", ("arr", "i32"), [3 if i == eot else 1 for i in range(len(tokens))]),
          ("tokenizer.ggml.merges", ("arr", "str"), merges),
          ("tokenizer.ggml.bos_token_id", "u32", eot),
          ("tokenizer.ggml.eos_token_id", "u32", eot)]
    g.write_gguf(args.out, kv, [])


# ------------------------------------------------------------------ check

def _q8_err_ratio(x, y):
    """Checks Q8_0 decoded y against source x per 32-block: |x - y| <= d/2 +
    127 |d - f16(d)| (d = amax/127, stored as f16); returns max |x - y| / (d/2)."""
    x = x.reshape(-1, 32).astype(np.float64)
    y = y.reshape(-1, 32).astype(np.float64)
    d = np.abs(x).max(axis=1, keepdims=True) / 127
    d16 = d.astype(np.float16).astype(np.float64)
    err = np.abs(x - y)
    assert (err <= d / 2 * 1.0001 + 127 * np.abs(d - d16) + 1e-30).all()
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.nanmax(np.where(d > 0, err / (d / 2), 0)))


def cmd_check(args):
    d = args.dir
    _, ref = read_safetensors(os.path.join(d, "blocks_ref.safetensors"))
    f = g.read_gguf(os.path.join(d, "blocks.gguf"))
    assert f["alignment"] == 64 and f["data_offset"] % 64 == 0
    want = dict((k, (vt, v)) for k, vt, v in blocks_metadata())
    for key, vt, v in f["kv"]:
        if key in want:
            wvt, wv = want[key]
            if wvt == "f32" or wvt == ("arr", "f32"):
                wv = np.array(wv, f32).tolist() if isinstance(wv, list) else float(f32(wv))
            assert (vt, v) == (wvt, wv), (key, vt, v, wvt, wv)
    assert set(want) <= {k for k, _, _ in f["kv"]}
    print(f"blocks.gguf: {len(f['kv'])} keys, {len(f['tensors'])} tensors, data at {f['data_offset']}")
    for t in f["tensors"]:
        y = g.tensor_f32(t)
        assert np.array_equal(y.view(np.uint32), ref[t["name"]].view(np.uint32)), t["name"]
        line = f"  {t['name']:9s} {t['type']:5s} ne={t['ne']} offset={t['offset']}"
        if "src." + t["name"] in ref:
            x = ref["src." + t["name"]]
            # re-encoding the source gives the stored bytes
            assert g.quantize(t["type"], x) == t["raw"], t["name"]
            err = np.abs(y.astype(np.float64) - x)
            rows = [f"{err[r].max() / max(np.abs(x[r]).max(), 1e-30):.2g}" for r in range(4)]
            line += f" max|err|/max|x| per row {rows}"
            bound = {"F16": 2 ** -11, "BF16": 2 ** -8, "Q8_0": 0.57 / 127, "Q4_0": 1 / 8 + 1e-3,
                     "Q4_K": 0.1, "Q6_K": 0.03}[t["type"]]
            for r in (0, 1):
                assert err[r].max() <= bound * np.abs(x[r]).max(), (t["name"], r, rows)
            # row 3 (|x| <= 1e-3): the quantized types' f16 scales are subnormal
            assert err[3].max() <= max(bound, 0.13) * np.abs(x[3]).max(), (t["name"], 3, rows)
            assert not err[2].any()
        print(line)
    # Per block: Q8_0 within half a step plus |q| times the f16 rounding of d;
    # Q4_0 within one step (the element opposite the max clamps to 7d).
    r01 = _q8_err_ratio(ref["src.t.q8_0"][:2], ref["t.q8_0"][:2])
    r3 = _q8_err_ratio(ref["src.t.q8_0"][3], ref["t.q8_0"][3])
    print(f"  t.q8_0 max |err| / (d/2), d = amax/127: rows 0-1 {r01:.4f}, row 3 (f16-subnormal d) {r3:.4f}")
    x = ref["src.t.q4_0"].reshape(-1, 32).astype(np.float64)
    y = ref["t.q4_0"].reshape(-1, 32)
    assert (np.abs(x - y) <= np.abs(x).max(axis=1, keepdims=True) / 8 * 1.002).all()
    for tie in ("", "_tied"):
        hp, w = read_llama2c_v1(os.path.join(GOLDEN, "llama_io", f"l2c_v1{tie}.bin"))
        f = g.read_gguf(os.path.join(d, f"l2c_v1{tie}.gguf"))
        ts = {t["name"]: g.tensor_f32(t) for t in f["tensors"]}
        want = {"token_embd.weight": w["tok"], "output_norm.weight": w["rms_final"]}
        if not hp["shared"]:
            want["output.weight"] = w["output"]
        for i in range(hp["n_layers"]):
            for name, key in [("attn_norm", "rms_att"), ("attn_q", "wq"), ("attn_k", "wk"), ("attn_v", "wv"),
                              ("attn_output", "wo"), ("ffn_norm", "rms_ffn"), ("ffn_gate", "w1"),
                              ("ffn_down", "w2"), ("ffn_up", "w3")]:
                want[f"blk.{i}.{name}.weight"] = w[key][i]
        assert ts.keys() == want.keys() and all(np.array_equal(ts[k], want[k]) for k in ts)
        print(f"l2c_v1{tie}.gguf: {len(ts)} tensors, {len(f['kv'])} keys, equal to the .bin's arrays")
    meta, st = read_safetensors(os.path.join(GOLDEN, "gpt2_ref.safetensors"))
    tensors = gpt2_tensors(st)[0]
    ts = {t["name"]: g.tensor_f32(t) for t in g.read_gguf(os.path.join(d, "gpt2_ref.gguf"))["tensors"]}
    assert list(ts) == [t[0] for t in tensors]
    for name, hf, conv, _ in tensors:
        src = st[hf or "wte.weight"]
        assert np.array_equal(ts[name], src.T if conv else src), name
    print(f"gpt2_ref.gguf: {len(ts)} tensors equal gpt2_ref.safetensors' (Conv1D transposed)")
    for q in ("q8_0", "q4_0"):
        f = g.read_gguf(os.path.join(d, f"gpt2_ref_{q}.gguf"))
        types = {t["name"]: t["type"] for t in f["tensors"]}
        back = {t["name"]: g.tensor_f32(t) for t in f["tensors"]}
        m2, deq = read_safetensors(os.path.join(d, f"gpt2_ref_{q}_dequant.safetensors"))
        assert m2 == meta and set(deq) == {hf for _, hf, _, _ in tensors if hf}
        assert np.array_equal(back["output.weight"], back["token_embd.weight"])
        worst = worst_q8 = 0.0
        for name, hf, conv, w in tensors:
            if hf is None:
                continue
            assert np.array_equal(deq[hf].T if conv else deq[hf], back[name]), name
            worst = max(worst, float(np.abs(back[name] - w).max() / np.abs(w).max()))
            if types[name] == "Q8_0":
                worst_q8 = max(worst_q8, _q8_err_ratio(w, back[name]))
        print(f"gpt2_ref_{q}.gguf: {sorted(set(types.values()))}, dequant matches; "
              f"worst max|err|/max|w| per tensor {worst:.3g}" +
              (f"; Q8_0 max |err| / (d/2) {worst_q8:.4f}" if q == "q8_0" else ""))
    if shutil.which("node"):
        for name in sorted(os.listdir(d)):
            if name.endswith(".gguf"):
                n_kv, n_t = _npm_agrees(os.path.join(d, name))
                print(f"@huggingface/gguf reads {name} alike: {n_kv} keys, {n_t} tensors")
    else:
        print("node not found: @huggingface/gguf comparison skipped")


def _npm_agrees(path):
    """Runs tools/gguf/gguf_meta.mjs (npm's @huggingface/gguf) on `path` and
    checks it reads the same metadata and tensor table as read_gguf."""
    import subprocess
    r = subprocess.run(["node", os.path.join(HERE, "gguf_meta.mjs"), path], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    npm, f = json.loads(r.stdout), g.read_gguf(path)

    def as_npm(vt, v):
        if isinstance(vt, tuple):
            return [as_npm(vt[1], x) for x in v]
        if vt == "str" and v.startswith("\ufeff"):
            return v[1:]  # the library's TextDecoder drops a leading BOM (Llama's piece 30143)
        return str(v) if vt in ("u64", "i64") else v
    assert npm["version"] == 3 and npm["tensor_count"] == str(len(f["tensors"]))
    assert list(npm["metadata"]) == [k for k, _, _ in f["kv"]], path
    for k, vt, v in f["kv"]:
        assert npm["metadata"][k] == as_npm(vt, v), (path, k)
    assert [(t["name"], t["shape"], t["dtype"], int(t["offset"])) for t in npm["tensors"]] == \
        [(t["name"], t["ne"], t["type_id"], t["offset"]) for t in f["tensors"]], path
    return len(f["kv"]), len(f["tensors"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    gp = sub.add_parser("goldens", help="write the GGUF goldens")
    gp.add_argument("--out", default=os.path.join(GOLDEN, "gguf"))
    cp = sub.add_parser("check", help="re-read the goldens and check them")
    cp.add_argument("--dir", default=os.path.join(GOLDEN, "gguf"))
    lp = sub.add_parser("tokenizer-llama", help="tokenizer GGUF from a llama2.c tokenizer.bin")
    lp.add_argument("--bin", required=True)
    lp.add_argument("--out", required=True)
    tp = sub.add_parser("tokenizer-gpt2", help="tokenizer GGUF from GPT-2's encoder.json and vocab.bpe")
    tp.add_argument("--encoder", required=True)
    tp.add_argument("--bpe", required=True)
    tp.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd in (None, "goldens"):
        out = getattr(args, "out", os.path.join(GOLDEN, "gguf"))
        os.makedirs(out, exist_ok=True)
        write_blocks(out)
        for tie in ("", "_tied"):
            write_llama2c_gguf(os.path.join(GOLDEN, "llama_io", f"l2c_v1{tie}.bin"),
                               os.path.join(out, f"l2c_v1{tie}.gguf"), f"l2c_v1{tie}")
        write_gpt2(out)
        for name in sorted(os.listdir(out)):
            print(f"{os.path.getsize(os.path.join(out, name)):>9} {os.path.join(out, name)}")
    elif args.cmd == "check":
        cmd_check(args)
    elif args.cmd == "tokenizer-llama":
        cmd_tokenizer_llama(args)
    else:
        cmd_tokenizer_gpt2(args)


if __name__ == "__main__":
    main()
