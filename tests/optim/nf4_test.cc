// NF4 with double quantization (backend/nf4.h) against a numpy port of
// bitsandbytes' create_normal_map, create_dynamic_map, quantize_4bit
// (blocksize 64, compress_statistics=True) and dequantize_4bit:
// tests/golden/nf4_ref.safetensors, written by tools/torch_ref/make_nf4.py.
//
// Everything is held bit for bit, the dequantized weights included (stricter
// than a relative tolerance): the C++ performs the port's float32 operations
// one for one (reciprocal, product, clamp, |s - value|; on decode a product
// and a sum, unfused), and the offset's mean is a float64 sum in block order
// on both sides, so no summation order can differ.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/codebook.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "backend/nf4.h"
#include "backend/quant_map.h"

#include "../golden_tensors.h"
namespace {

using po::backend::Codebook;
using po::checkpoint::SafetensorsReader;
using po::backend::codebook;
using po::backend::kNf4Block;
using po::backend::kNf4NestedBlock;
using po::backend::Nf4Tensor;
using po::backend::QuantMap;

const std::string kGolden = std::string(PO_SOURCE_DIR) + "/tests/golden/nf4_ref.safetensors";

// bitsandbytes' hard-coded NF4 table (functional.py get_4bit_type), as printed there.
const double kBnbNf4[16] = {-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                            0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                            0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                            0.7229568362236023, 1.0};

using po::test::bits_of;
using po::test::f32;
using po::test::u8;

// The first element that differs (floats by their bits), named and placed.
void expect_same(const std::string& what, const float* got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i])) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " (0x" << std::hex << bits_of(got[i])
                    << "), numpy port " << want[i] << " (0x" << bits_of(want[i]) << ")";
      return;
    }
}

void expect_same(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what << ": element count";
  expect_same(what, got.data(), want);
}

// Packed codes: the byte and which element (high nibble: the even one) differs.
void expect_same(const std::string& what, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                 bool packed) {
  ASSERT_EQ(got.size(), want.size()) << what << ": byte count";
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i]) {
      if (packed) {
        const bool high = (got[i] >> 4) != (want[i] >> 4);
        ADD_FAILURE() << what << " byte " << i << ": element " << 2 * i + (high ? 0 : 1) << " has code "
                      << (high ? got[i] >> 4 : got[i] & 15) << ", numpy port "
                      << (high ? want[i] >> 4 : want[i] & 15) << " (block " << 2 * i / kNf4Block << ")";
      } else {
        ADD_FAILURE() << what << "[" << i << "]: code " << +got[i] << ", numpy port " << +want[i];
      }
      return;
    }
}

template <typename Fn>
void expect_refusal(const std::string& says, Fn fn) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying \"" << says << "\"";
  } catch (const po::core::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

// Half the widest gap between neighbouring values of a map over [-1, 1]
// (with the distance from -1 to the first value when the map lacks -1).
double half_widest_gap(const Codebook& cb) {
  double gap = 2.0 * (cb.value[0] + 1.0);
  for (int c = 0; c + 1 < cb.size; ++c) gap = std::max(gap, static_cast<double>(cb.value[c + 1]) - cb.value[c]);
  return gap / 2;
}

const char* const kTensors[] = {"a", "b", "c"};

TEST(Nf4Map, IsBitsandbytesTableBitForBit) {
  const std::vector<float> map = po::backend::nf4_map();
  ASSERT_EQ(map.size(), 16u);
  for (int i = 0; i < 16; ++i)
    EXPECT_EQ(bits_of(map[i]), bits_of(static_cast<float>(kBnbNf4[i])))
        << "nf4_map()[" << i << "] = " << map[i] << ", bitsandbytes' table " << kBnbNf4[i];
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  expect_same("map.nf4", map, f32(f, "map.nf4"));
  const Codebook& cb = codebook(QuantMap::kNf4);
  ASSERT_EQ(cb.size, 16);
  EXPECT_EQ(cb.bits, 4);
  expect_same("codebook(kNf4)", cb.value.data(), map);
  // The nested map the port used is the project's signed dynamic map.
  expect_same("map.dynamic_signed8", codebook(QuantMap::kSigned8).value.data(),
              f32(f, "map.dynamic_signed8"));
}

TEST(Nf4Map, NormalQuantileInvertsErfc) {
  using po::backend::normal_quantile;
  EXPECT_EQ(normal_quantile(0.5), 0.0);
  EXPECT_NEAR(normal_quantile(0.975), 1.959963984540054, 1e-15);
  EXPECT_NEAR(normal_quantile(0.025), -1.959963984540054, 1e-15);
  // Phi(x) = erfc(-x / sqrt 2) / 2 within erfc's accuracy (times Phi's
  // relative slope, about x^2 in the tails), in all three AS241 regions.
  for (double p : {1e-300, 1e-20, 1e-10, 1e-3, 0.02, 0.0750, 0.3, 0.5 + 1e-9, 0.6, 0.9,
                   0.9677082896232605, 0.999, 1.0 - 1e-10}) {
    const double x = normal_quantile(p);
    const double back = 0.5 * std::erfc(-x / std::sqrt(2.0));
    EXPECT_NEAR(back, p, 1e-14 * std::max(1.0, x * x) * std::min(p, 1.0 - p))
        << "normal_quantile(" << p << ") = " << x;
  }
  expect_refusal("is not in (0, 1)", [] { (void)normal_quantile(0.0); });
  expect_refusal("is not in (0, 1)", [] { (void)normal_quantile(1.0); });
}

TEST(Nf4Map, CodeIsTheFirstNearestValue) {
  const Codebook& cb = codebook(QuantMap::kNf4);
  auto brute = [&](float s) {
    int best = 0;
    for (int c = 1; c < 16; ++c)
      if (std::fabs(s - cb.value[c]) < std::fabs(s - cb.value[best])) best = c;
    return best;
  };
  std::vector<float> probes = {-1.0f, 1.0f, 0.0f, -0.0f};
  int upper_on_midpoint = 0;
  for (int c = 0; c < 16; ++c) {
    probes.push_back(cb.value[c]);
    if (c + 1 < 16) {
      const float mid = (cb.value[c] + cb.value[c + 1]) / 2;
      float s = mid;
      for (int k = 0; k < 200; ++k) s = std::nextafter(s, -2.0f);
      for (int k = 0; k < 400; ++k, s = std::nextafter(s, 2.0f)) probes.push_back(s);
      upper_on_midpoint += cb.code(mid) == c + 1;
    }
  }
  std::mt19937 g(4127);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < 200000; ++i) probes.push_back(u(g) * std::ldexp(1.0f, -static_cast<int>(g() % 12)));
  for (float s : probes) ASSERT_EQ(cb.code(s), brute(s)) << "nf4 at " << s;
  // A value exactly on a float32 midpoint is rounded, so it is nearer one
  // side: argmin takes the upper code at 6 of the 15, where CUDA's
  // dQuantizeNF4 (x > midpoint) takes the lower one at all 15.
  EXPECT_EQ(upper_on_midpoint, 6);
}

TEST(Nf4Golden, MatchesTheNumpyPortBitForBit) {
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  for (const std::string t : kTensors) {
    SCOPED_TRACE("tensor " + t);
    const std::vector<float> w = f32(f, t + ".w");
    const Nf4Tensor q = po::backend::quantize_nf4(w.data(), static_cast<int64_t>(w.size()));
    EXPECT_EQ(q.numel, static_cast<int64_t>(w.size()));
    expect_same(t + ".codes", q.codes, u8(f, t + ".codes"), true);
    expect_same(t + ".absmax_codes", q.absmax_codes, u8(f, t + ".absmax_codes"), false);
    expect_same(t + ".nested_absmax", q.nested_absmax, f32(f, t + ".nested_absmax"));
    expect_same(t + ".offset", &q.offset, f32(f, t + ".offset"));
    std::vector<float> absmax(static_cast<size_t>(q.blocks()));
    for (int64_t b = 0; b < q.blocks(); ++b) absmax[static_cast<size_t>(b)] = po::backend::nf4_absmax(q, b);
    expect_same(t + ".absmax_deq", absmax, f32(f, t + ".absmax_deq"));
    std::vector<float> deq(w.size(), std::numeric_limits<float>::quiet_NaN());
    po::backend::dequantize_nf4(q, deq.data());
    expect_same(t + ".deq", deq, f32(f, t + ".deq"));
    // bitsandbytes' own offset is torch's float32 mean, whose last bit is
    // its reduction order's: this machine's torch is within an ulp here.
    if (f.has(t + ".torch_offset")) {
      const float torch_mean = f32(f, t + ".torch_offset")[0];
      EXPECT_LE(std::abs(static_cast<int64_t>(bits_of(torch_mean)) - static_cast<int64_t>(bits_of(q.offset))), 1)
          << "offset " << q.offset << ", torch's float32 mean " << torch_mean;
    }
  }
}

TEST(Nf4Golden, EdgeBlocksAreBitsandbytes) {
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  const std::vector<float> b = f32(f, "b.w");
  const Nf4Tensor q = po::backend::quantize_nf4(b.data(), static_cast<int64_t>(b.size()));
  // Block 5 is all zeros: 0 * (1 / 0) is NaN, code 0 (the value -1), which
  // decodes to -absmax' where the double quantization left absmax' near 0.
  for (int64_t e = 5 * kNf4Block; e < 6 * kNf4Block; ++e)
    ASSERT_EQ(po::backend::code_at(q.codes.data(), e, 4), 0) << "zero block, element " << e;
  std::vector<float> zero(kNf4Block);
  po::backend::dequantize_nf4_rows(q, 5 * kNf4Block, kNf4Block, zero.data());
  const float absmax5 = po::backend::nf4_absmax(q, 5);
  EXPECT_EQ(zero[17], -absmax5);
  EXPECT_NE(absmax5, 0.0f);
  EXPECT_LE(std::fabs(absmax5), q.nested_absmax[0] * half_widest_gap(codebook(QuantMap::kSigned8)))
      << "the zero block's recovered absmax";
  // The short last block (16484 = 257 * 64 + 36) and 258 blocks = 256 + 2 nested.
  EXPECT_EQ(q.blocks(), 258);
  EXPECT_EQ(q.nested_absmax.size(), 2u);
  // 37 elements: the pad nibble is 7, NF4's 0.
  const std::vector<float> c = f32(f, "c.w");
  const Nf4Tensor qc = po::backend::quantize_nf4(c.data(), 37);
  ASSERT_EQ(qc.codes.size(), 19u);
  EXPECT_EQ(qc.codes[18] & 0x0F, 7);
  // One block: absmax - offset is 0, its nested block codes 0 with absmax 0,
  // and the recovered absmax is the offset itself, the block's absmax.
  EXPECT_EQ(qc.nested_absmax[0], 0.0f);
  EXPECT_EQ(po::backend::nf4_absmax(qc, 0), qc.offset);
}

TEST(Nf4Golden, RowRangesAreTheWholeBitForBit) {
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  for (const std::string t : kTensors) {
    const std::vector<float> w = f32(f, t + ".w");
    const int64_t n = static_cast<int64_t>(w.size());
    const Nf4Tensor q = po::backend::quantize_nf4(w.data(), n);
    std::vector<float> whole(w.size());
    po::backend::dequantize_nf4(q, whole.data());
    std::vector<std::pair<int64_t, int64_t>> ranges = {{0, n}, {0, 0}, {n, 0}, {1, std::min<int64_t>(n - 1, 63)},
                                                       {n - 1, 1}, {n / 2, n - n / 2}};
    if (n > 200) ranges.insert(ranges.end(), {{63, 2}, {64, 64}, {65, 130}, {127, n - 127}});
    std::mt19937 g(7);
    for (int i = 0; i < 50; ++i) {
      const int64_t first = static_cast<int64_t>(g() % static_cast<uint32_t>(n));
      ranges.emplace_back(first, static_cast<int64_t>(g() % static_cast<uint32_t>(n - first + 1)));
    }
    for (auto [first, count] : ranges) {
      std::vector<float> part(static_cast<size_t>(count) + 1, 12345.0f);
      po::backend::dequantize_nf4_rows(q, first, count, part.data());
      for (int64_t i = 0; i < count; ++i)
        if (bits_of(part[static_cast<size_t>(i)]) != bits_of(whole[static_cast<size_t>(first + i)])) {
          ADD_FAILURE() << t << ": rows [" << first << ", " << first + count << ") element " << first + i << ": "
                        << part[static_cast<size_t>(i)] << ", whole " << whole[static_cast<size_t>(first + i)];
          break;
        }
      EXPECT_EQ(part[static_cast<size_t>(count)], 12345.0f) << t << ": rows [" << first << ", "
                                                            << first + count << ") wrote past the range";
    }
  }
}

// |w - w'| <= absmax * h4 + |absmax - absmax'| (the nearest value is h4 =
// half NF4's widest gap from w / absmax; the recovered absmax moves a value
// of magnitude <= 1 by at most their difference), and |absmax - absmax'| <=
// nested_absmax * h8 (the dynamic map's widest half gap, -1 included), each
// with float32 rounding's slack.
void expect_round_trip_bound(const std::string& what, const std::vector<float>& w) {
  const int64_t n = static_cast<int64_t>(w.size());
  const Nf4Tensor q = po::backend::quantize_nf4(w.data(), n);
  std::vector<float> deq(w.size());
  po::backend::dequantize_nf4(q, deq.data());
  const double h4 = half_widest_gap(codebook(QuantMap::kNf4));
  const double h8 = half_widest_gap(codebook(QuantMap::kSigned8));
  const double eps = std::ldexp(1.0, -22);
  for (int64_t b = 0; b < q.blocks(); ++b) {
    const int64_t lo = b * kNf4Block, hi = std::min(n, lo + kNf4Block);
    double absmax = 0;
    for (int64_t e = lo; e < hi; ++e) absmax = std::max(absmax, std::fabs(static_cast<double>(w[e])));
    const double rec = po::backend::nf4_absmax(q, b);
    const double nested = q.nested_absmax[static_cast<size_t>(b / kNf4NestedBlock)];
    ASSERT_LE(std::fabs(absmax - rec), nested * h8 + eps * (nested + std::fabs(q.offset)))
        << what << ": block " << b << " absmax " << absmax << " recovered as " << rec;
    const double bound = absmax * h4 + std::fabs(absmax - rec) + eps * std::max(absmax, std::fabs(rec));
    for (int64_t e = lo; e < hi; ++e)
      ASSERT_LE(std::fabs(static_cast<double>(w[e]) - deq[e]), bound)
          << what << ": element " << e << " (block " << b << ") " << w[e] << " decoded as " << deq[e];
  }
}

TEST(Nf4, RoundTripErrorIsBounded) {
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  for (const std::string t : kTensors) expect_round_trip_bound(t, f32(f, t + ".w"));
  // Blocks at scales 2^0 .. 2^-15, 3 nested blocks and a short last one.
  std::mt19937 g(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(64 * 600 + 5);
  for (size_t i = 0; i < w.size(); ++i) w[i] = normal(g) * std::ldexp(1.0f, -static_cast<int>((i / 64) % 16));
  expect_round_trip_bound("scaled", w);
}

TEST(Nf4, SizeIs4Point127BitsPerParameter) {
  std::vector<float> w(64 * 256 * 4, 0.01f);
  w[3] = -0.5f;
  const Nf4Tensor q = po::backend::quantize_nf4(w.data(), static_cast<int64_t>(w.size()));
  const double bits = 8.0 * static_cast<double>(q.codes.size() + q.absmax_codes.size() + 4 * q.nested_absmax.size()) /
                      static_cast<double>(w.size());
  EXPECT_EQ(bits, 4.0 + 8.0 / 64 + 32.0 / (64 * 256));
  EXPECT_NEAR(bits, 4.127, 5e-4);
}

TEST(Nf4, RefusesWhatIsWrong) {
  std::vector<float> w(300, 0.01f);
  expect_refusal("0 elements", [&] { (void)po::backend::quantize_nf4(w.data(), 0); });
  expect_refusal("null", [&] { (void)po::backend::quantize_nf4(nullptr, 3); });
  w[100] = std::numeric_limits<float>::quiet_NaN();
  expect_refusal("element 100 is nan", [&] { (void)po::backend::quantize_nf4(w.data(), 300); });
  w[100] = 0.01f;
  w[299] = -std::numeric_limits<float>::infinity();
  expect_refusal("element 299 is -inf", [&] { (void)po::backend::quantize_nf4(w.data(), 300); });
  w[299] = 0.01f;

  const Nf4Tensor q = po::backend::quantize_nf4(w.data(), 300);
  std::vector<float> out(300);
  expect_refusal("elements [250, 301)", [&] { po::backend::dequantize_nf4_rows(q, 250, 51, out.data()); });
  expect_refusal("elements [-1, 1)", [&] { po::backend::dequantize_nf4_rows(q, -1, 2, out.data()); });
  expect_refusal("block 5 of a tensor of 5 blocks", [&] { (void)po::backend::nf4_absmax(q, 5); });
  Nf4Tensor short_codes = q;
  short_codes.codes.pop_back();
  expect_refusal("149 bytes of codes for 300 elements", [&] { po::backend::dequantize_nf4(short_codes, out.data()); });
  Nf4Tensor no_absmax = q;
  no_absmax.absmax_codes.clear();
  expect_refusal("0 absmax codes for 5 blocks", [&] { po::backend::dequantize_nf4(no_absmax, out.data()); });
  Nf4Tensor extra_nested = q;
  extra_nested.nested_absmax.push_back(1.0f);
  expect_refusal("2 nested absmaxes for 5 blocks", [&] { (void)po::backend::nf4_absmax(extra_nested, 0); });
}

}  // namespace
