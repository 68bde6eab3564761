#include "optim/quant_map.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "core/error.h"

namespace po::optim {

std::vector<float> dynamic_map(bool is_signed, int max_exponent_bits, int total_bits) {
  const int non_sign_bits = total_bits - 1;  // bitsandbytes' (1 if signed else 1)
  PO_ASSERT((1 << (non_sign_bits - max_exponent_bits)) - 1 == 0,
            "dynamic_map: only the maps without linear extra items are built");
  std::vector<float> data;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int k = is_signed ? (1 << (i + non_sign_bits - max_exponent_bits)) + 1
                            : (1 << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    std::vector<float> b(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j) b[static_cast<size_t>(j)] = static_cast<float>(0.1 + (1.0 - 0.1) * j / (k - 1));
    // 10^(i - (max_exponent_bits - 1)) as Python's float, then float32.
    const float scale = static_cast<float>(std::pow(10.0, i - (max_exponent_bits - 1)));
    for (int j = 0; j + 1 < k; ++j) {
      const float mean = (b[static_cast<size_t>(j)] + b[static_cast<size_t>(j) + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  PO_ASSERT(data.size() == (size_t{1} << total_bits), "dynamic_map: ", data.size(), " values");
  std::sort(data.begin(), data.end());
  return data;
}

namespace {

uint8_t first_nearest_brute(const backend::Codebook& cb, float s) {
  int best = 0;
  float best_d = std::fabs(s - cb.value[0]);
  for (int c = 1; c < cb.size; ++c) {
    const float d = std::fabs(s - cb.value[static_cast<size_t>(c)]);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return static_cast<uint8_t>(best);
}

// The first candidate of each float32 bit-pattern bucket (top 16 bits): the
// lower of the first nearest codes of its two ends; the nearest code of any
// value between them lies between those two (it does not fall as the value
// rises), which must be at most kCandidates apart.
void build_buckets(backend::Codebook& cb) {
  cb.lo.assign(65536, 0);
  int widest = 1;
  for (uint32_t key = 0; key < 65536; ++key) {
    const uint32_t ends[2] = {key << 16, (key << 16) | 0xFFFFu};
    int a = 255, b = 0;
    for (uint32_t bits : ends) {
      float s;
      std::memcpy(&s, &bits, 4);
      if (std::isnan(s) || std::fabs(s) > 1.0f) continue;  // never a scaled value
      const int c = first_nearest_brute(cb, s);
      a = std::min(a, c);
      b = std::max(b, c);
    }
    if (a > b) a = b = cb.size - 1;
    PO_ASSERT(b - a < backend::Codebook::kCandidates, "codebook ", cb.name, ": bucket ", key,
              " holds codes ", a, " to ", b);
    cb.lo[key] = static_cast<uint8_t>(a);
    widest = std::max(widest, b - a + 1);
  }
  cb.candidates = widest;
}

// Codebook::step from nearest() (which reads lo): within a bucket the code
// moves one way as the low 16 bits rise (up for positive floats, down for
// negative ones; a pattern past ±1 takes the code of the bucket's end at
// ±1), so its at most two steps are found by bisection.
void build_steps(backend::Codebook& cb) {
  cb.step.assign(65536, 0);
  for (uint32_t key = 0; key < 65536; ++key) {
    const bool negative = (key & 0x8000u) != 0;
    auto code = [&](uint32_t low) {
      float s;
      const uint32_t bits = (key << 16) | low;
      std::memcpy(&s, &bits, 4);
      // Never a scaled value (the kernel masks NaN to code 0 itself).
      if (std::isnan(s) || std::fabs(s) > 1.0f) s = negative ? -1.0f : 1.0f;
      return static_cast<int>(cb.nearest(s));
    };
    const int c0 = code(0);
    const int d = negative ? -1 : 1;
    // The first low 16 bits whose code is at least k steps from c0 (0x10000: none).
    auto first = [&](int k) {
      uint32_t a = 0, b = 0x10000;
      while (a < b) {
        const uint32_t m = (a + b) / 2;
        if ((code(m) - c0) * d >= k) b = m; else a = m + 1;
      }
      return static_cast<uint64_t>(a);
    };
    const int span = (code(0xFFFF) - c0) * d;
    PO_ASSERT(span >= 0 && span <= 2, "codebook ", cb.name, ": bucket ", key, " moves ", span, " codes");
    cb.step[key] = static_cast<uint64_t>(c0) | first(1) << 8 | first(2) << 32;
  }
}

backend::Codebook make(const char* name, const std::vector<float>& values,
                       backend::Codebook::Rounding rounding, backend::Codebook::ZeroAbsmax zero) {
  backend::Codebook cb;
  cb.name = name;
  cb.size = static_cast<int>(values.size());
  cb.bits = cb.size == 256 ? 8 : 4;
  cb.rounding = rounding;
  cb.zero_absmax = zero;
  std::copy(values.begin(), values.end(), cb.value.begin());
  if (rounding == backend::Codebook::Rounding::kFirstNearest) {
    build_buckets(cb);
    build_steps(cb);
  }
  return cb;
}

}  // namespace

const backend::Codebook& codebook(QuantMap which) {
  using R = backend::Codebook::Rounding;
  using Z = backend::Codebook::ZeroAbsmax;
  static std::once_flag once[4];
  static backend::Codebook books[4];
  const auto i = static_cast<size_t>(which);
  std::call_once(once[i], [&] {
    switch (which) {
      case QuantMap::kSigned8:
        books[i] = make("signed8", dynamic_map(true, 7, 8), R::kFirstNearest, Z::kOne);
        break;
      case QuantMap::kUnsigned8:
        books[i] = make("unsigned8", dynamic_map(false, 7, 8), R::kFirstNearest, Z::kOne);
        break;
      case QuantMap::kSigned4:
        books[i] = make("signed4", dynamic_map(true, 3, 4), R::kHalfUp, Z::kClip);
        break;
      case QuantMap::kUnsigned4: {
        std::vector<float> v(16);
        for (int j = 1; j <= 16; ++j) v[static_cast<size_t>(j) - 1] = static_cast<float>(j / 16.0);
        books[i] = make("unsigned4", v, R::kHalfUp, Z::kClip);
        break;
      }
    }
  });
  return books[i];
}

}  // namespace po::optim
