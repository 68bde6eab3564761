// Flash-style causal attention against a naive materialised-softmax reference
// in double (out, lse, dq/dk/dv), on awkward shapes (T not a multiple of the
// block, T = 1, hs = 16/24/32/64/128), multi-head, grouped-query and
// multi-query, and by finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

struct AttnRef {
  std::vector<double> out, lse, dqkv;
};

// Naive reference; query head h reads kv head h / (NH / NKV).
AttnRef attention_ref(const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B,
                      int64_t T, int64_t NH, int64_t NKV, int64_t hs) {
  const int64_t C = NH * hs, C3 = (NH + 2 * NKV) * hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  AttnRef r{std::vector<double>(B * T * C), std::vector<double>(B * NH * T),
            std::vector<double>(B * T * C3, 0.0)};
  std::vector<double> P(T), dP(T);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t i = 0; i < T; i++) {
        const int64_t kc = (NH + h / (NH / NKV)) * hs, vc = kc + NKV * hs;
        const float* q = &qkv[(b * T + i) * C3 + h * hs];
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; j++) {
          const float* k = &qkv[(b * T + j) * C3 + kc];
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
          const float* v = &qkv[(b * T + j) * C3 + vc];
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
          const float* k = &qkv[(b * T + j) * C3 + kc];
          double* dk = &r.dqkv[(b * T + j) * C3 + kc];
          double* dv = &r.dqkv[(b * T + j) * C3 + vc];
          for (int64_t d = 0; d < hs; d++) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
            dv[d] += P[j] * go[d];
          }
        }
      }
  return r;
}

void check_attention(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t hs, float spread) {
  const int64_t C = NH * hs, C3 = (NH + 2 * NKV) * hs;
  auto qkv = random_vec(B * T * C3, T * 131 + C + NKV, -spread, spread);
  auto dout = random_vec(B * T * C, T + 7);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  std::vector<float> dqkv(B * T * C3, 777.0f);  // must be fully overwritten
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, hs);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                          NKV, hs);
  const AttnRef r = attention_ref(qkv, dout, B, T, NH, NKV, hs);
  const std::string tag = "(B=" + std::to_string(B) + ",T=" + std::to_string(T) +
                          ",NH=" + std::to_string(NH) + ",NKV=" + std::to_string(NKV) +
                          ",hs=" + std::to_string(hs) + ")";
  EXPECT_TRUE(all_close("out" + tag, out.data(), r.out.data(), out.size(), 1e-5));
  EXPECT_TRUE(all_close("lse" + tag, lse.data(), r.lse.data(), lse.size(), 1e-6));
  EXPECT_TRUE(all_close("dqkv" + tag, dqkv.data(), r.dqkv.data(), dqkv.size(), 2e-5));
}

}  // namespace

TEST(Attention, MatchesMaterialisedReference) {
  check_attention(2, 67, 2, 2, 64, 1.0f);   // hs = 64, T straddles a block
  check_attention(1, 1, 4, 4, 16, 1.0f);    // T = 1, hs = 16
  check_attention(2, 130, 3, 3, 16, 1.0f);  // hs = 16, three blocks
  check_attention(1, 64, 3, 3, 32, 1.0f);   // hs = 32, exactly one block
  check_attention(1, 129, 3, 3, 24, 1.0f);  // hs = 24 (generic path)
  check_attention(1, 70, 2, 2, 128, 1.0f);  // hs = 128
  check_attention(3, 200, 2, 2, 64, 4.0f);  // peaked softmax (large scores)
}

TEST(Attention, GroupedAndMultiQueryMatchReference) {
  check_attention(2, 67, 4, 2, 16, 1.0f);   // two query heads per kv head
  check_attention(1, 130, 6, 2, 32, 1.0f);  // three per kv head, three blocks
  check_attention(2, 70, 4, 1, 24, 1.0f);   // multi-query, generic hs
  check_attention(1, 1, 8, 1, 16, 1.0f);    // multi-query, T = 1
}

// A group's heads add into one dk/dv: GQA with the kv heads repeated must give
// the multi-head result bit for bit in out, and dk/dv equal to the sum of the
// repeated heads' gradients to rounding.
TEST(Attention, GroupedEqualsRepeatedKv) {
  const int64_t B = 1, T = 90, NH = 4, NKV = 2, hs = 32, per = NH / NKV;
  auto g = random_vec(B * T * (NH + 2 * NKV) * hs, 5);
  std::vector<float> m(B * T * 3 * NH * hs);
  for (int64_t t = 0; t < B * T; t++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t d = 0; d < hs; d++) {
        const float* row = &g[t * (NH + 2 * NKV) * hs];
        float* mrow = &m[t * 3 * NH * hs];
        mrow[h * hs + d] = row[h * hs + d];
        mrow[(NH + h) * hs + d] = row[(NH + h / per) * hs + d];
        mrow[(2 * NH + h) * hs + d] = row[(NH + NKV + h / per) * hs + d];
      }
  auto dout = random_vec(B * T * NH * hs, 6);
  std::vector<float> og(B * T * NH * hs), om(og.size()), lg(B * NH * T), lm(lg.size());
  std::vector<float> dg(g.size()), dm(m.size());
  cpu::attention_forward(og.data(), lg.data(), g.data(), B, T, NH, NKV, hs);
  cpu::attention_forward(om.data(), lm.data(), m.data(), B, T, NH, NH, hs);
  EXPECT_EQ(0, std::memcmp(og.data(), om.data(), og.size() * sizeof(float)))
      << "GQA forward differs from multi-head attention over repeated k, v";
  cpu::attention_backward(dg.data(), dout.data(), g.data(), og.data(), lg.data(), B, T, NH, NKV, hs);
  cpu::attention_backward(dm.data(), dout.data(), m.data(), om.data(), lm.data(), B, T, NH, NH, hs);
  std::vector<double> want(g.size(), 0.0);
  for (int64_t t = 0; t < B * T; t++)
    for (int64_t h = 0; h < NH; h++)
      for (int64_t d = 0; d < hs; d++) {
        const int64_t r = t * (NH + 2 * NKV) * hs, mr = t * 3 * NH * hs;
        want[r + h * hs + d] = dm[mr + h * hs + d];
        want[r + (NH + h / per) * hs + d] += dm[mr + (NH + h) * hs + d];
        want[r + (NH + NKV + h / per) * hs + d] += dm[mr + (2 * NH + h) * hs + d];
      }
  EXPECT_TRUE(all_close("dqkv(GQA vs repeated)", dg.data(), want.data(), dg.size(), 1e-6));
}

TEST(Attention, FiniteDifferenceGradients) {
  for (const int64_t NKV : {int64_t{4}, int64_t{2}, int64_t{1}}) {
  const int64_t B = 1, T = 70, NH = 4, hs = 8, C = NH * hs;
  auto qkv = random_vec(B * T * (NH + 2 * NKV) * hs, 99, -1.0f, 1.0f);
  auto rw = random_vec(B * T * C, 100);
  std::vector<float> out(B * T * C), lse(B * NH * T), dqkv(qkv.size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, hs);
  cpu::attention_backward(dqkv.data(), rw.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                          NKV, hs);
  std::vector<float> o2(out.size()), l2(lse.size());
  auto loss = [&] {
    cpu::attention_forward(o2.data(), l2.data(), qkv.data(), B, T, NH, NKV, hs);
    double l = 0.0;
    for (size_t i = 0; i < o2.size(); i++) l += static_cast<double>(o2[i]) * rw[i];
    return l;
  };
  EXPECT_TRUE(po::test::grad_check("dqkv(NKV=" + std::to_string(NKV) + ")", qkv, dqkv,
                                   po::test::sample_indices(qkv.size(), 60), loss, 1e-2f, 5e-3,
                                   0.02));
  }
}

// bf16 tiles (gemm_precision() == kBF16): against the double reference on the
// bf16-rounded inputs (q, k, v, dout). What remains is the rounding of the
// pre-scaled q and of each tile's probabilities and score gradients to bf16
// (relative 2^-8 each, unit roundoff of an 8-bit significand) with f32
// accumulation: out within 4 x 2^-8 relative to its scale (|want| + rms), lse
// within 2^-8 (it sums f32 probabilities), dqkv within 12 x 2^-8: the score
// gradient dS = P (dP - D) cancels (dP and D are close) before it is rounded,
// and each dq, dk element sums up to T such terms (measured: up to 8 x 2^-8
// on these shapes). The bits do not depend on the thread count.
namespace {

struct AttnOut {
  std::vector<float> out, lse, dqkv;
};

AttnOut run_attention(const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B,
                      int64_t T, int64_t NH, int64_t NKV, int64_t hs) {
  AttnOut r{std::vector<float>(B * T * NH * hs), std::vector<float>(B * NH * T),
            std::vector<float>(qkv.size(), 777.0f)};
  cpu::attention_forward(r.out.data(), r.lse.data(), qkv.data(), B, T, NH, NKV, hs);
  cpu::attention_backward(r.dqkv.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), B, T,
                          NH, NKV, hs);
  return r;
}

void check_bf16_attention(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t hs) {
  const int64_t C = NH * hs, C3 = (NH + 2 * NKV) * hs;
  const auto qkv = po::test::rounded_bf16(random_vec(B * T * C3, T * 17 + hs));
  const auto dout = po::test::rounded_bf16(random_vec(B * T * C, T + 3));
  const std::string tag = "(bf16 tiles, B=" + std::to_string(B) + ",T=" + std::to_string(T) +
                          ",NH=" + std::to_string(NH) + ",NKV=" + std::to_string(NKV) +
                          ",hs=" + std::to_string(hs) + ")";
  cpu::set_gemm_precision(cpu::GemmPrecision::kBF16);
  cpu::set_num_threads(2);
  const AttnOut two = run_attention(qkv, dout, B, T, NH, NKV, hs);
  cpu::set_num_threads(1);
  const AttnOut one = run_attention(qkv, dout, B, T, NH, NKV, hs);
  cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
  const AttnOut f32 = run_attention(qkv, dout, B, T, NH, NKV, hs);
  const AttnRef r = attention_ref(qkv, dout, B, T, NH, NKV, hs);
  const double u = std::ldexp(1.0, -8);
  EXPECT_TRUE(all_close("out" + tag, two.out.data(), r.out.data(), r.out.size(), 4 * u));
  EXPECT_TRUE(all_close("lse" + tag, two.lse.data(), r.lse.data(), r.lse.size(), u));
  EXPECT_TRUE(all_close("dqkv" + tag, two.dqkv.data(), r.dqkv.data(), r.dqkv.size(), 12 * u));
  EXPECT_EQ(0, std::memcmp(one.out.data(), two.out.data(), one.out.size() * sizeof(float)))
      << "out" << tag << " differs between 1 and 2 threads";
  EXPECT_EQ(0, std::memcmp(one.dqkv.data(), two.dqkv.data(), one.dqkv.size() * sizeof(float)))
      << "dqkv" << tag << " differs between 1 and 2 threads";
  // The backward from the saved bf16 q, k, v and output as they are: their
  // widened copies' bits, on either tiles.
  std::vector<uint16_t> qkv16(qkv.size()), out16(two.out.size());
  cpu::f32_to_bf16(qkv16.data(), qkv.data(), static_cast<int64_t>(qkv.size()));
  cpu::f32_to_bf16(out16.data(), two.out.data(), static_cast<int64_t>(out16.size()));
  std::vector<float> outw(out16.size());
  cpu::bf16_to_f32(outw.data(), out16.data(), static_cast<int64_t>(out16.size()));
  for (const auto p : {cpu::GemmPrecision::kBF16, cpu::GemmPrecision::kF32}) {
    cpu::set_gemm_precision(p);
    std::vector<float> widened(qkv.size(), 777.0f), direct(qkv.size(), 777.0f);
    cpu::attention_backward(widened.data(), dout.data(), qkv.data(), outw.data(), two.lse.data(), B, T,
                            NH, NKV, hs);
    cpu::attention_backward(direct.data(), dout.data(), qkv16.data(), out16.data(), two.lse.data(), B,
                            T, NH, NKV, hs);
    EXPECT_EQ(0, std::memcmp(widened.data(), direct.data(), widened.size() * sizeof(float)))
        << "dqkv" << tag << " from bf16 q, k, v and output differs from their widened copies' at "
        << (p == cpu::GemmPrecision::kBF16 ? "kBF16" : "kF32");
  }
  cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
  if (T == 1) return;  // one key: out is v itself, whatever the tiles
  if (cpu::bf16_attention_tiles())  // else kBF16 ran the f32 tiles, as it must
    EXPECT_NE(0, std::memcmp(f32.out.data(), two.out.data(), f32.out.size() * sizeof(float)))
        << "out" << tag << ": the bf16 tiles gave the f32 tiles' bits: not run?";
  else
    EXPECT_EQ(0, std::memcmp(f32.out.data(), two.out.data(), f32.out.size() * sizeof(float)))
        << "out" << tag << ": without bf16 tiles kBF16 must run the f32 ones";
}

}  // namespace

TEST(Attention, Bf16TilesWithinBf16Rounding) {
  std::cout << "[ path     ] attention at kBF16: "
            << (cpu::bf16_attention_tiles() ? "bf16 tiles (AVX512-BF16)"
                                            : "no AVX512-BF16 in this build: the f32 tiles")
            << "\n";
  check_bf16_attention(2, 67, 2, 2, 64);    // T straddles a block
  check_bf16_attention(1, 1, 4, 4, 16);     // T = 1
  check_bf16_attention(2, 130, 3, 3, 16);   // three blocks
  check_bf16_attention(1, 129, 3, 3, 24);   // hs = 24
  check_bf16_attention(1, 70, 2, 2, 128);   // hs = 128
  check_bf16_attention(2, 67, 4, 2, 16);    // grouped
  check_bf16_attention(1, 131, 6, 2, 32);   // grouped, odd T over three blocks
  check_bf16_attention(2, 70, 4, 1, 24);    // multi-query
}
