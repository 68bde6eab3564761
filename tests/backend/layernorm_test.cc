// LayerNorm forward/backward against a double reference, and the backward
// against finite differences of the f32 forward.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

void check_layernorm(int64_t BT, int64_t C, uint64_t seed) {
  auto inp = random_vec(BT * C, seed, -2.0f, 3.0f), w = random_vec(C, seed + 1),
       b = random_vec(C, seed + 2), dout = random_vec(BT * C, seed + 3);
  std::vector<float> out(BT * C), mean(BT), rstd(BT);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                         BT, C);
  auto dinp = random_vec(BT * C, seed + 4), dw = random_vec(C, seed + 5),
       db = random_vec(C, seed + 6);  // all three accumulate
  std::vector<double> out_ref(BT * C), mean_ref(BT), rstd_ref(BT);
  std::vector<double> dinp_ref(dinp.begin(), dinp.end()), dw_ref(dw.begin(), dw.end()),
      db_ref(db.begin(), db.end());
  for (int64_t r = 0; r < BT; r++) {
    const float* x = &inp[r * C];
    double m = 0, v = 0;
    for (int64_t i = 0; i < C; i++) m += x[i];
    m /= C;
    for (int64_t i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    const double rs = 1.0 / std::sqrt(v / C + 1e-5);
    mean_ref[r] = m;
    rstd_ref[r] = rs;
    double a = 0, bb = 0;
    for (int64_t i = 0; i < C; i++) {
      const double xh = (x[i] - m) * rs;
      out_ref[r * C + i] = xh * w[i] + b[i];
      const double dn = dout[r * C + i] * static_cast<double>(w[i]);
      a += dn;
      bb += dn * xh;
      dw_ref[i] += dout[r * C + i] * xh;
      db_ref[i] += dout[r * C + i];
    }
    a /= C;
    bb /= C;
    for (int64_t i = 0; i < C; i++) {
      const double xh = (x[i] - m) * rs;
      dinp_ref[r * C + i] += rs * (dout[r * C + i] * static_cast<double>(w[i]) - a - xh * bb);
    }
  }
  const std::string tag = "(BT=" + std::to_string(BT) + ",C=" + std::to_string(C) + ")";
  EXPECT_TRUE(all_close("out" + tag, out.data(), out_ref.data(), out.size(), 1e-5));
  EXPECT_TRUE(all_close("mean" + tag, mean.data(), mean_ref.data(), BT, 1e-6));
  EXPECT_TRUE(all_close("rstd" + tag, rstd.data(), rstd_ref.data(), BT, 1e-6));
  cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                          mean.data(), rstd.data(), BT, C);
  EXPECT_TRUE(all_close("dinp" + tag, dinp.data(), dinp_ref.data(), dinp.size(), 1e-5));
  EXPECT_TRUE(all_close("dweight" + tag, dw.data(), dw_ref.data(), C, 1e-5));
  EXPECT_TRUE(all_close("dbias" + tag, db.data(), db_ref.data(), C, 1e-5));
}

}  // namespace

TEST(LayerNorm, MatchesReference) {
  check_layernorm(1, 1, 1);
  check_layernorm(5, 33, 10);
  check_layernorm(37, 768, 20);
  check_layernorm(130, 100, 30);
}

TEST(LayerNorm, FiniteDifferenceGradients) {
  const int64_t BT = 4, C = 21;
  auto inp = random_vec(BT * C, 40, -2.0f, 2.0f), w = random_vec(C, 41), b = random_vec(C, 42);
  auto rw = random_vec(BT * C, 43);
  std::vector<float> out(BT * C), mean(BT), rstd(BT), dinp(BT * C, 0.0f), dw(C, 0.0f),
      db(C, 0.0f);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                         BT, C);
  cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), rw.data(), inp.data(), w.data(),
                          mean.data(), rstd.data(), BT, C);
  auto loss = [&] {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(),
                           b.data(), BT, C);
    double l = 0.0;
    for (size_t i = 0; i < out.size(); i++) l += static_cast<double>(out[i]) * rw[i];
    return l;
  };
  using po::test::grad_check;
  using po::test::sample_indices;
  EXPECT_TRUE(grad_check("dinp", inp, dinp, sample_indices(inp.size(), 30), loss, 1e-2f, 2e-3, 0.05));
  EXPECT_TRUE(grad_check("dweight", w, dw, sample_indices(C, 10), loss, 1e-2f, 2e-3, 0.05));
  EXPECT_TRUE(grad_check("dbias", b, db, sample_indices(C, 10), loss, 1e-2f, 2e-3, 0.05));
}
