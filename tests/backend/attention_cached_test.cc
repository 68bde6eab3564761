// Generation's attention against a KV cache (attention_cached_forward) and
// its paged form (paged_attention_forward): the values of a double-precision
// reference, and the bits serving depends on. A query row's result may not
// depend on how many rows are computed in one call (a prompt prefilled whole,
// in chunks, or decoded one position at a time), on its place in a call (the
// kernel shares loads between up to four rows), or on which blocks of the
// pool hold the sequence: `generate` and the server, alone and in a batch,
// then give the same tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "test_util.h"

namespace cpu = po::backend::cpu;
using po::test::all_close;
using po::test::random_vec;

namespace {

struct Shape {
  int64_t NH, NKV, hs, T;
};

// out[i, h] for query i at position i (keys 0..i), in double.
std::vector<float> reference(const std::vector<float>& q, int64_t q_stride, const std::vector<float>& k,
                             const std::vector<float>& v, const Shape& s) {
  const int64_t kvw = s.NKV * s.hs, per = s.NH / s.NKV;
  std::vector<float> out(static_cast<size_t>(s.T * s.NH * s.hs));
  for (int64_t i = 0; i < s.T; ++i)
    for (int64_t h = 0; h < s.NH; ++h) {
      const int64_t g = h / per;
      std::vector<double> p(static_cast<size_t>(i + 1));
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double d = 0;
        for (int64_t c = 0; c < s.hs; ++c)
          d += static_cast<double>(q[static_cast<size_t>(i * q_stride + h * s.hs + c)]) *
               k[static_cast<size_t>(j * kvw + g * s.hs + c)];
        p[static_cast<size_t>(j)] = d / std::sqrt(static_cast<double>(s.hs));
        mx = std::max(mx, p[static_cast<size_t>(j)]);
      }
      for (auto& x : p) sum += (x = std::exp(x - mx));
      for (int64_t c = 0; c < s.hs; ++c) {
        double o = 0;
        for (int64_t j = 0; j <= i; ++j)
          o += p[static_cast<size_t>(j)] / sum * v[static_cast<size_t>(j * kvw + g * s.hs + c)];
        out[static_cast<size_t>((i * s.NH + h) * s.hs + c)] = static_cast<float>(o);
      }
    }
  return out;
}

class CachedAttention : public ::testing::TestWithParam<Shape> {};

TEST_P(CachedAttention, ChunksRowsAndBlocksGiveTheSameBits) {
  const Shape s = GetParam();
  const int64_t kvw = s.NKV * s.hs, q_stride = (s.NH + 2 * s.NKV) * s.hs;  // q | k | v rows, as the model's
  const std::vector<float> q = random_vec(static_cast<size_t>(s.T * q_stride), 1, -2.0f, 2.0f);
  const std::vector<float> k = random_vec(static_cast<size_t>(s.T * kvw), 2, -2.0f, 2.0f);
  const std::vector<float> v = random_vec(static_cast<size_t>(s.T * kvw), 3);
  const size_t out_n = static_cast<size_t>(s.T * s.NH * s.hs);
  const std::string what = "NH " + std::to_string(s.NH) + " NKV " + std::to_string(s.NKV) + " hs " +
                           std::to_string(s.hs) + " T " + std::to_string(s.T);

  // The whole prompt in one call.
  std::vector<float> whole(out_n);
  cpu::attention_cached_forward(whole.data(), q.data(), q_stride, k.data(), v.data(), s.T, 0, s.NH, s.NKV,
                                s.hs);
  const std::vector<float> want = reference(q, q_stride, k, v, s);
  EXPECT_TRUE(all_close(what + " vs double", whole.data(), want.data(), out_n, 1e-5, 1e-6));

  // In chunks of 1 (decoding), 3 and 5 positions: each call sees the keys so far.
  for (int64_t chunk : {1, 3, 5}) {
    std::vector<float> got(out_n);
    for (int64_t p0 = 0; p0 < s.T; p0 += chunk) {
      const int64_t n = std::min(chunk, s.T - p0);
      cpu::attention_cached_forward(got.data() + p0 * s.NH * s.hs, q.data() + p0 * q_stride, q_stride,
                                    k.data(), v.data(), n, p0, s.NH, s.NKV, s.hs);
    }
    for (size_t e = 0; e < out_n; ++e)
      ASSERT_EQ(got[e], whole[e]) << what << ": chunks of " << chunk << ", row "
                                  << e / static_cast<size_t>(s.NH * s.hs) << " differs from the whole prompt's";
  }

  // Paged: blocks of 4 positions in a shuffled pool, prefilled in chunks of 6.
  const int64_t bs = 4, blocks = (s.T + bs - 1) / bs + 3;
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(7));
  std::vector<float> kp(static_cast<size_t>(blocks * bs * kvw), NAN), vp(kp.size(), NAN);
  for (int64_t j = 0; j < s.T; ++j) {
    const int64_t at = (table[static_cast<size_t>(j / bs)] * bs + j % bs) * kvw;
    std::memcpy(kp.data() + at, k.data() + j * kvw, static_cast<size_t>(kvw) * sizeof(float));
    std::memcpy(vp.data() + at, v.data() + j * kvw, static_cast<size_t>(kvw) * sizeof(float));
  }
  std::vector<float> paged(out_n);
  for (int64_t p0 = 0; p0 < s.T; p0 += 6) {
    const int64_t n = std::min<int64_t>(6, s.T - p0);
    cpu::paged_attention_forward(paged.data() + p0 * s.NH * s.hs, q.data() + p0 * q_stride, q_stride, kp.data(),
                                 vp.data(), table.data(), bs, n, p0, s.NH, s.NKV, s.hs);
  }
  for (size_t e = 0; e < out_n; ++e)
    ASSERT_EQ(paged[e], whole[e]) << what << ": paged, row " << e / static_cast<size_t>(s.NH * s.hs)
                                  << " differs from the contiguous cache's";
}

// hs 64 and 32 take the grouped AVX-512 rows; 40 and 128 the one-row loop.
INSTANTIATE_TEST_SUITE_P(Shapes, CachedAttention,
                         ::testing::Values(Shape{4, 4, 64, 37}, Shape{4, 2, 64, 70}, Shape{6, 1, 32, 19},
                                           Shape{2, 2, 40, 23}, Shape{2, 1, 128, 33}));

}  // namespace
