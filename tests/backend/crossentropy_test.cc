// Fused softmax + cross-entropy: losses and the in-place gradient against a
// double reference, gradient rows summing to zero, stability for huge logits,
// grad_scale == 0 leaving logits untouched, and finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

void ce_ref(const std::vector<float>& logits, const std::vector<int32_t>& tg, int64_t BT,
            int64_t V, double gs, std::vector<double>& loss, std::vector<double>& grad) {
  loss.assign(BT, 0.0);
  grad.assign(BT * V, 0.0);
  for (int64_t r = 0; r < BT; r++) {
    const float* z = &logits[r * V];
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < V; j++) mx = std::max(mx, static_cast<double>(z[j]));
    for (int64_t j = 0; j < V; j++) sum += std::exp(z[j] - mx);
    loss[r] = std::log(sum) + mx - z[tg[r]];
    for (int64_t j = 0; j < V; j++) grad[r * V + j] = gs * std::exp(z[j] - mx) / sum;
    grad[r * V + tg[r]] -= gs;
  }
}

std::vector<int32_t> targets_for(int64_t BT, int64_t V) {
  std::vector<int32_t> t(BT);
  for (int64_t r = 0; r < BT; r++) t[r] = static_cast<int32_t>((r * 7919 + 3) % V);
  if (BT > 1) t[1] = static_cast<int32_t>(V - 1);
  return t;
}

}  // namespace

TEST(CrossEntropy, LossAndGradientMatchReference) {
  for (auto [BT, V, spread] : {std::tuple<int64_t, int64_t, float>{5, 1001, 3.0f},
                               {1, 1, 1.0f}, {3, 50257, 10.0f}, {4, 37, 1000.0f}}) {
    auto logits = random_vec(BT * V, BT * V, -spread, spread);
    const auto tg = targets_for(BT, V);
    const float gs = 1.0f / (BT * 3);
    std::vector<double> loss_ref, grad_ref;
    ce_ref(logits, tg, BT, V, gs, loss_ref, grad_ref);
    const std::string tag = "(BT=" + std::to_string(BT) + ",V=" + std::to_string(V) + ")";
    // grad_scale = 0: losses only, logits untouched
    std::vector<float> z0(logits), loss0(BT);
    cpu::crossentropy_forward(loss0.data(), z0.data(), tg.data(), BT, V, 0.0f);
    EXPECT_TRUE(all_close("losses(no grad)" + tag, loss0.data(), loss_ref.data(), BT, 1e-5, 1e-6));
    EXPECT_TRUE(all_close("logits untouched" + tag, z0.data(), logits.data(), z0.size(), 0.0));
    std::vector<float> z(logits), loss(BT);
    cpu::crossentropy_forward(loss.data(), z.data(), tg.data(), BT, V, gs);
    for (float l : loss) ASSERT_TRUE(std::isfinite(l)) << "non-finite loss" << tag;
    EXPECT_TRUE(all_close("losses" + tag, loss.data(), loss_ref.data(), BT, 1e-5, 1e-6));
    // Elementwise relative: softmax has no cancellation except at the target.
    EXPECT_TRUE(all_close("dlogits" + tag, z.data(), grad_ref.data(), z.size(), 1e-5, 1e-12));
    for (int64_t r = 0; r < BT; r++) {
      double s = 0.0;
      for (int64_t j = 0; j < V; j++) s += z[r * V + j];
      EXPECT_NEAR(s, 0.0, 1e-6 * gs) << "gradient row " << r << tag << " sums to " << s;
    }
  }
}

TEST(CrossEntropy, FiniteDifferenceGradient) {
  const int64_t BT = 3, V = 45;
  auto logits = random_vec(BT * V, 3, -2.0f, 2.0f);
  const auto tg = targets_for(BT, V);
  const float gs = 0.5f;
  std::vector<float> grad(logits), loss(BT);
  cpu::crossentropy_forward(loss.data(), grad.data(), tg.data(), BT, V, gs);
  std::vector<float> tmp(logits.size());
  auto L = [&] {
    tmp = logits;
    cpu::crossentropy_forward(loss.data(), tmp.data(), tg.data(), BT, V, 0.0f);
    double s = 0.0;
    for (float l : loss) s += l;
    return gs * s;
  };
  std::vector<size_t> idx;
  for (int64_t r = 0; r < BT; r++) {
    idx.push_back(r * V + tg[r]);
    idx.push_back(r * V + (tg[r] + 5) % V);
  }
  auto more = po::test::sample_indices(logits.size(), 20);
  idx.insert(idx.end(), more.begin(), more.end());
  EXPECT_TRUE(po::test::grad_check("dlogits", logits, grad, idx, L, 1e-2f, 2e-3, 2e-2));
}
