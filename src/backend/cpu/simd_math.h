// Vectorisable elementwise math for the CPU kernels. glibc's expf/tanhf are
// scalar calls unless -ffast-math; these inline versions let `#pragma omp simd`
// loops vectorise (AVX-512: 16 lanes). exp_approx is accurate to ~2 ulp on
// [-87.3, 88.7]; below it returns 0 and above it +inf, as expf would
// (denormal results are flushed to 0). NaN inputs are not propagated.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cpu/kernel_isa.h"
#include "core/bf16.h"

PO_KERNELS_BEGIN
namespace detail {

#pragma omp declare simd notinbranch
inline float exp_approx(float x_in) {
  const float x = x_in < -87.3f ? -87.3f : (x_in > 88.7f ? 88.7f : x_in);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  // Cody-Waite: r = x - n ln2 in two pieces, |r| <= ln2/2.
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  // exp(r) on |r| <= 0.3466, degree-7 Taylor/Horner (truncation < 1e-8).
  float p = 1.9841270e-4f;
  p = p * r + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // Scale by 2^n (n in [-126, 128]); split in two to stay in range.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  const float e = p * s1 * s2;
  return x_in > 88.7f ? __builtin_inff() : (x_in < -87.3f ? 0.0f : e);
}

// A kernel's output element: f32 as computed, or its bf16 bits rounded to
// nearest even (a fused cast: the same value a separate f32_to_bf16 pass
// would give, without that pass over memory).
inline void put(float* out, float v) { *out = v; }
inline void put(uint16_t* out, float v) { *out = core::f32_to_bf16(v).bits; }

// A kernel's input element as f32: as stored, or a bf16 activation widened
// (exact), so a kernel reading bf16 computes what it computes on the
// widened f32 copy, without that copy's pass over memory.
inline float get(const float* in, int64_t i) { return in[i]; }
inline float get(const uint16_t* in, int64_t i) { return core::bf16_to_f32(core::bf16{in[i]}); }

}  // namespace detail
PO_KERNELS_END
