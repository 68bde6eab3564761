#include "backend/quant_map.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "core/error.h"

namespace po::backend {

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

// c[0] r^7 + c[1] r^6 + ... + c[7], by Horner's rule.
double horner8(const double (&c)[8], double r) {
  double y = c[0];
  for (int i = 1; i < 8; ++i) y = y * r + c[i];
  return y;
}

}  // namespace

double normal_quantile(double p) {
  PO_CHECK(p > 0.0 && p < 1.0, "normal_quantile: p = ", p, " is not in (0, 1)");
  // AS241's coefficients, highest power first: |p - 0.5| <= 0.425; then in
  // r = sqrt(-log(min(p, 1 - p))) for r <= 5 (less 1.6) and beyond (less 5).
  static constexpr double kCentralNum[8] = {
      2.5090809287301226727e+3, 3.3430575583588128105e+4, 6.7265770927008700853e+4,
      4.5921953931549871457e+4, 1.3731693765509461125e+4, 1.9715909503065514427e+3,
      1.3314166789178437745e+2, 3.3871328727963666080e+0};
  static constexpr double kCentralDen[8] = {
      5.2264952788528545610e+3, 2.8729085735721942674e+4, 3.9307895800092710610e+4,
      2.1213794301586595867e+4, 5.3941960214247511077e+3, 6.8718700749205790830e+2,
      4.2313330701600911252e+1, 1.0};
  static constexpr double kNearNum[8] = {
      7.74545014278341407640e-4, 2.27238449892691845833e-2, 2.41780725177450611770e-1,
      1.27045825245236838258e+0, 3.64784832476320460504e+0, 5.76949722146069140550e+0,
      4.63033784615654529590e+0, 1.42343711074968357734e+0};
  static constexpr double kNearDen[8] = {
      1.05075007164441684324e-9, 5.47593808499534494600e-4, 1.51986665636164571966e-2,
      1.48103976427480074590e-1, 6.89767334985100004550e-1, 1.67638483018380384940e+0,
      2.05319162663775882187e+0, 1.0};
  static constexpr double kTailNum[8] = {
      2.01033439929228813265e-7, 2.71155556874348757815e-5, 1.24266094738807843860e-3,
      2.65321895265761230930e-2, 2.96560571828504891230e-1, 1.78482653991729133580e+0,
      5.46378491116411436990e+0, 6.65790464350110377720e+0};
  static constexpr double kTailDen[8] = {
      2.04426310338993978564e-15, 1.42151175831644588870e-7, 1.84631831751005468180e-5,
      7.86869131145613259100e-4, 1.48753612908506148525e-2, 1.36929880922735805310e-1,
      5.99832206555887937690e-1, 1.0};
  const double q = p - 0.5;
  if (std::fabs(q) <= 0.425) {
    const double r = 0.180625 - q * q;
    return q * horner8(kCentralNum, r) / horner8(kCentralDen, r);
  }
  const double r = std::sqrt(-std::log(q <= 0.0 ? p : 1.0 - p));
  const double x = r <= 5.0 ? horner8(kNearNum, r - 1.6) / horner8(kNearDen, r - 1.6)
                            : horner8(kTailNum, r - 5.0) / horner8(kTailDen, r - 5.0);
  return q < 0.0 ? -x : x;
}

std::vector<float> nf4_map() {
  // torch.linspace(start, end, k) in float32 (the products rounded before
  // the sum: volatile, never contracted into an FMA).
  auto linspace = [](float start, float end, int k) {
    const float step = (end - start) / static_cast<float>(k - 1);
    std::vector<float> x(static_cast<size_t>(k));
    for (int i = 0; i < k; ++i) {
      volatile float d = step * static_cast<float>(i < k / 2 ? i : k - 1 - i);
      x[static_cast<size_t>(i)] = i < k / 2 ? start + d : end - d;
    }
    return x;
  };
  const float offset = 0.9677083f;
  std::vector<float> v;
  const std::vector<float> pos = linspace(offset, 0.5f, 9), neg = linspace(offset, 0.5f, 8);
  for (int i = 0; i < 8; ++i) v.push_back(static_cast<float>(normal_quantile(pos[static_cast<size_t>(i)])));
  for (int i = 0; i < 7; ++i) v.push_back(static_cast<float>(-normal_quantile(neg[static_cast<size_t>(i)])));
  v.push_back(0.0f);
  std::sort(v.begin(), v.end());
  const float max = v.back();
  for (float& x : v) x /= max;
  return v;
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
  static std::once_flag once[5];
  static backend::Codebook books[5];
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
      case QuantMap::kNf4:
        books[i] = make("nf4", nf4_map(), R::kFirstNearest, Z::kOne);
        break;
    }
  });
  return books[i];
}

}  // namespace po::backend
