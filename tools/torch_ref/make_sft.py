"""Golden reference for SFT batches: the masked loss (cross-entropy with ignore_index) and
packed rows (block-diagonal causal attention, positions reset per example), in float64.

Rerun (deterministic; rewrites tests/golden/sft_{gpt2,llama}.safetensors):

    /usr/bin/python3 tools/torch_ref/make_sft.py

The model of each case is a golden model already in tests/golden (its weights): GPT-2 from
gpt2_ref.safetensors, Llama (grouped-query, untied) from llama_ref_kv2.safetensors; every
parameter trains. Eight examples of different lengths (LENGTHS), random tokens; the first
PROMPT[i] tokens of example i are its prompt, the rest its reply. A token's target is the
next token of its example where that token is a reply's, else -1 (ignored); an example's
last token has none. Two layouts of the same examples:
  rows.*    one example per row, padded with token 0 (targets -1), positions 0 .. T-1;
  packed.*  whole examples side by side, a new row when the next does not fit, the padding
            one more example of its own; positions count up from 0 in each example, and a
            token attends only within its example (gpt2.attention_mask).
The loss is F.cross_entropy(..., ignore_index=-1): the mean over the counted targets. Both
layouts give the same loss and gradients (checked here to 1e-12).

Contents of sft_<case>.safetensors:
  rows.inputs, rows.targets           I32 [8, T]
  packed.inputs, packed.targets,
  packed.positions                    I32 [R, T]
  loss                                F32 [1]
  grad.<parameter>                    F32, d(loss)/d(parameter) (HF names, as the base file's)
  __metadata__                        base file, counted targets, generator
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_writer  # noqa: E402
from make_lora import GOLDEN, ROOT, load_base  # noqa: E402

LENGTHS = [7, 12, 4, 9, 15, 6, 20, 3]
PROMPT = [3, 5, 1, 4, 9, 2, 11, 1]
SEED = 2468


def examples(vocab):
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for n, p in zip(LENGTHS, PROMPT):
        toks = torch.randint(0, vocab, (n,), generator=gen).tolist()
        tg = [toks[k + 1] if k + 1 < n and k + 1 >= p else -1 for k in range(n)]
        out.append((toks, tg))
    return out


def rows_layout(exs, T):
    inputs = np.zeros((len(exs), T), np.int32)
    targets = np.full((len(exs), T), -1, np.int32)
    for r, (toks, tg) in enumerate(exs):
        inputs[r, :len(toks)] = toks
        targets[r, :len(tg)] = tg
    return inputs, targets, None


def packed_layout(exs, T):
    rows, cur = [], []
    for e in exs:
        if sum(len(x[0]) for x in cur) + len(e[0]) > T:
            rows.append(cur)
            cur = []
        cur.append(e)
    rows.append(cur)
    inputs = np.zeros((len(rows), T), np.int32)
    targets = np.full((len(rows), T), -1, np.int32)
    positions = np.zeros((len(rows), T), np.int32)
    for r, row in enumerate(rows):
        at = 0
        for toks, tg in row:
            n = len(toks)
            inputs[r, at:at + n], targets[r, at:at + n] = toks, tg
            positions[r, at:at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(T - at)
    return inputs, targets, positions


def loss_and_grads(model, layout):
    inputs, targets, positions = layout
    model.zero_grad(set_to_none=True)
    pos = None if positions is None else torch.from_numpy(positions.astype(np.int64))
    _, loss = model(torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)),
                    positions=pos)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def make_case(family):
    model, _, base_file = load_base(family)
    for p in model.parameters():
        p.requires_grad_(True)
    vocab = model.vocab_size if family == "gpt2" else model.model.embed_tokens.weight.shape[0]
    exs = examples(vocab)
    T = model.seq_len
    rows, packed = rows_layout(exs, T), packed_layout(exs, T)
    loss_r, grads_r = loss_and_grads(model, rows)
    loss_p, grads_p = loss_and_grads(model, packed)
    assert abs(loss_r - loss_p) < 1e-12 * abs(loss_r), (loss_r, loss_p)
    for n in grads_r:
        d = (grads_r[n] - grads_p[n]).norm() / grads_r[n].norm().clamp_min(1e-300)
        assert d < 1e-10, (n, d.item())
    tensors = {"rows.inputs": rows[0], "rows.targets": rows[1], "packed.inputs": packed[0],
               "packed.targets": packed[1], "packed.positions": packed[2],
               "loss": np.array([loss_p], dtype=np.float32)}
    for n, g in grads_p.items():
        tensors["grad." + n] = g.float().numpy()
    counted = int((rows[1] >= 0).sum())
    meta = dict(base=base_file, counted=counted, seed=SEED,
                generator="tools/torch_ref/make_sft.py (torch %s, float64 maths)" % torch.__version__)
    out = os.path.join(GOLDEN, "sft_%s.safetensors" % family)
    st_writer.save(out, tensors, {k: str(v) for k, v in meta.items()})
    print(f"wrote {os.path.relpath(out, ROOT)}: {len(exs)} examples in {rows[0].shape[0]} rows or "
          f"{packed[0].shape[0]} packed rows of {T}, {counted} counted targets, loss {loss_p:.8f}")


if __name__ == "__main__":
    for fam in ("gpt2", "llama"):
        make_case(fam)
