// GELU (tanh approximation), residual add, scale and sum_squares against
// double references; GELU's backward also by finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {
// 0.5 x (1 + tanh u) written as x * sigmoid(2u): identical in exact arithmetic,
// but free of the cancellation 1 + tanh(u) suffers for x << 0 even in double.
double gelu_ref(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));
}
double gelu_grad_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  const double u = k * (x + 0.044715 * x * x * x);
  const double s = 1.0 / (1.0 + std::exp(-2.0 * u));  // (1 + tanh u) / 2
  // 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u', with 1 - tanh^2 = 4 s (1 - s)
  return s + 2.0 * x * s * (1.0 - s) * k * (1.0 + 3.0 * 0.044715 * x * x);
}
}  // namespace

TEST(Gelu, ForwardBackwardMatchReference) {
  for (int64_t n : {1, 17, 1003, 100000}) {
    auto x = random_vec(n, n, -12.0f, 12.0f), dout = random_vec(n, n + 1);
    x[0] = 0.0f;
    std::vector<float> out(n), din(n);
    std::vector<double> out_ref(n), din_ref(n);
    for (int64_t i = 0; i < n; i++) {
      out_ref[i] = gelu_ref(x[i]);
      din_ref[i] = gelu_grad_ref(x[i]) * dout[i];
    }
    cpu::gelu_forward(out.data(), x.data(), n);
    cpu::gelu_backward(din.data(), x.data(), dout.data(), n);
    const std::string tag = "(n=" + std::to_string(n) + ")";
    // Per-element relative. For x << 0, GELU ~ x exp(-2u) and f32 rounding of
    // the argument 2u (~|2u| * 6e-8 relative) bounds what any f32 kernel can do.
    for (int64_t i = 0; i < n; i++) {
      const double u2 = 2.0 * std::sqrt(2.0 / M_PI) * std::fabs(x[i] + 0.044715 * x[i] * x[i] * x[i]);
      ASSERT_NEAR(out[i], out_ref[i], 2e-6 * (1.0 + u2) * std::fabs(out_ref[i]) + 1e-37)
          << "gelu out" << tag << "[" << i << "] at x=" << x[i];
    }
    EXPECT_TRUE(all_close("gelu dinp" + tag, din.data(), din_ref.data(), n, 1e-5));
    // dinp may alias dout
    std::vector<float> inplace(dout);
    cpu::gelu_backward(inplace.data(), x.data(), inplace.data(), n);
    EXPECT_TRUE(all_close("gelu dinp(aliased)" + tag, inplace.data(), din.data(), n, 0.0));
  }
}

TEST(Gelu, FiniteDifferenceGradient) {
  const int64_t n = 64;
  auto x = random_vec(n, 5, -4.0f, 4.0f), rw = random_vec(n, 6);
  std::vector<float> out(n), din(n);
  cpu::gelu_backward(din.data(), x.data(), rw.data(), n);
  auto loss = [&] {
    cpu::gelu_forward(out.data(), x.data(), n);
    double l = 0.0;
    for (int64_t i = 0; i < n; i++) l += static_cast<double>(out[i]) * rw[i];
    return l;
  };
  std::vector<size_t> all(n);
  for (int64_t i = 0; i < n; i++) all[i] = i;
  EXPECT_TRUE(po::test::grad_check("gelu dinp", x, din, all, loss, 1e-2f, 2e-3, 0.02));
}

TEST(Elementwise, ResidualScaleSumSquares) {
  const int64_t n = 1037;
  auto a = random_vec(n, 1), b = random_vec(n, 2);
  std::vector<float> out(n);
  cpu::residual_forward(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; i++) ASSERT_EQ(out[i], a[i] + b[i]) << "residual[" << i << "]";
  cpu::residual_forward(a.data(), a.data(), b.data(), n);  // aliasing allowed
  for (int64_t i = 0; i < n; i++) ASSERT_EQ(a[i], out[i]) << "residual(aliased)[" << i << "]";

  auto x = random_vec(n, 3, -100.0f, 100.0f);
  double want = 0.0;
  for (float v : x) want += static_cast<double>(v) * v;
  EXPECT_NEAR(cpu::sum_squares(x.data(), n), want, 1e-12 * want);
  EXPECT_EQ(cpu::sum_squares(x.data(), 0), 0.0);
  std::vector<float> y(x);
  cpu::scale(y.data(), 0.37f, n);
  for (int64_t i = 0; i < n; i++) ASSERT_EQ(y[i], x[i] * 0.37f) << "scale[" << i << "]";
}
