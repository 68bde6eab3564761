// gemm (all four transpose combinations, strides, alpha/beta) and the linear
// layer built on it, against double references; matmul gradients by finite
// differences.
#include <gtest/gtest.h>

#include <cstring>

#include "backend/isa.h"
#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

struct GemmCase {
  bool ta, tb;
  int64_t M, N, K;
};

void run_gemm_case(const GemmCase& c) {
  const float alpha = 0.75f, beta = -0.5f;
  // Row-major op(A)[M,K]: A stored [M,K] or [K,M]; pad leading dims by 3.
  const int64_t ar = c.ta ? c.K : c.M, ac = c.ta ? c.M : c.K;
  const int64_t br = c.tb ? c.N : c.K, bc = c.tb ? c.K : c.N;
  const int64_t lda = ac + 3, ldb = bc + 3, ldc = c.N + 3;
  auto A = random_vec(ar * lda, 1), B = random_vec(br * ldb, 2), C = random_vec(c.M * ldc, 3);
  std::vector<double> want(C.begin(), C.end());
  for (int64_t i = 0; i < c.M; i++)
    for (int64_t j = 0; j < c.N; j++) {
      double s = 0.0;
      for (int64_t k = 0; k < c.K; k++) {
        const double a = c.ta ? A[k * lda + i] : A[i * lda + k];
        const double b = c.tb ? B[j * ldb + k] : B[k * ldb + j];
        s += a * b;
      }
      want[i * ldc + j] = alpha * s + beta * want[i * ldc + j];
    }
  cpu::gemm(c.ta, c.tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(),
            ldc);
  EXPECT_TRUE(all_close("C(ta=" + std::to_string(c.ta) + ",tb=" + std::to_string(c.tb) + ")",
                        C.data(), want.data(), C.size(), 1e-5));
}

}  // namespace

TEST(Gemm, AllTransposeCombinations) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      run_gemm_case({ta, tb, 37, 53, 29});
      run_gemm_case({ta, tb, 1, 17, 5});
      run_gemm_case({ta, tb, 130, 70, 200});
    }
}

TEST(Gemm, ThreadsAndName) {
  const int before = cpu::num_threads();
  cpu::set_num_threads(1);
  EXPECT_EQ(cpu::num_threads(), 1);
  run_gemm_case({false, true, 64, 48, 80});
  cpu::set_num_threads(before);
  EXPECT_EQ(cpu::num_threads(), before);
  const std::string name = cpu::blas_name();
  EXPECT_TRUE(name == "openblas" || name == "blis" || name == "dnnl") << name;
}

TEST(Matmul, ForwardBackwardMatchReference) {
  const int64_t BT = 23, C = 45, OC = 19;
  auto inp = random_vec(BT * C, 4), w = random_vec(OC * C, 5), bias = random_vec(OC, 6);
  auto dout = random_vec(BT * OC, 7);
  std::vector<float> out(BT * OC);
  cpu::matmul_forward(out.data(), inp.data(), w.data(), bias.data(), BT, C, OC);
  std::vector<double> ref(BT * OC), dinp_ref(BT * C, 0.0), dw_ref(OC * C), db_ref(OC);
  auto dw = random_vec(OC * C, 8), db = random_vec(OC, 9);  // accumulate onto these
  for (int64_t i = 0; i < OC * C; i++) dw_ref[i] = dw[i];
  for (int64_t o = 0; o < OC; o++) db_ref[o] = db[o];
  for (int64_t r = 0; r < BT; r++)
    for (int64_t o = 0; o < OC; o++) {
      double s = bias[o];
      for (int64_t c = 0; c < C; c++) s += static_cast<double>(inp[r * C + c]) * w[o * C + c];
      ref[r * OC + o] = s;
      const double g = dout[r * OC + o];
      db_ref[o] += g;
      for (int64_t c = 0; c < C; c++) {
        dinp_ref[r * C + c] += g * w[o * C + c];
        dw_ref[o * C + c] += g * inp[r * C + c];
      }
    }
  EXPECT_TRUE(all_close("out", out.data(), ref.data(), ref.size(), 1e-5));
  std::vector<float> out_nb(BT * OC);
  cpu::matmul_forward(out_nb.data(), inp.data(), w.data(), nullptr, BT, C, OC);
  for (int64_t r = 0; r < BT; r++)
    for (int64_t o = 0; o < OC; o++) ref[r * OC + o] -= bias[o];
  EXPECT_TRUE(all_close("out(no bias)", out_nb.data(), ref.data(), ref.size(), 1e-5));

  std::vector<float> dinp(BT * C, 123.0f);  // written, not accumulated
  cpu::matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                       BT, C, OC);
  EXPECT_TRUE(all_close("dinp", dinp.data(), dinp_ref.data(), dinp.size(), 1e-5));
  EXPECT_TRUE(all_close("dweight", dw.data(), dw_ref.data(), dw.size(), 1e-5));
  EXPECT_TRUE(all_close("dbias", db.data(), db_ref.data(), db.size(), 1e-5));

  // accumulate_dinp adds; dinp == nullptr skips.
  auto dinp_acc = random_vec(BT * C, 10);
  std::vector<double> acc_ref(BT * C);
  for (int64_t i = 0; i < BT * C; i++) acc_ref[i] = dinp_acc[i] + dinp_ref[i];
  cpu::matmul_backward(dinp_acc.data(), dw.data(), nullptr, dout.data(), inp.data(), w.data(),
                       BT, C, OC, true);
  EXPECT_TRUE(all_close("dinp(accumulate)", dinp_acc.data(), acc_ref.data(), acc_ref.size(),
                        1e-5));
  cpu::matmul_backward(nullptr, dw.data(), nullptr, dout.data(), inp.data(), w.data(), BT, C,
                       OC);
}

TEST(Matmul, FiniteDifferenceGradients) {
  const int64_t BT = 7, C = 19, OC = 11;
  auto inp = random_vec(BT * C, 11), w = random_vec(OC * C, 12), bias = random_vec(OC, 13);
  auto rw = random_vec(BT * OC, 14);  // L = sum(out * rw) => dout = rw
  std::vector<float> out(BT * OC), dinp(BT * C), dw(OC * C, 0.0f), db(OC, 0.0f);
  cpu::matmul_backward(dinp.data(), dw.data(), db.data(), rw.data(), inp.data(), w.data(), BT,
                       C, OC);
  auto loss = [&] {
    cpu::matmul_forward(out.data(), inp.data(), w.data(), bias.data(), BT, C, OC);
    double l = 0.0;
    for (size_t i = 0; i < out.size(); i++) l += static_cast<double>(out[i]) * rw[i];
    return l;
  };
  using po::test::grad_check;
  using po::test::sample_indices;
  EXPECT_TRUE(grad_check("dinp", inp, dinp, sample_indices(inp.size(), 20), loss, 1e-2f, 1e-3, 0.1));
  EXPECT_TRUE(grad_check("dweight", w, dw, sample_indices(w.size(), 20), loss, 1e-2f, 1e-3, 0.1));
  EXPECT_TRUE(grad_check("dbias", bias, db, sample_indices(OC, 11), loss, 1e-2f, 1e-3, 0.1));
}

namespace {

// out = x · wᵀ + bias in double.
std::vector<double> linear_reference(const std::vector<float>& x, const std::vector<float>& w,
                                     const std::vector<float>& bias, int64_t rows, int64_t C,
                                     int64_t OC) {
  std::vector<double> want(static_cast<size_t>(rows * OC));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < OC; j++) {
      double s = bias[j];
      for (int64_t c = 0; c < C; c++) s += static_cast<double>(x[r * C + c]) * w[j * C + c];
      want[r * OC + j] = s;
    }
  return want;
}

}  // namespace

// Generation's linear layer at row counts on both sides of the tiled range
// (kDecodeRowsTiled), output widths with remainders, and an input width the
// tiles do not take (C % 16 != 0).
TEST(Matmul, DecodeRowsMatchReferenceAtEveryRowCount) {
  for (int64_t C : {64, 40}) {
    for (int64_t OC : {37, 48}) {
      const auto w = random_vec(OC * C, 5), bias = random_vec(OC, 6);
      for (int64_t rows : {1, 2, 4, 5, 6, 7, 12, 13, 31, 32, 40, 41, 64, 130}) {
        const auto x = random_vec(rows * C, 7 + rows);
        std::vector<float> out(static_cast<size_t>(rows * OC));
        cpu::matmul_forward_decode(out.data(), x.data(), w.data(), bias.data(), rows, C, OC);
        const auto want = linear_reference(x, w, bias, rows, C, OC);
        EXPECT_TRUE(all_close("decode rows " + std::to_string(rows) + " C " + std::to_string(C) +
                                  " OC " + std::to_string(OC),
                              out.data(), want.data(), out.size(), 1e-5, 1e-6));
      }
    }
  }
}

// Up to kDecodeRowsTiled rows every output is one dot product whose order
// does not depend on the other rows: a decode row's values are the same bits
// alone and in a batch (on the avx512 paths, where C % 16 == 0).
TEST(Matmul, DecodeRowsAreTheSameBitsAloneAndInABatch) {
  if (cpu::active_isa() < cpu::Isa::kAvx512)
    GTEST_SKIP() << "path " << cpu::isa_name(cpu::active_isa())
                 << ": decode rows go through the BLAS, which promises no batch invariance";
  const int64_t C = 768, OC = 53, rows = cpu::kDecodeRowsTiled;
  const auto w = random_vec(OC * C, 8), bias = random_vec(OC, 9), x = random_vec(rows * C, 10);
  std::vector<float> batch(static_cast<size_t>(rows * OC)), alone(static_cast<size_t>(OC));
  cpu::matmul_forward_decode(batch.data(), x.data(), w.data(), bias.data(), rows, C, OC);
  for (int64_t r = 0; r < rows; r += 7) {
    cpu::matmul_forward_decode(alone.data(), x.data() + r * C, w.data(), bias.data(), 1, C, OC);
    for (int64_t j = 0; j < OC; j++)
      EXPECT_EQ(std::memcmp(&alone[j], &batch[r * OC + j], sizeof(float)), 0)
          << "row " << r << " column " << j << ": " << alone[j] << " alone, " << batch[r * OC + j]
          << " among " << rows << " rows";
  }
}
