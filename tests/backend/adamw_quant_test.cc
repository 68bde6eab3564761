// 8- and 4-bit Adam state (optim.state_bits) against numpy ports of the
// published algorithms: tests/golden/optim_bits_ref.safetensors, written by
// tools/torch_ref/make_optim_bits.py (bitsandbytes' dynamic maps, blockwise
// quantization and optimizer_update_8bit_blockwise_pytorch; torchao's 4-bit
// maps, quantize_4bit_with_qmap and single_param_adam).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "checkpoint/safetensors.h"
#include "backend/quant_map.h"

#include "../golden_tensors.h"
namespace {

namespace cpu = po::backend::cpu;
using po::backend::Codebook;
using po::checkpoint::SafetensorsReader;
using po::backend::codebook;
using po::backend::QuantMap;

const std::string kGolden = std::string(PO_SOURCE_DIR) + "/tests/golden/optim_bits_ref.safetensors";

using po::test::bits_of;
using po::test::f32;
using po::test::u8;

// Units in the last place between two finite floats of one sign.
int64_t ulps(float a, float b) {
  return std::llabs(static_cast<int64_t>(bits_of(a)) - static_cast<int64_t>(bits_of(b)));
}

void expect_same_bits(const std::string& what, const float* got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i])) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " (0x" << std::hex << bits_of(got[i])
                    << "), reference " << want[i] << " (0x" << bits_of(want[i]) << ")";
      return;
    }
}

template <typename T>
void expect_equal(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    if (!(got[i] == want[i]) && !(std::isnan(static_cast<double>(got[i])) && std::isnan(static_cast<double>(want[i])))) {
      ADD_FAILURE() << what << "[" << i << "]: " << +got[i] << ", reference " << +want[i];
      return;
    }
}

TEST(QuantMaps, AreTheirConstructionBitForBit) {
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  const struct {
    QuantMap map;
    const char* name;
  } cases[] = {{QuantMap::kSigned8, "map.signed8"},
               {QuantMap::kUnsigned8, "map.unsigned8"},
               {QuantMap::kSigned4, "map.signed4"},
               {QuantMap::kUnsigned4, "map.unsigned4"}};
  for (const auto& c : cases) {
    const Codebook& cb = codebook(c.map);
    const std::vector<float> want = f32(f, c.name);
    ASSERT_EQ(cb.size, static_cast<int>(want.size())) << c.name;
    expect_same_bits(c.name, cb.value.data(), want);
  }
  // The published shapes: 8-bit signed has no -1.0 and 127 negative values;
  // the 4-bit v map has no zero.
  const Codebook& s8 = codebook(QuantMap::kSigned8);
  EXPECT_FLOAT_EQ(s8.value[0], -0.99296875f);
  EXPECT_EQ(s8.value[127], 0.0f);
  EXPECT_EQ(s8.value[255], 1.0f);
  EXPECT_GT(codebook(QuantMap::kUnsigned4).value[0], 0.0f);
}

TEST(QuantMaps, TorchLinspaceMapsAreWithinTwoUlps) {
  // torch.linspace's float32 points depend on its CPU dispatch; what this
  // machine's torch gave is held within two ulps (a mean of two points each
  // one ulp off), entry by entry.
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  for (auto [map, name] : {std::pair{QuantMap::kSigned8, "torch_signed8"},
                           std::pair{QuantMap::kUnsigned8, "torch_unsigned8"}}) {
    const std::vector<float> t = f32(f, name);
    const Codebook& cb = codebook(map);
    int differ = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      EXPECT_LE(ulps(cb.value[i], t[i]), 2) << name << "[" << i << "]: " << cb.value[i] << " vs " << t[i];
      differ += cb.value[i] != t[i];
    }
    EXPECT_LE(differ, 64) << name;
  }
}

TEST(QuantMaps, BucketSearchIsTheFirstNearestCode) {
  for (QuantMap m : {QuantMap::kSigned8, QuantMap::kUnsigned8}) {
    const Codebook& cb = codebook(m);
    auto brute = [&](float s) {
      int best = 0;
      for (int c = 1; c < cb.size; ++c)
        if (std::fabs(s - cb.value[c]) < std::fabs(s - cb.value[best])) best = c;
      return best;
    };
    std::vector<float> probes;
    for (int c = 0; c < cb.size; ++c) {
      probes.push_back(cb.value[c]);
      if (c + 1 < cb.size) {
        const float mid = (cb.value[c] + cb.value[c + 1]) / 2;
        probes.push_back(mid);
        probes.push_back(std::nextafter(mid, -2.0f));
        probes.push_back(std::nextafter(mid, 2.0f));
      }
    }
    std::mt19937 g(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int i = 0; i < 200000; ++i) probes.push_back(u(g) * std::ldexp(1.0f, -static_cast<int>(g() % 24)));
    for (float s : probes) {
      if (m == QuantMap::kUnsigned8) s = std::fabs(s);
      ASSERT_EQ(cb.code(s), brute(s)) << cb.name << " at " << s;
    }
  }
}

// The kernel's vector search (Codebook::step on the avx512 paths) against
// the scalar one, code for code: every float within 300 ulps of each value
// and of each midpoint between neighbours, ±0, subnormals, and random values
// at every scale. Each block of 256 starts with 1.0, so its absmax is 1 and
// an element's scaled value is itself.
TEST(QuantMaps, VectorEncodeIsTheScalarSearch) {
  for (QuantMap m : {QuantMap::kSigned8, QuantMap::kUnsigned8}) {
    const Codebook& cb = codebook(m);
    std::vector<float> probes = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), 1e-40f, -1e-40f};
    auto around = [&](float x) {
      float lo = x, hi = x;
      for (int k = 0; k < 300; ++k) {
        probes.push_back(lo = std::nextafter(lo, -2.0f));
        probes.push_back(hi = std::nextafter(hi, 2.0f));
      }
      probes.push_back(x);
    };
    for (int c = 0; c < cb.size; ++c) {
      around(cb.value[c]);
      if (c + 1 < cb.size) around((cb.value[c] + cb.value[c + 1]) / 2);
    }
    std::mt19937 g(11);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int i = 0; i < 300000; ++i) probes.push_back(u(g) * std::ldexp(1.0f, -static_cast<int>(g() % 40)));
    std::vector<float> x;
    for (size_t i = 0; i < probes.size(); ++i) {
      if (x.size() % 256 == 0) x.push_back(1.0f);
      const float p = std::clamp(probes[i], -1.0f, 1.0f);
      x.push_back(m == QuantMap::kUnsigned8 ? std::fabs(p) : p);
    }
    const auto n = static_cast<int64_t>(x.size());
    std::vector<uint8_t> codes(static_cast<size_t>(n));
    std::vector<float> absmax(static_cast<size_t>((n + 255) / 256));
    cpu::quantize_blockwise(&cb, x.data(), n, 256, codes.data(), absmax.data());
    for (float a : absmax) ASSERT_EQ(a, 1.0f);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(codes[static_cast<size_t>(i)], cb.code(x[static_cast<size_t>(i)]))
          << cb.name << ": element " << i << " = " << x[static_cast<size_t>(i)] << " (bits "
          << std::hex << std::bit_cast<uint32_t>(x[static_cast<size_t>(i)]) << std::dec << ")";
  }
}

struct QuantCase {
  const char* prefix;
  QuantMap map;
  const char* input;
  int64_t block;
};

TEST(QuantizeBlockwise, MatchesReferenceCodesAndScales) {
  // A tail block, an all-zero block, -1.0 and 1.0, values on midpoints, and a
  // block each with NaN, +Inf and -Inf.
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  const QuantCase cases[] = {{"q8s", QuantMap::kSigned8, "q.x", 256},
                             {"q8u", QuantMap::kUnsigned8, "q8u.x", 256},
                             {"q4s", QuantMap::kSigned4, "q.x", 128},
                             {"q4u", QuantMap::kUnsigned4, "q8u.x", 128},
                             {"bad8s", QuantMap::kSigned8, "bad.x", 256},
                             {"bad4s", QuantMap::kSigned4, "bad.x", 128}};
  for (const auto& c : cases) {
    const Codebook& cb = codebook(c.map);
    const std::vector<float> x = f32(f, c.input);
    const int64_t n = static_cast<int64_t>(x.size());
    const std::vector<uint8_t> want = u8(f, std::string(c.prefix) + ".codes");
    const std::vector<float> want_absmax = f32(f, std::string(c.prefix) + ".absmax");
    std::vector<uint8_t> codes(want.size(), 0xAA);
    std::vector<float> absmax(want_absmax.size());
    cpu::quantize_blockwise(&cb, x.data(), n, c.block, codes.data(), absmax.data());
    expect_equal(std::string(c.prefix) + " codes", codes, want);
    expect_equal(std::string(c.prefix) + " absmax", absmax, want_absmax);
    // Decoding gives value × absmax, and a zero block decodes to zeros.
    std::vector<float> back(x.size());
    cpu::dequantize_blockwise(&cb, codes.data(), absmax.data(), n, c.block, back.data());
    for (int64_t i = 0; i < n; ++i) {
      const int code = cb.bits == 8 ? codes[i] : (i & 1 ? codes[i / 2] & 15 : codes[i / 2] >> 4);
      const float want_x = cb.value[code] * absmax[i / c.block];
      ASSERT_TRUE(bits_of(back[i]) == bits_of(want_x) || (std::isnan(back[i]) && std::isnan(want_x)))
          << c.prefix << " decoded [" << i << "]";
    }
  }
}

// The reference's gradients (make_optim_bits.py: grads()).
std::vector<float> reference_grads(int64_t step, int64_t n, int tensor) {
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = (static_cast<uint64_t>(step) << 40) ^ (static_cast<uint64_t>(tensor) << 32) ^
                 static_cast<uint64_t>(i);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = static_cast<double>(z >> 40);
    g[static_cast<size_t>(i)] =
        static_cast<float>((u / 16777216.0 - 0.5) * std::ldexp(1.0, -static_cast<int>((i / 256) % 8)));
  }
  g[5] = 0;
  for (int64_t i = 3 * 256; i < 4 * 256; ++i) g[static_cast<size_t>(i)] = 0;
  if (step % 37 == 0 && n > 700) g[700] = 50;
  return g;
}

// |a - b| relative to b, or to lr where |b| < lr (a parameter near zero is
// held to a step's rounding).
double rel_error(float a, float b, double lr) {
  return std::fabs(static_cast<double>(a) - b) / std::max(std::fabs(static_cast<double>(b)), lr);
}

struct AdamCase {
  int bits;
  int64_t block;
  QuantMap m, v;
};

// Element i's code in codes of `bits` bits.
int code_of(const std::vector<uint8_t>& codes, int64_t i, int bits) {
  return bits == 8 ? codes[static_cast<size_t>(i)]
                   : (i & 1 ? codes[static_cast<size_t>(i / 2)] & 15 : codes[static_cast<size_t>(i / 2)] >> 4);
}

// 100 steps of the kernel on tensor t's reference gradients, compared with
// the reference run in the library's float32 order ("ref") and in
// adamw_update's ("ours").
void run_adam(const AdamCase& c) {
  const SafetensorsReader f = SafetensorsReader::open(kGolden);
  const double lr = std::stod(f.metadata().at("lr")), b1 = std::stod(f.metadata().at("beta1")),
               b2 = std::stod(f.metadata().at("beta2")), eps = std::stod(f.metadata().at("eps")),
               wd = std::stod(f.metadata().at("weight_decay"));
  const int steps = std::stoi(f.metadata().at("steps"));
  const int64_t sizes[] = {3000, 4096};
  for (int t = 0; t < 2; ++t) {
    const std::string tensor = "adam" + std::to_string(c.bits) + "." + std::to_string(t) + ".";
    const int64_t n = sizes[t];
    std::vector<float> p = f32(f, tensor + "p0");
    const std::vector<float> p0 = p;
    const int64_t code_bytes = c.bits == 8 ? n : (n + 1) / 2;
    const int64_t nb = (n + c.block - 1) / c.block;
    std::vector<uint8_t> m(static_cast<size_t>(code_bytes), 0), v(static_cast<size_t>(code_bytes), 0);
    std::vector<float> am(static_cast<size_t>(nb), 0.0f), av(static_cast<size_t>(nb), 0.0f);
    cpu::QuantMoments q{m.data(), am.data(), v.data(), av.data(), &codebook(c.m), &codebook(c.v), c.block};
    const float decay = t == 0 ? static_cast<float>(wd) : 0.0f;
    for (int s = 1; s <= steps; ++s) {
      const std::vector<float> g = reference_grads(s, n, t);
      cpu::adamw_update_quant(p.data(), g.data(), nullptr, nullptr, &q, n, static_cast<float>(lr),
                              static_cast<float>(b1), static_cast<float>(b2), static_cast<float>(eps),
                              decay, 1.0f, s);
      if (s == 1) {
        expect_same_bits(tensor + "ours step 1 parameters", p.data(), f32(f, tensor + "ours.p1"));
        const std::vector<float> ref = f32(f, tensor + "ref.p1");
        for (int64_t i = 0; i < n; ++i)
          ASSERT_LE(rel_error(p[i], ref[i], lr), 1e-6)
              << tensor << "ref step 1, element " << i << ": " << p[i] << " vs " << ref[i];
      }
    }
    // Against adamw_update's order: the same bits, codes and scales.
    const std::string ours = tensor + "ours.";
    expect_same_bits(ours + "p", p.data(), f32(f, ours + "p"));
    expect_equal(ours + "m", m, u8(f, ours + "m"));
    expect_equal(ours + "v", v, u8(f, ours + "v"));
    expect_equal(ours + "m_absmax", am, f32(f, ours + "m_absmax"));
    expect_equal(ours + "v_absmax", av, f32(f, ours + "v_absmax"));
    // Against the library's order: at least 99.9% of the codes equal; the
    // parameters within 1e-6 after one step (above) and, after 100, within
    // what a code that crossed a boundary mid-run moves (measured 1.4e-3).
    const std::string ref = tensor + "ref.";
    for (const char* field : {"m", "v"}) {
      const std::vector<uint8_t> want = u8(f, ref + field);
      const std::vector<uint8_t>& got = *field == 'm' ? m : v;
      int64_t same = 0;
      for (int64_t i = 0; i < n; ++i) same += code_of(got, i, c.bits) == code_of(want, i, c.bits);
      std::printf("%s%s: %ld of %ld codes equal\n", ref.c_str(), field, static_cast<long>(same),
                  static_cast<long>(n));
      EXPECT_GE(static_cast<double>(same), 0.999 * static_cast<double>(n))
          << ref << field << ": " << n - same << " of " << n << " codes differ";
    }
    const std::vector<float> want_p = f32(f, ref + "p");
    double worst = 0;
    int64_t worst_i = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double e = rel_error(p[i], want_p[i], lr);
      if (e > worst) worst = e, worst_i = i;
    }
    std::printf("%sp: worst relative difference %.3g (element %ld)\n", ref.c_str(), worst,
                static_cast<long>(worst_i));
    EXPECT_LE(worst, 1e-2) << ref << "p[" << worst_i << "]: " << p[worst_i] << " vs " << want_p[worst_i];
    // A coordinate whose gradient is always zero, and a block of them, stay
    // exactly as they were (no decay on tensor 1): m decodes to exactly 0.
    if (t == 1) {
      EXPECT_EQ(bits_of(p[5]), bits_of(p0[5])) << tensor << " element 5 (always a zero gradient) moved";
      for (int64_t i = 3 * 256; i < 4 * 256; ++i)
        ASSERT_EQ(bits_of(p[i]), bits_of(p0[i])) << tensor << " element " << i << " of the zero block moved";
    }
  }
}

TEST(AdamWQuant, EightBitFollowsBitsandbytesReference) {
  run_adam({8, 256, QuantMap::kSigned8, QuantMap::kUnsigned8});
}

TEST(AdamWQuant, FourBitFollowsTorchaoReference) {
  run_adam({4, 128, QuantMap::kSigned4, QuantMap::kUnsigned4});
}

TEST(AdamWQuant, LosslessStateGivesTheFloat32Step) {
  // One step from zero state with every block's values exactly on codes: the
  // fp32 update and the quantized one see the same m and v, so the parameters
  // are the same bits (the arithmetic is adamw_update's).
  const int64_t n = 512;
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = i % 7 == 0 ? 0.0f : 0.25f;  // signed8 has 1.0, not -1.0
  std::vector<float> p(n, 0.5f), p32 = p, m32(n, 0.0f), v32(n, 0.0f);
  std::vector<uint8_t> m(n, 0), v(n, 0);
  std::vector<float> am(2, 0.0f), av(2, 0.0f);
  cpu::QuantMoments q{m.data(), am.data(), v.data(), av.data(), &codebook(QuantMap::kSigned8),
                      &codebook(QuantMap::kUnsigned8), 256};
  cpu::adamw_update_quant(p.data(), g.data(), nullptr, nullptr, &q, n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                          0.1f, 1.0f, 1);
  cpu::adamw_update(p32.data(), g.data(), m32.data(), v32.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                    0.1f, 1.0f, 1);
  expect_same_bits("param", p.data(), p32);
  // |m| = 0.025 and v = 0.003125 on every nonzero element: the absmax, code 1.0.
  std::vector<float> back(n);
  cpu::dequantize_blockwise(&codebook(QuantMap::kSigned8), m.data(), am.data(), n, 256, back.data());
  expect_same_bits("m", back.data(), m32);
  cpu::dequantize_blockwise(&codebook(QuantMap::kUnsigned8), v.data(), av.data(), n, 256, back.data());
  expect_same_bits("v", back.data(), v32);
}

TEST(AdamWQuant, Bf16GradientsAndParametersOut) {
  // The mixed-precision form: bf16 gradients in, the fp32 master updated and
  // its bf16 rounding written out; the same master as from float32 gradients
  // holding the same values.
  const int64_t n = 1000;
  std::vector<float> g(n);
  std::vector<uint16_t> gb(n);
  std::mt19937 r(3);
  std::uniform_real_distribution<float> u(-0.1f, 0.1f);
  for (auto& x : g) x = u(r);
  cpu::f32_to_bf16(gb.data(), g.data(), n);
  cpu::bf16_to_f32(g.data(), gb.data(), n);
  auto run = [&](bool bf16, std::vector<float>& p, std::vector<uint16_t>& out) {
    std::vector<uint8_t> m((n + 1) / 2, 0), v((n + 1) / 2, 0);
    std::vector<float> am(8, 0.0f), av(8, 0.0f);
    cpu::QuantMoments q{m.data(), am.data(), v.data(), av.data(), &codebook(QuantMap::kSigned4),
                        &codebook(QuantMap::kUnsigned4), 128};
    for (int s = 1; s <= 3; ++s)
      cpu::adamw_update_quant(p.data(), bf16 ? nullptr : g.data(), bf16 ? gb.data() : nullptr,
                              bf16 ? out.data() : nullptr, &q, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                              1.0f, s);
  };
  std::vector<float> pa(n, 0.3f), pb(n, 0.3f);
  std::vector<uint16_t> out(n, 0), unused;
  run(false, pa, unused);
  run(true, pb, out);
  expect_same_bits("master", pb.data(), pa);
  std::vector<uint16_t> want(n);
  cpu::f32_to_bf16(want.data(), pa.data(), n);
  expect_equal("bf16 parameters", out, want);
}

}  // namespace
