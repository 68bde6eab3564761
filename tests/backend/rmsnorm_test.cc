// RMSNorm forward/backward against a double reference, and the backward
// against finite differences of the f32 forward.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

void check_rmsnorm(int64_t BT, int64_t C, double eps, uint64_t seed) {
  auto inp = random_vec(BT * C, seed, -2.0f, 3.0f), w = random_vec(C, seed + 1),
       dout = random_vec(BT * C, seed + 3);
  std::vector<float> out(BT * C), rstd(BT);
  cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), BT, C, eps);
  auto dinp = random_vec(BT * C, seed + 4), dw = random_vec(C, seed + 5);  // both accumulate
  std::vector<double> out_ref(BT * C), rstd_ref(BT), dinp_ref(dinp.begin(), dinp.end()),
      dw_ref(dw.begin(), dw.end());
  for (int64_t r = 0; r < BT; r++) {
    const float* x = &inp[r * C];
    double ss = 0;
    for (int64_t i = 0; i < C; i++) ss += static_cast<double>(x[i]) * x[i];
    const double rs = 1.0 / std::sqrt(ss / C + eps);
    rstd_ref[r] = rs;
    double b = 0;
    for (int64_t i = 0; i < C; i++) {
      out_ref[r * C + i] = x[i] * rs * w[i];
      b += dout[r * C + i] * static_cast<double>(w[i]) * x[i] * rs;
      dw_ref[i] += dout[r * C + i] * x[i] * rs;
    }
    b /= C;
    for (int64_t i = 0; i < C; i++)
      dinp_ref[r * C + i] += rs * (dout[r * C + i] * static_cast<double>(w[i]) - x[i] * rs * b);
  }
  const std::string tag = "(BT=" + std::to_string(BT) + ",C=" + std::to_string(C) + ")";
  EXPECT_TRUE(all_close("out" + tag, out.data(), out_ref.data(), out.size(), 1e-5));
  EXPECT_TRUE(all_close("rstd" + tag, rstd.data(), rstd_ref.data(), BT, 1e-6));
  cpu::rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(),
                        BT, C);
  EXPECT_TRUE(all_close("dinp" + tag, dinp.data(), dinp_ref.data(), dinp.size(), 1e-5));
  EXPECT_TRUE(all_close("dweight" + tag, dw.data(), dw_ref.data(), C, 1e-5));
}

}  // namespace

TEST(RMSNorm, MatchesReference) {
  check_rmsnorm(1, 1, 1e-5, 1);
  check_rmsnorm(5, 33, 1e-6, 10);
  check_rmsnorm(37, 768, 1e-5, 20);
  check_rmsnorm(130, 100, 1e-6, 30);
}

TEST(RMSNorm, FiniteDifferenceGradients) {
  const int64_t BT = 4, C = 21;
  auto inp = random_vec(BT * C, 40, -2.0f, 2.0f), w = random_vec(C, 41);
  auto rw = random_vec(BT * C, 43);
  std::vector<float> out(BT * C), rstd(BT), dinp(BT * C, 0.0f), dw(C, 0.0f);
  cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), BT, C, 1e-5);
  cpu::rmsnorm_backward(dinp.data(), dw.data(), rw.data(), inp.data(), w.data(), rstd.data(), BT,
                        C);
  auto loss = [&] {
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), BT, C, 1e-5);
    double l = 0.0;
    for (size_t i = 0; i < out.size(); i++) l += static_cast<double>(out[i]) * rw[i];
    return l;
  };
  using po::test::grad_check;
  using po::test::sample_indices;
  EXPECT_TRUE(grad_check("dinp", inp, dinp, sample_indices(inp.size(), 30), loss, 1e-2f, 2e-3, 0.05));
  EXPECT_TRUE(grad_check("dweight", w, dw, sample_indices(C, 10), loss, 1e-2f, 2e-3, 0.05));
}
