// Context parallel's attention pieces (ops.h: attention_block_forward and
// _backward, attention_lse_merge) against the unsplit causal attention: the
// sequence cut into chunks, each query chunk's blocks (its own, causal, and
// every earlier chunk, full) computed in a ring's order and merged, gives
// attention_forward's out and lse and, block by block, attention_backward's
// dq, dk and dv. Multi-head, grouped-query and multi-query; chunks that are
// and are not multiples of the 64-row tile.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

// Largest |a - b| / (|b| + 1% of the largest |b|) over the elements, and
// where: relative, except near zero, where f32 cancellation leaves noise of
// the tensor's own scale (a row attending to one key has dq = 0 exactly).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (float w : want) scale = std::max(scale, std::abs(static_cast<double>(w)));
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); i++) {
    const double e =
        std::abs(static_cast<double>(got[i]) - want[i]) / (0.01 * scale + std::abs(want[i]));
    if (!(e <= worst)) {
      worst = e;
      at = i;
    }
  }
  EXPECT_LE(worst, tol) << what << ": element " << at << " is " << got[at] << ", unsplit "
                        << want[at];
}

// Chunk c of n holds rows [c·S, (c+1)·S) of each sequence; query chunk a takes
// its blocks in a ring's order: itself (causal), then a-1, a-2, .., 0 (full).
// bf16: inputs rounded to bf16, blocks at kBF16, each result held to the f32
// unsplit attention within bf16 tiles' bounds (as attention_test holds the
// unsplit bf16 tiles: out 4u, lse u, dqkv 12u of |x| + the tensor's rms, u =
// 2^-8); else the f32 blocks within 2e-5 and 1e-4 of the tensor's scale.
void check_blocks(int64_t B, int64_t T, int64_t n, int64_t NH, int64_t NKV, int64_t hs,
                  bool bf16 = false) {
  SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " chunks=" << n << " NH=" << NH
                                  << " NKV=" << NKV << " hs=" << hs);
  const int64_t C = NH * hs, C3 = (NH + 2 * NKV) * hs, S = T / n;
  ASSERT_EQ(S * n, T);
  auto qkv = random_vec(B * T * C3, T * 17 + C3, -1.5f, 1.5f);
  auto dout = random_vec(B * T * C, T + 3, -1.0f, 1.0f);
  if (bf16) {
    qkv = po::test::rounded_bf16(qkv);
    dout = po::test::rounded_bf16(dout);
  }
  std::vector<float> out(B * T * C), lse(B * NH * T), dqkv(B * T * C3);
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, hs);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH,
                          NKV, hs);

  if (bf16) cpu::set_gemm_precision(cpu::GemmPrecision::kBF16);
  std::vector<float> bout(B * T * C, 0.0f), blse(B * NH * T, -INFINITY), bd(B * T * C3, 0.0f);
  auto rows = [&](const float* base, int64_t chunk, int64_t col, int64_t row) {
    return cpu::AttnRows{base + chunk * S * row + col, row, T * row};
  };
  auto rows_out = [&](float* base, int64_t chunk, int64_t col, int64_t row) {
    return cpu::AttnRowsOut{base + chunk * S * row + col, row, T * row};
  };
  for (int64_t a = 0; a < n; a++)
    for (int64_t kb = a; kb >= 0; kb--)
      cpu::attention_block_forward(rows_out(bout.data(), a, 0, C), blse.data() + a * S, T,
                                   rows(qkv.data(), a, 0, C3), rows(qkv.data(), kb, NH * hs, C3),
                                   rows(qkv.data(), kb, (NH + NKV) * hs, C3), B, S, S, NH, NKV,
                                   hs, kb == a);
  if (bf16) {
    cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
    const double u = std::ldexp(1.0, -8);
    EXPECT_TRUE(all_close("out (bf16 blocks)", bout.data(), out.data(), out.size(), 4 * u));
    EXPECT_TRUE(all_close("lse (bf16 blocks)", blse.data(), lse.data(), lse.size(), u));
    if (cpu::bf16_attention_tiles()) {  // the bf16 tiles ran: their rounding shows
      double worst = 0;
      for (size_t i = 0; i < out.size(); i++)
        worst = std::max(worst, std::abs(static_cast<double>(bout[i]) - out[i]));
      EXPECT_GT(worst, 1e-4) << "out at kBF16 is the f32 tiles' (within " << worst << ")";
    }
    cpu::set_gemm_precision(cpu::GemmPrecision::kBF16);
  } else {
    expect_close(bout, out, 2e-5, "out");
    expect_close(blse, lse, 2e-5, "lse");
  }
  // The backward from the unsplit forward's out and lse, so that only the
  // backward's blocks are compared.
  for (int64_t a = 0; a < n; a++)
    for (int64_t kb = a; kb >= 0; kb--)
      cpu::attention_block_backward(
          rows_out(bd.data(), a, 0, C3), rows_out(bd.data(), kb, NH * hs, C3),
          rows_out(bd.data(), kb, (NH + NKV) * hs, C3), rows(dout.data(), a, 0, C),
          rows(out.data(), a, 0, C), lse.data() + a * S, T, rows(qkv.data(), a, 0, C3),
          rows(qkv.data(), kb, NH * hs, C3), rows(qkv.data(), kb, (NH + NKV) * hs, C3), B, S, S,
          NH, NKV, hs, kb == a);
  if (bf16) {
    cpu::set_gemm_precision(cpu::GemmPrecision::kF32);
    EXPECT_TRUE(all_close("dqkv (bf16 blocks)", bd.data(), dqkv.data(), dqkv.size(),
                          12 * std::ldexp(1.0, -8)));
  } else {
    expect_close(bd, dqkv, 1e-4, "dqkv");
  }
}

}  // namespace

TEST(AttentionBlock, RingOfChunksEqualsUnsplitAttention) {
  check_blocks(2, 256, 2, 4, 4, 32);   // chunks of 128: whole tiles
  check_blocks(1, 256, 4, 2, 2, 64);   // chunks of 64
  check_blocks(2, 160, 4, 3, 3, 24);   // chunks of 40: partial tiles, hs padded
  check_blocks(1, 48, 8, 2, 2, 16);    // chunks of 6
}

TEST(AttentionBlock, GroupedAndMultiQueryEqualUnsplitAttention) {
  check_blocks(2, 192, 2, 4, 2, 32);   // grouped-query
  check_blocks(1, 200, 4, 4, 1, 16);   // multi-query, chunks of 50
}

// At kBF16 (on a CPU with AVX512-BF16: bf16 tiles, q, k, v, dO and each
// tile's probabilities and score gradients rounded to bf16; elsewhere the f32
// tiles) the blocks stay within bf16 tiles' bounds of the f32 attention.
TEST(AttentionBlock, Bf16TilesWithinBf16Rounding) {
  check_blocks(2, 256, 2, 4, 4, 32, true);
  check_blocks(2, 160, 4, 3, 3, 24, true);  // partial tiles, odd keys per tile
  check_blocks(1, 200, 4, 4, 1, 16, true);  // multi-query
  check_blocks(1, 42, 6, 2, 2, 64, true);   // chunks of 7
}

TEST(AttentionBlock, MergeIntoAnEmptyRowGivesTheBlockExactly) {
  const std::vector<float> ob = {0.25f, -1.5f, 3.0f};
  std::vector<float> out(3, 0.0f);
  float lse = -INFINITY;
  cpu::attention_lse_merge(out.data(), &lse, ob.data(), 0.7f, 3);
  EXPECT_EQ(lse, 0.7f);
  EXPECT_EQ(out, ob);
  // Two halves of a softmax merge to the whole: lse of {1, 2} and {3}.
  std::vector<float> o2 = {1.0f};
  float l2 = std::log(std::exp(1.0f) + std::exp(2.0f));
  const float third = 3.0f;
  cpu::attention_lse_merge(o2.data(), &l2, &third, 3.0f, 1);
  const double want_lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(l2, want_lse, 1e-6);
  const double w = std::exp(3.0 - want_lse);
  EXPECT_NEAR(o2[0], (1 - w) * 1.0 + w * 3.0, 1e-6);
  // A block that saw no key (lse_b = -inf) changes nothing.
  const float before = o2[0];
  cpu::attention_lse_merge(o2.data(), &l2, &third, -INFINITY, 1);
  EXPECT_EQ(o2[0], before);
}
