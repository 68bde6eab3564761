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
#include <vector>

#include "backend/ops.h"
#include "model/transformer.h"

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

}  // namespace
