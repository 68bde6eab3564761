// bf16 saved activations (TransformerConfig::bf16_activations): the forward computes
// in f32 exactly as without them (the same loss, bit for bit); the backward
// reads the saved tensors rounded to bf16, so gradients move by about bf16's
// resolution and no more; and each layer's saved tensors cost 2 bytes per
// element instead of 4 (Korthikanti et al.'s 16-bit count), with and
// without activation checkpointing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/ops.h"
#include "model/transformer.h"
#include "parallel/unit_blocks.h"

namespace {

using po::model::Transformer;
using po::model::TransformerConfig;

TransformerConfig config(bool bf16, bool checkpointing, int64_t layers = 3) {
  TransformerConfig c;
  c.n_layer = layers;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 97;
  c.seq_len = 32;
  c.bf16_activations = bf16;
  c.activation_checkpointing = checkpointing;
  return c;
}

struct Result {
  float loss;
  std::vector<float> grads;
};

Result run(const TransformerConfig& c) {
  po::backend::cpu::set_num_threads(1);
  const int64_t B = 2, T = 32, n = B * T;
  Transformer m(c, B, T);
  m.init_random(11);
  std::vector<int32_t> in(n), tg(n);
  for (int64_t i = 0; i < n; ++i) {
    in[i] = static_cast<int32_t>((i * 37 + 5) % 97);
    tg[i] = static_cast<int32_t>((i * 53 + 2) % 97);
  }
  m.zero_grads();
  const float loss = m.forward_backward(in.data(), tg.data(), 1.0f / static_cast<float>(n));
  return {loss, std::vector<float>(m.grads(), m.grads() + m.num_params())};
}

TEST(GPT2Bf16Activations, SameForwardGradientsWithinBf16Resolution) {
  for (bool ckpt : {false, true}) {
    const Result f = run(config(false, ckpt)), h = run(config(true, ckpt));
    EXPECT_EQ(f.loss, h.loss) << "checkpointing " << ckpt << ": the forward must not change";
    ASSERT_EQ(f.grads.size(), h.grads.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < f.grads.size(); ++i) {
      num += (f.grads[i] - h.grads[i]) * static_cast<double>(f.grads[i] - h.grads[i]);
      den += f.grads[i] * static_cast<double>(f.grads[i]);
    }
    const double rel = std::sqrt(num / den);
    std::printf("checkpointing %d: relative L2 gradient difference %.2e\n", ckpt, rel);
    EXPECT_GT(rel, 0) << "checkpointing " << ckpt << ": gradients identical: bf16 copies unused?";
    EXPECT_LT(rel, 1e-2) << "checkpointing " << ckpt
                         << ": relative L2 difference of all gradients, bf16 vs f32 activations";
  }
}

// The bytes one more layer adds: f32 saves 16 B·T·C floats per layer (ln1,
// qkv 3, atty, residual2, ln2, fch 4, fch_gelu 4, residual3) plus the
// statistics (2 means, 2 rstds: B·T each; lse B·NH·T); bf16 halves the
// tensors and keeps the statistics in f32. With checkpointing only the block
// output stays: 4 vs 2 bytes per element.
TEST(GPT2Bf16Activations, EachLayerSavesTwoBytesPerElement) {
  const int64_t B = 2, T = 32, C = 64, NH = 4, BT = B * T;
  auto per_layer = [&](bool bf16, bool ckpt) {
    return static_cast<double>(Transformer::predicted_bytes(config(bf16, ckpt, 5), B, T)) -
           static_cast<double>(Transformer::predicted_bytes(config(bf16, ckpt, 4), B, T)) -
           2 * 4.0 * static_cast<double>(12 * C * C + 13 * C);  // params + grads of a block
  };
  const double stats = 4.0 * (4 * BT + B * NH * T);
  EXPECT_EQ(per_layer(false, false), 4.0 * 16 * BT * C + stats);
  EXPECT_EQ(per_layer(true, false), 2.0 * 16 * BT * C + stats);
  EXPECT_EQ(per_layer(false, true), 4.0 * BT * C);
  EXPECT_EQ(per_layer(true, true), 2.0 * BT * C);
}

// bf16 GEMMs (the trainer's train.precision = "bf16"): with saved bf16
// activations the norms and the MLP activation write their outputs in bf16
// only, the GEMMs read the saved copies and the stored bf16 weights, and the
// loss writes its gradient in bf16. Each of those is the value a GEMM would
// round per call, so the bits are those of rounding per call: the loss of
// f32 activations at bf16 GEMMs, the gradients of the split backward (which
// widens every saved tensor and rounds it again), and the gradients of
// weights widened from bf16 and rounded again.
struct Hooked {
  float loss;
  std::vector<float> grads;
};

// lean: the hooks also offer params_lean, whose buffer holds NaN where the
// model must read bits (Layout::read_as_bf16), so a read of those f32 values
// shows in the loss and every gradient.
Hooked run_bf16_gemms(const TransformerConfig& c, bool split, bool bf16_weights,
                      bool lean = false) {
  namespace cpu = po::backend::cpu;
  cpu::set_num_threads(1);
  cpu::set_gemm_precision(cpu::GemmPrecision::kBF16);
  const int64_t B = 2, T = 32, n = B * T;
  Transformer m(c, B, T);
  m.init_random(11);
  // The parameters as a bf16 run stores them, and their widened f32 values.
  const int64_t np = m.num_params();
  std::vector<uint16_t> stored(static_cast<size_t>(np));
  std::vector<float> wide(static_cast<size_t>(np)), grads(static_cast<size_t>(np), 0.0f);
  cpu::f32_to_bf16(stored.data(), m.params(), np);
  cpu::bf16_to_f32(wide.data(), stored.data(), np);
  po::model::UnitHooks h;
  h.params = [&](int u) { return wide.data() + m.unit_offset(u); };
  h.done = [](int) {};
  h.grads = [&](int u) { return grads.data() + m.unit_offset(u); };
  h.grads_ready = [](int) {};
  if (bf16_weights) h.params_bf16 = [&](int u) { return stored.data() + m.unit_offset(u); };
  std::vector<float> poisoned(static_cast<size_t>(np), std::numeric_limits<float>::quiet_NaN());
  if (lean) {
    for (int u = 0; u < m.num_units(); ++u)
      po::parallel::widen_unit(m.layout(), u, stored.data() + m.unit_offset(u),
                               poisoned.data() + m.unit_offset(u), true);
    h.params_lean = [&](int u) { return poisoned.data() + m.unit_offset(u); };
  }
  m.set_unit_hooks(h);
  std::vector<int32_t> in(n), tg(n);
  for (int64_t i = 0; i < n; ++i) {  // no token twice: the lookup gradient's order is moot
    in[i] = static_cast<int32_t>((i * 37 + 5) % 97);
    tg[i] = static_cast<int32_t>((i * 53 + 2) % 97);
  }
  const float scale = 1.0f / static_cast<float>(n);
  float loss = 0;
  if (!split) {
    loss = m.forward_backward(in.data(), tg.data(), scale);
  } else {
    loss = static_cast<float>(m.stage_forward(in.data(), nullptr, tg.data(), scale) /
                              static_cast<double>(n));
    std::vector<po::model::WeightGradWork> works;
    for (int64_t l = 0; l < c.n_layer; ++l) works.push_back(m.make_weight_grad_work());
    m.stage_backward(in.data(), nullptr, {}, &works);
    m.stage_backward_weight(works);
  }
  cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
  return {loss, grads};
}

size_t bits_differ(const std::vector<float>& a, const std::vector<float>& b) {
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return bad;
}

// GPT-2's LayerNorm and GELU, then Llama's RMSNorm, SwiGLU, RoPE and grouped KV.
TransformerConfig family(bool llama, bool bf16) {
  TransformerConfig c = config(bf16, false);
  if (!llama) return c;
  TransformerConfig l = TransformerConfig::arch_defaults("llama");
  l.n_layer = 2;
  l.n_embd = 64;
  l.n_head = 4;
  l.n_kv_head = 2;
  l.ffn_hidden = 96;
  l.vocab_size = 97;
  l.seq_len = 32;
  l.bf16_activations = bf16;
  return l;
}

// What a lean widening leaves out: exactly the GEMM weights and the token
// table (GPT-2: the fused c_attn, c_proj, c_fc, mlp c_proj; Llama: q/k/v,
// o, gate/up, down and the untied lm_head), and its ranges cover the rest.
TEST(GPT2Bf16Activations, LeanWideningSkipsExactlyTheTensorsReadAsBits) {
  for (bool llama : {false, true}) {
    const po::model::Layout layout(family(llama, true));
    int64_t skipped = 0, kept = 0;
    for (const po::model::TensorSpec& t : layout.tensors()) {
      const bool gemm = t.name.find("attn") != std::string::npos ||
                        t.name.find("mlp") != std::string::npos ||
                        t.name.find("lm_head") != std::string::npos ||
                        t.name.find("wte") != std::string::npos ||
                        t.name.find("embed_tokens") != std::string::npos;
      const bool expect = gemm && t.shape.size() == 2;
      EXPECT_EQ(po::model::Layout::read_as_bf16(t), expect) << t.name;
      (expect ? skipped : kept) += t.numel();
    }
    int64_t covered = 0;
    for (int u = 0; u < layout.num_units(); ++u) {
      int64_t prev = 0;
      for (const auto& [b, e] : layout.f32_read_ranges(u)) {
        EXPECT_GE(b, prev) << "unit " << u << ": ranges overlap or go backwards";
        EXPECT_LE(e, layout.unit_numel(u)) << "unit " << u;
        covered += e - b;
        prev = e;
      }
    }
    EXPECT_EQ(covered, kept) << (llama ? "llama" : "gpt2")
                             << ": the ranges do not cover exactly the f32-read tensors";
    EXPECT_GT(skipped, 3 * kept) << "the GEMM weights and the table are most of the model";
  }
}

TEST(GPT2Bf16Activations, Bf16GemmsReadSavedCopiesWithTheBitsOfRoundingPerCall) {
  for (bool llama : {false, true}) {
    const char* name = llama ? "llama" : "gpt2";
    const Hooked direct = run_bf16_gemms(family(llama, true), false, true);
    const Hooked f32_acts = run_bf16_gemms(family(llama, false), false, true);
    EXPECT_EQ(direct.loss, f32_acts.loss)
        << name << ": the forward writing GEMM inputs in bf16 changed the loss of rounding them "
        << "per call";
    const Hooked split = run_bf16_gemms(family(llama, true), true, true);
    EXPECT_EQ(direct.loss, split.loss) << name;
    EXPECT_EQ(bits_differ(direct.grads, split.grads), 0u)
        << name << ": gradient elements differ between the fused backward (saved bf16 GEMM "
        << "inputs read directly) and the split one (widened and rounded again)";
    const Hooked rounded = run_bf16_gemms(family(llama, true), false, false);
    EXPECT_EQ(direct.loss, rounded.loss) << name;
    EXPECT_EQ(bits_differ(direct.grads, rounded.grads), 0u)
        << name << ": gradient elements differ between stored bf16 weights and widened ones "
        << "rounded again";
    // Lean widening: the GEMM weights and the token table reach the model
    // only as bits (their f32 values are NaN here), the same bits result.
    for (bool split_backward : {false, true}) {
      const Hooked full = split_backward ? split : direct;
      const Hooked lean = run_bf16_gemms(family(llama, true), split_backward, true, true);
      EXPECT_EQ(full.loss, lean.loss) << name << (split_backward ? " split" : " fused")
                                      << ": the loss differs when only the f32-read tensors are widened";
      EXPECT_EQ(bits_differ(full.grads, lean.grads), 0u)
          << name << (split_backward ? " split" : " fused")
          << ": gradient elements differ when only the f32-read tensors are widened";
    }
    double norm = 0;
    for (float g : direct.grads) norm += static_cast<double>(g) * g;
    EXPECT_GT(norm, 0.0) << name << ": no gradient reached the hooks";
  }
}

}  // namespace
