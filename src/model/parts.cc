#include "model/parts.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"

namespace po::model::parts {
namespace ops = po::backend::cpu;

void AdapterDropout::scales(float* keep, int piece, int64_t rows, int64_t in, float p) const {
  const uint64_t key = seed ^ kDropoutKey;
  const uint32_t stream = unit * 256u + static_cast<uint32_t>(piece);
  const float kept = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < in; ++c) {
      const uint64_t e = static_cast<uint64_t>((row0 + i) * in + c);
      const uint32_t w = core::philox4x32({static_cast<uint32_t>(e), static_cast<uint32_t>(e >> 32), stream, step},
                                          {static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)})[0];
      keep[i * in + c] = static_cast<float>(w >> 8) * (1.0f / 16777216.0f) >= p ? kept : 0.0f;
    }
}

namespace {

// Whether piece k's adapter input is dropped out (a training pass with
// lora.dropout > 0); if so xd = x ⊙ keep, keep from AdapterDropout::scales
// (left for the backward's dx).
bool dropout_input(const Linear& lin, const Linear::Weights& p, int k, ops::Operand x, int64_t rows,
                   std::vector<float>& keep, std::vector<float>& xd) {
  if (!p.drop.on || lin.lora.dropout <= 0.0f) return false;
  const int64_t n = rows * lin.in;
  keep.resize(static_cast<size_t>(n));
  xd.resize(static_cast<size_t>(n));
  p.drop.scales(keep.data(), k, rows, lin.in, lin.lora.dropout);
  if (x.f32 != nullptr)
    for (int64_t e = 0; e < n; ++e) xd[e] = x.f32[e] * keep[e];
  else
    for (int64_t e = 0; e < n; ++e) xd[e] = core::bf16_to_f32(core::bf16{x.bf16[e]}) * keep[e];
  return true;
}

}  // namespace

Linear::Weights Linear::weights(const float* unit, const uint16_t* bits, bool lean,
                                const float* adapter) const {
  Weights p;
  p.w = lean ? nullptr : unit + weight;  // lean: the weight is read through its bits alone
  p.w16 = bits == nullptr ? nullptr : bits + weight;
  p.b = bias < 0 ? nullptr : unit + bias;
  if (lora.on()) p.adapter = adapter != nullptr ? adapter : unit;
  return p;
}

Linear::Grads Linear::grads(float* unit, float* adapter) const {
  Grads g;
  if (lora.on()) g.adapter = adapter != nullptr ? adapter : unit;
  if (!trainable || unit == nullptr) return g;
  g.w = unit + weight;
  g.b = bias < 0 ? nullptr : unit + bias;
  return g;
}

namespace {

Operand shifted(Operand x, int64_t n) {
  return {x.f32 != nullptr ? x.f32 + n : nullptr, x.bf16 != nullptr ? x.bf16 + n : nullptr};
}

// z[rows, n] = x · W[row0 .. row0 + n)ᵀ for the base weight as held: its
// f32 values or bf16 bits, or a quantized weight decoded panel by panel.
void base_rows_product(float* z, Operand x, const Linear::Weights& p, int64_t row0, int64_t n,
                       int64_t rows, int64_t in) {
  if (p.q == nullptr) {
    ops::gemm(false, true, rows, n, in, 1.0f, x, in,
              Operand(p.w != nullptr ? p.w + row0 * in : nullptr,
                      p.w16 != nullptr ? p.w16 + row0 * in : nullptr),
              in, 0.0f, z, n);
    return;
  }
  quant_matmul_rows(z, n, x, *p.q, row0, n, rows, in);
}

// DoRA's per-row scale m / ‖W0 + s·B·A‖ of a piece (the norm over the input,
// accumulated in double): what PEFT computes, detached, every forward. A
// quantized base is read as its decoded values, panel by panel (PEFT's
// dequantize_module_weight).
void dora_scale(float* c, const Linear& lin, const Adapter::Piece& pc, const Linear::Weights& p) {
  PO_CHECK(p.w != nullptr || p.w16 != nullptr || p.q != nullptr, "DoRA needs its base weight's values");
  const int64_t in = lin.in, r = lin.lora.r;
  const int64_t P = p.q != nullptr ? quant_panel_rows(in, pc.rows) : pc.rows;
  thread_local std::vector<float> ba, panel;
  ba.resize(static_cast<size_t>(pc.rows * in));
  ops::gemm(false, false, pc.rows, in, r, lin.lora.scale, p.adapter + pc.b, r, p.adapter + pc.a, in,
            0.0f, ba.data(), in);
  if (p.q != nullptr) panel.resize(static_cast<size_t>(P * in));
  const float* m = p.adapter + pc.m;
  const float* sba = ba.data();  // (thread_local: not the worker threads' to name)
  const float* dec = panel.data();
  for (int64_t j0 = 0; j0 < pc.rows; j0 += P) {
    const int64_t k = std::min(P, pc.rows - j0);
    if (p.q != nullptr) p.q->decode(pc.row0 + j0, k, panel.data());
#pragma omp parallel for schedule(static)
    for (int64_t j = j0; j < j0 + k; ++j) {
      const int64_t row = (pc.row0 + j) * in;
      double s = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        const float w0 = p.q != nullptr   ? dec[(j - j0) * in + i]
                         : p.w != nullptr ? p.w[row + i]
                                          : core::bf16_to_f32(core::bf16{p.w16[row + i]});
        const double v = static_cast<double>(w0 + sba[j * in + i]);
        s += v * v;
      }
      c[j] = m[j] / static_cast<float>(std::sqrt(s));
    }
  }
}

}  // namespace

void Linear::forward(float* y, Operand x, const Weights& p, int64_t rows, bool with_bias) const {
  if (p.q != nullptr)
    quant_matmul_forward(y, x, *p.q, with_bias ? p.b : nullptr, rows, in, out);
  else
    ops::matmul_forward(y, x, {p.w, p.w16}, with_bias ? p.b : nullptr, rows, in, out);
  if (lora.on()) adapter_forward(y, x, p, rows, with_bias);
}

void Linear::forward_decode(float* y, const float* x, const Weights& p, int64_t rows,
                            bool with_bias) const {
  if (p.q != nullptr)
    quant_matmul_forward(y, x, *p.q, with_bias ? p.b : nullptr, rows, in, out);
  else
    ops::matmul_forward_decode(y, x, p.w, with_bias ? p.b : nullptr, rows, in, out);
  if (lora.on()) adapter_forward(y, x, p, rows, with_bias);
}

// y (the base's x·W0ᵀ (+ b)) += each piece's s·(x·Aᵀ)·Bᵀ; DoRA's pieces then
// b + c ⊙ (y - b).
void Linear::adapter_forward(float* y, Operand x, const Weights& p, int64_t rows,
                             bool with_bias) const {
  const int64_t r = lora.r;
  thread_local std::vector<float> u, c, keep, xd;
  u.resize(static_cast<size_t>(rows * r));
  for (size_t k = 0; k < lora.pieces.size(); ++k) {
    const Adapter::Piece& pc = lora.pieces[k];
    const Operand xa =
        dropout_input(*this, p, static_cast<int>(k), x, rows, keep, xd) ? Operand(xd.data()) : x;
    ops::gemm(false, true, rows, r, in, 1.0f, xa, in, p.adapter + pc.a, in, 0.0f, u.data(), r);
    ops::gemm(false, true, rows, pc.rows, r, lora.scale, u.data(), r, p.adapter + pc.b, r, 1.0f,
              y + pc.row0, out);
    if (pc.m < 0) continue;
    c.resize(static_cast<size_t>(pc.rows));
    dora_scale(c.data(), *this, pc, p);
    const float* b = with_bias && p.b != nullptr ? p.b + pc.row0 : nullptr;
    const float* sc = c.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      float* yi = y + i * out + pc.row0;
      for (int64_t j = 0; j < pc.rows; ++j) {
        const float bj = b != nullptr ? b[j] : 0.0f;
        yi[j] = bj + sc[j] * (yi[j] - bj);
      }
    }
  }
}

void Linear::backward(float* dx, const Grads& g, Operand dy, Operand x, const Weights& p,
                      int64_t rows) const {
  if (p.q != nullptr) PO_ASSERT(g.w == nullptr && g.b == nullptr, "a quantized weight is frozen");
  if (!lora.on()) {
    if (p.q == nullptr) return ops::matmul_backward(dx, g.w, g.b, dy, x, {p.w, p.w16}, rows, in, out);
    if (dx != nullptr) quant_matmul_backward_input(dx, dy, *p.q, rows, in, out);
    return;
  }
  PO_ASSERT(g.w == nullptr && g.b == nullptr, "an adapted Linear's base is frozen");
  PO_ASSERT(dx != nullptr && p.adapter != nullptr, "an adapted Linear's backward needs dx and its weights");
  const int64_t r = lora.r;
  // DoRA: the output gradient through the row scale, dz = c ⊙ dy, on the
  // pieces that have one; the base and the low-rank product read dz. c holds
  // each DoRA piece's scales at its rows (computed once, read again for dm).
  thread_local std::vector<float> dz, c, u, du, z, keep, xd, dxa;
  bool dora = false;
  for (const Adapter::Piece& pc : lora.pieces) dora = dora || pc.m >= 0;
  Operand d = dy;
  if (dora) {
    PO_CHECK(dy.f32 != nullptr, "DoRA's backward reads its output gradient in f32");
    dz.assign(dy.f32, dy.f32 + rows * out);
    c.resize(static_cast<size_t>(out));
    for (const Adapter::Piece& pc : lora.pieces) {
      if (pc.m < 0) continue;
      dora_scale(c.data() + pc.row0, *this, pc, p);
      float* sdz = dz.data();
      const float* sc = c.data() + pc.row0;
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < pc.rows; ++j) sdz[i * out + pc.row0 + j] *= sc[j];
    }
    d = Operand(dz.data());
  }
  if (p.q != nullptr)
    quant_matmul_backward_input(dx, d, *p.q, rows, in, out);
  else
    ops::matmul_backward(dx, nullptr, nullptr, d, x, {p.w, p.w16}, rows, in, out);
  u.resize(static_cast<size_t>(rows * r));
  du.resize(static_cast<size_t>(rows * r));
  for (size_t k = 0; k < lora.pieces.size(); ++k) {
    const Adapter::Piece& pc = lora.pieces[k];
    const float* A = p.adapter + pc.a;
    const float* B = p.adapter + pc.b;
    const Operand dp = shifted(d, pc.row0);
    // With dropout the adapter reads xd = x ⊙ keep (the forward's mask, made again).
    const bool dropped = dropout_input(*this, p, static_cast<int>(k), x, rows, keep, xd);
    const Operand xa = dropped ? Operand(xd.data()) : x;
    ops::gemm(false, true, rows, r, in, 1.0f, xa, in, A, in, 0.0f, u.data(), r);  // u = xa·Aᵀ
    if (pc.m >= 0 && g.adapter != nullptr) {
      // dm_j += Σ_rows dy_j · z_j / ‖·‖_j, z = x·W0ᵀ + s·u·Bᵀ (the piece, no bias):
      // c_j / m_j is 1 / ‖·‖_j.
      z.resize(static_cast<size_t>(rows * pc.rows));
      base_rows_product(z.data(), x, p, pc.row0, pc.rows, rows, in);
      ops::gemm(false, true, rows, pc.rows, r, lora.scale, u.data(), r, B, r, 1.0f, z.data(),
                pc.rows);
      const float* m = p.adapter + pc.m;
      float* dm = g.adapter + pc.m;
      const float *sz = z.data(), *sc = c.data() + pc.row0;
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < pc.rows; ++j) {
        float s = 0.0f;
        for (int64_t i = 0; i < rows; ++i) s += dy.f32[i * out + pc.row0 + j] * sz[i * pc.rows + j];
        dm[j] += s * (sc[j] / m[j]);
      }
    }
    if (g.adapter != nullptr)  // dB += s·dzᵀ·u
      ops::gemm(true, false, pc.rows, r, rows, lora.scale, dp, out, u.data(), r, 1.0f,
                g.adapter + pc.b, r);
    // du = s·dz·B; dA += duᵀ·xa; dx += du·A (⊙ keep under dropout)
    ops::gemm(false, false, rows, r, pc.rows, lora.scale, dp, out, B, r, 0.0f, du.data(), r);
    if (g.adapter != nullptr)
      ops::gemm(true, false, r, in, rows, 1.0f, du.data(), r, xa, in, 1.0f, g.adapter + pc.a, in);
    if (!dropped) {
      ops::gemm(false, false, rows, in, r, 1.0f, du.data(), r, A, in, 1.0f, dx, in);
      continue;
    }
    dxa.resize(static_cast<size_t>(rows * in));
    ops::gemm(false, false, rows, in, r, 1.0f, du.data(), r, A, in, 0.0f, dxa.data(), in);
    for (int64_t e = 0; e < rows * in; ++e) dx[e] += dxa[e] * keep[e];
  }
}

void Linear::merge(float* unit, const float* adapter) const {
  const Weights p{unit + weight, nullptr, nullptr, adapter};
  std::vector<float> c;
  for (const Adapter::Piece& pc : lora.pieces) {
    if (pc.m >= 0) {  // the scale of the unmerged weight
      c.resize(static_cast<size_t>(pc.rows));
      dora_scale(c.data(), *this, pc, p);
    }
    float* w = unit + weight + pc.row0 * in;
    ops::gemm(false, false, pc.rows, in, lora.r, lora.scale, adapter + pc.b, lora.r, adapter + pc.a,
              in, 1.0f, w, in);
    if (pc.m < 0) continue;
    for (int64_t j = 0; j < pc.rows; ++j)
      for (int64_t i = 0; i < in; ++i) w[j * in + i] *= c[static_cast<size_t>(j)];
  }
}

namespace {
// Out: float, or uint16_t for outputs rounded to bf16 as written.
template <typename Out>
void norm_forward(const Norm& n, Out* out, float* mean, float* rstd, const float* in,
                  const Norm::Weights& p, int64_t rows) {
  if (n.kind == model::Norm::kLayerNorm)
    ops::layernorm_forward(out, mean, rstd, in, p.w, p.b, rows, n.C, n.eps);
  else
    ops::rmsnorm_forward(out, rstd, in, p.w, rows, n.C, n.eps);
}

template <typename Out>
void act_forward(const Mlp& m, Out* out, const float* in, int64_t rows) {
  if (m.act == model::Mlp::kGeluTanh)
    ops::gelu_forward(out, in, rows * m.hidden);
  else
    ops::swiglu_forward(out, in, rows, m.hidden);
}
}  // namespace

void Norm::forward(float* out, float* mean, float* rstd, const float* in, const Weights& p,
                   int64_t rows) const {
  norm_forward(*this, out, mean, rstd, in, p, rows);
}

void Norm::forward(uint16_t* out, float* mean, float* rstd, const float* in, const Weights& p,
                   int64_t rows) const {
  norm_forward(*this, out, mean, rstd, in, p, rows);
}

void Norm::backward(float* dinp, const Grads& g0, const float* dout, Operand in, const Weights& p,
                    const float* mean, const float* rstd, int64_t rows) const {
  // Frozen: the kernels' weight sums go to scratch nobody reads.
  thread_local std::vector<float> discard;
  Grads g = g0;
  if (g.w == nullptr) {
    discard.resize(static_cast<size_t>(2 * C));
    g = {discard.data(), discard.data() + C};
  }
  if (kind == model::Norm::kLayerNorm) {
    if (in.f32 != nullptr)
      return ops::layernorm_backward(dinp, g.w, g.b, dout, in.f32, p.w, mean, rstd, rows, C);
    return ops::layernorm_backward(dinp, g.w, g.b, dout, in.bf16, p.w, mean, rstd, rows, C);
  }
  if (in.f32 != nullptr) return ops::rmsnorm_backward(dinp, g.w, dout, in.f32, p.w, rstd, rows, C);
  ops::rmsnorm_backward(dinp, g.w, dout, in.bf16, p.w, rstd, rows, C);
}

void Mlp::act_forward(float* out, const float* in, int64_t rows) const {
  parts::act_forward(*this, out, in, rows);
}

void Mlp::act_forward(uint16_t* out, const float* in, int64_t rows) const {
  parts::act_forward(*this, out, in, rows);
}

void Mlp::act_backward(float* dinp, Operand in, const float* dout, int64_t rows) const {
  if (act == model::Mlp::kGeluTanh) {
    if (in.f32 != nullptr) return ops::gelu_backward(dinp, in.f32, dout, rows * hidden);
    return ops::gelu_backward(dinp, in.bf16, dout, rows * hidden);
  }
  if (in.f32 != nullptr) return ops::swiglu_backward(dinp, in.f32, dout, rows, hidden);
  ops::swiglu_backward(dinp, in.bf16, dout, rows, hidden);
}

Block::Weights Block::weights(const float* unit, const uint16_t* bits, bool lean,
                              const float* adapters) const {
  Weights p{norm1.weights(unit),
            norm2.weights(unit),
            attn.qkv.weights(unit, bits, lean, adapters),
            attn.out.weights(unit, bits, lean, adapters),
            {},
            {},
            {}};
  if (moe.on()) {
    p.moe = {unit + moe.router, unit + moe.experts};
  } else {
    p.up = mlp.up.weights(unit, bits, lean, adapters);
    p.down = mlp.down.weights(unit, bits, lean, adapters);
  }
  return p;
}

Block::Grads Block::grads(float* unit, float* adapters) const {
  Grads g{norm1.grads(unit), norm2.grads(unit), attn.qkv.grads(unit, adapters), attn.out.grads(unit, adapters),
          {},                {},                {}};
  if (moe.on()) {
    if (unit != nullptr) g.moe = {unit + moe.router, unit + moe.experts};
  } else {
    g.up = mlp.up.grads(unit, adapters);
    g.down = mlp.down.grads(unit, adapters);
  }
  return g;
}

namespace {

// A family's names for block l's tensors.
struct Names {
  std::string norm1_w, norm1_b, norm2_w, norm2_b;
  std::vector<std::string> qkv_w, qkv_b;  // one fused tensor (GPT-2) or q, k, v (Llama)
  std::string out_w, out_b;
  std::vector<std::string> up_w, up_b;  // GPT-2 c_fc; Llama gate, up (SwiGLU) or up (GELU)
  std::string down_w, down_b;
  bool conv1d = false;  // GPT-2 files store linear weights as [in, out]
};

Names gpt2_names(int64_t l) {
  const std::string h = "h." + std::to_string(l) + ".";
  return {h + "ln_1.weight",           h + "ln_1.bias",
          h + "ln_2.weight",           h + "ln_2.bias",
          {h + "attn.c_attn.weight"},  {h + "attn.c_attn.bias"},
          h + "attn.c_proj.weight",    h + "attn.c_proj.bias",
          {h + "mlp.c_fc.weight"},     {h + "mlp.c_fc.bias"},
          h + "mlp.c_proj.weight",     h + "mlp.c_proj.bias",
          true};
}

Names llama_names(int64_t l, bool swiglu) {
  const std::string h = "model.layers." + std::to_string(l) + ".";
  const std::string a = h + "self_attn.", m = h + "mlp.";
  Names n{h + "input_layernorm.weight",
          h + "input_layernorm.bias",
          h + "post_attention_layernorm.weight",
          h + "post_attention_layernorm.bias",
          {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
          {a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"},
          a + "o_proj.weight",
          a + "o_proj.bias",
          {m + "up_proj.weight"},
          {m + "up_proj.bias"},
          m + "down_proj.weight",
          m + "down_proj.bias",
          false};
  if (swiglu) {
    n.up_w = {m + "gate_proj.weight", m + "up_proj.weight"};
    n.up_b = {m + "gate_proj.bias", m + "up_proj.bias"};
  }
  return n;
}

// A column-parallel linear whose output is `rows` (one per fused part) by
// `in`: one tensor of all parts (a fused file tensor, `names` of one) or one
// tensor per part, back to back.
Linear declare_column(const std::vector<std::string>& w, const std::vector<std::string>& b,
                      const std::vector<int64_t>& rows, int64_t in, bool bias, bool conv1d,
                      const Declare& add) {
  Linear lin;
  lin.in = in;
  lin.partition = Partition::kSplitRows;
  for (int64_t r : rows) lin.out += r;
  const bool fused = w.size() == 1;
  PO_ASSERT(fused || w.size() == rows.size(), "declare_column: ", w.size(), " names for ",
            rows.size(), " parts");
  if (fused) {
    lin.weight = add({w[0], {lin.out, in}, Init::kNormal, Partition::kSplitRows, rows, conv1d});
    if (bias) lin.bias = add({b[0], {lin.out}, Init::kZeros, Partition::kSplitRows, rows});
    return lin;
  }
  for (size_t i = 0; i < w.size(); ++i) {
    const int64_t at = add({w[i], {rows[i], in}, Init::kNormal, Partition::kSplitRows, {}, conv1d});
    if (i == 0) lin.weight = at;
  }
  if (bias)
    for (size_t i = 0; i < b.size(); ++i) {
      const int64_t at = add({b[i], {rows[i]}, Init::kZeros, Partition::kSplitRows, {}, false});
      if (i == 0) lin.bias = at;
    }
  return lin;
}

// A row-parallel linear [out, in]: its input columns split, its bias whole.
Linear declare_row(const std::string& w, const std::string& b, int64_t out, int64_t in, bool bias,
                   bool conv1d, const Declare& add) {
  Linear lin;
  lin.in = in;
  lin.out = out;
  lin.partition = Partition::kSplitCols;
  lin.weight = add({w, {out, in}, Init::kResidualNormal, Partition::kSplitCols, {}, conv1d});
  if (bias) lin.bias = add({b, {out}, Init::kZeros, Partition::kReplicated, {}, false});
  return lin;
}

}  // namespace

Norm declare_norm(const TransformerConfig& c, const std::string& w, const std::string& b,
                  const Declare& add) {
  Norm n;
  n.kind = c.norm;
  n.C = c.n_embd;
  n.eps = c.norm_eps;
  n.weight = add({w, {c.n_embd}, Init::kOnes, Partition::kReplicated, {}, false});
  if (c.norm == model::Norm::kLayerNorm)
    n.bias = add({b, {c.n_embd}, Init::kZeros, Partition::kReplicated, {}, false});
  return n;
}

Block declare_block(const TransformerConfig& c, int64_t l, const Declare& add) {
  const int64_t C = c.n_embd, NH = c.n_head, NKV = c.n_kv_head, hs = c.head_dim();
  const int64_t F = c.ffn_hidden;
  const bool swiglu = c.mlp == model::Mlp::kSwiGLU;
  const Names n = c.arch == "gpt2" ? gpt2_names(l) : llama_names(l, swiglu);
  Block k;
  k.norm1 = declare_norm(c, n.norm1_w, n.norm1_b, add);
  k.attn.n_head = NH;
  k.attn.n_kv_head = NKV;
  k.attn.head_dim = hs;
  k.attn.rope = c.positions == Positions::kRope;
  k.attn.qkv = declare_column(n.qkv_w, n.qkv_b, {NH * hs, NKV * hs, NKV * hs}, C, c.bias,
                              n.conv1d, add);
  k.attn.out = declare_row(n.out_w, n.out_b, C, NH * hs, c.bias, n.conv1d, add);
  k.norm2 = declare_norm(c, n.norm2_w, n.norm2_b, add);
  if (c.moe.on()) {  // Mixtral's names: the router, then each expert's w1 (gate), w3 (up), w2 (down)
    const int64_t E = c.moe.experts, F = c.moe.ffn_hidden > 0 ? c.moe.ffn_hidden : c.ffn_hidden;
    const std::string m = "model.layers." + std::to_string(l) + ".block_sparse_moe.";
    k.moe.shape = {C, F, E, c.moe.top_k, c.moe.router};
    k.moe.router = add({m + "gate.weight", {E, C}, Init::kNormal, Partition::kReplicated, {}, false});
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = m + "experts." + std::to_string(e) + ".";
      const int64_t at = add({x + "w1.weight", {F, C}, Init::kNormal, Partition::kReplicated, {}, false});
      if (e == 0) k.moe.experts = at;
      add({x + "w3.weight", {F, C}, Init::kNormal, Partition::kReplicated, {}, false});
      add({x + "w2.weight", {C, F}, Init::kResidualNormal, Partition::kReplicated, {}, false});
    }
    return k;
  }
  k.mlp.act = c.mlp;
  k.mlp.hidden = F;
  k.mlp.up = declare_column(n.up_w, n.up_b, swiglu ? std::vector<int64_t>{F, F} : std::vector<int64_t>{F},
                            C, c.bias, n.conv1d, add);
  k.mlp.down = declare_row(n.down_w, n.down_b, C, F, c.bias, n.conv1d, add);
  return k;
}

}  // namespace po::model::parts
