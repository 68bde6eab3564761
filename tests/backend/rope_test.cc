// RoPE (rotate-half) against a double reference built from HF Llama's
// formulas, the backward as the exact inverse and by finite differences, and
// Llama-3.1's frequency scaling against its published rule.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

// HF: inv_freq = 1 / theta^(arange(0, hs, 2) / hs); x * cos + rotate_half(x) * sin.
std::vector<double> rope_ref(const std::vector<float>& x, int64_t B, int64_t T, int64_t stride,
                             int64_t n_heads, int64_t hs, double theta, int64_t pos0) {
  std::vector<double> out(x.begin(), x.end());
  const int64_t half = hs / 2;
  for (int64_t bt = 0; bt < B * T; bt++)
    for (int64_t h = 0; h < n_heads; h++)
      for (int64_t i = 0; i < hs; i++) {
        const int64_t j = i % half;
        const double a = static_cast<double>(pos0 + bt % T) / std::pow(theta, 2.0 * j / hs);
        const float* row = &x[bt * stride + h * hs];
        const double rot = i < half ? -static_cast<double>(row[i + half]) : row[i - half];
        out[bt * stride + h * hs + i] = row[i] * std::cos(a) + rot * std::sin(a);
      }
  return out;
}

}  // namespace

TEST(Rope, MatchesRotateHalfReference) {
  for (const auto& [T, hs, pos0] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 2, 0}, {17, 16, 0}, {33, 64, 5}, {9, 128, 100}}) {
    const int64_t B = 2, n_heads = 3, stride = 5 * hs;  // rotates 3 of 5 heads per row
    cpu::RopeScaling rs;
    rs.theta = 10000.0;
    std::vector<float> cos_t((pos0 + T) * hs / 2), sin_t(cos_t.size());
    cpu::rope_table(cos_t.data(), sin_t.data(), pos0 + T, hs, rs);
    auto x = random_vec(B * T * stride, T + hs);
    const auto want = rope_ref(x, B, T, stride, n_heads, hs, rs.theta, pos0);
    auto y = x;
    cpu::rope_forward(y.data(), B, T, stride, n_heads, hs, cos_t.data(), sin_t.data(), pos0);
    const std::string tag = "(T=" + std::to_string(T) + ",hs=" + std::to_string(hs) + ")";
    EXPECT_TRUE(all_close("rope" + tag, y.data(), want.data(), y.size(), 1e-6));
    cpu::rope_backward(y.data(), B, T, stride, n_heads, hs, cos_t.data(), sin_t.data(), pos0);
    EXPECT_TRUE(all_close("inverse" + tag, y.data(), x.data(), y.size(), 1e-6));
  }
}

TEST(Rope, BackwardIsTheTransposeByFiniteDifferences) {
  const int64_t B = 1, T = 6, hs = 8, n = 2, stride = n * hs;
  cpu::RopeScaling rs;
  std::vector<float> cos_t(T * hs / 2), sin_t(cos_t.size());
  cpu::rope_table(cos_t.data(), sin_t.data(), T, hs, rs);
  auto x = random_vec(B * T * stride, 3), rw = random_vec(B * T * stride, 4);
  auto dx = rw;
  cpu::rope_backward(dx.data(), B, T, stride, n, hs, cos_t.data(), sin_t.data());
  auto loss = [&] {
    auto y = x;
    cpu::rope_forward(y.data(), B, T, stride, n, hs, cos_t.data(), sin_t.data());
    double l = 0.0;
    for (size_t i = 0; i < y.size(); i++) l += static_cast<double>(y[i]) * rw[i];
    return l;
  };
  EXPECT_TRUE(po::test::grad_check("dx", x, dx, po::test::sample_indices(x.size(), 30), loss,
                                   1e-2f, 2e-3, 0.05));
}

// Llama-3.1 (factor 8, low 1, high 4, original 8192, theta 500000): wavelengths
// above 8192 are divided by 8, below 2048 kept, between blended.
TEST(Rope, Llama31ScalingRule) {
  cpu::RopeScaling rs;
  rs.theta = 500000.0;
  rs.factor = 8.0;
  rs.low_freq_factor = 1.0;
  rs.high_freq_factor = 4.0;
  rs.original_max_position = 8192.0;
  const int64_t hs = 128;
  std::vector<double> f(hs / 2);
  cpu::rope_inv_freq(f.data(), hs, rs);
  const double kPi = 3.14159265358979323846;
  int low = 0, high = 0, mid = 0;
  for (int64_t i = 0; i < hs / 2; i++) {
    const double base = 1.0 / std::pow(500000.0, 2.0 * i / hs), wl = 2 * kPi / base;
    if (wl < 2048.0) {
      EXPECT_DOUBLE_EQ(f[i], base) << "pair " << i << " (short wavelength) must be unscaled";
      ++high;
    } else if (wl > 8192.0) {
      EXPECT_DOUBLE_EQ(f[i], base / 8.0) << "pair " << i << " (long wavelength) must be / 8";
      ++low;
    } else {
      const double s = (8192.0 / wl - 1.0) / 3.0;
      EXPECT_NEAR(f[i], (1 - s) * base / 8.0 + s * base, 1e-15 * base) << "pair " << i;
      ++mid;
    }
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(high, 0);
  EXPECT_GT(mid, 0);
}
