// The bf16 kernels against their f32 references.
//
// Error bounds, from bf16's 8-bit significand (unit roundoff u16 = 2^-8 for
// round to nearest even: half an ulp of 2^-7 relative to the binade) and
// f32's (u32 = 2^-24):
// - A fused cast (norm, GELU, SwiGLU, the loss's gradient): the output is the
//   f32 kernel's value rounded once, so it must equal f32_to_bf16 of the f32
//   output bit for bit, hence |out - f32| <= 2^-8 |f32|.
// - A GEMM on bf16 operands: products of two bf16 values are exact in f32
//   (8 + 8 <= 24 significand bits), so against the exact (double) product of
//   the rounded operands only the f32 accumulation errs:
//   |C - ref| <= K u32 (1 + ...) sum_k |a_ik b_kj|; we allow 2 K u32.
//   Against the unrounded operands each product adds at most (2 u16 + u16^2)
//   |a b|: |C - ref_f32| <= (2^-7 + 2^-16 + 2 K u32) sum_k |a_ik b_kj|.
// The tests name the GEMM path they ran (native bf16 instructions or the f32
// fallback) and run the fallback on every machine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <vector>

#include "backend/ops.h"
#include "core/bf16.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::random_vec;

namespace {

std::vector<uint16_t> round16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  cpu::f32_to_bf16(h.data(), x.data(), static_cast<int64_t>(x.size()));
  return h;
}

float widen(uint16_t b) { return po::core::bf16_to_f32(po::core::bf16{b}); }

// got[i] == f32_to_bf16(want[i]) for every i, naming the first that differs.
::testing::AssertionResult rounded_from(const char* name, const std::vector<uint16_t>& got,
                                        const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << name << ": " << got.size() << " values, want "
                                         << want.size();
  const std::vector<uint16_t> ref = round16(want);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != ref[i])
      return ::testing::AssertionFailure()
             << name << "[" << i << "]: bf16 bits 0x" << std::hex << got[i] << " ("
             << widen(got[i]) << ") but the f32 kernel's " << want[i] << " rounds to 0x"
             << ref[i] << std::dec << " (" << widen(ref[i]) << ")";
    const double err = std::fabs(static_cast<double>(widen(got[i])) - want[i]);
    if (err > std::ldexp(std::fabs(static_cast<double>(want[i])), -8))
      return ::testing::AssertionFailure() << name << "[" << i << "]: |" << widen(got[i])
                                           << " - " << want[i] << "| exceeds 2^-8 of it";
  }
  return ::testing::AssertionSuccess();
}

const char* gemm_path() {
  return cpu::native_bf16_gemm() ? "native bf16 instructions (oneDNN)"
                                 : "no native bf16 GEMM here: the f32 fallback";
}

}  // namespace

TEST(Bf16Kernels, NormsWriteTheirF32ValuesRounded) {
  const int64_t BT = 37, C = 96;
  const auto x = random_vec(BT * C, 11, -3.0f, 3.0f);
  const auto w = random_vec(C, 12, 0.5f, 1.5f), b = random_vec(C, 13);
  std::vector<float> out(x.size()), mean(BT), rstd(BT), mean16(BT), rstd16(BT);
  std::vector<uint16_t> out16(x.size());
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), BT, C);
  cpu::layernorm_forward(out16.data(), mean16.data(), rstd16.data(), x.data(), w.data(), b.data(),
                         BT, C);
  EXPECT_TRUE(rounded_from("layernorm out", out16, out));
  EXPECT_EQ(0, std::memcmp(mean.data(), mean16.data(), BT * sizeof(float))) << "layernorm mean";
  EXPECT_EQ(0, std::memcmp(rstd.data(), rstd16.data(), BT * sizeof(float))) << "layernorm rstd";
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), BT, C, 1e-5);
  cpu::rmsnorm_forward(out16.data(), rstd16.data(), x.data(), w.data(), BT, C, 1e-5);
  EXPECT_TRUE(rounded_from("rmsnorm out", out16, out));
  EXPECT_EQ(0, std::memcmp(rstd.data(), rstd16.data(), BT * sizeof(float))) << "rmsnorm rstd";
}

TEST(Bf16Kernels, ActivationsWriteTheirF32ValuesRounded) {
  const int64_t BT = 29, F = 88;
  const auto x = random_vec(BT * 2 * F, 21, -6.0f, 6.0f);
  std::vector<float> out(BT * F);
  std::vector<uint16_t> out16(BT * F);
  cpu::gelu_forward(out.data(), x.data(), BT * F);
  cpu::gelu_forward(out16.data(), x.data(), BT * F);
  EXPECT_TRUE(rounded_from("gelu out", out16, out));
  cpu::swiglu_forward(out.data(), x.data(), BT, F);
  cpu::swiglu_forward(out16.data(), x.data(), BT, F);
  EXPECT_TRUE(rounded_from("swiglu out", out16, out));
}

// The backwards that read a saved bf16 input (the norms' input, the
// activation's pre-activation) compute on its widened values, which are
// exact: so their outputs are the f32 kernels' on the widened copy, bit for
// bit, and their error against the unrounded input is the input's rounding
// (2^-8 relative per element) carried through the derivative, as when the
// model widened the copy first. Odd sizes, several threads.
TEST(Bf16Kernels, BackwardsReadingBf16GiveTheWidenedInputsBits) {
  const int64_t BT = 37, C = 96, F = 88;
  const auto x = random_vec(BT * C, 31, -3.0f, 3.0f), dy = random_vec(BT * C, 32);
  const auto w = random_vec(C, 33, 0.5f, 1.5f);
  const std::vector<uint16_t> x16 = round16(x);
  std::vector<float> xw(x.size());
  cpu::bf16_to_f32(xw.data(), x16.data(), BT * C);
  std::vector<float> mean(BT), rstd(BT), out(x.size());
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), xw.data(), w.data(), w.data(), BT, C);
  auto same = [](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
    for (size_t i = 0; i < a.size(); ++i)
      if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
        return ::testing::AssertionResult(false) << what << "[" << i << "]: " << b[i]
                                                 << " reading bf16, " << a[i] << " on the widened copy";
    return ::testing::AssertionSuccess();
  };
  {
    std::vector<float> dx(x.size(), 0.5f), dw(C, 0.25f), db(C), dx16 = dx, dw16 = dw, db16 = db;
    cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), xw.data(), w.data(), mean.data(),
                            rstd.data(), BT, C);
    cpu::layernorm_backward(dx16.data(), dw16.data(), db16.data(), dy.data(), x16.data(), w.data(),
                            mean.data(), rstd.data(), BT, C);
    EXPECT_TRUE(same("layernorm dinp", dx, dx16));
    EXPECT_TRUE(same("layernorm dweight", dw, dw16));
    EXPECT_TRUE(same("layernorm dbias", db, db16));
  }
  {
    cpu::rmsnorm_forward(out.data(), rstd.data(), xw.data(), w.data(), BT, C, 1e-5);
    std::vector<float> dx(x.size(), 0.5f), dw(C, 0.25f), dx16 = dx, dw16 = dw;
    cpu::rmsnorm_backward(dx.data(), dw.data(), dy.data(), xw.data(), w.data(), rstd.data(), BT, C);
    cpu::rmsnorm_backward(dx16.data(), dw16.data(), dy.data(), x16.data(), w.data(), rstd.data(), BT, C);
    EXPECT_TRUE(same("rmsnorm dinp", dx, dx16));
    EXPECT_TRUE(same("rmsnorm dweight", dw, dw16));
  }
  {
    const auto a = random_vec(BT * 2 * F, 34, -6.0f, 6.0f), d = random_vec(BT * 2 * F, 35);
    const std::vector<uint16_t> a16 = round16(a);
    std::vector<float> aw(a.size());
    cpu::bf16_to_f32(aw.data(), a16.data(), static_cast<int64_t>(a.size()));
    std::vector<float> g(a.size()), g16(a.size());
    cpu::gelu_backward(g.data(), aw.data(), d.data(), BT * 2 * F);
    cpu::gelu_backward(g16.data(), a16.data(), d.data(), BT * 2 * F);
    EXPECT_TRUE(same("gelu dinp", g, g16));
    cpu::swiglu_backward(g.data(), aw.data(), d.data(), BT, F);
    cpu::swiglu_backward(g16.data(), a16.data(), d.data(), BT, F);
    EXPECT_TRUE(same("swiglu dinp", g, g16));
  }
}

TEST(Bf16Kernels, LossGradientIsTheF32GradientRounded) {
  const int64_t BT = 9, V = 5003;  // V spans several of the row sum's blocks
  const auto logits = random_vec(BT * V, 31, -8.0f, 8.0f);
  std::vector<int32_t> targets(BT);
  for (int64_t r = 0; r < BT; ++r) targets[r] = static_cast<int32_t>((r * 977) % V);
  std::vector<float> a = logits, b = logits, loss_a(BT), loss_b(BT);
  std::vector<uint16_t> g16(BT * V);
  const float scale = 1.0f / static_cast<float>(BT);
  cpu::crossentropy_forward(loss_a.data(), a.data(), targets.data(), BT, V, scale);
  cpu::crossentropy_forward_bf16(loss_b.data(), b.data(), g16.data(), targets.data(), BT, V, scale);
  EXPECT_EQ(0, std::memcmp(loss_a.data(), loss_b.data(), BT * sizeof(float)))
      << "the losses of the f32 and bf16-gradient kernels differ";
  EXPECT_TRUE(rounded_from("loss gradient", g16, a));
}

namespace {

// C = A[M,K] · B[N,K]^T (the linear layer's shape) at bf16 through gemm_bf16,
// checked against double references on the rounded and the unrounded operands.
void check_bf16_gemm(int64_t M, int64_t N, int64_t K) {
  const auto A = random_vec(M * K, 41), B = random_vec(N * K, 42);
  const auto A16 = round16(A), B16 = round16(B);
  std::vector<float> C(M * N, 0.0f);
  cpu::gemm_bf16(false, true, M, N, K, 1.0f, A16.data(), K, B16.data(), K, 0.0f, C.data(), N);
  const double u32 = std::ldexp(1.0, -24);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double exact16 = 0, exact = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        exact16 += static_cast<double>(widen(A16[i * K + k])) * widen(B16[j * K + k]);
        exact += static_cast<double>(A[i * K + k]) * B[j * K + k];
        mag += std::fabs(static_cast<double>(A[i * K + k]) * B[j * K + k]);
      }
      const double c = C[i * N + j];
      ASSERT_LE(std::fabs(c - exact16), 2 * K * u32 * mag * 1.01 + 1e-30)
          << "C[" << i << "," << j << "] = " << c << " vs the exact product of the rounded "
          << "operands " << exact16 << " (K = " << K << ", path: " << gemm_path() << ")";
      ASSERT_LE(std::fabs(c - exact), (std::ldexp(1.0, -7) + std::ldexp(1.0, -16) + 2 * K * u32) * mag * 1.01)
          << "C[" << i << "," << j << "] = " << c << " vs the f32 operands' product " << exact
          << " (path: " << gemm_path() << ")";
    }
}

}  // namespace

TEST(Bf16Kernels, GemmWithinTheBoundOfBf16Rounding) {
  std::cout << "[ path     ] bf16 GEMM: " << gemm_path() << "\n";
  check_bf16_gemm(33, 70, 96);
  check_bf16_gemm(64, 64, 385);
}

TEST(Bf16Kernels, GemmFallbackWithinTheSameBound) {
  cpu::allow_native_bf16_gemm(false);
  std::cout << "[ path     ] bf16 GEMM: " << gemm_path() << "\n";
  check_bf16_gemm(33, 70, 96);
  check_bf16_gemm(64, 64, 385);
  cpu::allow_native_bf16_gemm(true);
}

// At kBF16 an operand given as bf16 bits is the operand rounded per call:
// the same bits whether a kernel wrote it in bf16 or the GEMM rounded it.
TEST(Bf16Kernels, OperandsRoundedOnceGiveTheBitsOfRoundingPerCall) {
  const int64_t BT = 24, C = 40, OC = 56;
  const auto x = random_vec(BT * C, 51), w = random_vec(OC * C, 52), dy = random_vec(BT * OC, 53);
  const auto x16 = round16(x), w16 = round16(w), dy16 = round16(dy);
  cpu::set_gemm_precision(cpu::GemmPrecision::kBF16);
  std::vector<float> out_a(BT * OC), out_b(BT * OC), out_c(BT * OC);
  cpu::matmul_forward(out_a.data(), x.data(), w.data(), nullptr, BT, C, OC);
  cpu::matmul_forward(out_b.data(), cpu::Operand(x.data(), x16.data()), w16.data(), nullptr, BT, C, OC);
  cpu::matmul_forward(out_c.data(), x16.data(), cpu::Operand(w.data(), w16.data()), nullptr, BT, C, OC);
  EXPECT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)))
      << "matmul_forward: f32 operands rounded per call vs bf16 bits given";
  EXPECT_EQ(0, std::memcmp(out_a.data(), out_c.data(), out_a.size() * sizeof(float)))
      << "matmul_forward: bf16 input alone vs f32 input";
  std::vector<float> dx_a(BT * C), dx_b(BT * C), dw_a(OC * C, 0.0f), dw_b(OC * C, 0.0f);
  std::vector<float> db_a(OC, 0.0f), db_b(OC, 0.0f);
  cpu::matmul_backward(dx_a.data(), dw_a.data(), db_a.data(), dy.data(), x.data(), w.data(), BT, C, OC);
  cpu::matmul_backward(dx_b.data(), dw_b.data(), db_b.data(), cpu::Operand(dy.data(), dy16.data()),
                       x16.data(), w16.data(), BT, C, OC);
  cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
  EXPECT_EQ(0, std::memcmp(dx_a.data(), dx_b.data(), dx_a.size() * sizeof(float))) << "dinp";
  EXPECT_EQ(0, std::memcmp(dw_a.data(), dw_b.data(), dw_a.size() * sizeof(float))) << "dweight";
  EXPECT_EQ(0, std::memcmp(db_a.data(), db_b.data(), db_a.size() * sizeof(float))) << "dbias";
}

// At kF32 a bf16-only operand is widened: exactly the f32 GEMM of its values.
TEST(Bf16Kernels, Bf16OperandAtF32IsWidened) {
  const int64_t M = 12, N = 20, K = 33;
  const auto a = random_vec(M * K, 61), b = random_vec(N * K, 62);
  const auto a16 = round16(a);
  std::vector<float> aw(a.size());
  cpu::bf16_to_f32(aw.data(), a16.data(), static_cast<int64_t>(a.size()));
  std::vector<float> c1(M * N), c2(M * N);
  cpu::gemm(false, true, M, N, K, 1.0f, aw.data(), K, b.data(), K, 0.0f, c1.data(), N);
  cpu::gemm(false, true, M, N, K, 1.0f, a16.data(), K, b.data(), K, 0.0f, c2.data(), N);
  EXPECT_EQ(0, std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)))
      << "a bf16 operand at kF32 is not its widened values' GEMM";
}
