// Flash-style causal attention against a naive materialised-softmax reference
// in double (out, lse, dq/dk/dv), on awkward shapes (T not a multiple of the
// block, T = 1, hs = 16/24/32/64/128), and by finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

struct AttnRef {
  std::vector<double> out, lse, dqkv;
};

AttnRef attention_ref(const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B,
                      int64_t T, int64_t C, int64_t NH) {
  const int64_t hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  AttnRef r{std::vector<double>(B * T * C), std::vector<double>(B * NH * T),
            std::vector<double>(B * T * C3, 0.0)};
  std::vector<double> P(T), dP(T);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t i = 0; i < T; i++) {
        const float* q = &qkv[(b * T + i) * C3 + h * hs];
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; j++) {
          const float* k = &qkv[(b * T + j) * C3 + C + h * hs];
          double s = 0;
          for (int64_t d = 0; d < hs; d++) s += static_cast<double>(q[d]) * k[d];
          P[j] = s * scale;
          mx = std::max(mx, P[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; j++) sum += std::exp(P[j] - mx);
        r.lse[(b * NH + h) * T + i] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; j++) P[j] = std::exp(P[j] - mx) / sum;
        const float* go = &dout[(b * T + i) * C + h * hs];
        double dsum = 0;
        for (int64_t j = 0; j <= i; j++) {
          const float* v = &qkv[(b * T + j) * C3 + 2 * C + h * hs];
          double s = 0;
          for (int64_t d = 0; d < hs; d++) {
            r.out[(b * T + i) * C + h * hs + d] += P[j] * v[d];
            s += static_cast<double>(go[d]) * v[d];
          }
          dP[j] = s;
          dsum += P[j] * s;
        }
        double* dq = &r.dqkv[(b * T + i) * C3 + h * hs];
        for (int64_t j = 0; j <= i; j++) {
          const double ds = P[j] * (dP[j] - dsum) * scale;
          const float* k = &qkv[(b * T + j) * C3 + C + h * hs];
          double* dk = &r.dqkv[(b * T + j) * C3 + C + h * hs];
          double* dv = &r.dqkv[(b * T + j) * C3 + 2 * C + h * hs];
          for (int64_t d = 0; d < hs; d++) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
            dv[d] += P[j] * go[d];
          }
        }
      }
  return r;
}

void check_attention(int64_t B, int64_t T, int64_t C, int64_t NH, float spread) {
  auto qkv = random_vec(B * T * 3 * C, T * 131 + C, -spread, spread);
  auto dout = random_vec(B * T * C, T + 7);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  std::vector<float> dqkv(B * T * 3 * C, 777.0f);  // must be fully overwritten
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T,
                          C, NH);
  const AttnRef r = attention_ref(qkv, dout, B, T, C, NH);
  const std::string tag = "(B=" + std::to_string(B) + ",T=" + std::to_string(T) +
                          ",C=" + std::to_string(C) + ",NH=" + std::to_string(NH) + ")";
  EXPECT_TRUE(all_close("out" + tag, out.data(), r.out.data(), out.size(), 1e-5));
  EXPECT_TRUE(all_close("lse" + tag, lse.data(), r.lse.data(), lse.size(), 1e-6));
  EXPECT_TRUE(all_close("dqkv" + tag, dqkv.data(), r.dqkv.data(), dqkv.size(), 2e-5));
}

}  // namespace

TEST(Attention, MatchesMaterialisedReference) {
  check_attention(2, 67, 128, 2, 1.0f);   // hs = 64, T straddles a block
  check_attention(1, 1, 64, 4, 1.0f);     // T = 1, hs = 16
  check_attention(2, 130, 48, 3, 1.0f);   // hs = 16, three blocks
  check_attention(1, 64, 96, 3, 1.0f);    // hs = 32, exactly one block
  check_attention(1, 129, 72, 3, 1.0f);   // hs = 24 (generic path)
  check_attention(1, 70, 256, 2, 1.0f);   // hs = 128
  check_attention(3, 200, 128, 2, 4.0f);  // peaked softmax (large scores)
}

TEST(Attention, FiniteDifferenceGradients) {
  const int64_t B = 1, T = 70, C = 32, NH = 2;
  auto qkv = random_vec(B * T * 3 * C, 99, -1.0f, 1.0f);
  auto rw = random_vec(B * T * C, 100);
  std::vector<float> out(B * T * C), lse(B * NH * T), dqkv(B * T * 3 * C);
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  cpu::attention_backward(dqkv.data(), rw.data(), qkv.data(), out.data(), lse.data(), B, T, C,
                          NH);
  std::vector<float> o2(out.size()), l2(lse.size());
  auto loss = [&] {
    cpu::attention_forward(o2.data(), l2.data(), qkv.data(), B, T, C, NH);
    double l = 0.0;
    for (size_t i = 0; i < o2.size(); i++) l += static_cast<double>(o2[i]) * rw[i];
    return l;
  };
  EXPECT_TRUE(po::test::grad_check("dqkv", qkv, dqkv, po::test::sample_indices(qkv.size(), 60),
                                   loss, 1e-2f, 5e-3, 0.02));
}
