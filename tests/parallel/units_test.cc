// ZeRO-3 in one process (no communicator: a gather is a copy of the one
// shard, a reduce-scatter the accumulator itself): the same training as
// stage 0 for every prefetch depth, with evaluations in between (requests
// off the prefetch order), and a memory report of what it holds. The
// multi-rank equivalence runs in zero_launch_test.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../test_util.h"
#include "backend/ops.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/data_parallel.h"

namespace {

using po::model::Transformer;
using po::model::TransformerConfig;
using po::parallel::DataParallel;
using po::parallel::DataParallelOptions;

struct Curve {
  std::vector<double> loss, norm, val;
  std::vector<float> final_params;
};

// 4 steps of 2 micro-batches, an evaluation after each step.
Curve run(int stage, int prefetch, bool checkpointing = false) {
  po::backend::cpu::set_num_threads(1);  // tiny shapes: threads only contend
  TransformerConfig c = po::test::tiny_model();
  c.activation_checkpointing = checkpointing;
  const int64_t B = 2, T = 16, n = B * T;
  Transformer model(c, B, T);
  DataParallelOptions o;
  o.zero_stage = stage;
  o.prefetch = prefetch;
  po::optim::AdamWConfig adam;
  adam.grad_clip = 0.5;
  DataParallel dp(model, adam, nullptr, o);
  model.init_random(5);
  dp.shard_params();
  Curve out;
  std::vector<int32_t> in(n), tg(n);
  for (int step = 0; step < 4; ++step) {
    dp.begin_step(1e-2);
    double loss = 0;
    for (int m = 0; m < 2; ++m) {
      for (int64_t i = 0; i < n; ++i) {
        in[i] = static_cast<int32_t>((i * 31 + 7 * step + 3 * m) % c.vocab_size);
        tg[i] = static_cast<int32_t>((i * 17 + 5 * step + m + 1) % c.vocab_size);
      }
      loss += dp.micro_batch(in.data(), tg.data(), 1.0f / (2 * n), m == 1);
    }
    out.norm.push_back(dp.step(1e-2));
    out.loss.push_back(loss / 2);
    out.val.push_back(model.evaluate(tg.data(), in.data()));
  }
  for (int u = 0; u < model.num_units(); ++u) {
    const float* p = dp.param_shard(u);
    out.final_params.insert(out.final_params.end(), p, p + dp.layout().owned(u));
  }
  return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(std::fabs(a[i] - b[i]), 1e-6 * std::fabs(a[i]))
        << what << " at step " << i + 1 << ": " << a[i] << " vs " << b[i];
}

double relative_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += std::pow(static_cast<double>(a[i]) - b[i], 2);
    ref += std::pow(static_cast<double>(a[i]), 2);
  }
  return std::sqrt(diff / ref);
}

// Stage 3 sums each micro-batch's gradient in its own accumulator before
// adding it to the shard (stage 0 adds in place), so it matches stage 0 up to
// that rounding; the prefetch depth and recompute change nothing at all.
TEST(Zero3, OneProcessMatchesStageZeroAtEveryPrefetch) {
  const Curve ref = run(0, 1);
  const Curve first = run(3, 0);
  for (int prefetch : {1, 2, 9}) {
    for (bool ckpt : {false, true}) {
      if (ckpt && prefetch != 2) continue;
      const std::string what =
          "prefetch " + std::to_string(prefetch) + (ckpt ? " checkpointing" : "");
      const Curve z = run(3, prefetch, ckpt);
      expect_close(ref.loss, z.loss, what + ": loss");
      expect_close(ref.norm, z.norm, what + ": grad norm");
      expect_close(ref.val, z.val, what + ": eval loss");
      ASSERT_EQ(ref.final_params.size(), z.final_params.size());
      EXPECT_LE(relative_diff(ref.final_params, z.final_params), 1e-5)
          << what << ": parameters after 4 steps vs stage 0";
      EXPECT_EQ(relative_diff(first.final_params, z.final_params), 0.0)
          << what << ": parameters after 4 steps vs stage 3 prefetch 0 (must be bit-identical)";
    }
  }
}

TEST(Zero3, MemoryReportHoldsShardsAndPools) {
  const TransformerConfig c = po::test::tiny_model();
  Transformer model(c, 2, 16);
  DataParallelOptions o;
  o.zero_stage = 3;
  DataParallel dp(model, {}, nullptr, o);
  EXPECT_EQ(model.grads_bytes(), 0u) << "stage 3 takes over the gradients at construction";
  model.init_random(1);
  dp.shard_params();
  const size_t full = static_cast<size_t>(model.num_params()) * sizeof(float);
  auto r = dp.memory();
  EXPECT_EQ(r.params, full) << "one rank: the model's buffer is the one shard";
  EXPECT_EQ(r.gathered, 0u) << "nothing gathered before the first forward";
  std::vector<int32_t> tok(32, 3);
  model.forward_backward(tok.data(), tok.data(), 1.0f / 32);
  dp.step(1e-3);
  r = dp.memory();
  EXPECT_EQ(r.params, full);
  // Prefetch 1: the embedding, two blocks and the final LayerNorm at most.
  const size_t unit0 = static_cast<size_t>(model.unit_numel(0)) * sizeof(float);
  const size_t block = static_cast<size_t>(model.unit_numel(1)) * sizeof(float);
  EXPECT_GE(r.gathered, unit0 + block);
  EXPECT_LE(r.gathered, unit0 + 2 * block + 64 * 1024);
  EXPECT_LT(r.gathered, full) << "the gather pool must not hold the whole model";
  EXPECT_GE(r.grads, full) << "the gradient shard (the whole model at one rank)";
  EXPECT_LE(r.grads, full + unit0 + 2 * block + 64 * 1024);
  EXPECT_EQ(dp.param_shard(1), model.params() + model.unit_offset(1));
  EXPECT_EQ(dp.adam_m_shard(2), dp.adam().m() + model.unit_offset(2));
}

}  // namespace
