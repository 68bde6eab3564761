// matmul_forward_decode_blocks: the linear layer of a decode step over
// weights in GGUF's block formats, dequantized inside the dot products.
// Every output equals the dot product of the input row with the weight row
// as backend/block_formats.h decodes it (held in double) to float rounding;
// an output does not depend on the other rows or the thread count (bit for
// bit). Run on every instruction-set path (tests/CMakeLists.txt): the
// avx512 paths' register kernels (Q8_0, Q4_0, BF16, F16, Q4_K, Q6_K), the row
// decoder elsewhere and for F32.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/block_formats.h"
#include "backend/ops.h"
#include "test_util.h"

namespace po::backend {
namespace {

namespace cpu = backend::cpu;

// A [rows, cols] weight stored as `t`: quantized from random values where
// the engine writes the type, random bytes with finite small scales where
// it only reads it (the K-quants).
std::vector<uint8_t> stored_weight(GgmlType t, int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<uint8_t> w(static_cast<size_t>(ggml_row_bytes(t, cols) * rows));
  if (t != GgmlType::kQ4_K && t != GgmlType::kQ6_K) {
    const std::vector<float> v = test::random_vec(static_cast<size_t>(rows * cols), seed, -0.5f, 0.5f);
    ggml_quantize(t, v.data(), w.data(), rows * cols);
    return w;
  }
  std::mt19937_64 g(seed);
  for (auto& b : w) b = static_cast<uint8_t>(g());
  const int64_t bb = ggml_block_bytes(t);
  for (size_t at = 0; at < w.size(); at += static_cast<size_t>(bb)) {
    const uint16_t d = 0x2000 + static_cast<uint16_t>(g() % 0x400);  // ~0.008: finite, small
    if (t == GgmlType::kQ4_K) {
      std::memcpy(&w[at], &d, 2);
      std::memcpy(&w[at + 2], &d, 2);
    } else {
      std::memcpy(&w[at + static_cast<size_t>(bb) - 2], &d, 2);
    }
  }
  return w;
}

TEST(DecodeBlocks, EveryOutputIsTheDecodedRowsDotProduct) {
  const int64_t C = 512, OC = 37;
  for (GgmlType t : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0, GgmlType::kQ4_0,
                     GgmlType::kQ4_K, GgmlType::kQ6_K}) {
    SCOPED_TRACE(std::string(ggml_type_name(t)));
    const std::vector<uint8_t> w = stored_weight(t, OC, C, 11);
    std::vector<float> decoded(static_cast<size_t>(OC * C));
    ggml_dequantize(t, w.data(), decoded.data(), OC * C);
    const std::vector<float> bias = test::random_vec(OC, 5);
    for (int64_t rows : {1, 2, 3, 5, 9}) {
      SCOPED_TRACE(rows);
      const std::vector<float> x = test::random_vec(static_cast<size_t>(rows * C), 7 + rows);
      for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
        std::vector<float> out(static_cast<size_t>(rows * OC), -1.0f);
        cpu::matmul_forward_decode_blocks(out.data(), x.data(), w.data(), t, b, rows, C, OC);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < OC; ++j) {
            // Float rounding of a sum of C terms x·w: within 2e-6 of Σ|x·w|. The
            // K-quants' kernels sum (d·sc)·Σx·q and (dmin·m)·Σx apart, whose
            // terms may exceed |x·w| (w = d·sc·q − dmin·m cancels): for them,
            // of Σ|x|·(max|w| + 1).
            double ref = b != nullptr ? b[j] : 0.0, mag = std::fabs(ref), sum_x = 0, w_max = 0;
            for (int64_t c = 0; c < C; ++c) {
              ref += double(x[r * C + c]) * double(decoded[j * C + c]);
              mag += std::fabs(double(x[r * C + c]) * double(decoded[j * C + c]));
              sum_x += std::fabs(double(x[r * C + c]));
              w_max = std::max(w_max, std::fabs(double(decoded[j * C + c])));
            }
            const bool k_quant = t == GgmlType::kQ4_K || t == GgmlType::kQ6_K;
            const double bound = k_quant ? 4e-6 * sum_x * (w_max + 1) + 1e-6 : 2e-6 * mag + 1e-7;
            ASSERT_LE(std::fabs(out[r * OC + j] - ref), bound) << "row " << r << ", output " << j;
          }
      }
    }
  }
}

TEST(DecodeBlocks, AnOutputDependsOnNeitherTheOtherRowsNorTheThreads) {
  const int64_t C = 768, OC = 50;
  const int threads = cpu::num_threads();
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kBF16, GgmlType::kQ4_K, GgmlType::kQ6_K}) {
    SCOPED_TRACE(std::string(ggml_type_name(t)));
    const std::vector<uint8_t> w = stored_weight(t, OC, C, 3);
    const std::vector<float> x = test::random_vec(static_cast<size_t>(7 * C), 9);
    std::vector<float> seven(static_cast<size_t>(7 * OC)), one(static_cast<size_t>(OC));
    cpu::matmul_forward_decode_blocks(seven.data(), x.data(), w.data(), t, nullptr, 7, C, OC);
    for (int n : {1, 2}) {
      cpu::set_num_threads(n);
      for (int64_t r = 0; r < 7; ++r) {
        cpu::matmul_forward_decode_blocks(one.data(), x.data() + r * C, w.data(), t, nullptr, 1, C, OC);
        EXPECT_EQ(std::memcmp(one.data(), seven.data() + r * OC, static_cast<size_t>(OC) * 4), 0)
            << "row " << r << " alone on " << n << " threads differs from it among 7";
      }
    }
    cpu::set_num_threads(threads);
  }
}

}  // namespace
}  // namespace po::backend
