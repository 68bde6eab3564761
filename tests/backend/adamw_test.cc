// AdamW against a scalar loop in torch.optim.AdamW's order of operations, and
// against the same update in double.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

TEST(AdamW, MatchesTorchOrderScalarLoop) {
  const int64_t n = 1037;
  const float lr = 6e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  auto p = random_vec(n, 1), m = random_vec(n, 2, 0.0f, 0.0f), v = random_vec(n, 3, 0.0f, 0.0f);
  std::vector<float> pf(p), mf(m), vf(v);
  std::vector<double> pd(p.begin(), p.end()), md(n, 0.0), vd(n, 0.0);
  for (int64_t t = 1; t <= 5; t++) {
    auto g = random_vec(n, 10 + t, -0.1f, 0.1f);
    if (t == 3) g[0] = 0.0f;  // v stays ~0 for one element: eps matters
    cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, gs, t);
    const double bc1 = 1.0 - std::pow(static_cast<double>(b1), t);
    const double bc2 = 1.0 - std::pow(static_cast<double>(b2), t);
    for (int64_t i = 0; i < n; i++) {
      // f32 scalar loop, torch order: decay, m, v, addcdiv
      const float gi = g[i] * gs;
      pf[i] *= static_cast<float>(1.0 - static_cast<double>(lr) * wd);
      mf[i] = mf[i] * b1 + static_cast<float>(1.0 - b1) * gi;
      vf[i] = vf[i] * b2 + static_cast<float>(1.0 - b2) * gi * gi;
      const float denom = std::sqrt(vf[i]) / static_cast<float>(std::sqrt(bc2)) + eps;
      pf[i] += static_cast<float>(-(lr / bc1)) * mf[i] / denom;
      // double
      const double gd = static_cast<double>(g[i]) * gs;
      pd[i] *= 1.0 - static_cast<double>(lr) * wd;
      md[i] = md[i] * b1 + (1.0 - b1) * gd;
      vd[i] = vd[i] * b2 + (1.0 - b2) * gd * gd;
      pd[i] -= (lr / bc1) * md[i] / (std::sqrt(vd[i]) / std::sqrt(bc2) + eps);
    }
    const std::string tag = "(step " + std::to_string(t) + ")";
    ASSERT_TRUE(all_close("param vs f32 loop" + tag, p.data(), pf.data(), n, 2e-7));
    ASSERT_TRUE(all_close("m vs f32 loop" + tag, m.data(), mf.data(), n, 2e-7));
    ASSERT_TRUE(all_close("v vs f32 loop" + tag, v.data(), vf.data(), n, 2e-7));
    ASSERT_TRUE(all_close("param vs double" + tag, p.data(), pd.data(), n, 1e-6));
  }
}
