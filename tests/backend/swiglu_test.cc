// SwiGLU forward/backward against a double reference and finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

TEST(SwiGLU, MatchesReference) {
  for (const auto& [BT, F] : {std::pair<int64_t, int64_t>{1, 1}, {7, 33}, {64, 352}}) {
    auto inp = random_vec(BT * 2 * F, BT + F, -6.0f, 6.0f), dout = random_vec(BT * F, 3);
    std::vector<float> out(BT * F), dinp(BT * 2 * F, 777.0f);  // dinp is written
    cpu::swiglu_forward(out.data(), inp.data(), BT, F);
    cpu::swiglu_backward(dinp.data(), inp.data(), dout.data(), BT, F);
    std::vector<double> out_ref(BT * F), dinp_ref(BT * 2 * F);
    for (int64_t r = 0; r < BT; r++)
      for (int64_t i = 0; i < F; i++) {
        const double g = inp[r * 2 * F + i], u = inp[r * 2 * F + F + i];
        const double s = 1.0 / (1.0 + std::exp(-g));
        out_ref[r * F + i] = g * s * u;
        dinp_ref[r * 2 * F + i] = dout[r * F + i] * u * s * (1.0 + g * (1.0 - s));
        dinp_ref[r * 2 * F + F + i] = dout[r * F + i] * g * s;
      }
    const std::string tag = "(BT=" + std::to_string(BT) + ",F=" + std::to_string(F) + ")";
    EXPECT_TRUE(all_close("out" + tag, out.data(), out_ref.data(), out.size(), 1e-5));
    EXPECT_TRUE(all_close("dinp" + tag, dinp.data(), dinp_ref.data(), dinp.size(), 1e-5));
  }
}

TEST(SwiGLU, FiniteDifferenceGradients) {
  const int64_t BT = 5, F = 13;
  auto inp = random_vec(BT * 2 * F, 50, -3.0f, 3.0f), rw = random_vec(BT * F, 51);
  std::vector<float> out(BT * F), dinp(BT * 2 * F);
  cpu::swiglu_backward(dinp.data(), inp.data(), rw.data(), BT, F);
  auto loss = [&] {
    cpu::swiglu_forward(out.data(), inp.data(), BT, F);
    double l = 0.0;
    for (size_t i = 0; i < out.size(); i++) l += static_cast<double>(out[i]) * rw[i];
    return l;
  };
  EXPECT_TRUE(po::test::grad_check("dinp", inp, dinp, po::test::sample_indices(inp.size(), 40),
                                   loss, 1e-2f, 2e-3, 0.05));
}
