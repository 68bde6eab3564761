// Samplers: offsets are a pure function of (seed, step, sequence index), so a
// batch split any way gives the same data; targets are inputs shifted by one.
#include "data/loader.h"

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "data_test_util.h"

namespace po::data {
namespace {

using testing::ScratchDir;

// A file whose token i is i % 50000, so every window is identified by its start.
TokenFile make_file(const ScratchDir& dir, size_t n) {
  std::vector<int32_t> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>(i % 50000);
  write_token_file(dir.file("train.bin"), tokens);
  return TokenFile(dir.file("train.bin"), 50257);
}

TEST(BatchSampler, DeterministicAndShifted) {
  ScratchDir dir;
  TokenFile file = make_file(dir, 10000);
  const int64_t T = 16;
  BatchSampler a(file, T, 1234), b(file, T, 1234), c(file, T, 99);
  std::vector<int32_t> in1(8 * T), tg1(8 * T), in2(8 * T), tg2(8 * T);
  a.fill(5, 0, 8, in1.data(), tg1.data());
  b.fill(5, 0, 8, in2.data(), tg2.data());
  EXPECT_EQ(in1, in2);
  EXPECT_EQ(tg1, tg2);
  for (int64_t i = 0; i < 8; ++i) {
    int64_t off = a.offset(5, i);
    ASSERT_GE(off, 0);
    ASSERT_LE(off + T, 10000 - 1);
    for (int64_t k = 0; k < T; ++k) {
      ASSERT_EQ(in1[i * T + k], file[off + k]);
      ASSERT_EQ(tg1[i * T + k], file[off + k + 1]);
    }
  }
  c.fill(5, 0, 8, in2.data(), tg2.data());
  EXPECT_NE(in1, in2) << "a different seed gave the same batch";
  a.fill(6, 0, 8, in2.data(), tg2.data());
  EXPECT_NE(in1, in2) << "a different step gave the same batch";
}

TEST(BatchSampler, LayoutIndependent) {
  ScratchDir dir;
  TokenFile file = make_file(dir, 5000);
  const int64_t T = 8;
  BatchSampler s(file, T, 7);
  for (int64_t step : {0, 1, 1000000}) {
    std::vector<int32_t> whole_in(8 * T), whole_tg(8 * T), split_in(8 * T), split_tg(8 * T);
    s.fill(step, 0, 8, whole_in.data(), whole_tg.data());
    s.fill(step, 0, 4, split_in.data(), split_tg.data());
    s.fill(step, 4, 4, split_in.data() + 4 * T, split_tg.data() + 4 * T);
    EXPECT_EQ(whole_in, split_in) << "step " << step;
    EXPECT_EQ(whole_tg, split_tg) << "step " << step;
    for (int64_t i = 0; i < 8; ++i) {  // one sequence at a time, as eight ranks would
      std::vector<int32_t> in(T), tg(T);
      s.fill(step, i, 1, in.data(), tg.data());
      EXPECT_TRUE(std::equal(in.begin(), in.end(), whole_in.begin() + i * T)) << "step " << step << " seq " << i;
    }
  }
}

TEST(BatchSampler, CoversTheFile) {
  ScratchDir dir;
  TokenFile file = make_file(dir, 40);
  const int64_t T = 8;
  BatchSampler s(file, T, 3);
  std::vector<bool> seen(40 - T);
  for (int64_t i = 0; i < 2000; ++i) seen[s.offset(0, i)] = true;
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), 40 - T) << "some start offsets never sampled";
}

TEST(BatchSampler, TooShortFileIsAClearError) {
  ScratchDir dir;
  TokenFile file = make_file(dir, 8);
  try {
    BatchSampler s(file, 8, 0);
    ADD_FAILURE() << "no error for 8 tokens with T = 8";
  } catch (const core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("train.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("seq_len + 1 = 9"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(BatchSampler(file, 7, 0));
  EXPECT_THROW(EvalSampler(file, 8), core::InvalidArgument);
}

TEST(EvalSampler, SequentialWindows) {
  ScratchDir dir;
  TokenFile file = make_file(dir, 35);
  const int64_t T = 8;
  EvalSampler e(file, T);
  EXPECT_EQ(e.num_sequences(), 4);  // (35 - 1) / 8
  std::vector<int32_t> in(6 * T), tg(6 * T);
  e.fill(0, 6, in.data(), tg.data());
  for (int64_t j = 0; j < 6; ++j) {
    int64_t start = (j % 4) * T;
    for (int64_t k = 0; k < T; ++k) {
      ASSERT_EQ(in[j * T + k], start + k) << "window " << j;
      ASSERT_EQ(tg[j * T + k], start + k + 1) << "window " << j;
    }
  }
}

}  // namespace
}  // namespace po::data
