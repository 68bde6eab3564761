// The real Llama shapes build: every preset's declared layout has the
// published parameter count, and a one-block slice (a pipeline stage of one
// unit) of Llama-3 8B (218M parameters, GQA 32/8, SwiGLU 14336) allocates,
// initialises and runs forward and backward at a small (B, T) with finite
// results (~20 s, 2 GB; Llama-2 70B's block passes too, in 80 s and 6.7 GB,
// too long for CI).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/transformer.h"

namespace {

using po::model::Transformer;
using po::model::TransformerConfig;
using po::model::UnitRange;

TEST(RealShapes, PresetLayoutsHaveThePublishedCounts) {
  EXPECT_EQ(TransformerConfig::preset("llama2-7b").num_params(), 6738415616);
  EXPECT_EQ(TransformerConfig::preset("llama2-13b").num_params(), 13015864320);
  EXPECT_EQ(TransformerConfig::preset("llama2-70b").num_params(), 68976648192);
  EXPECT_EQ(TransformerConfig::preset("llama3-8b").num_params(), 8030261248);
  EXPECT_EQ(TransformerConfig::preset("llama3-70b").num_params(), 70553706496);
  EXPECT_EQ(TransformerConfig::preset("gpt2-124M").num_params(), 124439808);
}

void run_one_block(const char* preset) {
  TransformerConfig c = TransformerConfig::preset(preset);
  const int64_t B = 1, T = 8, C = c.n_embd;
  Transformer stage(c, B, T, UnitRange{1, 1});  // block 0 alone
  ASSERT_EQ(stage.num_params(), stage.unit_numel(1)) << preset;
  stage.init_random_unit(1, 1, stage.params());
  std::vector<float> x(static_cast<size_t>(B * T * C)), d(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(0.01 * static_cast<double>(i));
    d[i] = std::cos(0.02 * static_cast<double>(i)) * 1e-3f;
  }
  stage.zero_grads();
  stage.stage_forward(nullptr, x.data(), nullptr, 0.0f);
  const float* out = stage.stage_output();
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += std::fabs(out[i] - x[i]);
  EXPECT_TRUE(std::isfinite(s) && s > 0) << preset << ": block output not finite or unchanged";
  const float* din = stage.stage_backward(nullptr, d.data());
  double g = 0;
  for (size_t i = 0; i < x.size(); ++i) g += std::fabs(din[i]);
  EXPECT_TRUE(std::isfinite(g) && g > 0) << preset << ": input gradient not finite or zero";
}

TEST(RealShapes, OneBlockOfLlama3_8BRunsForwardAndBackward) { run_one_block("llama3-8b"); }

}  // namespace
