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

namespace {

// The loss and gradient of [BT, V] logits computed over vocabulary pieces at
// the given boundaries (each piece's logits packed [BT, Vk], as the head lays
// them out), the gradient scattered back to [BT, V]; bf16: the gradient's bits.
void ce_by_pieces(const std::vector<float>& logits, const std::vector<int32_t>& tg, int64_t BT,
                  int64_t V, const std::vector<int64_t>& bounds, float gs, std::vector<float>& loss,
                  std::vector<float>& grad, std::vector<uint16_t>* grad16 = nullptr) {
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<float> mx(P * BT), zt(BT), scale(P * BT);
  std::vector<double> sum(P * BT);
  std::vector<std::vector<float>> z(P);
  for (int64_t k = 0; k < P; k++) {
    const int64_t v0 = bounds[k], Vk = bounds[k + 1] - v0;
    z[k].resize(BT * Vk);
    for (int64_t r = 0; r < BT; r++)
      for (int64_t j = 0; j < Vk; j++) z[k][r * Vk + j] = logits[r * V + v0 + j];
    cpu::ce_piece_stats(mx.data() + k * BT, sum.data() + k * BT, zt.data(), z[k].data(), tg.data(),
                        BT, Vk, v0, gs != 0.0f);
  }
  loss.assign(BT, 0.0f);
  cpu::ce_piece_combine(loss.data(), scale.data(), mx.data(), sum.data(), zt.data(), tg.data(), P, BT, gs);
  grad.assign(BT * V, 0.0f);
  if (grad16) grad16->assign(BT * V, 0);
  if (gs == 0.0f) return;
  for (int64_t k = 0; k < P; k++) {
    const int64_t v0 = bounds[k], Vk = bounds[k + 1] - v0;
    std::vector<uint16_t> g16(BT * Vk);
    if (grad16) cpu::ce_piece_grad(g16.data(), z[k].data(), scale.data() + k * BT, tg.data(), BT, Vk, v0, gs);
    cpu::ce_piece_grad(z[k].data(), scale.data() + k * BT, tg.data(), BT, Vk, v0, gs);
    for (int64_t r = 0; r < BT; r++)
      for (int64_t j = 0; j < Vk; j++) {
        grad[r * V + v0 + j] = z[k][r * Vk + j];
        if (grad16) (*grad16)[r * V + v0 + j] = g16[r * Vk + j];
      }
  }
}

}  // namespace

// One piece is the fused kernel: the same loss and gradient bits, f32 and bf16.
TEST(CrossEntropyPieces, OnePieceIsTheFusedKernelsBits) {
  const int64_t BT = 6, V = 3001;
  const auto logits = random_vec(BT * V, 11, -8.0f, 8.0f);
  const auto tg = targets_for(BT, V);
  const float gs = 1.0f / 24;
  std::vector<float> loss, grad;
  std::vector<uint16_t> g16;
  ce_by_pieces(logits, tg, BT, V, {0, V}, gs, loss, grad, &g16);
  std::vector<float> z(logits), loss_f(BT), zb(logits), loss_b(BT);
  std::vector<uint16_t> fused16(BT * V);
  cpu::crossentropy_forward(loss_f.data(), z.data(), tg.data(), BT, V, gs);
  cpu::crossentropy_forward_bf16(loss_b.data(), zb.data(), fused16.data(), tg.data(), BT, V, gs);
  EXPECT_TRUE(all_close("losses, one piece vs fused", loss.data(), loss_f.data(), BT, 0.0));
  EXPECT_TRUE(all_close("dlogits, one piece vs fused", grad.data(), z.data(), z.size(), 0.0));
  for (int64_t i = 0; i < BT * V; i++)
    ASSERT_EQ(g16[i], fused16[i]) << "bf16 dlogits differ at row " << i / V << " column " << i % V;
}

// Pieces of any boundaries follow the double reference as closely as the
// fused kernel: each piece's sum has the fused kernel's error (1024-term
// blocks, f32 lanes), and the combination is in double, so the bound is the
// fused test's (loss 1e-5 relative, gradient 1e-5 elementwise).
TEST(CrossEntropyPieces, AnyPiecesMatchTheReference) {
  for (auto [BT, V, spread] : {std::tuple<int64_t, int64_t, float>{5, 1001, 3.0f},
                               {3, 50257, 10.0f}, {4, 37, 1000.0f}}) {
    const auto logits = random_vec(BT * V, BT + V, -spread, spread);
    const auto tg = targets_for(BT, V);
    const float gs = 1.0f / (BT * 3);
    std::vector<double> loss_ref, grad_ref;
    ce_ref(logits, tg, BT, V, gs, loss_ref, grad_ref);
    for (int64_t P : {2, 3, 8}) {
      std::vector<int64_t> b{0};
      for (int64_t k = 0; k < P; k++) b.push_back(b.back() + V / P + (k < V % P ? 1 : 0));
      const std::string tag = "(BT=" + std::to_string(BT) + ",V=" + std::to_string(V) +
                              ", " + std::to_string(P) + " pieces)";
      std::vector<float> loss, grad;
      ce_by_pieces(logits, tg, BT, V, b, gs, loss, grad);
      EXPECT_TRUE(all_close("losses" + tag, loss.data(), loss_ref.data(), BT, 1e-5, 1e-6));
      EXPECT_TRUE(all_close("dlogits" + tag, grad.data(), grad_ref.data(), grad.size(), 1e-5, 1e-12));
      std::vector<float> loss0, grad0;  // grad_scale 0: the same losses
      ce_by_pieces(logits, tg, BT, V, b, 0.0f, loss0, grad0);
      EXPECT_TRUE(all_close("losses without gradient" + tag, loss0.data(), loss.data(), BT, 0.0));
    }
  }
}

// SFT's masked rows (ops::kIgnoreTarget): loss 0 and a zero gradient row in
// the fused kernels (f32 and bf16) and over vocabulary pieces, and the other
// rows' bits the same as with every row counted.
TEST(CrossEntropy, IgnoredRowsGiveNoLossAndNoGradient) {
  const int64_t BT = 6, V = 1001;
  const auto logits = random_vec(BT * V, 5, -6.0f, 6.0f);
  const auto tg = targets_for(BT, V);
  auto masked = tg;
  masked[1] = masked[4] = cpu::kIgnoreTarget;
  const float gs = 1.0f / 24;
  auto check = [&](const std::string& what, const float* loss_all, const float* loss_m,
                   auto grad_all, auto grad_m) {
    for (int64_t r = 0; r < BT; r++) {
      const bool ignored = masked[r] < 0;
      EXPECT_EQ(loss_m[r], ignored ? 0.0f : loss_all[r]) << what << ": loss of row " << r;
      for (int64_t j = 0; j < V; j++) {
        const auto want = ignored ? 0 : grad_all[r * V + j];
        if (grad_m[r * V + j] != want) {
          ADD_FAILURE() << what << ": gradient of row " << r << " column " << j << " is "
                        << grad_m[r * V + j] << ", expected " << want;
          break;
        }
      }
    }
  };
  std::vector<float> z_all(logits), l_all(BT), z_m(logits), l_m(BT);
  cpu::crossentropy_forward(l_all.data(), z_all.data(), tg.data(), BT, V, gs);
  cpu::crossentropy_forward(l_m.data(), z_m.data(), masked.data(), BT, V, gs);
  check("fused f32", l_all.data(), l_m.data(), z_all.data(), z_m.data());
  std::vector<uint16_t> g_all(BT * V), g_m(BT * V);
  std::vector<float> zb_all(logits), zb_m(logits);
  cpu::crossentropy_forward_bf16(l_all.data(), zb_all.data(), g_all.data(), tg.data(), BT, V, gs);
  cpu::crossentropy_forward_bf16(l_m.data(), zb_m.data(), g_m.data(), masked.data(), BT, V, gs);
  check("fused bf16", l_all.data(), l_m.data(), g_all.data(), g_m.data());
  std::vector<float> pl_all, pg_all, pl_m, pg_m;
  ce_by_pieces(logits, tg, BT, V, {0, 300, 700, V}, gs, pl_all, pg_all);
  ce_by_pieces(logits, masked, BT, V, {0, 300, 700, V}, gs, pl_m, pg_m);
  check("3 pieces", pl_all.data(), pl_m.data(), pg_all.data(), pg_m.data());
}
