"""Golden reference for PagedOptim's LoRA and DoRA adapters (PEFT's math), in float64.

Rerun (deterministic; rewrites tests/golden/lora_*.safetensors, or the cases named):

    /usr/bin/python3 tools/torch_ref/make_lora.py [gpt2 gpt2_dora llama llama_dora gpt2_dropout llama_dropout
                                                   gpt2_nf4 llama_nf4 llama_nf4_dora llama_int8]

(/usr/bin/python3 has Debian's python3-torch 1.13; the pyenv python3 on PATH has no torch.)

The base of each case is a golden model already in tests/golden (its weights and tokens):
GPT-2 from gpt2_ref.safetensors, Llama (grouped-query, untied) from llama_ref_kv2.safetensors.
Every base parameter is frozen. Each targeted linear module (PEFT's rule: the module path
equals the target or ends with "." + target) gets, as PEFT's LoraLayer writes them,

    h = W0 x + b + s * B (A x)                               (LoRA)
    h = b + m / ||W0 + s B A||_row * (W0 x + s B (A x))       (DoRA, the norm detached)

with s = alpha / r (alpha / sqrt(r) under rsLoRA), A [r, in], B [out, r], m [out], the
row norm over the input dimension. GPT-2's Conv1D weights are [in, out] (W0 = W^T).
A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming-uniform, a = sqrt(5)); B ~ N(0, 0.02), not
PEFT's zeros, so that A's gradient is not zero; m = ||W0||_row * (1 + 0.1 N(0, 1)), not
exactly the norm, so that the scale is not one. All rounded to float32 first.

Contents of lora_<case>.safetensors (F32 unless noted; adapter names are PEFT's without
the "base_model.model." prefix: <module path>.lora_A.weight, .lora_B.weight,
.lora_magnitude_vector):
  init.<adapter>    the adapters before training
  grad.<adapter>    d(mean loss)/d(adapter) at init
  loss0             [1] loss at init
  losses            [3] loss before each of 3 AdamW steps (the same batch)
  grad_norms        [3] the adapters' gradient norm before clipping
  after3.<adapter>  the adapters after the 3 steps
  __metadata__      base file, r, alpha, rslora, dora, targets, the hyperparameters (and for
                    the _dropout cases dropout p and dropout_seed: the masks below)
QLoRA (the _nf4 and _int8 cases, model.quant): every block linear weight of the base (all of
them, adapted or not) is replaced by its reference-dequantized value before anything runs:
W0 [out, in] (Conv1D: weight^T) as float32, quantized and decoded per module by
make_nf4.py's numpy port of bitsandbytes' quantize_4bit / dequantize_4bit (NF4, blocks of
64, double-quantized absmaxes) or by the port of LLM.int8()'s vector-wise format below
(int8_vectorwise_quant with threshold 0, int8_vectorwise_dequant). Embeddings, norms and
the head stay as they are.
AdamW as make_golden.py (torch.optim.AdamW, decay on tensors of dim >= 2, clip_grad_norm_,
gpt2.py's lr_at), over the adapters alone.
"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402
from gpt2 import GPT2, lr_at  # noqa: E402
from llama import Llama  # noqa: E402
from make_golden import read_safetensors  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(ROOT, "tests", "golden")
HP = dict(lr=1e-3, min_lr=1e-4, warmup_steps=1, steps=3, beta1=0.9, beta2=0.95, eps=1e-8,
          weight_decay=0.1, grad_clip=1.0)
GPT2_ALL = ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (family, r, alpha, rslora, dora, targets[, dropout])
CASES = {
    "gpt2": ("gpt2", 4, 8.0, False, False, GPT2_ALL),
    "gpt2_dora": ("gpt2", 4, 8.0, False, True, GPT2_ALL),
    "llama": ("llama", 4, 8.0, True, False, LLAMA_ALL),
    "llama_dora": ("llama", 4, 16.0, False, True, LLAMA_ALL),
    "gpt2_dropout": ("gpt2", 4, 8.0, False, False, GPT2_ALL, 0.25),
    "llama_dropout": ("llama", 4, 8.0, True, False, LLAMA_ALL, 0.25),
    "gpt2_nf4": ("gpt2", 4, 8.0, False, False, GPT2_ALL, 0.0, "nf4"),
    "llama_nf4": ("llama", 4, 8.0, True, False, LLAMA_ALL, 0.0, "nf4"),
    "llama_nf4_dora": ("llama", 4, 16.0, False, True, LLAMA_ALL, 0.0, "nf4"),
    "llama_int8": ("llama", 4, 8.0, False, False, ["q_proj", "v_proj", "down_proj"], 0.0, "int8"),
}
# Dropout masks (lora.dropout; model/parts.h AdapterDropout): element (row, c) of piece k's
# input in block l (the engine's unit l + 1) at step s is kept, as x / (1 - p), iff the top 24
# bits of word 0 of Philox4x32-10 at counter (e, e >> 32, (l + 1) * 256 + k, s), key
# DROPOUT_SEED ^ DROPOUT_KEY, e = row * in + c (row = b * T + t), scaled by 2^-24 in float32,
# are >= p. k: the module's place among the pieces of its fused GEMM (q, k, v; gate, up).
DROPOUT_SEED = 1234
DROPOUT_KEY = 0xD80F0C0DE5A1E000
PIECE = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
STEP = [0]  # the step whose masks the forward draws


def philox_word0(e, stream, step, key):
    """Word 0 of Philox4x32-10 (core/rng.h) at counters (e lo, e hi, stream, step), numpy uint64."""
    m32 = np.uint64(0xFFFFFFFF)
    c0, c1 = e & m32, (e >> np.uint64(32)) & m32
    c2 = np.full_like(e, np.uint64(stream))
    c3 = np.full_like(e, np.uint64(step))
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0) & m32, p1 & m32, \
            ((p0 >> np.uint64(32)) ^ c3 ^ k1) & m32, p0 & m32
        k0 = (k0 + np.uint64(0x9E3779B9)) & m32
        k1 = (k1 + np.uint64(0xBB67AE85)) & m32
    return c0


def dropout_keep(rows, n_in, unit, piece, step, p):
    """[rows, n_in] float32: 1 / (1 - p) where kept, 0 where dropped."""
    e = np.arange(rows * n_in, dtype=np.uint64)
    w = philox_word0(e, unit * 256 + piece, step, DROPOUT_SEED ^ DROPOUT_KEY)
    u = (w >> np.uint64(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    kept = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return np.where(u >= np.float32(p), kept, np.float32(0.0)).reshape(rows, n_in)
SEED = 4321


def matches(path, target):
    return path == target or path.endswith("." + target)


class Adapted(torch.nn.Module):
    """A frozen linear module (nn.Linear or Conv1D) with a LoRA or DoRA adapter."""

    def __init__(self, base, conv1d, r, scale, dora, gen, dropout=0.0, unit=0, piece=0):
        super().__init__()
        self.base, self.conv1d, self.scale, self.dora = base, conv1d, scale, dora
        self.dropout, self.unit, self.piece = dropout, unit, piece
        w0 = self.w0()
        out_f, in_f = w0.shape
        bound = 1.0 / math.sqrt(in_f)
        a = (torch.rand((r, in_f), generator=gen, dtype=torch.float64) * 2 - 1) * bound
        b = torch.randn((out_f, r), generator=gen, dtype=torch.float64) * 0.02
        self.lora_A = torch.nn.Parameter(a.float().double())
        self.lora_B = torch.nn.Parameter(b.float().double())
        if dora:
            m = w0.norm(dim=1) * (1 + 0.1 * torch.randn(out_f, generator=gen, dtype=torch.float64))
            self.lora_magnitude_vector = torch.nn.Parameter(m.float().double())

    def w0(self):
        w = self.base.weight.detach()
        return w.t() if self.conv1d else w

    def forward(self, x):
        w0 = self.w0()
        bias = getattr(self.base, "bias", None)
        base = x @ w0.t()
        xa = x
        if self.dropout > 0:  # PEFT's lora_dropout, with the engine's masks
            keep = dropout_keep(x.shape[0] * x.shape[1], x.shape[2], self.unit, self.piece, STEP[0],
                                self.dropout)
            xa = x * torch.from_numpy(keep.astype(np.float64)).view(x.shape)
        lora = (xa @ self.lora_A.t()) @ self.lora_B.t() * self.scale
        if not self.dora:
            y = base + lora
        else:
            norm = (w0 + self.scale * self.lora_B @ self.lora_A).norm(dim=1).detach()
            y = (self.lora_magnitude_vector / norm) * (base + lora)
        return y if bias is None else y + bias


def int8_rows(w):
    """LLM.int8()'s vector-wise format (bitsandbytes int8_vectorwise_quant, threshold 0, and
    int8_vectorwise_dequant), float32: a = max |w| per row, code = rint(w * (127 / a)) (ties to
    even), decoded (code * a) * float32(1 / 127); a zero row codes 0."""
    f = np.float32
    w = w.astype(f)
    a = np.abs(w).max(axis=1).astype(f)
    k = np.where(a > 0, f(127) / np.where(a > 0, a, f(1)), f(0)).astype(f)
    codes = np.rint((w * k[:, None]).astype(f)).astype(np.int8)
    return ((codes.astype(f) * a[:, None]).astype(f) * f(7.874015718698502e-3)).astype(f)


def nf4_rows(w):
    """bitsandbytes' NF4 with double quantization of one module's weight, decoded."""
    import make_nf4
    flat = w.astype(np.float32).reshape(-1)
    packed, absmax_codes, nested, offset, _ = make_nf4.quantize_4bit(flat)
    out, _ = make_nf4.dequantize_4bit(packed, absmax_codes, nested, offset, flat.size)
    return np.asarray(out, dtype=np.float32).reshape(w.shape)


def quantize_base(model, family, quant):
    """Replaces every block linear weight by its reference-dequantized value (QLoRA's base)."""
    decode = nf4_rows if quant == "nf4" else int8_rows
    count = 0
    with torch.no_grad():
        for path, mod in model.named_modules():
            if not hasattr(mod, "weight") or mod.weight.dim() != 2 or "embed" in path or path in (
                    "wte", "wpe", "lm_head"):
                continue
            w = mod.weight.detach().float().numpy()
            w0 = w.T if family == "gpt2" else w  # the engine's [out, in]
            d = decode(np.ascontiguousarray(w0))
            mod.weight.copy_(torch.from_numpy((d.T if family == "gpt2" else d).astype(np.float64)))
            count += 1
    assert count > 0


def load_base(family):
    path = os.path.join(GOLDEN, "gpt2_ref.safetensors" if family == "gpt2" else
                        "llama_ref_kv2.safetensors")
    meta, tensors = read_safetensors(path)
    n = lambda k: int(float(meta[k]))  # noqa: E731
    if family == "gpt2":
        model = GPT2(n("n_layer"), n("n_embd"), n("n_head"), n("vocab_size"), n("seq_len"))
    else:
        model = Llama(n("n_layer"), n("n_embd"), n("n_head"), n("n_kv_head"), n("ffn_hidden"),
                      n("vocab_size"), n("seq_len"), float(meta["norm_eps"]),
                      float(meta["rope_theta"]), bool(n("tie")))
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(tensors[name], dtype=np.float64)))
            p.requires_grad_(False)
    tokens = torch.from_numpy(np.asarray(tensors["tokens"]).astype(np.int64))
    return model, tokens, os.path.basename(path)


def make_case(name, family, r, alpha, rslora, dora, targets, dropout=0.0, quant=""):
    gen = torch.Generator().manual_seed(SEED)
    model, tokens, base_file = load_base(family)
    if quant:
        quantize_base(model, family, quant)
    inputs, targets_tok = tokens[:, :-1], tokens[:, 1:]
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    adapted = {}
    for path, mod in list(model.named_modules()):
        if not hasattr(mod, "weight") or mod.weight.dim() != 2 or "embed" in path or path in (
                "wte", "wpe", "lm_head"):
            continue
        if not any(matches(path, t) for t in targets):
            continue
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = int(path.split(".")[1] if family == "gpt2" else path.split(".")[2])
        wrapped = Adapted(mod, family == "gpt2", r, scale, dora, gen, dropout, layer + 1,
                          PIECE.get(path.rsplit(".", 1)[-1], 0))
        setattr(parent, child, wrapped)
        adapted[path] = wrapped
    assert adapted, "no module adapted"

    def adapter_params():
        out = {}
        for path, mod in adapted.items():
            out[path + ".lora_A.weight"] = mod.lora_A
            out[path + ".lora_B.weight"] = mod.lora_B
            if dora:
                out[path + ".lora_magnitude_vector"] = mod.lora_magnitude_vector
        return out

    params = adapter_params()
    tensors = {}
    for n, p in params.items():
        tensors["init." + n] = p.detach().float().numpy()
    STEP[0] = 0
    _, loss0 = model(inputs, targets_tok)
    loss0.backward()
    for n, p in params.items():
        tensors["grad." + n] = p.grad.detach().float().numpy()
    tensors["loss0"] = np.array([loss0.item()], dtype=np.float32)

    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": HP["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    losses, norms = [], []
    for step in range(HP["steps"]):
        STEP[0] = step
        lr = lr_at(step, HP["lr"], HP["min_lr"], HP["warmup_steps"], HP["steps"])
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets_tok)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(list(params.values()), HP["grad_clip"]).item())
        opt.step()
        losses.append(loss.item())
    tensors["losses"] = np.array(losses, dtype=np.float32)
    tensors["grad_norms"] = np.array(norms, dtype=np.float32)
    for n, p in params.items():
        tensors["after3." + n] = p.detach().float().numpy()

    meta = dict(HP)
    meta.update(base=base_file, r=r, alpha=alpha, rslora=int(rslora), dora=int(dora), quant=quant or "none",
                targets=" ".join(targets), seed=SEED, dropout=dropout, dropout_seed=DROPOUT_SEED,
                generator="tools/torch_ref/make_lora.py (torch %s, float64 maths)" % torch.__version__)
    out = os.path.join(GOLDEN, "lora_%s.safetensors" % name)
    st_writer.save(out, tensors, {k: str(v) for k, v in meta.items()})
    if not dora and dropout == 0 and not quant:  # the same adapters as PEFT saves them, for lora.init
        write_peft_dir(name, family, r, alpha, rslora, targets, tensors)
    print(f"wrote {os.path.relpath(out, ROOT)}: {len(params)} adapter tensors on {len(adapted)} "
          f"modules, loss0 {loss0.item():.8f}, losses {[round(x, 8) for x in losses]}, "
          f"grad norms {[round(x, 5) for x in norms]}")


def write_peft_dir(name, family, r, alpha, rslora, targets, tensors):
    """tests/golden/peft_<name>/: the init adapters as peft's save_pretrained lays them out
    (adapter_config.json; adapter_model.safetensors, metadata {"format": "pt"}, keys
    base_model.model.<HF module path>.lora_A.weight [r, in] / .lora_B.weight [out, r], GPT-2's
    modules under "transformer."), written with numpy and the stdlib, not by the engine."""
    import json
    d = os.path.join(GOLDEN, "peft_" + name)
    os.makedirs(d, exist_ok=True)
    prefix = "base_model.model." + ("transformer." if family == "gpt2" else "")
    weights = {prefix + k[len("init."):]: v for k, v in tensors.items() if k.startswith("init.")}
    st_writer.save(os.path.join(d, "adapter_model.safetensors"), weights, {"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
              "target_modules": targets, "lora_dropout": 0.0, "use_rslora": rslora,
              "use_dora": False, "bias": "none", "fan_in_fan_out": family == "gpt2",
              "base_model_name_or_path": "tests/golden/" + ("gpt2_ref" if family == "gpt2"
                                                            else "llama_ref_kv2") + ".safetensors"}
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    """Every case, or those named on the command line."""
    for name, case in CASES.items():
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            make_case(name, *case)


if __name__ == "__main__":
    main()
